import json

import pytest

from rl3d.data import PromptItem, PromptSampler


def _items(n):
    return [PromptItem(i, [16 + i % 8], str(16 + i % 8), None, f"synthetic:t:{i}") for i in range(n)]


def _indices(batches):
    return [[item.index for item in batch] for batch in batches]


def _take(sampler, k):
    return [sampler.next_batch() for _ in range(k)]


def test_each_epoch_visits_every_prompt_once_in_a_new_order():
    sampler = PromptSampler(_items(12), prompts_per_step=4, seed=7, shuffle=True)
    epoch0 = sum(_indices(_take(sampler, 3)), [])
    epoch1 = sum(_indices(_take(sampler, 3)), [])
    assert sorted(epoch0) == sorted(epoch1) == list(range(12))
    assert epoch0 != epoch1 and epoch0 != list(range(12))
    assert sampler.epoch == 2 and sampler.offset == 0
    again = PromptSampler(_items(12), prompts_per_step=4, seed=7, shuffle=True)
    assert sum(_indices(_take(again, 3)), []) == epoch0
    other_seed = PromptSampler(_items(12), prompts_per_step=4, seed=8, shuffle=True)
    assert sum(_indices(_take(other_seed, 3)), []) != epoch0


def test_a_step_crossing_the_epoch_end_continues_in_the_next_epoch():
    sampler = PromptSampler(_items(5), prompts_per_step=3, seed=0, shuffle=False)
    assert _indices(_take(sampler, 4)) == [[0, 1, 2], [3, 4, 0], [1, 2, 3], [4, 0, 1]]
    small = PromptSampler(_items(2), prompts_per_step=5, seed=0, shuffle=False)
    assert _indices(_take(small, 1)) == [[0, 1, 0, 1, 0]]


def test_resume_continues_at_the_same_data_position():
    n, per_step = 10, 3  # steps cross epoch boundaries
    original = PromptSampler(_items(n), prompts_per_step=per_step, seed=3, shuffle=True)
    _take(original, 5)
    state = json.loads(json.dumps(original.state_dict()))  # plain values: survives JSON
    expected = _indices(_take(original, 7))
    resumed = PromptSampler(_items(n), prompts_per_step=per_step, seed=3, shuffle=True)
    resumed.load_state_dict(state)
    assert _indices(_take(resumed, 7)) == expected
    assert resumed.state_dict() == original.state_dict()


def test_resume_refuses_a_different_dataset_or_seed():
    sampler = PromptSampler(_items(10), prompts_per_step=2, seed=3, shuffle=True)
    state = sampler.state_dict()
    with pytest.raises(ValueError, match="num_items is 10 but this run's is 9"):
        PromptSampler(_items(9), prompts_per_step=2, seed=3, shuffle=True).load_state_dict(state)
    with pytest.raises(ValueError, match="seed is 3 but this run's is 4"):
        PromptSampler(_items(10), prompts_per_step=2, seed=4, shuffle=True).load_state_dict(state)


def test_iteration_and_argument_checks():
    sampler = PromptSampler(_items(4), prompts_per_step=2, seed=0, shuffle=False)
    batches = iter(sampler)
    assert _indices([next(batches), next(batches), next(batches)]) == [[0, 1], [2, 3], [0, 1]]
    assert sampler.steps_per_epoch == 2
    with pytest.raises(ValueError, match="empty"):
        PromptSampler([], prompts_per_step=2, seed=0, shuffle=True)
    with pytest.raises(ValueError, match="prompts_per_step"):
        PromptSampler(_items(3), prompts_per_step=0, seed=0, shuffle=True)
