"""`rollout.multi_turn`: off by default, validated before anything starts, errors name the key."""

import pytest

from rl3d.config import ConfigError, load_config
from rl3d.tools import ToolBox

ROOT = __import__("pathlib").Path(__file__).resolve().parents[3]
TOOL_RECIPE = ROOT / "recipes" / "quickstart_cpu_tool_grpo.yaml"
GRPO = ROOT / "recipes" / "quickstart_cpu_grpo.yaml"


def test_off_by_default_in_the_quickstart():
    mt = load_config(GRPO).config.rollout.multi_turn
    assert mt.enabled is False


def test_tool_recipe_builds_its_tools():
    mt = load_config(TOOL_RECIPE).config.rollout.multi_turn
    assert mt.enabled and mt.max_turns == 3
    box = mt.build_tools()
    assert isinstance(box, ToolBox) and list(box.tools) == ["calculator"]


@pytest.mark.parametrize(
    ("override", "key", "message"),
    [
        (
            "rollout.multi_turn.tools=[calculater]",
            "rollout.multi_turn.tools.calculater",
            "did you mean 'calculator'",
        ),
        ("rollout.multi_turn.tools=[nope.mod:Thing]", "rollout.multi_turn.tools.nope.mod:Thing", "nope"),
        ("rollout.multi_turn.call_tags=[<a>]", "rollout.multi_turn.call_tags", "two different"),
        ("rollout.multi_turn.observation_tags=[x,x]", "rollout.multi_turn.observation_tags", "two different"),
        ("rollout.multi_turn.max_turns=0", "rollout.multi_turn.max_turns", "> 0"),
        ("rollout.multi_turn.tool_timeout_s=-1", "rollout.multi_turn.tool_timeout_s", "> 0"),
        (
            "rollout.multi_turn.tools={python: {wall_seconds: 0}}",
            "rollout.multi_turn.tools.python",
            "wall_seconds",
        ),
    ],
)
def test_bad_settings_name_the_key(override, key, message):
    with pytest.raises(ConfigError) as err:
        load_config(TOOL_RECIPE, [override])
    assert err.value.key == key and message in str(err.value), str(err.value)


def test_tools_with_options():
    cfg = load_config(
        TOOL_RECIPE, ["rollout.multi_turn.tools={calculator: {max_digits: 50}, python: {}}"]
    ).config
    box = cfg.rollout.multi_turn.build_tools()
    assert sorted(box.tools) == ["calculator", "python"] and box.tools["calculator"].max_digits == 50
