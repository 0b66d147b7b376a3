"""`rl3d bench packing --json`: the contract on a small skewed batch (no timing assertions: the
machine may be busy), in a subprocess since it starts its own one-rank gloo world."""

import json
import subprocess
import sys

from rl3d.cli import main

KEYS = ("padded_seconds", "packed_seconds", "speedup", "padded_tokens", "packed_tokens", "max_abs_logp_diff")
SMALL = [
    "--batch",
    "16",
    "--median-response",
    "6",
    "--sigma",
    "1.5",
    "--max-response",
    "80",
    "--repeats",
    "1",
]


def test_json_contract():
    code = f"from rl3d.cli import main; raise SystemExit(main({['bench', 'packing', '--json', *SMALL]!r}))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert tuple(out) == KEYS
    assert out["padded_seconds"] > 0 and out["packed_seconds"] > 0
    assert out["packed_tokens"] < out["padded_tokens"]
    assert out["max_abs_logp_diff"] < 1e-5


def test_bad_arguments_are_exit_2(capsys):
    assert main(["bench", "packing", "--batch", "6", "--micro-batch-size", "4"]) == 2
    assert "not a multiple" in capsys.readouterr().err
    assert main(["bench", "packing", "--sigma", "0.1"]) == 2
    assert "below 8.0" in capsys.readouterr().err


def test_balance_report_on_a_skewed_batch():
    """The text report's token balance (no timing): loads over 2 DP ranks and over the packed
    micro-batches, contiguous / first-fit against balanced."""
    from rl3d.bench.packing import _balance, skewed_batch

    data = skewed_batch(256, batch=32, prompt_len=32, median=24, sigma=1.3, cap=448, seed=0)
    lengths = data["attention_mask"].sum(1).tolist()
    report = _balance(lengths, 2, budget=max(lengths) * 2)
    assert 1.0 <= report["dp_imbalance_balanced"] < report["dp_imbalance_contiguous"]
    assert 1.0 <= report["micro_imbalance_balanced"] <= report["micro_imbalance_first_fit"]
