"""`rollout.agent`: off by default, one of two kinds, validated before anything starts, errors
name the key; `rollout.multi_turn`, the tool loop's former section, still loads with a warning
naming the new key."""

from pathlib import Path

import pytest

import yaml
from rl3d.config import ConfigError, load_config
from rl3d.config.agent import _KEYS, AgentConfig, AgentKind
from rl3d.config.typed import to_dict
from rl3d.tools import ToolBox

ROOT = Path(__file__).resolve().parents[3]
TOOL_RECIPE = ROOT / "recipes" / "quickstart_cpu_tool_grpo.yaml"
AGENT_RECIPE = ROOT / "recipes" / "quickstart_cpu_tool_agent.yaml"
GRPO = ROOT / "recipes" / "quickstart_cpu_grpo.yaml"
EXAMPLE = "rl3d.agents.examples:calculator_agent"
DEPRECATED = "rollout.multi_turn is deprecated: write rollout.agent with kind: tool_loop"


def test_off_by_default_in_the_quickstart():
    agent = load_config(GRPO).config.rollout.agent
    assert agent.kind is None and not agent.enabled


def test_tool_recipe_builds_its_tools():
    agent = load_config(TOOL_RECIPE).config.rollout.agent
    assert agent.kind == "tool_loop" and agent.max_turns == 3 and agent.concurrency == 4
    box = agent.build_tools()
    assert isinstance(box, ToolBox) and list(box.tools) == ["calculator"]


def test_fn_alone_is_the_endpoint_kind():
    assert load_config(AGENT_RECIPE).config.rollout.agent.kind == "endpoint"
    agent = load_config(GRPO, [f"rollout.agent.fn={EXAMPLE}"]).config.rollout.agent
    assert agent.kind == "endpoint" and agent.enabled


def test_the_kinds_are_the_agents_registry():
    from typing import get_args

    from rl3d.agents import AGENT_KINDS

    assert sorted(get_args(AgentKind)) == list(AGENT_KINDS.names())


@pytest.mark.parametrize(
    ("recipe", "override", "key", "message"),
    [
        (
            TOOL_RECIPE,
            "rollout.agent.tools=[calculater]",
            "rollout.agent.tools.calculater",
            "did you mean 'calculator'",
        ),
        (TOOL_RECIPE, "rollout.agent.tools=[nope.mod:Thing]", "rollout.agent.tools.nope.mod:Thing", "nope"),
        (TOOL_RECIPE, "rollout.agent.call_tags=[<a>]", "rollout.agent.call_tags", "two different"),
        (
            TOOL_RECIPE,
            "rollout.agent.observation_tags=[x,x]",
            "rollout.agent.observation_tags",
            "two different",
        ),
        (TOOL_RECIPE, "rollout.agent.max_turns=0", "rollout.agent.max_turns", "> 0"),
        (TOOL_RECIPE, "rollout.agent.tool_timeout_s=-1", "rollout.agent.tool_timeout_s", "> 0"),
        (
            TOOL_RECIPE,
            "rollout.agent.tools={python: {wall_seconds: 0}}",
            "rollout.agent.tools.python",
            "wall_seconds",
        ),
        (TOOL_RECIPE, "rollout.agent.kind=tool_lop", "rollout.agent.kind", "did you mean 'tool_loop'"),
        # a key of the other kind would be ignored: refused, naming the kind that reads it
        (TOOL_RECIPE, "rollout.agent.timeout_s=5", "rollout.agent.timeout_s", "belongs to kind endpoint"),
        (AGENT_RECIPE, "rollout.agent.max_turns=2", "rollout.agent.max_turns", "belongs to kind tool_loop"),
        (GRPO, "rollout.agent.kind=endpoint", "rollout.agent.fn", "set fn"),
    ],
)
def test_bad_settings_name_the_key(recipe, override, key, message):
    with pytest.raises(ConfigError) as err:
        load_config(recipe, [override])
    assert err.value.key == key and message in str(err.value), str(err.value)


def test_tools_with_options():
    cfg = load_config(TOOL_RECIPE, ["rollout.agent.tools={calculator: {max_digits: 50}, python: {}}"]).config
    box = cfg.rollout.agent.build_tools()
    assert sorted(box.tools) == ["calculator", "python"] and box.tools["calculator"].max_digits == 50


