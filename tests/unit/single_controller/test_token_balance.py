"""Token-balanced dispatch over data-parallel ranks: every mini-batch's samples are
dealt to the DP ranks by token count, each rank gets the same number, a mini-batch holds the
same samples whatever the DP size, and outputs come back in input order."""

import pytest
import torch

from rl3d.single_controller.batch import DataBatch
from rl3d.single_controller.dispatch import MODES, Dispatch, DispatchInfo
from rl3d.utils.partition import balanced_partition, chunked_partition, imbalance


def test_balanced_partition_equal_counts_and_loads():
    lengths = [40, 12, 7, 3, 33, 5, 20, 8]
    parts = balanced_partition(lengths, 2)
    assert [len(p) for p in parts] == [4, 4]
    assert sorted(i for p in parts for i in p) == list(range(8))
    assert imbalance(lengths, parts) < imbalance(lengths, [[0, 1, 2, 3], [4, 5, 6, 7]])
    assert imbalance(lengths, parts) == pytest.approx(65 / 64)  # 40+12+8+5 and 33+20+7+3


def test_balanced_partition_under_budget_or_none():
    # longest first: 6 | 4, then 4 and 3 on the lighter, and the last 3 fits neither under 10
    assert balanced_partition([6, 4, 4, 3, 3], 2, equal_size=False, budget=10) is None
    assert balanced_partition([6, 4, 4, 3, 3], 2, equal_size=False, budget=11) == [[0, 3], [1, 2, 4]]
    with pytest.raises(ValueError, match="3 samples do not split into 2 parts"):
        balanced_partition([1, 2, 3], 2)


def test_chunked_partition_keeps_mini_batches_whatever_the_dp_size():
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 100, (24,), generator=gen).tolist()
    for dp in (1, 2, 4):
        shares = chunked_partition(lengths, dp, chunk=8)
        local = 8 // dp
        for k in range(3):  # mini-batch k = rank shares' k-th local slices, together
            members = sorted(i for s in shares for i in s[k * local : (k + 1) * local])
            assert members == list(range(8 * k, 8 * k + 8))
    with pytest.raises(ValueError, match="mini-batches of 8 do not split evenly over 3"):
        chunked_partition(lengths, 3, chunk=8)


def _batch(lengths: list[int], width: int = 16) -> DataBatch:
    mask = (torch.arange(width) >= width - torch.tensor(lengths)[:, None]).long()
    return DataBatch({"attention_mask": mask, "row": torch.arange(len(lengths))})


@pytest.mark.parametrize("balance", [0, 4])
def test_megatron_compute_split_and_collect_in_input_order(balance):
    lengths = [16, 1, 2, 15, 14, 3, 2, 13]
    batch = _batch(lengths)
    mode = MODES[Dispatch.MEGATRON_COMPUTE]
    parts, loads = [], []
    for dp_rank in range(2):
        slot = mode.slot(DispatchInfo(dp_rank=dp_rank, dp_size=2, is_collector=True, token_balance=balance))
        share = mode.split(batch, slot)
        loads.append(int(share["attention_mask"].sum()))
        parts.append((slot, DataBatch({"out": share["row"] * 10})))  # a per-sample output
    out = mode.collect(parts, "mean", batch)
    assert out["out"].tolist() == [10 * i for i in range(8)]
    if balance:  # each mini-batch of 4 balanced: 16+1 | 2+15 and 14+2 | 3+13 -> 33 | 33 (contiguous: 34 | 32)
        assert loads == [33, 33]
    else:
        assert loads == [34, 32]
