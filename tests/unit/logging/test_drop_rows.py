"""On resume, metric rows after the resumed step are dropped from metrics.jsonl and metrics.csv."""

import csv
import json

from rl3d.logging import drop_rows_after


def test_rows_after_the_resumed_step_are_dropped(tmp_path):
    rows = [{"step": s, "worker": "trainer", "r": s / 10} for s in (1, 2, 3, 4, 5)]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (tmp_path / "metrics.jsonl").write_text(text + '{"step": 6, "wor')  # torn by a kill
    with open(tmp_path / "metrics.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["step", "r"])
        writer.writeheader()
        writer.writerows({"step": r["step"], "r": r["r"]} for r in rows)
    assert drop_rows_after(tmp_path, 3) == 3 + 2
    kept = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert kept == rows[:3]  # the rows up to the step are untouched
    with open(tmp_path / "metrics.csv", newline="") as f:
        assert [int(r["step"]) for r in csv.DictReader(f)] == [1, 2, 3]
    assert drop_rows_after(tmp_path, 0) == 3 + 3
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_no_files_is_a_no_op(tmp_path):
    assert drop_rows_after(tmp_path, 5) == 0
    assert list(tmp_path.iterdir()) == []
