import textwrap

import pytest

from rl3d.controller.hooks import HookError, load_hooks

MODULE = """
calls = []

def step_end(*, step, batch, metrics):
    calls.append((step, batch, dict(metrics)))
    return {"hook/len": len(batch), "loss": -1.0}

def quiet(*, step, batch, metrics):
    return None

def explode(*, step, batch, metrics):
    raise RuntimeError("bad hook")

def wrong_type(*, step, batch, metrics):
    return [1, 2]
"""


@pytest.fixture
def hooks_module(tmp_path, monkeypatch):
    (tmp_path / "rl3d_test_hooks_mod.py").write_text(textwrap.dedent(MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    import rl3d_test_hooks_mod

    rl3d_test_hooks_mod.calls.clear()
    return rl3d_test_hooks_mod


def test_hook_metrics_are_merged(hooks_module):
    hooks = load_hooks(
        {"on_step_end": "rl3d_test_hooks_mod:step_end", "on_checkpoint": "rl3d_test_hooks_mod:quiet"}
    )
    assert "on_step_end" in hooks and "on_rollout_end" not in hooks
    metrics = {"loss": 0.5}
    out = hooks.call("on_step_end", step=3, batch=[1, 2, 3], metrics=metrics)
    assert out is metrics and metrics == {"loss": -1.0, "hook/len": 3}
    assert hooks_module.calls == [(3, [1, 2, 3], {"loss": 0.5})]
    assert hooks.call("on_checkpoint", step=3, batch=None, metrics={"a": 1}) == {"a": 1}
    assert hooks.call("on_rollout_end", step=3, batch=None, metrics={"a": 1}) == {"a": 1}  # unconfigured


def test_a_raising_hook_names_itself(hooks_module):
    hooks = load_hooks({"on_rollout_end": "rl3d_test_hooks_mod:explode"})
    with pytest.raises(
        HookError, match=r"hook on_rollout_end \(rl3d_test_hooks_mod:explode\) failed at step 7"
    ) as info:
        hooks.call("on_rollout_end", step=7, batch=None, metrics={})
    assert info.value.hook == "on_rollout_end" and info.value.path == "rl3d_test_hooks_mod:explode"
    assert isinstance(info.value.__cause__, RuntimeError)


def test_a_hook_returning_a_non_dict_is_an_error(hooks_module):
    hooks = load_hooks({"on_step_end": "rl3d_test_hooks_mod:wrong_type"})
    with pytest.raises(HookError, match="returned list; expected a dict"):
        hooks.call("on_step_end", step=1, batch=None, metrics={})


def test_load_errors_name_the_hook_and_path(hooks_module):
    with pytest.raises(
        ValueError, match="trainer.hooks.on_step_ends: unknown hook.*did you mean 'on_step_end'"
    ):
        load_hooks({"on_step_ends": "rl3d_test_hooks_mod:quiet"})
    with pytest.raises(
        ValueError, match="trainer.hooks.on_step_end: hook on_step_end 'rl3d_test_hooks_mod:nope'"
    ):
        load_hooks({"on_step_end": "rl3d_test_hooks_mod:nope"})
    with pytest.raises(ValueError, match="module 'missing_hooks_rl3d' not found"):
        load_hooks({"on_checkpoint": "missing_hooks_rl3d:fn"})
    assert load_hooks({}).fns == {}
