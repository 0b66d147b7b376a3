"""The measured transition benchmark on simulated nodes joined by a shaped link, next to the
cost model's prediction for the same rank -> node map and link.

    python benchmarks/netns_transition.py --nodes 2 --link-gbit 0.1 --placement spread \
        --strategies hybridflow,hybridflow_v,ds_chat,openrlhf --model llama2-7b-shape-1/64

Needs root (network namespaces, `rl3d.testing.netns`). Every rank is one process started in
its simulated node's namespace (env:// rendezvous at node 0): `--placement contiguous` puts
ranks i*W/K .. (i+1)*W/K-1 on node i (torchrun's order: with openrlhf in the run, the training
ranks fill the first nodes and the rollout ranks the last ones), `spread` puts rank r on node
r % K (training ranks and rollout ranks both spread over the nodes). Every node's egress is
shaped to `--link-gbit` with tbf, so bytes between nodes cross a real link of that rate and
bytes inside a node stay on its loopback.

Per strategy: the measured median seconds (`rl3d.bench.measured`), the modelled seconds
(`rl3d.bench.link_model`: the executor's calls, gloo's algorithms, on this rank -> node map,
rollout ranks included, at the nominal link rate, with the per-call latency measured in the
same run by `rl3d.bench.link_probe`), their ratio, and the bytes the busiest node sent over its
link: counted by the executor, planned, and on the wire (gloo's algorithms: modelled; the
interface's counter: measured, TCP/IP headers included). The same run measures what a single
stream and a two-way exchange get from the link. Results go to --out: result.json,
transition.csv, transition.md, transition.png.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PORT = 29517


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=2, metavar="K")
    parser.add_argument("--link-gbit", type=float, required=True, metavar="R", help="inter-node rate")
    parser.add_argument("--burst-kb", type=float, default=64.0)
    parser.add_argument("--tbf-latency-ms", type=float, default=100.0, help="tbf's queue, in time")
    parser.add_argument("--placement", choices=("contiguous", "spread"), default="spread")
    parser.add_argument("--model", default="llama2-7b-shape-1/64")
    parser.add_argument("--train", default="1,2,1", help="P,T,D")
    parser.add_argument("--gen", default="1,1", help="TG,PG")
    parser.add_argument("--strategies", default="hybridflow,hybridflow_v,ds_chat,openrlhf")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--bucket-mb", type=float, default=64.0)
    parser.add_argument("--out", default=str(ROOT / "results/netns_transition"))
    parser.add_argument("--inner", default=None, help=argparse.SUPPRESS)  # rank 0's JSON output path
    return parser.parse_args(argv)


def placement(world: int, nodes: int, how: str) -> list[list[int]]:
    """Every rank's node: contiguous (torchrun's --node-rank order) or spread (r % K)."""
    if how == "contiguous":
        per_node = world // nodes
        return [list(range(i * per_node, (i + 1) * per_node)) for i in range(nodes)]
    return [list(range(i, world, nodes)) for i in range(nodes)]


def inner(args: argparse.Namespace) -> int:
    """One rank, on its simulated node."""
    import torch.distributed as dist

    from rl3d.bench.link_probe import calibrate_link
    from rl3d.bench.measured import run_measured
    from rl3d.hybrid_engine.nodes import NodeMap

    strategies = tuple(args.strategies.split(","))
    layout, (t_g, p_g) = _ints(args.train), _ints(args.gen)
    nodes = placement(int(os.environ["WORLD_SIZE"]), args.nodes, args.placement)
    result = run_measured(
        args.model,
        layout,
        t_g,
        p_g,
        strategies=strategies,
        repeats=args.repeats,
        warmup=args.warmup,
        bucket_mb=args.bucket_mb,
        nodes=nodes,
    )
    result["calibration"] = calibrate_link(NodeMap.of(nodes))
    if int(os.environ["RANK"]) == 0:
        Path(args.inner).write_text(json.dumps(result, default=str))
    dist.barrier()
    dist.destroy_process_group()  # a rank that exits with gloo's threads alive may abort
    return 0


def outer(args: argparse.Namespace) -> int:
    from rl3d.bench.measured import run_measured  # noqa: F401  fail here, not on the nodes
    from rl3d.hybrid_engine.strategy import get_strategy
    from rl3d.testing.netns import SimNodes, netns_unavailable_reason

    reason = netns_unavailable_reason()
    if reason:
        print(f"netns_transition: {reason}", file=sys.stderr)  # noqa: T201
        return 2
    layout = _ints(args.train)
    n = layout[0] * layout[1] * layout[2]
    separate = any(get_strategy(s).uses_rollout_ranks for s in args.strategies.split(","))
    world = 2 * n if separate else n
    if world % args.nodes:
        print(f"netns_transition: {world} ranks do not fill {args.nodes} nodes evenly", file=sys.stderr)  # noqa: T201
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result_path = out / "result.json"
    result_path.unlink(missing_ok=True)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])),
        "WORLD_SIZE": str(world),
        "MASTER_PORT": str(PORT),
        "RL3D_BENCH_LINK_IFACE": "eth0",
        "OMP_NUM_THREADS": "1",
    }
    keep = ["--link-gbit", "--nodes", "--placement", "--model", "--train", "--gen", "--strategies"]
    keep += ["--repeats", "--warmup", "--bucket-mb"]
    passthrough = [x for k in keep for x in (k, str(getattr(args, k[2:].replace("-", "_"))))]
    passthrough += ["--inner", str(result_path)]
    ranks_on = placement(world, args.nodes, args.placement)
    started = time.perf_counter()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # still remove the nodes when killed
    shaping = dict(rate_mbit=args.link_gbit * 1000, burst_kb=args.burst_kb, latency_ms=args.tbf_latency_ms)
    with SimNodes(args.nodes, **shaping) as nodes:
        procs = []
        for node, ranks in zip(nodes, ranks_on):
            for local, rank in enumerate(ranks):
                rank_env = env | {"RANK": str(rank), "LOCAL_RANK": str(local)}
                rank_env |= {"LOCAL_WORLD_SIZE": str(len(ranks)), "MASTER_ADDR": nodes[0].hostname}
                log = open(out / f"rank{rank}.log", "w")
                cmd = [sys.executable, __file__, *passthrough]
                procs.append(node.popen(cmd, env=rank_env, stdout=log, stderr=subprocess.STDOUT))
            print(f"node{node.index}: ranks {ranks}", flush=True)  # noqa: T201
        codes = [p.wait() for p in procs]
        sent = [nodes.link_bytes(i)[0] for i in range(args.nodes)]
    if any(codes) or not result_path.exists():
        print(f"netns_transition: ranks failed ({codes}); see {out}/rank*.log", file=sys.stderr)  # noqa: T201
        return 1
    result = json.loads(result_path.read_text())
    rows = table_rows(result, args)
    write_outputs(rows, result, args, out, time.perf_counter() - started, sent)
    return 0


def table_rows(result: dict, args) -> list[dict]:
    """Measured next to modelled, per strategy, for the run's rank -> node map and link."""
    from dataclasses import replace

    import rl3d.bench  # noqa: F401  registers the baselines
    from rl3d.bench.link_model import LinkSetup, model_strategy
    from rl3d.bench.measured import _training_nodes
    from rl3d.hybrid_engine.nodes import NodeMap
    from rl3d.hybrid_engine.plan import plan_transition
    from rl3d.models.spec import get_model_spec
    from rl3d.parallel import ParallelLayout

    layout, (t_g, p_g) = _ints(args.train), _ints(args.gen)
    train = ParallelLayout(*layout)
    nodes = NodeMap.of(result["nodes"])
    plan = plan_transition(
        get_model_spec(args.model),
        train,
        t_g,
        p_g,
        dtype="float32",
        strategies=tuple(result["strategies"]),
        nodes=_training_nodes(nodes, train.world_size),
    )
    cal = result["calibration"]
    setup = LinkSetup(
        nodes,
        args.link_gbit,
        local_gbit=cal["local_gbit"] or 20.0,
        alpha_s=cal["alpha_s"],
        local_alpha_s=cal["local_alpha_s"],
        burst_bytes=int(args.burst_kb * 1024),  # tc's kb: 1024 bytes
    )
    measured_link = replace(setup, link_gbit=cal["stream_gbit"], two_way_gbit=cal["duplex_gbit"])
    rows = []
    for name, s in result["strategies"].items():
        model = model_strategy(plan, name, setup, bucket_mb=args.bucket_mb)
        calibrated = model_strategy(plan, name, measured_link, bucket_mb=args.bucket_mb)["seconds"]
        counted = max((s.get("links") or {}).get("inter_out", {}).values(), default=None)
        rows.append(
            {
                "strategy": name,
                "measured_s": s["seconds"],
                "raw_s": s["raw_seconds"],
                "modeled_s": model["seconds"],
                "measured_over_modeled": s["seconds"] / model["seconds"] if model["seconds"] else None,
                "modeled_latency_s": model["latency_seconds"],
                "modeled_at_measured_link_s": calibrated,
                "measured_over_modeled_at_measured_link": s["seconds"] / calibrated if calibrated else None,
                "calls_measured": s["calls_max"],
                "calls_modeled": model["calls_max"],
                "node_out_counted": counted,
                "node_out_planned": model["planned_node_out_max"],
                "links_match_plan": s.get("links_match"),
                "wire_out_modeled": model["wire_sent_max"],
                "wire_out_measured": max(s["wire_sent"]) if "wire_sent" in s else None,
            }
        )
    return rows


