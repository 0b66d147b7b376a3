"""The measured benchmark's extra tables: bytes per link on simulated nodes, the overlap with
the optimizer step, and the per-call overhead fit (CSV + markdown lines, PNG where natural)."""

from __future__ import annotations

import csv
import json
from pathlib import Path


def _csv(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def measured_extras(result: dict, out: Path) -> list[str]:
    lines: list[str] = []
    if "nodes" in result:
        rows = []
        for name, s in result["strategies"].items():
            if "links" not in s:
                continue
            got, planned = s["links"], s["planned_links"]
            rows.append(
                {
                    "strategy": name,
                    "inter_total": got["inter_total"],
                    "node_bytes_max": got["node_bytes_max"],
                    "intra_total": sum(got["intra"].values()),
                    "planned_inter_total": planned["inter_total"],
                    "planned_node_bytes_max": planned["node_bytes_max"],
                    "match": s["links_match"],
                }
            )
        if rows:
            _csv(out / "links.csv", rows)
            lines += ["", f"bytes per link, nodes {result['nodes']} (counted by the executor; planned):"]
            lines += [
                "| strategy | network total | busiest node link | intra-node total | = planned |",
                "|---|---|---|---|---|",
            ]
            for r in rows:
                cells = (r["strategy"], r["inter_total"], r["node_bytes_max"], r["intra_total"], r["match"])
                lines.append("| " + " | ".join(str(c) for c in cells) + " |")
            by = {r["strategy"]: r for r in rows}
            if "hybridflow" in by and "hybridflow_hier" in by and by["hybridflow"]["node_bytes_max"]:
                hf, hi = by["hybridflow"], by["hybridflow_hier"]
                st = result["strategies"]
                time_ratio = st["hybridflow_hier"]["seconds"] / st["hybridflow"]["seconds"]
                lines.append(
                    "hybridflow_hier vs hybridflow: busiest node link "
                    f"{hi['node_bytes_max'] / hf['node_bytes_max']:.3f}x, "
                    f"network total {hi['inter_total'] / hf['inter_total']:.3f}x, time {time_ratio:.3f}x "
                    "(one machine: every link is the same loopback)"
                )
    ov = result.get("overlap")
    if ov:
        _csv(
            out / "overlap.csv",
            [
                {"schedule": "plain", "visible_seconds": v, "step_seconds": ov["step_seconds"]}
                for v in ov["plain_runs"]
            ]
            + [
                {"schedule": "overlap", "visible_seconds": v, "step_seconds": ov["step_seconds"]}
                for v in ov["overlap_runs"]
            ],
        )
        _plot_overlap(ov, out / "overlap.png")
        ratio = f"{ov['ratio']:.3f}" if ov["ratio"] is not None else "n/a"
        lines += [
            "",
            f"overlap with a simulated optimizer step of {ov['step_seconds'] * 1e3:.0f} ms per rank "
            f"({ov['buckets']} buckets): visible transition after the step, "
            f"median of {len(ov['plain_runs'])}: plain {ov['plain_visible_seconds'] * 1e3:.1f} ms, "
            f"overlapped {ov['overlap_visible_seconds'] * 1e3:.1f} ms "
            f"(ratio {ratio}; the model predicts {ov['modeled_visible_seconds'] * 1e3:.1f} ms)",
        ]
    return lines


def _plot_overlap(ov: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    names = ["plain hybridflow", "overlapped", "model"]
    values = [ov["plain_visible_seconds"], ov["overlap_visible_seconds"], ov["modeled_visible_seconds"]]
    ax.bar(names, [v * 1e3 for v in values], color=["tab:blue", "tab:green", "tab:gray"])
    ax.set_ylabel("visible transition, ms (median)")
    ax.set_title(f"after a {ov['step_seconds'] * 1e3:.0f} ms optimizer step, {ov['buckets']} buckets")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_fit_overhead(args) -> str:
    from rl3d.bench.overhead import DEFAULT_FIT_PATH, run_fit

    result = run_fit(repeats=args.repeats, dtype=args.dtype)
    path = Path(args.overhead_fit or DEFAULT_FIT_PATH)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    _csv(path.with_suffix(".csv"), result["samples"])
    if args.json:
        return json.dumps({"fit": result["fit"]})
    lines = [
        "| strategy | us per call | GB/s | RMS residual ms | residual / mean | samples | calls | MB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, f in result["fit"].items():
        bw = f"{f['bandwidth_GBps']:.2f}" if f["bandwidth_GBps"] else "n/a"
        lines.append(
            f"| {name} | {f['alpha_s_per_call'] * 1e6:.0f} | {bw} | {f['rms_residual_s'] * 1e3:.2f} | "
            f"{f['relative_residual']:.2f} | {f['samples']} | {f['calls_range'][0]}-{f['calls_range'][1]} | "
            f"{f['bytes_range'][0] / 1e6:.1f}-{f['bytes_range'][1] / 1e6:.1f} |"
        )
    return "\n".join(lines) + f"\nfit in {path} ({result['wall_seconds']:.0f} s)"
