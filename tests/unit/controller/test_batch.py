"""DataBatch: split, concat, select, union, and size checks."""

import pickle

import pytest
import torch

from rl3d.controller.batch import DataBatch
from rl3d.controller.dispatch import merge_outputs


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
