"""DataBatch: split, concat, select, union, and size checks."""

import pickle

import pytest
import torch

from rl3d.single_controller.batch import PAD_VALUES, DataBatch
from rl3d.single_controller.dispatch import INPUT_ROW, MODES, Dispatch, DispatchInfo, merge_outputs


def make(n=6):
    return DataBatch(
        {"ids": torch.arange(n * 3).view(n, 3), "reward": torch.arange(n, dtype=torch.float32)},
        {"text": [f"s{i}" for i in range(n)]},
        {"step": 4},
    )


def test_split_concat_round_trip():
    batch = make()
    parts = batch.split(3)
    assert [len(p) for p in parts] == [2, 2, 2] and parts[1]["text"] == ["s2", "s3"]
    back = DataBatch.concat(parts)
    assert (
        torch.equal(back["ids"], batch["ids"]) and back["text"] == batch["text"] and back.info == {"step": 4}
    )


def test_select_and_union():
    batch = make().select([4, 0])
    assert batch["text"] == ["s4", "s0"] and batch["reward"].tolist() == [4.0, 0.0]
    both = batch.union(DataBatch({"adv": torch.ones(2)}))
    assert set(both.tensors) == {"ids", "reward", "adv"}
    with pytest.raises(ValueError, match="union of batches with 2 and 3 rows"):
        batch.union(DataBatch({"adv": torch.ones(3)}))


def test_sizes_must_agree():
    with pytest.raises(ValueError, match="disagree on the batch size"):
        DataBatch({"a": torch.ones(3)}, {"b": [1, 2]})
    with pytest.raises(ValueError, match="cannot split a batch of 6 into 4"):
        make().split(4)
    with pytest.raises(KeyError, match="no field 'nope'"):
        make()["nope"]


def test_concat_pads_ragged_sequences():
    a = DataBatch({"ids": torch.ones(2, 3, dtype=torch.long)})
    b = DataBatch({"ids": torch.full((1, 5), 2, dtype=torch.long)})
    out = DataBatch.concat([a, b])["ids"]
    assert out.shape == (3, 5) and out[0].tolist() == [1, 1, 1, 0, 0] and out[2].tolist() == [2] * 5


def test_pickles_for_the_object_store():
    batch = make()
    back = pickle.loads(pickle.dumps(batch))
    assert torch.equal(back["ids"], batch["ids"]) and back.meta == batch.meta


def test_merge_outputs_averages_metrics_and_concats_batches():
    assert merge_outputs([{"loss": 1.0, "x": 2.0}, {"loss": 3.0}]) == {"loss": 2.0, "x": 2.0}
    merged = merge_outputs([make(2), None, make(2)])
    assert len(merged) == 4


def test_merge_outputs_sums_counts_when_declared_and_merges_tuples():
    parts = [(make(2), {"errors": 1}), (make(3), {"errors": 2, "other": 1})]
    batch, counts = merge_outputs(parts, metrics="sum")
    assert len(batch) == 5 and counts == {"errors": 3.0, "other": 1.0}


def test_concat_pads_each_field_with_its_own_value():
    pad = {PAD_VALUES: {"ids": -1}}
    a = DataBatch({"ids": torch.zeros(1, 2, dtype=torch.long), "m": torch.ones(1, 2)}, info=pad)
    b = DataBatch({"ids": torch.zeros(1, 3, dtype=torch.long), "m": torch.ones(1, 3)}, info=pad)
    out = DataBatch.concat([a, b])
    assert out["ids"].tolist() == [[0, 0, -1], [0, 0, 0]]
    assert out["m"].tolist() == [[1, 1, 0], [1, 1, 1]]


def test_generation_mode_deals_round_robin_and_restores_input_order():
    """Prompt i goes to generation-DP rank i mod size; rows come back in prompt order, a
    prompt's several rows in the order its rank produced them; TP > 0 ranks are not read."""
    mode = MODES[Dispatch.GENERATION_COMPUTE]
    prompts = DataBatch({"p": torch.arange(5)})
    infos = [
        DispatchInfo(
            dp_rank=0, dp_size=1, is_collector=True, gen_dp_rank=g, gen_dp_size=2, is_gen_collector=c
        )
        for g in (0, 1)
        for c in (True, False)
    ]
    parts = []
    for info in infos:
        slot = mode.slot(info)
        share = mode.split(prompts, slot)
        assert share["p"].tolist() == list(range(slot.index, 5, 2))
        rows = DataBatch(
            {
                "p": share["p"].repeat_interleave(2),
                "k": torch.arange(2).repeat(len(share)),
                INPUT_ROW: torch.arange(len(share)).repeat_interleave(2),
            }
        )
        if slot.collects:
            parts.append((slot, rows))
    out = mode.collect(parts, "mean")
    assert out["p"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert out["k"].tolist() == [0, 1] * 5
    assert INPUT_ROW not in out
