"""Finding a tool call in generated text: good calls, and every malformed one as an error value."""

import pytest

from rl3d.tools import ToolCall, ToolCallError, ToolCallParser

PARSER = ToolCallParser()


def test_good_call_with_span():
    text = (
        'Let me compute. <tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call> ok'
    )
    call = PARSER.parse(text)
    assert call == ToolCall("calculator", {"expression": "2+2"}, text.index("<tool_call>"), text.index(" ok"))


def test_arguments_as_json_string_and_absent():
    assert PARSER.parse('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>').arguments == {
        "a": 1
    }
    assert PARSER.parse('<tool_call>{"name": "f"}</tool_call>').arguments == {}


def test_no_open_tag_is_no_call():
    assert PARSER.parse("The answer is 4.") is None
    assert PARSER.parse('{"name": "calculator", "arguments": {}}') is None


@pytest.mark.parametrize(
    "body, message",
    [
        ('{"name": "calculator", "arguments": {', "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"arguments": {}}', '"name"'),
        ('{"name": 3}', '"name"'),
        ('{"name": "f", "arguments": [1]}', '"arguments" must be an object'),
        ('{"name": "f", "arguments": "{nope"}', '"arguments" string is not valid JSON'),
        ("[" * 100_000, "not valid JSON"),
    ],
)
def test_malformed_calls_are_errors(body, message):
    result = PARSER.parse(f"<tool_call>{body}</tool_call>")
    assert isinstance(result, ToolCallError)
    assert message in result.message


def test_missing_close_tag():
    result = PARSER.parse('<tool_call>{"name": "f", "arguments": {}}')
    assert isinstance(result, ToolCallError) and "closing" in result.message


def test_custom_tags():
    parser = ToolCallParser(open_tag="[CALL]", close_tag="[/CALL]")
    assert parser.parse('x [CALL]{"name": "f", "arguments": {}}[/CALL]').name == "f"
    assert parser.parse('<tool_call>{"name": "f"}</tool_call>') is None
    with pytest.raises(ValueError, match="tools.parser"):
        ToolCallParser(open_tag="|", close_tag="|")
