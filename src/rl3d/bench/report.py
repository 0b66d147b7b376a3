"""`rl3d bench transition`: run a mode, print a table (or JSON), write CSV + PNG + markdown."""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
from pathlib import Path

from rl3d.bench.cost_model import Cluster, fit_alpha_beta
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
    tr.add_argument("--nics-per-node", type=int, default=1, help="modeled mode: 200 Gb/s NICs per node")
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
    rows = []
    for model, m in result["models"].items():
        red = result["reductions"]["per_model"][model]
        for strategy, s in m["strategies"].items():
            rows.append(
                {
                    "model": model,
                    "gpus": m["layout"]["gpus"],
                    "strategy": strategy,
                    "bytes_max": s["bytes_max"],
                    "seconds": s["seconds"],
                    "peak_param_bytes": s["peak_param_bytes"],
                    "redundant_bytes": s["redundant_bytes"],
                    "hybridflow_reduction": red.get(strategy, 0.0),
                }
            )
    _csv(out / "transition.csv", rows)
    lines = [
        "| model | GPUs | train p-t-d | gen t_g,p_g (d_g) | "
        + " | ".join(f"{s} s" for s in STRATEGIES)
        + " | cut vs ds_chat | cut vs openrlhf |",
        "|" + "---|" * (4 + len(STRATEGIES) + 2),
    ]
    for model, m in result["models"].items():
        lay, st = m["layout"], m["strategies"]
        red = result["reductions"]["per_model"][model]
        layout = f"{lay['p']}-{lay['t']}-{lay['d']} | {lay['t_g']},{lay['p_g']} ({lay['d_g']})"
        lines.append(
            f"| {model} | {lay['gpus']} | {layout} | "
            + " | ".join(f"{st[s]['seconds']:.2f}" for s in STRATEGIES)
            + f" | {100 * red['ds_chat']:.1f}% | {100 * red['openrlhf']:.1f}% |"
        )
    avg = result["reductions"]["average_vs_ds_chat_and_openrlhf"]
    paper = result["paper"]
    r70 = result["reductions"]["per_model"].get("llama2-70b", {})
    nan = float("nan")
    lines += [
        "",
        f"average cut (ds_chat and openrlhf, all models): {100 * avg:.1f}% "
        f"(paper: {100 * paper['average_reduction']:.1f}%)",
        f"70B cut vs openrlhf: {100 * r70.get('openrlhf', nan):.1f}% "
        f"(paper: {100 * paper['70b_vs_openrlhf']:.1f}%)",
        f"70B cut vs ds_chat: {100 * r70.get('ds_chat', nan):.1f}% "
        f"(paper: up to {100 * paper['70b_vs_ds_chat_up_to']:.1f}%)",
        f"cluster model: {result['cluster']}",
    ]
    _plot_modeled(result, out / "transition.png")
    return "\n".join(lines)


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
    return "\n".join(lines)


def _csv(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def _plot_modeled(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(result["models"])
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(STRATEGIES)
    for i, s in enumerate(STRATEGIES):
        ax.bar(
            [x + i * width for x in range(len(models))],
            [result["models"][m]["strategies"][s]["seconds"] for m in models],
            width,
            label=s,
        )
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(models))], models)
    ax.set_ylabel("modelled transition time (s)")
    ax.set_title("Actor train -> generate transition (alpha-beta model, A100 cluster)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


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
        result = run_modeled(models, Cluster(nics_per_node=args.nics_per_node))
        name, writer = "+".join(models), _write_modeled
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
        return {
            "models": {
                m: {
                    "layout": v["layout"],
                    "strategies": {
                        s: {"bytes_max": x["bytes_max"], "seconds": x["seconds"]}
                        for s, x in v["strategies"].items()
                    },
                }
                for m, v in result["models"].items()
            }
        }
    keys = ("seconds", "bytes_max", "planned_bytes_max", "verified", "raw_seconds")
    return {"strategies": {s: {k: v[k] for k in keys} for s, v in result["strategies"].items()}}