def write_outputs(rows: list[dict], result: dict, args, out: Path, wall_s: float, sent: list[int]) -> None:
    cal = result["calibration"]
    head = f"{args.nodes} nodes ({args.placement}: {result['nodes']}), link {args.link_gbit:g} Gbit/s"
    head += f" (tbf, latency {args.tbf_latency_ms:g} ms)"
    head += f", {args.model}, train {args.train}, gen {args.gen}, median of {args.repeats}"
    cols = "| strategy | measured s | raw s | modelled s | measured / modelled"
    cols += " | modelled at the measured link s | measured / that | calls (measured / modelled)"
    cols += " | busiest node sent: counted / planned"
    cols += " | on the wire: modelled / measured |"
    lines = [f"# {head}", "", cols, "|" + "---|" * 10]
    fmt = lambda v, f: "n/a" if v is None else format(v, f)  # noqa: E731
    for r in rows:
        cells = [r["strategy"], *(fmt(r[k], ".3f") for k in ("measured_s", "raw_s", "modeled_s"))]
        cells += [fmt(r["measured_over_modeled"], ".2f"), fmt(r["modeled_at_measured_link_s"], ".3f")]
        cells += [fmt(r["measured_over_modeled_at_measured_link"], ".2f")]
        cells += [f"{r['calls_measured']} / {r['calls_modeled']}"]
        cells += [f"{fmt(r['node_out_counted'], 'd')} / {r['node_out_planned']}"]
        cells += [f"{r['wire_out_modeled']} / {fmt(r['wire_out_measured'], 'd')}"]
        lines.append("| " + " | ".join(cells) + " |")
    local = "n/a"
    if cal["local_gbit"] is not None:
        local = f"{cal['local_gbit']:.2f} Gbit/s, per-call latency {cal['local_alpha_s'] * 1e3:.2f} ms"
    lines += [
        "",
        f"link measured in the same run ({cal['bytes']} B): one stream {cal['stream_gbit']:.3f} Gbit/s, "
        f"two-way exchange {cal['duplex_gbit']:.3f} Gbit/s per direction (plain TCP socket: "
        f"{cal.get('tcp_duplex_gbit', float('nan')):.3f}), per-call latency "
        f"{cal['alpha_s'] * 1e3:.2f} ms; inside a node {local}",
        f"bytes each node sent over its link in the whole run: {sent}; wall {wall_s:.0f} s",
    ]
    text = "\n".join(lines)
    (out / "transition.md").write_text(text + "\n")
    with open(out / "transition.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, head, out / "transition.png")
    print(text)  # noqa: T201


def plot(rows: list[dict], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["strategy"] for r in rows]
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(7, 3.8))
    ax.bar([x - 0.27 for x in xs], [r["measured_s"] for r in rows], 0.27, label="measured")
    ax.bar(list(xs), [r["modeled_s"] for r in rows], 0.27, label="modelled (link at its rate)")
    at_measured = [r["modeled_at_measured_link_s"] for r in rows]
    ax.bar([x + 0.27 for x in xs], at_measured, 0.27, label="modelled (link as measured in the run)")
    for x, r in zip(xs, rows):
        if r["measured_over_modeled"]:
            label = f"{r['measured_over_modeled']:.2f}x"
            ax.annotate(label, (x - 0.27, r["measured_s"]), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("transition seconds")
    ax.set_title(title, fontsize=7)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    return inner(args) if args.inner and "RANK" in os.environ else outer(args)


if __name__ == "__main__":
    sys.exit(main())
