"""`rl3d bench transition --mode measured`: spawns gloo ranks, prints the JSON contract."""

import json

import pytest

from rl3d.cli import main

# a tiny measured run: tiny-llama trained at 1-2-1, generated at t_g = 1
MEASURED = "bench transition --mode measured --model tiny-llama --train 1,2,1 --gen 1,1".split()


@pytest.mark.distributed
def test_measured_contract_on_two_ranks(capsys, tmp_path):
    args = [
        *MEASURED,
        "--strategies",
        "hybridflow,ds_chat",
        "--repeats",
        "1",
        "--warmup",
        "0",
        "--verify",
        "--json",
        "--out",
        str(tmp_path),
    ]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["strategies"]) == {"hybridflow", "ds_chat"}
    for s in out["strategies"].values():
        assert set(s) == {"seconds", "bytes_max", "planned_bytes_max", "verified", "raw_seconds", "calls_max"}
        assert s["bytes_max"] == s["planned_bytes_max"] > 0
        assert s["verified"] is True and s["seconds"] > 0 and s["raw_seconds"] > 0
    assert (tmp_path / "transition.png").stat().st_size > 0
    (result,) = tmp_path.rglob("result.json")  # the full record: also the CPU work per strategy
    for s in json.loads(result.read_text())["strategies"].values():
        assert s["cpu_seconds"] > 0 and s["raw_cpu_seconds"] > 0
    assert "CPU-seconds ratio" in next(tmp_path.rglob("transition.md")).read_text()


@pytest.mark.distributed
def test_measured_links_and_overlap_on_two_simulated_nodes(capsys, tmp_path):
    args = "bench transition --mode measured --model tiny-llama --train 2,2,1 --gen 1,1".split()
    args += "--strategies hybridflow,hybridflow_hier --gpus-per-node 2 --overlap --step-ms 40".split()
    args += ["--bucket-mb", "0.01", "--repeats", "1", "--warmup", "0", "--json", "--out", str(tmp_path)]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["nodes"] == [[0, 1], [2, 3]]
    hf, hier = out["strategies"]["hybridflow"], out["strategies"]["hybridflow_hier"]
    for s in (hf, hier):  # bytes counted on every link equal the planned
        assert s["links_match"] is True and s["links"] == s["planned_links"]
    assert hier["links"]["node_bytes_max"] * 2 == hf["links"]["node_bytes_max"]
    ov = out["overlap"]
    assert ov["strategy"] == "hybridflow" and ov["buckets"] > 1 and ov["step_seconds"] == 0.04
    assert ov["plain_visible_seconds"] > 0 and ov["overlap_visible_seconds"] >= 0
    for name in ("links.csv", "overlap.csv", "overlap.png"):
        assert next(tmp_path.rglob(name)).stat().st_size > 0


def test_bad_nodes_flag_names_it(capsys):
    assert main([*MEASURED, "--node-ranks", "0,x"]) == 2
    assert "--node-ranks expects rank lists" in capsys.readouterr().err


def test_measured_world_must_fit_the_layout(capsys):
    args = [
        *MEASURED,
        "--world",
        "3",
    ]
    assert main(args) == 2
    assert (
        "--world 3 does not fit: training (1, 2, 1) needs 2 ranks plus 2 rollout ranks"
        in capsys.readouterr().err
    )
