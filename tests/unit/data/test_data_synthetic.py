import random

import pytest

from rl3d.data import SYMBOL_BASE, get_synthetic_task
from rl3d.data.synthetic import response_content


def test_prompts_are_deterministic_per_seed_and_inside_the_alphabet():
    task = get_synthetic_task("parity_match")
    a = task.make_prompts(50, seed=3)
    assert a == task.make_prompts(50, seed=3)
    assert a != task.make_prompts(50, seed=4)
    assert all(len(p) == 8 and set(p) <= set(task.alphabet) for p in a)
    assert task.alphabet == tuple(range(SYMBOL_BASE, SYMBOL_BASE + 16))
    # both parities of the first token occur, so ignoring the prompt cannot beat 0.5
    assert {p[0] % 2 for p in a} == {0, 1}


def test_repeat_tasks_write_one_symbol_per_prompt_and_share_the_reward():
    for name, random_twin in (("parity_repeat", "parity_match"), ("copy_repeat", "copy_first")):
        task, twin = get_synthetic_task(name), get_synthetic_task(random_twin)
        assert task.repeat and not twin.repeat
        assert task.alphabet == twin.alphabet and task.credit is twin.credit
        prompts = task.make_prompts(40, seed=1)
        assert prompts == task.make_prompts(40, seed=1)
        assert all(len(p) == 8 and len(set(p)) == 1 and p[0] in task.alphabet for p in prompts)
        assert len({p[0] for p in prompts}) > 4


def test_response_content_drops_only_a_final_stop_token():
    assert response_content([5, 6, 1], "stop") == [5, 6]
    assert response_content([5, 6, 1], "length") == [5, 6, 1]
    assert response_content([], "stop") == []


def test_parity_match_reward_by_hand():
    task = get_synthetic_task("parity_match")
    prompt = [17, 20, 22]  # first token odd
    assert task.score(prompt, [3, 4, 5, 1], "stop") == pytest.approx(2 / 3)  # scores 3, 4, 5
    assert task.score(prompt, [3, 4, 5, 1], "length") == pytest.approx(3 / 4)
    assert task.score([16], [2, 4, 30], "length") == 1.0
    assert task.score([16], [1], "stop") == 0.0  # nothing but the stop token


def test_copy_first_reward_by_hand():
    task = get_synthetic_task("copy_first")
    assert task.alphabet == tuple(range(16, 24))
    prompt = [19, 16, 23]  # 19 = 0b10011, low bits 011
    # 19: exact (1.0); 18 = ..010: 2 of 3 low bits -> 0.5*2/3; 27 = ..011: 3 bits, not exact -> 0.5;
    # 20 = ..100: no low bit shared -> 0.0
    expected = (1.0 + 1 / 3 + 0.5 + 0.0) / 4
    assert task.score(prompt, [19, 18, 27, 20], "length") == pytest.approx(expected)
    assert task.score(prompt, [19] * 5, "length") == 1.0
    assert task.answer(prompt) == 19


def _random_policy_reward(name: str, *, num_samples: int, length: int, vocab: int, seed: int) -> float:
    task = get_synthetic_task(name)
    rng = random.Random(seed)
    prompts = task.make_prompts(num_samples, seed=seed)
    total = sum(task.score(p, [rng.randrange(vocab) for _ in range(length)], "length") for p in prompts)
    return total / num_samples


def test_random_policy_reward_levels():
    # 1000 uniformly random 8-token responses over the tiny Llama's 256 ids.
    for name in ("parity_match", "parity_repeat"):
        reward = _random_policy_reward(name, num_samples=1000, length=8, vocab=256, seed=0)
        assert reward == pytest.approx(0.5, abs=0.02)
    for name in ("copy_first", "copy_repeat"):
        reward = _random_policy_reward(name, num_samples=1000, length=8, vocab=256, seed=0)
        assert reward == pytest.approx(0.5 / 256 + 0.25, abs=0.02)  # analytic expectation 0.252


def test_unknown_task_suggests_a_name():
    with pytest.raises(ValueError, match="did you mean 'parity_match'"):
        get_synthetic_task("parity_mach")
