"""fp16's dynamic loss scaler skips its first steps by design: counted, and only a streak fails."""

import pytest

from rl3d.models.training import SkippedSteps


def test_fp16_skips_are_counted_and_a_success_ends_the_streak():
    skipped = SkippedSteps(max_in_a_row=3)
    for ok in (False, False, True, False, False, True):
        skipped.record(ok)
    assert (skipped.total, skipped.in_a_row) == (4, 0)
    skipped.record(False)
    skipped.record(False)
    with pytest.raises(
        FloatingPointError, match=r"3 optimizer step\(s\) in a row skipped .*7 skipped in all"
    ):
        skipped.record(False)


def test_without_a_loss_scaler_one_skipped_step_is_an_error():
    with pytest.raises(FloatingPointError, match="1 optimizer step"):
        SkippedSteps().record(False)
