"""The per-call overhead fit and its use by the modelled benchmark (no process groups)."""

import json

import pytest

from rl3d.bench.modeled import run_modeled
from rl3d.bench.overhead import apply_overhead, fit
from rl3d.cli import main


def test_fit_recovers_alpha_and_beta_and_reports_the_residual():
    alpha, beta = 2e-4, 1e-9
    samples = [
        {"strategy": "s", "calls": c, "bytes": b, "seconds": alpha * c + beta * b}
        for c in (10, 100, 1000)
        for b in (1e6, 1e7)
    ]
    got = fit(samples)["s"]
    assert got["alpha_s_per_call"] == pytest.approx(alpha, rel=1e-6)
    assert got["beta_s_per_byte"] == pytest.approx(beta, rel=1e-6)
    assert got["rms_residual_s"] < 1e-12 and got["samples"] == 6


def test_measured_overhead_charges_fitted_alpha_per_call():
    result = run_modeled(["llama2-7b"], paper_layouts=True)
    before = {p["gpus"]: {k: dict(v) for k, v in p["strategies"].items()} for p in result["points"]}
    fitted = {s: {"alpha_s_per_call": 1e-3} for s in ("hybridflow", "hybridflow_v", "ds_chat", "openrlhf")}
    apply_overhead(result, fitted)
    for point in result["points"]:
        for name, s in point["strategies"].items():
            old = before[point["gpus"]][name]
            if name != "hybridflow_overlap":
                expected = old["seconds"] - old["latency_seconds"] + old["calls"] * 1e-3
                assert s["seconds"] == pytest.approx(expected)
    assert result["overhead"]["source"] == "measured"


def test_modeled_measured_overhead_needs_a_fit(tmp_path, capsys):
    args = ["bench", "transition", "--mode", "modeled", "--models", "llama2-7b", "--paper-layouts"]
    assert main([*args, "--overhead", "measured", "--overhead-fit", str(tmp_path / "none.json")]) == 2
    assert "no overhead fit" in capsys.readouterr().err
    path = tmp_path / "fit.json"
    path.write_text(
        json.dumps(
            {
                "fit": {
                    s: {"alpha_s_per_call": 0.01}
                    for s in ("hybridflow", "hybridflow_v", "ds_chat", "openrlhf")
                }
            }
        )
    )
    out_dir = tmp_path / "out"
    assert (
        main([*args, "--overhead", "measured", "--overhead-fit", str(path), "--json", "--out", str(out_dir)])
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    hf = out["points"][0]["strategies"]["hybridflow"]
    assert hf["seconds"] >= hf["calls"] * 0.01
