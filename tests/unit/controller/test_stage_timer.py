"""The stage timer: wall and process CPU seconds per stage, and the per-rank file of them."""

import json
import time

from rl3d.controller.trainer import StageTimer


def test_a_waiting_stage_takes_wall_time_but_almost_no_cpu_time_and_stages_accumulate():
    t = StageTimer()
    with t("wait"):
        time.sleep(0.05)
    with t("wait"):
        time.sleep(0.05)
    with t("work"):
        sum(range(10_000))
    assert set(t.seconds) == set(t.cpu_seconds) == {"wait", "work"}
    assert t.seconds["wait"] >= 0.1  # both entries of the stage
    assert t.cpu_seconds["wait"] < 0.05  # a sleeping process uses no CPU, however busy the host
    assert t.cpu_seconds["work"] >= 0.0


def test_each_rank_appends_one_line_per_step_to_its_own_file(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    t = StageTimer()
    with t("generate"):
        pass
    t.append_to(str(tmp_path), step=1)
    t.append_to(str(tmp_path), step=2)
    lines = [json.loads(line) for line in (tmp_path / "rank3.jsonl").read_text().splitlines()]
    assert [row["step"] for row in lines] == [1, 2]
    assert lines[0]["rank"] == 3
    assert lines[0]["wall"] == t.seconds and lines[0]["cpu"] == t.cpu_seconds
