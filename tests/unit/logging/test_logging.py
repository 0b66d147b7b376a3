"""Logging foundation: JSONL records, TensorBoard events, progress/ETA, per-rank console."""

import logging

import pytest
import torch

from rl3d.logging import JsonlMetricsWriter, Progress, TensorBoardWriter, setup_logging
from rl3d.logging.metrics import read_jsonl
from rl3d.logging.progress import format_duration


def test_jsonl_record_fields_and_append(tmp_path):
    path = tmp_path / "metrics.jsonl"
    writer = JsonlMetricsWriter(path, rank=3)
    writer.log(1, {"reward/mean": torch.tensor(0.5), "loss": 1.25}, worker="actor")
    writer.close()
    writer = JsonlMetricsWriter(path, rank=3)  # a resumed run appends
    writer.log(2, {"loss": float("nan")})
    writer.close()
    rows = read_jsonl(path)
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["worker"] == "actor" and rows[0]["rank"] == 3 and rows[0]["reward/mean"] == 0.5
    assert isinstance(rows[0]["time"], float) and rows[1]["loss"] == "nan"


def test_jsonl_rejects_reserved_names(tmp_path):
    writer = JsonlMetricsWriter(tmp_path / "m.jsonl")
    with pytest.raises(ValueError, match="'step' collides"):
        writer.log(1, {"step": 3})
    writer.close()


def test_tensorboard_writes_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = TensorBoardWriter(tmp_path)
    for step in range(3):
        writer.log(step, {"reward/mean": step * 0.5, "note": "text is skipped"}, worker="trainer")
    writer.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert "reward/mean" in acc.Tags()["scalars"]
    assert [e.value for e in acc.Scalars("reward/mean")] == [0.0, 0.5, 1.0]


def test_progress_rate_and_eta():
    now = [100.0]
    lines = []
    prog = Progress(10, emit=lines.append, clock=lambda: now[0])
    assert prog.eta_seconds is None
    now[0] = 104.0
    text = prog.update(2, {"reward": 0.25})
    assert prog.rate == 0.5 and prog.eta_seconds == 16.0
    assert text == lines[-1]
    assert "2/10" in text and "0.50 step/s" in text and "ETA 00:16" in text and "reward 0.25" in text


def test_progress_resumed_counts_only_new_steps():
    now = [0.0]
    prog = Progress(10, start=6, emit=lambda _: None, clock=lambda: now[0])
    now[0] = 2.0
    prog.update(1)
    assert prog.rate == 0.5 and prog.eta_seconds == 6.0


def test_format_duration():
    assert format_duration(75) == "01:15" and format_duration(3725) == "1:02:05"


def test_only_rank0_reaches_console_but_all_ranks_log_to_file(tmp_path, capsys):
    log = setup_logging(rank=1, log_dir=tmp_path)
    logging.getLogger("rl3d.test").warning("hello from 1")
    assert "hello from 1" not in capsys.readouterr().err
    assert "[rank 1] WARNING rl3d.test: hello from 1" in (tmp_path / "rank1.log").read_text()
    setup_logging(rank=0)
    logging.getLogger("rl3d.test").warning("hello from 0")
    assert "[rank 0] WARNING rl3d.test: hello from 0" in capsys.readouterr().err
    assert log is logging.getLogger("rl3d")
