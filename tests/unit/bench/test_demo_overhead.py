"""benchmarks/demo_overhead.py's summary: warm-up steps dropped, profiled steps give only the op
counts and op seconds, the wall is the slower rank's, collectives are rank 0's, and what the
collectives and the ops leave of the wall is the Python time."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
_spec = importlib.util.spec_from_file_location("demo_overhead", ROOT / "benchmarks/demo_overhead.py")
demo_overhead = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(demo_overhead)


def _row(step, rank, wall, *, profiled=False, coll=(4, 0.02), ops=None):
    stage = {"wall_s": wall, "cpu_s": wall / 2, "coll_n": coll[0], "coll_s": coll[1]}
    if ops is not None:
        stage |= {"ops": ops[0], "op_s": ops[1]}
    return {"step": step, "rank": rank, "profiled": profiled, "stages": {"old_logp": stage}}


def test_summary_of_one_run():
    rows = [_row(1, 0, 9.0), _row(1, 1, 9.0)]  # warm-up: dropped
    for step, walls in ((2, (0.10, 0.12)), (3, (0.08, 0.07)), (4, (0.11, 0.09))):
        rows += [_row(step, 0, walls[0]), _row(step, 1, walls[1], coll=(99, 9.0))]
    rows += [_row(5, 0, 5.0, profiled=True, ops=(800, 0.03)), _row(5, 1, 5.0, profiled=True, ops=(1, 1.0))]
    run = {"meta": {"warmup": 1}, "rows": rows}
    stage, step = demo_overhead.summarize([run])
    assert stage["stage"] == "old_logp" and step["stage"] == "step"
    assert stage["wall"] == 0.11  # median of the slower ranks' 0.12, 0.08, 0.11
    assert (stage["coll_n"], stage["coll_s"]) == (4, 0.02)  # rank 0's
    assert (stage["ops"], stage["op_s"]) == (800, 0.03)  # the profiled step's, rank 0
    assert abs(stage["python_s"] - (0.11 - 0.02 - 0.03)) < 1e-12
    assert step["wall"] == stage["wall"] and step["ops"] == 800
