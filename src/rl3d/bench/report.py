"""`rl3d bench transition`: run a mode, print a table (or JSON), write CSV + PNG + markdown."""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
from pathlib import Path

from rl3d.bench.cost_model import fit_alpha_beta
from rl3d.costs.cluster import Cluster
from rl3d.hybrid_engine.strategy import STRATEGIES

GB = 1e9


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", required=True, metavar="BENCH")
    tr = sub.add_parser("transition", help="train -> generate transition time, all strategies")
    tr.add_argument("--mode", choices=("modeled", "measured"), required=True)
    tr.add_argument("--models", default="llama2-7b,llama2-13b,llama2-34b,llama2-70b", help="modeled mode")
    tr.add_argument(
        "--model", default="llama2-70b-shape-1/64", help="measured mode: a name or NAME-shape-1/K"
    )
    tr.add_argument("--train", default="1,4,2", help="measured mode: P,T,D")
    tr.add_argument("--gen", default="2,1", help="measured mode: TG,PG")
    tr.add_argument(
        "--world", type=int, default=None, help="ranks to launch (default: what the layout needs)"
    )
    tr.add_argument("--strategies", default=",".join(STRATEGIES))
    tr.add_argument("--repeats", type=int, default=5)
    tr.add_argument("--warmup", type=int, default=2)
    tr.add_argument("--bucket-mb", type=float, default=64.0)
    tr.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    tr.add_argument("--verify", action="store_true", help="measured mode: check every shard bit for bit")
    tr.add_argument(
        "--nics-per-node",
        type=int,
        default=1,
        help="modeled mode: 200 Gb/s links per node (1: the paper's 200Gbps per node; 8: per GPU)",
    )
    tr.add_argument(
        "--paper-layouts",
        action="store_true",
        help="modeled mode: Fig. 14's layouts (7B 8,1->2,1; 13B 8,1->4,1; 34B 8,4->8,1; "
        "70B 8,8->8,1) on 8-128 GPUs",
    )
    tr.add_argument(
        "--gpus-per-node",
        type=int,
        default=None,
        help="measured mode: simulated nodes of K ranks (0..K-1, K..2K-1, ...); bytes per link in the JSON",
    )
    tr.add_argument(
        "--node-ranks", default=None, help="measured mode: simulated nodes as rank lists, e.g. '0,3;1,2'"
    )
    tr.add_argument(
        "--overlap",
        action="store_true",
        help="measured mode: hybridflow overlapped with a simulated optimizer step vs plain, side by side",
    )
    tr.add_argument("--step-ms", type=float, default=200.0, help="--overlap: the optimizer step per rank")
    tr.add_argument(
        "--fit-overhead",
        action="store_true",
        help="measured mode: fit each executor's per-call and per-byte cost; writes --overhead-fit",
    )
    tr.add_argument(
        "--overhead",
        choices=("nccl", "measured"),
        default="nccl",
        help="modeled mode: per-call cost from NCCL 2.18.1's tuning table, or fitted on the gloo executors",
    )
    tr.add_argument(
        "--overhead-fit",
        default=None,
        help="the fit's JSON (default benchmarks/transition/overhead/overhead_fit.json)",
    )
    tr.add_argument("--json", action="store_true", help="print one JSON object")
    tr.add_argument("--out", default=None, help="results folder (default results/transition/<name>)")
    from rl3d.bench.rollout import add_rollout_arguments

    ro = sub.add_parser("rollout", help="torch rollout engine vs HF generate, tokens/s on CPU")
    add_rollout_arguments(ro)
    from rl3d.bench.packing import add_packing_arguments

    pk = sub.add_parser("packing", help="actor forward+backward, padded vs packed micro-batches, on CPU")
    add_packing_arguments(pk)


def _ints(text: str, count: int, flag: str) -> tuple[int, ...]:
    parts = text.split(",")
    if len(parts) != count or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"{flag} expects {count} comma-separated integers, got {text!r}")
    return tuple(int(p) for p in parts)


