"""The delta encoding of a weight-sync bucket (`rl3d.weight_sync.delta`): the smallest encoding
is chosen (bitmask when many changed, index list when few, the full bucket when most did), and
decoding gives the new bucket bit for bit, in bf16 and fp32, signed zeros and NaNs included."""

import pytest
import torch

from rl3d.weight_sync.delta import (
    BITMASK,
    FULL,
    INDEX,
    choose,
    decode,
    encode,
    encoding_bytes,
    pack_bits,
    unpack_bits,
)


def _bits(t):
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _roundtrip(new, old):
    enc = encode(new, old)
    out = torch.empty_like(new)
    decode(enc.kind, enc.changed, enc.payload, old, out)
    assert torch.equal(_bits(out), _bits(new))  # bit for bit, NaN payloads and -0.0 too
    return enc


def test_sizes_and_choice_by_hand():
    # 1000 bf16 elements: full 2000 B; bitmask 125 + 2c; index 6c
    assert encoding_bytes(1000, 10, 2) == {FULL: 2000, BITMASK: 145, INDEX: 60}
    assert choose(1000, 10, 2) == INDEX  # few changed: positions are cheaper than a mask
    assert choose(1000, 100, 2) == BITMASK  # 325 < 600 < 2000
    assert choose(1000, 940, 2) == FULL  # 125 + 1880 = 2005 > 2000
    assert choose(1000, 0, 2) == INDEX  # nothing changed: an empty payload
    assert choose(1000, 20, 4) == INDEX  # fp32: 160 < 205
    assert choose(1000, 40, 4) == BITMASK  # 285 < 320


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fraction,kind", [(0.0, INDEX), (0.005, INDEX), (0.2, BITMASK), (0.99, FULL)])
def test_roundtrip_is_exact_and_picks_the_smallest(dtype, fraction, kind):
    g = torch.Generator().manual_seed(0)
    old = torch.randn(4099, generator=g).to(dtype)  # not a multiple of 8: the mask's padding
    new = old.clone()
    changed = torch.rand(4099, generator=g) < fraction
    new[changed] = (old[changed].float() * 2 + 1).to(dtype)  # differs unless x = -1
    enc = _roundtrip(new, old)
    want_changed = int((_bits(new) != _bits(old)).sum())
    assert enc.changed == want_changed
    assert enc.kind == kind == choose(4099, want_changed, new.element_size())
    assert enc.payload.numel() == encoding_bytes(4099, want_changed, new.element_size())[kind]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_first_send_is_full_and_bit_patterns_count_as_changes(dtype):
    old = torch.tensor([0.0, 1.0, float("nan"), 2.0] * 64, dtype=dtype)
    enc = _roundtrip(old.clone(), None)
    assert enc.kind == FULL and enc.payload.numel() == old.numel() * old.element_size()
    new = old.clone()
    new[0] = -0.0  # equal as a number, not as bits: the engine must hold the trainer's bits
    enc = _roundtrip(new, old)
    assert enc.changed == 1 and enc.kind == INDEX  # the NaNs compare equal bit for bit


def test_bits_pack_and_unpack():
    mask = torch.rand(77, generator=torch.Generator().manual_seed(1)) < 0.3
    packed = pack_bits(mask)
    assert packed.numel() == 10 and torch.equal(unpack_bits(packed, 77), mask)
    assert pack_bits(torch.tensor([True, False, False, True])).tolist() == [9]  # least significant first
