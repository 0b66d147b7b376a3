import pickle
import textwrap

import pytest

from rl3d.config.schema import DataConfig, RewardConfig, SyntheticDataConfig
from rl3d.rewards import RewardInput, answer_check_for, resolve_reward_fn, reward_fn_name
from rl3d.rewards.rule_based import gsm8k_answer_check, gsm8k_reward

SYN = DataConfig(synthetic=SyntheticDataConfig(task="parity_match"))
FILES = DataConfig(train_files=["x.parquet"])


def _resolve(fn, data=SYN):
    return resolve_reward_fn(RewardConfig(fn=fn), data)


def test_builtin_names():
    assert _resolve("gsm8k", FILES) is gsm8k_reward
    assert reward_fn_name(_resolve("gsm8k", FILES)) == "gsm8k"
    assert reward_fn_name(_resolve("math_exact", FILES)) == "math_exact"


def test_synthetic_resolves_to_the_data_task():
    fn = _resolve("synthetic")
    assert reward_fn_name(fn) == "parity_match"
    inp = RewardInput(
        prompt_index=0,
        prompt_ids=[17, 16],
        response_ids=[3, 5, 6, 1],
        prompt_text="17 16",
        response_text="3 5 6 1",
        answer=17,
        finish_reason="stop",
    )
    assert fn(inp) == pytest.approx(2 / 3)  # 3, 5 odd like 17; 6 not; stop token 1 not scored
    assert reward_fn_name(_resolve("copy_first")) == "copy_first"
    with pytest.raises(
        ValueError, match="'synthetic' means the reward of data.synthetic.task; data.synthetic is unset"
    ):
        _resolve("synthetic", FILES)


def test_builtins_pickle_for_worker_processes():
    for fn in (_resolve("synthetic"), _resolve("copy_repeat"), _resolve("gsm8k", FILES)):
        clone = pickle.loads(pickle.dumps(fn))
        assert reward_fn_name(clone) == reward_fn_name(fn)
    inp = RewardInput(
        prompt_index=0,
        prompt_ids=[19] * 8,
        response_ids=[19, 18],
        prompt_text="",
        response_text="",
        answer=19,
        finish_reason="length",
    )
    assert pickle.loads(pickle.dumps(_resolve("copy_repeat")))(inp) == pytest.approx((1.0 + 1 / 3) / 2)


def test_unknown_name_suggests():
    with pytest.raises(ValueError, match="unknown reward 'gsm8'.*did you mean 'gsm8k'"):
        _resolve("gsm8")


def test_answer_checks():
    assert answer_check_for(RewardConfig(fn="gsm8k"), FILES) is gsm8k_answer_check
    assert answer_check_for(RewardConfig(fn="math_exact"), FILES) is not None
    assert answer_check_for(RewardConfig(fn="synthetic"), SYN) is None
    assert answer_check_for(RewardConfig(fn="os.path:join"), FILES) is None


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "rl3d_test_user_rewards.py").write_text(
        textwrap.dedent(
            """
            import this_module_does_not_exist_rl3d  # noqa: F401
            """
        )
    )
    (tmp_path / "rl3d_test_rewards_ok.py").write_text(
        textwrap.dedent(
            """
            NOT_CALLABLE = 3

            def length_reward(inp):
                return float(len(inp.response_ids))

            class Scorers:
                @staticmethod
                def one(inp):
                    return 1.0
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_user_function_by_import_path(user_module):
    fn = _resolve("rl3d_test_rewards_ok:length_reward", FILES)
    assert fn.__name__ == "length_reward"
    assert reward_fn_name(fn) == "rl3d_test_rewards_ok:length_reward"
    assert _resolve("rl3d_test_rewards_ok:Scorers.one", FILES)(None) == 1.0


@pytest.mark.parametrize(
    "path, message",
    [
        ("no_such_module_rl3d:fn", "module 'no_such_module_rl3d' not found"),
        (
            "rl3d_test_user_rewards:fn",
            "importing 'rl3d_test_user_rewards' failed.*this_module_does_not_exist",
        ),
        (
            "rl3d_test_rewards_ok:length_rewrd",
            "'rl3d_test_rewards_ok' has no attribute 'length_rewrd' \\(did you mean 'length_reward'",
        ),
        ("rl3d_test_rewards_ok:NOT_CALLABLE", "int object is not callable"),
        ("rl3d_test_rewards_ok:", "expected 'package.module:function'"),
        ("a:b:c", "expected 'package.module:function'"),
        ("bad-name:fn", "'bad-name' is not a module name"),
    ],
)
def test_user_function_errors_name_the_path(user_module, path, message):
    with pytest.raises(ValueError, match=f"reward.fn: reward function '{path}': {message}"):
        _resolve(path, FILES)


def test_reward_and_cost_tables_are_registries():
    """Both tables are `rl3d.utils.registry.Registry`s: the error names the key, the closest
    name, every built-in, and the other ways to name a function."""
    from rl3d.rewards.registry import BUILTIN_COSTS, BUILTIN_REWARDS, resolve_cost_fn
    from rl3d.utils.registry import Registry

    assert isinstance(BUILTIN_REWARDS, Registry) and isinstance(BUILTIN_COSTS, Registry)
    assert {"gsm8k", "math", "parity_match"} <= set(BUILTIN_REWARDS.names())
    with pytest.raises(ValueError) as err:
        _resolve("math_exakt", FILES)
    text = str(err.value)
    assert text.startswith("reward.fn: unknown reward 'math_exakt' (did you mean 'math_exact'")
    assert "gsm8k_flexible" in text and "'synthetic'" in text and "package.module:function" in text
    with pytest.raises(
        ValueError, match=r"reward\.cost_fn: unknown cost 'x'; known: high_token_ids, or a user"
    ):
        resolve_cost_fn(RewardConfig(cost_fn="x"))