def test_kind_null_turns_the_tool_loop_off():
    agent = load_config(TOOL_RECIPE, ["rollout.agent.kind=null"]).config.rollout.agent
    assert not agent.enabled


# -- rollout.multi_turn, the former key ----------------------------------------------------------


def _old_style_recipe(tmp_path: Path, monkeypatch) -> Path:
    """The tool recipe as it was written before `rollout.agent` (multi_turn, enabled: true)."""
    text = TOOL_RECIPE.read_text()
    new = "  agent:\n    kind: tool_loop  # rl3d's tool loop over the engine's tokens\n"
    assert new in text
    path = tmp_path / "old_tool_recipe.yaml"
    path.write_text(text.replace(new, "  multi_turn:\n    enabled: true\n"))
    monkeypatch.setenv("RL3D_YAML_DIR", str(ROOT / "yaml"))
    return path


def test_the_old_key_loads_as_the_new_one_and_warns_naming_it(tmp_path, monkeypatch, caplog):
    old = _old_style_recipe(tmp_path, monkeypatch)
    with caplog.at_level("WARNING", logger="rl3d.config.agent"):
        loaded = load_config(old)
    assert DEPRECATED in caplog.text and str(old.name) in caplog.text, caplog.text
    assert to_dict(loaded.config) == to_dict(load_config(TOOL_RECIPE).config)


def test_an_old_resolved_config_loads_as_the_tool_loop(tmp_path, caplog):
    """A run's resolved_config.yaml from before: every key written out, `rollout.agent` the user
    agent's section (off, at its defaults: concurrency 8) beside `rollout.multi_turn` (on,
    concurrency 4). It loads as the same tool loop (a re-run from it trains the same)."""
    data = to_dict(load_config(TOOL_RECIPE).config)
    agent = data["rollout"]["agent"]
    loop_keys = _KEYS["tool_loop"]  # the tool loop's own keys, as the config names them
    data["rollout"]["multi_turn"] = {"enabled": True, **{k: agent.pop(k) for k in loop_keys}}
    data["rollout"]["multi_turn"]["concurrency"] = agent["concurrency"]
    agent.pop("kind")
    agent["concurrency"] = AgentConfig().concurrency
    path = tmp_path / "resolved_config.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    with caplog.at_level("WARNING", logger="rl3d.config.agent"):
        loaded = load_config(path)
    assert DEPRECATED in caplog.text
    assert to_dict(loaded.config) == to_dict(load_config(TOOL_RECIPE).config)


def test_old_overrides_reach_the_tool_loop(caplog):
    with caplog.at_level("WARNING", logger="rl3d.config.agent"):
        agent = load_config(TOOL_RECIPE, ["rollout.multi_turn.max_turns=5"]).config.rollout.agent
        assert agent.kind == "tool_loop" and agent.max_turns == 5
        assert not load_config(TOOL_RECIPE, ["rollout.multi_turn.enabled=false"]).config.rollout.agent.enabled
        agent = load_config(GRPO, ["rollout.multi_turn.enabled=true"]).config.rollout.agent
        assert agent.kind == "tool_loop" and agent.max_turns == 4
    assert DEPRECATED in caplog.text


def test_old_key_errors_name_the_file_of_the_old_key(tmp_path, monkeypatch):
    old = _old_style_recipe(tmp_path, monkeypatch)
    with pytest.raises(ConfigError) as err:
        load_config(old, ["rollout.multi_turn.tools=[calculater]"])
    assert err.value.key == "rollout.agent.tools.calculater" and err.value.source == "command line"
    path = tmp_path / "bad.yaml"
    path.write_text(old.read_text().replace("max_turns: 3", "max_turns: 0"))
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert err.value.key == "rollout.agent.max_turns" and err.value.source.endswith("bad.yaml")


@pytest.mark.parametrize(
    ("recipe", "overrides", "named"),
    [
        (AGENT_RECIPE, [], "rollout.agent.kind"),
        (GRPO, [f"rollout.agent.fn={EXAMPLE}"], "rollout.agent.fn"),
    ],
)
def test_both_keys_choosing_an_agent_is_an_error_naming_them(recipe, overrides, named):
    with pytest.raises(ConfigError) as err:
        load_config(recipe, [*overrides, "rollout.multi_turn.enabled=true"])
    assert err.value.key == "rollout.multi_turn.enabled", str(err.value)
    assert named in str(err.value) and "rollout.agent.kind: tool_loop" in str(err.value)