def _hardware(mode: str, args, result: dict) -> str:
    if mode == "modeled":
        return f"model-a100-{args.nics_per_node}nic"
    device = result.get("device", "cpu")
    if device.startswith("cuda"):
        import torch

        return "nccl-" + torch.cuda.get_device_name(0).replace(" ", "_").lower()
    return f"cpu-gloo-{result.get('world')}ranks-{os.cpu_count()}c"


def _results_dir(args, mode: str, name: str, result: dict) -> Path:
    if args.out:
        return Path(args.out)
    safe = name.replace("/", "_").replace(",", "+")
    stamp = datetime.date.today().isoformat()
    return Path("results") / "transition" / f"{mode}_{safe}_{_hardware(mode, args, result)}_{stamp}"


def _write_modeled(result: dict, out: Path) -> str:
    from rl3d.bench import report_modeled

    _csv(out / "transition.csv", report_modeled.csv_rows(result))
    report_modeled.plot(result, out / "transition.png")
    return report_modeled.markdown(result)


def _write_measured(result: dict, out: Path) -> str:
    samples = result["fit_samples"]
    alpha, bandwidth, r2 = fit_alpha_beta(samples)
    result["fit"] = {"alpha_s": alpha, "bandwidth_Bps": bandwidth, "r2": r2}
    rows = []
    for strategy, s in result["strategies"].items():
        predicted = s["bytes_max"] / bandwidth if bandwidth > 0 else float("nan")
        rows.append(
            {
                "strategy": strategy,
                "seconds": s["seconds"],
                "raw_seconds": s["raw_seconds"],
                "ratio_to_raw": s["seconds"] / s["raw_seconds"] if s["raw_seconds"] else float("nan"),
                "bytes_max": s["bytes_max"],
                "planned_bytes_max": s["planned_bytes_max"],
                "achieved_GBps": s["bytes_max"] / s["seconds"] / GB if s["seconds"] else 0.0,
                "model_seconds": predicted,
                "verified": s["verified"],
                "cpu_seconds": s.get("cpu_seconds", float("nan")),
                "raw_cpu_seconds": s.get("raw_cpu_seconds", float("nan")),
            }
        )
    _csv(out / "transition.csv", rows)
    hf = result["strategies"].get("hybridflow")
    lines = [
        "| strategy | seconds | raw s | x raw | bytes max | planned | GB/s | verified |",
        "|" + "---|" * 8,
    ]
    for r in rows:
        lines.append(
            f"| {r['strategy']} | {r['seconds']:.4f} | {r['raw_seconds']:.4f} | {r['ratio_to_raw']:.2f} | "
            f"{r['bytes_max']} | {r['planned_bytes_max']} | {r['achieved_GBps']:.2f} | {r['verified']} |"
        )
    if hf:
        lines.append("")
        for base, s in result["strategies"].items():
            if base != "hybridflow" and s["seconds"] > 0 and s["bytes_max"] > 0:
                work = ""
                if s.get("cpu_seconds") and s.get("raw_cpu_seconds"):
                    work = (
                        f", CPU-seconds ratio {hf['cpu_seconds'] / s['cpu_seconds']:.3f} "
                        f"(raw collectives: {hf['raw_cpu_seconds'] / s['raw_cpu_seconds']:.3f})"
                    )
                lines.append(
                    f"hybridflow vs {base}: time ratio {hf['seconds'] / s['seconds']:.3f} "
                    f"(raw collectives: {hf['raw_seconds'] / s['raw_seconds']:.3f}), "
                    f"byte ratio {hf['bytes_max'] / s['bytes_max']:.3f}{work}"
                )
    lines.append(
        f"alpha-beta fit on raw all-gathers: alpha {alpha * 1e6:.1f} us/step, "
        f"bandwidth {bandwidth / GB:.2f} GB/s, R^2 {r2:.3f}"
    )
    _plot_measured(rows, out / "transition.png")
    from rl3d.bench.extras import measured_extras

    lines += measured_extras(result, out)
    return "\n".join(lines)


