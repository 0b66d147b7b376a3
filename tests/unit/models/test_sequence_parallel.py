"""Sequence parallelism's arithmetic: when it is on, the padded lengths, each TP rank's part of
a forward's tokens, the micro-batch's left pad columns and a packed row's pad tokens."""

import pytest
import torch

from rl3d.engine.micro_batches import left_pad
from rl3d.models.packing import (
    block_causal_mask,
    pack_rows,
    packed_model_inputs,
    segment_bounds,
    unpack_response,
)
from rl3d.models.sequence_parallel import padded_length, resolve_sequence_parallel, token_shard
from rl3d.single_controller.batch import ROUTING, DataBatch


@pytest.mark.parametrize(
    ("setting", "is_moe", "tp", "on"),
    [
        ("auto", True, 2, True),
        ("auto", False, 2, False),  # dense models keep their path
        ("auto", True, 1, False),  # nothing to split
        (True, False, 4, True),
        (True, True, 1, False),
        (False, True, 2, False),
    ],
)
def test_when_it_is_on(setting, is_moe, tp, on):
    assert resolve_sequence_parallel(setting, is_moe=is_moe, tp=tp) is on


def test_padded_length_and_token_shards():
    assert [padded_length(n, 2) for n in (1, 2, 11, 12)] == [2, 2, 12, 12]
    assert [padded_length(n, 4) for n in (1, 5, 8)] == [4, 8, 8]
    assert padded_length(7, 1) == 7
    # 12 columns x 3 samples, sequence-major: TP rank r of 2 routes columns 6r .. 6r + 5
    assert token_shard(36, 0, 2) == slice(0, 18) and token_shard(36, 1, 2) == slice(18, 36)
    rows_TB = torch.arange(36).view(12, 3)
    assert torch.equal(rows_TB[6:].reshape(-1), torch.arange(36)[token_shard(36, 1, 2)])
    with pytest.raises(AssertionError):
        token_shard(35, 0, 2)


def test_left_pad_keeps_the_response_columns_and_positions():
    from rl3d.engine.micro_batches import position_ids_of

    ids = torch.tensor([[0, 5, 6, 7, 8], [9, 10, 11, 12, 0]])
    mask = (ids > 0).long()
    routing = torch.arange(2 * 5 * 2 * 2, dtype=torch.int16).view(2, 5, 2, 2)
    micro = DataBatch(
        {"input_ids": ids, "attention_mask": mask, ROUTING: routing, "response_mask": mask[:, 3:]}
    )
    out = left_pad(micro, 3)
    assert out["input_ids"].shape == (2, 8) and torch.equal(out["input_ids"][:, 3:], ids)
    assert (out["input_ids"][:, :3] == 0).all() and (out["attention_mask"][:, :3] == 0).all()
    assert torch.equal(out[ROUTING][:, 3:], routing) and (out[ROUTING][:, :3] == 0).all()
    assert out["response_mask"] is micro["response_mask"]
    # positions count real tokens, so the pad columns move no token's position
    assert torch.equal(position_ids_of(out["attention_mask"])[:, 3:], position_ids_of(mask))


def test_packed_row_pads_to_a_multiple_and_keeps_its_sequences_apart():
    ids = torch.tensor([[0, 3, 4, 5, 6], [7, 8, 9, 10, 0], [0, 0, 11, 12, 13]])
    mask = (ids > 0).long()
    plain = pack_rows(ids, mask, response_width=2)
    row = pack_rows(ids, mask, response_width=2, multiple=4)
    assert plain.num_tokens == 11 and plain.num_pad == 0
    assert (row.num_tokens, row.num_pad, row.num_real) == (12, 1, 11)
    assert torch.equal(row.input_ids_1N[0, :11], plain.input_ids_1N[0]) and row.input_ids_1N[0, 11] == 0
    assert torch.equal(row.cu_seqlens, plain.cu_seqlens)  # the samples' boundaries only
    assert segment_bounds(row).tolist() == [0, 4, 8, 11, 12]
    assert torch.equal(row.response_index_BR, plain.response_index_BR)
    mask_NN = block_causal_mask(segment_bounds(row), row.num_tokens)[0, 0]
    assert torch.equal(mask_NN[:11, :11], block_causal_mask(plain.cu_seqlens, 11)[0, 0])
    assert mask_NN[11, :11].all() and mask_NN[:11, 11].all() and not mask_NN[11, 11]  # pads apart
    (ids_in, positions, mask_in), _ = packed_model_inputs(row, te=False)
    assert ids_in.shape == positions.shape == (1, 12) and mask_in.shape == (1, 1, 12, 12)
    out = torch.arange(12.0)[None, :, None]
    assert torch.equal(unpack_response(out, row), unpack_response(out[:, :11], plain))
    assert pack_rows(ids, mask, response_width=2, multiple=11).num_pad == 0
