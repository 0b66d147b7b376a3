"""The modeled transition benchmark's outputs: markdown tables, CSV, PNG and the JSON contract."""

from __future__ import annotations

from pathlib import Path

CONTRACT_KEYS = ("seconds", "bytes_max", "node_bytes_max", "calls", "peak_param_bytes")
GB = 1e9


def contract(result: dict) -> dict:
    """`{"points": [{model, gpus, train, gen, lower_bound_seconds, strategies: {S: {...}}}]}`."""
    return {
        "points": [
            {
                "model": pt["model"],
                "gpus": pt["gpus"],
                "train": pt["train"],
                "gen": pt["gen"],
                "lower_bound_seconds": pt["lower_bound_seconds"],
                "strategies": {s: {k: v[k] for k in CONTRACT_KEYS} for s, v in pt["strategies"].items()},
            }
            for pt in result["points"]
        ]
    }


def _layout(pt: dict) -> str:
    tr, ge = pt["train"], pt["gen"]
    return f"{tr['t']},{tr['p']},{tr['d']} -> {ge['t_g']},{ge['p_g']} ({ge['d_g']})"


def explain(pt: dict, strategy: str) -> str:
    """Which mechanisms put a strategy above the node-link lower bound."""
    s, lb = pt["strategies"][strategy], pt["lower_bound"]
    parts = []
    if lb["node_bytes"] and s["node_bytes_max"] > 1.01 * lb["node_bytes"]:
        parts.append(
            f"node link carries {s['node_bytes_max'] / lb['node_bytes']:.2f}x the bytes a node lacks"
        )
    elif not lb["node_bytes"] and s["node_bytes_max"]:
        parts.append(f"{s['node_bytes_max'] / GB:.1f} GB over a node link the layout does not need")
    if lb["gpu_need_bytes"] and s["bytes_max"] > 1.01 * lb["gpu_need_bytes"]:
        parts.append(f"a GPU receives {s['bytes_max'] / lb['gpu_need_bytes']:.1f}x what it lacks")
    if s["latency_seconds"] >= 0.005:
        parts.append(f"{s['calls']} calls = {s['latency_seconds']:.2f} s latency")
    for term, seconds in s["terms"].items():
        if term.startswith(("reload", "reslice", "vllm_load", "torch_cat")) and seconds >= 0.005:
            parts.append(f"{term} {seconds:.2f} s")
    if strategy == "hybridflow_overlap":
        terms = s["terms"]
        parts = [f"{terms['hidden']:.3f} s hidden behind a {terms['optimizer_step']:.3f} s optimizer step"]
    return "; ".join(parts) or "at the bound"


def markdown(result: dict) -> str:
    points = result["points"]
    names = list(points[0]["strategies"])
    head = "| model | GPUs | T,P,D -> T_g,P_g (d_g) | lower bound s | " + " | ".join(f"{n} s" for n in names)
    lines = [head + " | paper s |", "|" + "---|" * (5 + len(names))]
    for pt in points:
        st = pt["strategies"]
        paper = ", ".join(f"{k} {v}" for k, v in pt["paper_seconds"].items()) or "-"
        lines.append(
            f"| {pt['model']} | {pt['gpus']} | {_layout(pt)} | {pt['lower_bound_seconds']:.3f} | "
            + " | ".join(f"{st[n]['seconds']:.3f}" if n in st else "-" for n in names)
            + f" | {paper} |"
        )
    lines += ["", "| model | GPUs | strategy | node GB | GPU GB | calls | peak GB | why above the bound |"]
    lines.append("|" + "---|" * 8)
    for pt in points:
        for n, s in pt["strategies"].items():
            lines.append(
                f"| {pt['model']} | {pt['gpus']} | {n} | {s['node_bytes_max'] / GB:.1f} | "
                f"{s['bytes_max'] / GB:.2f} | {s['calls']} | {s['peak_param_bytes'] / GB:.1f} | "
                f"{explain(pt, n)} |"
            )
    red, paper, cl = result["reductions"], result["paper"], result["cluster"]
    lines += [
        "",
        f"average cut of hybridflow vs ds_chat and openrlhf over these points: "
        f"{100 * red['average_vs_ds_chat_and_openrlhf']:.1f}% "
        f"(paper: {100 * paper['average_reduction']:.1f}%; "
        f"70B vs openrlhf paper {100 * paper['70b_vs_openrlhf']:.1f}%, vs ds_chat up to "
        f"{100 * paper['70b_vs_ds_chat_up_to']:.1f}%)",
        f"cluster: {cl['gpus_per_node']} GPUs/node, node link {cl['nic_gbps'] * cl['nics_per_node']:g} GB/s "
        f"({cl['nics_per_node']} x {cl['nic_gbps']:g}), NVLink {cl['nvlink_gbps']:g} GB/s, PCIe "
        f"{cl['pcie_gbps']:g} GB/s, HBM {cl['hbm_gbps']:g} GB/s, buckets {cl['bucket_mb']:g} MiB, "
        + _latency_source(result),
    ]
    return "\n".join(lines)


def _latency_source(result: dict) -> str:
    over = result.get("overhead")
    if not over:
        return "NCCL 2.18.1 ring latencies"
    per = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in over["alpha_s_per_call"].items())
    return f"per-call cost fitted on the gloo executors ({per}; verl_2024 takes hybridflow's)"


def csv_rows(result: dict) -> list[dict]:
    rows = []
    for pt in result["points"]:
        for n, s in pt["strategies"].items():
            rows.append(
                {
                    "model": pt["model"],
                    "gpus": pt["gpus"],
                    **pt["train"],
                    **pt["gen"],
                    "strategy": n,
                    **{k: s[k] for k in CONTRACT_KEYS},
                    "latency_seconds": s["latency_seconds"],
                    "lower_bound_seconds": pt["lower_bound_seconds"],
                    "paper_seconds": pt["paper_seconds"].get(n, ""),
                }
            )
    return rows


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(pt["model"] for pt in result["points"]))
    fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models), 3.8), squeeze=False)
    for ax, model in zip(axes[0], models):
        pts = [pt for pt in result["points"] if pt["model"] == model]
        gpus = [pt["gpus"] for pt in pts]
        for n in pts[0]["strategies"]:
            ax.plot(gpus, [pt["strategies"][n]["seconds"] for pt in pts], marker="o", label=n)
        ax.plot(gpus, [pt["lower_bound_seconds"] for pt in pts], "k--", label="node-link lower bound")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{model} ({_layout(pts[0]).split(' (')[0]})", fontsize=9)
        ax.set_xlabel("GPUs")
    axes[0][0].set_ylabel("modelled transition time (s)")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
