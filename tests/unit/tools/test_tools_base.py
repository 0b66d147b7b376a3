"""The registry and `ToolBox.call`: unknown tools, bad arguments and raising tools are error
results, never exceptions."""

import pytest

from rl3d.tools import BUILTIN_TOOLS, Tool, ToolBox, ToolResult, build_tool, check_arguments


class Echo(Tool):
    name = "echo"
    parameters = {
        "type": "object",
        "properties": {"text": {"type": "string"}, "times": {"type": "integer"}},
        "required": ["text"],
    }

    def call(self, arguments):
        return ToolResult(arguments["text"] * arguments.get("times", 1))


class Broken(Tool):
    name = "broken"

    def call(self, arguments):
        raise RuntimeError("boom")


ECHO = Echo()


def test_builtins_and_import_paths():
    assert build_tool("calculator").name == "calculator"
    assert {"calculator", "python"} <= set(BUILTIN_TOOLS)
    assert build_tool(f"{__name__}:Echo").name == "echo"
    assert build_tool(f"{__name__}:ECHO") is ECHO
    assert build_tool("python", cpu_seconds=2).config.cpu_seconds == 2


@pytest.mark.parametrize(
    "spec, kwargs, message",
    [
        ("calculater", {}, "did you mean 'calculator'"),
        (f"{__name__}:Nope", {}, "has no attribute"),
        (f"{__name__}:check_arguments", {}, "not a rl3d.tools.Tool"),
        ("calculator", {"bogus": 1}, "bad options"),
        ("python", {"cpu_seconds": 0}, "tools.python.cpu_seconds"),
    ],
)
def test_build_errors(spec, kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_tool(spec, **kwargs)


def test_toolbox_call_never_raises():
    box = ToolBox([ECHO, Broken()])
    assert box.call("echo", {"text": "ab", "times": 2}) == ToolResult("abab")
    assert "unknown tool 'ecko'" in box.call("ecko", {}).error
    assert "missing required" in box.call("echo", {}).error
    assert "'times' must be integer, got str" in box.call("echo", {"text": "a", "times": "2"}).error
    assert "must be integer, got bool" in box.call("echo", {"text": "a", "times": True}).error
    assert "unknown argument 'txt'" in box.call("echo", {"text": "a", "txt": 1}).error
    assert "JSON object" in box.call("echo", ["a"]).error
    assert "RuntimeError: boom" in box.call("broken", {}).error
    assert box.call(None, {}).error


def test_toolbox_from_specs_and_schemas():
    box = ToolBox.from_specs({"calculator": {"max_digits": 50}, f"{__name__}:Echo": None})
    assert [s["function"]["name"] for s in box.schemas()] == ["calculator", "echo"]
    with pytest.raises(ValueError, match="two tools named"):
        ToolBox([ECHO, Echo()])


def test_check_arguments_numbers():
    schema = {"properties": {"x": {"type": "number"}}, "required": []}
    assert check_arguments({"x": 1}, schema) is None
    assert check_arguments({"x": 1.5}, schema) is None
    assert check_arguments({"x": "1"}, schema)