def _csv(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def _plot_measured(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["seconds"] for r in rows], 0.4, label="executor")
    ax.bar([x + 0.2 for x in xs], [r["raw_seconds"] for r in rows], 0.4, label="raw collective, same bytes")
    ax.set_xticks(list(xs), [r["strategy"] for r in rows])
    ax.set_ylabel("seconds (median)")
    ax.set_title("Measured transition")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_bench(args: argparse.Namespace) -> str:
    """Run the benchmark; its output (a table, or the JSON contract with --json)."""
    if args.bench == "rollout":
        from rl3d.bench.rollout import run_rollout_bench

        return run_rollout_bench(args)
    if args.bench == "packing":
        from rl3d.bench.packing import run_packing_bench

        return run_packing_bench(args)
    if args.mode == "modeled":
        from rl3d.bench.modeled import run_modeled

        models = [m.strip() for m in args.models.split(",") if m.strip()]
        if args.nics_per_node < 1:
            raise ValueError(f"--nics-per-node must be >= 1, got {args.nics_per_node}")
        cluster = Cluster(nics_per_node=args.nics_per_node)
        result = run_modeled(models, cluster, paper_layouts=args.paper_layouts)
        name = ("fig14_" if args.paper_layouts else "") + "+".join(models)
        if args.overhead == "measured":
            from rl3d.bench.overhead import DEFAULT_FIT_PATH, apply_overhead, load_fit

            apply_overhead(result, load_fit(args.overhead_fit or DEFAULT_FIT_PATH))
            name += "_measured_overhead"
        writer = _write_modeled
    elif args.fit_overhead:
        from rl3d.bench.extras import run_fit_overhead

        return run_fit_overhead(args)
    else:
        from rl3d.bench.measured import run_measured

        layout = _ints(args.train, 3, "--train")
        t_g, p_g = _ints(args.gen, 2, "--gen")
        strategies = tuple(s.strip() for s in args.strategies.split(",") if s.strip())
        unknown = [s for s in strategies if s not in STRATEGIES]
        if unknown:
            raise ValueError(f"unknown strategy {unknown[0]!r}; known: {', '.join(STRATEGIES)}")
        result = run_measured(
            args.model,
            layout,
            t_g,
            p_g,
            strategies=strategies,
            world=args.world,
            repeats=args.repeats,
            warmup=args.warmup,
            verify=args.verify,
            bucket_mb=args.bucket_mb,
            dtype=args.dtype,
            gpus_per_node=args.gpus_per_node,
            nodes=_node_lists(args.node_ranks),
            overlap_step_s=args.step_ms / 1e3 if args.overlap else None,
        )
        result["model"], result["layout"] = args.model, {"train": layout, "gen": (t_g, p_g)}
        name, writer = args.model, _write_measured
    out = _results_dir(args, args.mode, name, result)
    out.mkdir(parents=True, exist_ok=True)
    table = writer(result, out)
    (out / "transition.md").write_text(table + "\n")
    (out / "result.json").write_text(json.dumps(result, indent=1, default=str))
    if args.json:
        return json.dumps(_contract(args.mode, result))
    return f"{table}\nresults in {out}"


def _contract(mode: str, result: dict) -> dict:
    """Exactly the fields the command-line contract names (plus nothing other tools must parse)."""
    if mode == "modeled":
        from rl3d.bench.report_modeled import contract

        return contract(result)
    keys = ("seconds", "bytes_max", "planned_bytes_max", "verified", "raw_seconds")
    keys += ("calls_max", "links", "planned_links", "links_match")  # links: with --gpus-per-node/--node-ranks
    out = {"strategies": {s: {k: v[k] for k in keys if k in v} for s, v in result["strategies"].items()}}
    out |= {k: result[k] for k in ("nodes", "overlap") if k in result}
    return out


def _node_lists(text: str | None) -> list[list[int]] | None:
    if text is None:
        return None
    try:
        return [[int(r) for r in node.split(",")] for node in text.split(";")]
    except ValueError:
        raise ValueError(f"--node-ranks expects rank lists like '0,1;2,3', got {text!r}") from None
