"""rl3d.models.packing on hand-built batches: the packed row, its mask, the unpack index and the
token-budget grouping."""

import pytest
import torch

from rl3d.models.packing import (
    block_causal_mask,
    pack_rows,
    packed_micro_batches,
    token_budget_groups,
    unpack_response,
)


def _batch():
    # [left-padded prompt (3) | right-padded response (3)]; 0 = pad
    ids = torch.tensor([[0, 5, 6, 7, 8, 0], [9, 10, 11, 12, 13, 14]])
    mask = (ids != 0).long()
    return ids, mask


def test_pack_rows_drops_pads_and_restarts_positions():
    ids, mask = _batch()
    row = pack_rows(ids, mask, response_width=3)
    assert row.input_ids_1N.tolist() == [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14]]
    assert row.position_ids_1N.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 4, 5]]
    assert row.cu_seqlens.tolist() == [0, 4, 10] and row.max_seqlen == 6
    # padded response columns read positions P-1..T-2 = columns 2, 3, 4 of each row; row 0's
    # column 4 is a pad: it maps to its last real token (packed column 3)
    assert row.response_index_BR.tolist() == [[1, 2, 3], [6, 7, 8]]


def test_unpack_response_equals_the_padded_slice():
    ids, mask = _batch()
    row = pack_rows(ids, mask, response_width=3)
    padded_out = ids[..., None].float() * 10  # an "output" that names its token
    packed_out = row.input_ids_1N[..., None].float() * 10
    got = unpack_response(packed_out, row)
    want = padded_out[:, 2:5]
    resp_mask = mask[:, 3:].bool()
    assert torch.equal(got[resp_mask], want[resp_mask])


def test_block_causal_mask():
    mask = block_causal_mask(torch.tensor([0, 2, 5], dtype=torch.int32), 5)[0, 0]
    allowed = (~mask).long().tolist()
    assert allowed == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 0, 1, 0, 0],
        [0, 0, 1, 1, 0],
        [0, 0, 1, 1, 1],
    ]


def test_token_budget_groups_count_from_first_fit_then_balanced():
    lengths = [5, 9, 3, 4, 6]
    groups = token_budget_groups(lengths, 10, key="actor.max_tokens_per_micro_batch")
    # first-fit decreasing needs 3 micro-batches ([9], [6, 4], [5, 3]: 9, 10, 8 tokens);
    # balanced over 3 they carry 9 tokens each
    assert groups == [[1], [2, 4], [0, 3]]
    assert [sum(lengths[i] for i in g) for g in groups] == [9, 9, 9]


def test_token_budget_keeps_first_fit_where_balancing_cannot_fit():
    # first-fit decreasing packs [6, 4] and [4, 3, 3] under 10; longest-first balancing puts
    # 6 and 4 apart and then has no room for the last 3: the first-fit groups stay
    lengths = [6, 4, 4, 3, 3]
    groups = token_budget_groups(lengths, 10, key="actor.max_tokens_per_micro_batch")
    assert groups == [[0, 1], [2, 3, 4]]


def test_micro_batches_without_budget_balance_tokens_at_equal_counts():
    lengths = [30, 2, 28, 3, 1, 25, 4, 27]
    groups = packed_micro_batches(lengths, micro_batch_size=2, budget=None, key="k")
    assert sorted(i for g in groups for i in g) == list(range(8))
    assert all(len(g) == 2 for g in groups)
    loads = [sum(lengths[i] for i in g) for g in groups]
    assert max(loads) - min(loads) <= 4, loads  # contiguous pairs: 32, 31, 26, 31
    # a batch that does not split into equal micro-batches keeps its order
    assert packed_micro_batches([5, 1, 7], micro_batch_size=2, budget=None, key="k") == [[0, 1], [2]]


def test_token_budget_names_both_numbers():
    with pytest.raises(ValueError, match=r"12 tokens exceeds critic.max_tokens_per_micro_batch=10"):
        token_budget_groups([3, 12], 10, key="critic.max_tokens_per_micro_batch")


def test_budget_needs_packing():
    from rl3d.config.errors import FieldError
    from rl3d.config.schema import ActorConfig, ReferenceConfig

    with pytest.raises(FieldError, match="max_tokens_per_micro_batch: needs packing: true"):
        ActorConfig(max_tokens_per_micro_batch=64)
    assert ActorConfig(packing=True, max_tokens_per_micro_batch=64).max_tokens_per_micro_batch == 64
    assert ActorConfig().packing is False and ReferenceConfig().packing is None


def test_te_spec_only_for_packed_roles(monkeypatch):
    """Transformer Engine's attention ignores left padding, so a padded role keeps the local
    spec; a packing role (no pads, THD boundaries) takes TE's. The import is the only thing the
    decision reads from TE, so an empty module stands in for an installed one."""
    import sys
    import types

    from rl3d.models.builder import use_transformer_engine

    monkeypatch.setitem(sys.modules, "transformer_engine", types.ModuleType("transformer_engine"))
    cuda = torch.device("cuda")
    assert use_transformer_engine(cuda, packed=True)
    assert not use_transformer_engine(cuda)
    assert not use_transformer_engine(torch.device("cpu"), packed=True)
    monkeypatch.setitem(sys.modules, "transformer_engine", None)  # not installed
    assert not use_transformer_engine(cuda)  # padded: the local spec, as on CPU
    # packed: refused (tests/unit/models/test_packing_needs_te.py), never the local spec


def test_packed_metric_rows_are_weighted_by_their_tokens():
    """A packing role's micro-batches differ in size: a step's metric is the mini-batch mean
    (rows weighted by their tokens), not a mean of micro-batch means; unweighted rows (padded
    roles, grad_norm) keep the plain mean."""
    from rl3d.engine import METRIC_WEIGHT
    from rl3d.workers.roles import _mean_metrics

    rows = [{"loss": 1.0, METRIC_WEIGHT: 30.0}, {"loss": 4.0, METRIC_WEIGHT: 10.0}, {"grad_norm": 2.0}]
    assert _mean_metrics(rows) == {"loss": (30 + 40) / 40, "grad_norm": 2.0}
    assert _mean_metrics([{"loss": 1.0}, {"loss": 4.0}]) == {"loss": 2.5}


def test_no_micro_batches_for_no_samples():
    assert packed_micro_batches([], micro_batch_size=4, budget=None, key="k") == []
