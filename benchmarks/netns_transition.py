"""The measured transition benchmark on simulated nodes joined by a shaped link (issue 27).

    python benchmarks/netns_transition.py --nodes 2 --link-gbit 0.1 --train 1,2,1 --gen 1,1 \
        --strategies hybridflow,hybridflow_v --model llama2-7b-shape-1/64

Needs root (network namespaces, `rl3d.testing.netns`). Each of K simulated nodes gets one
torchrun (static rendezvous, `--node-rank i`, so global ranks i*W/K .. (i+1)*W/K-1 sit on node i)
running `rl3d.bench.measured.run_measured` with that grouping as its nodes; every node's egress is
shaped to `--link-gbit` with tbf, so bytes between nodes cross a real link of that rate and
bytes inside a node stay on its loopback. Printed per strategy: the median seconds, the bytes
the busiest node sent over its link, and the time that many bytes take at the link's rate
(the link-bound model), with the ratio measured / link-bound. Results go to --out as JSON, CSV
and a markdown table.
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
    parser.add_argument("--model", default="llama2-7b-shape-1/64")
    parser.add_argument("--train", default="1,2,1", help="P,T,D")
    parser.add_argument("--gen", default="1,1", help="TG,PG")
    parser.add_argument("--strategies", default="hybridflow,hybridflow_v")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", default=str(ROOT / "results/netns_transition"))
    parser.add_argument("--inner", default=None, help=argparse.SUPPRESS)  # a rank's JSON output path
    return parser.parse_args(argv)


def node_ranks(world: int, nodes: int, train_world: int) -> list[list[int]]:
    """The training ranks on each node under torchrun's contiguous assignment."""
    per_node = world // nodes
    groups = [[r for r in range(i * per_node, (i + 1) * per_node) if r < train_world] for i in range(nodes)]
    return [g for g in groups if g]


def inner(args: argparse.Namespace) -> int:
    """One rank, under torchrun on its simulated node."""
    from rl3d.bench.measured import run_measured

    strategies = tuple(args.strategies.split(","))
    layout, (t_g, p_g) = _ints(args.train), _ints(args.gen)
    world = int(os.environ["WORLD_SIZE"])
    nodes = node_ranks(world, args.nodes, layout[0] * layout[1] * layout[2])
    result = run_measured(
        args.model,
        layout,
        t_g,
        p_g,
        strategies=strategies,
        repeats=args.repeats,
        warmup=args.warmup,
        nodes=nodes,
    )
    if int(os.environ["RANK"]) == 0:
        Path(args.inner).write_text(json.dumps(result, default=str))
    import torch.distributed as dist

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
    }
    passthrough = ["--link-gbit", str(args.link_gbit), "--nodes", str(args.nodes), "--model", args.model]
    passthrough += ["--train", args.train, "--gen", args.gen, "--strategies", args.strategies]
    passthrough += ["--repeats", str(args.repeats), "--warmup", str(args.warmup), "--inner", str(result_path)]
    started = time.perf_counter()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # still remove the nodes when killed
    with SimNodes(args.nodes, rate_mbit=args.link_gbit * 1000, burst_kb=args.burst_kb) as nodes:
        procs = []
        for node in nodes:
            cmd = [
                sys.executable, "-m", "torch.distributed.run", f"--nnodes={args.nodes}",
                f"--nproc-per-node={world // args.nodes}", f"--node-rank={node.index}",
                f"--master-addr={nodes[0].hostname}", f"--master-port={PORT}", __file__, *passthrough,
            ]  # fmt: skip
            log = open(out / f"node{node.index}.log", "w")
            procs.append(node.popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
            print(f"node{node.index}: {world // args.nodes} rank(s), log {log.name}", flush=True)  # noqa: T201
        codes = [p.wait() for p in procs]
        sent = [nodes.link_bytes(i)[0] for i in range(args.nodes)]
    if any(codes) or not result_path.exists():
        print(f"netns_transition: ranks failed ({codes}); see {out}/node*.log", file=sys.stderr)  # noqa: T201
        return 1
    result = json.loads(result_path.read_text())
    rows = table_rows(result, args.link_gbit)
    write_outputs(rows, args, out, time.perf_counter() - started, sent)
    return 0


def table_rows(result: dict, link_gbit: float) -> list[dict]:
    rows = []
    for name, s in result["strategies"].items():
        links = s.get("links") or {}
        busiest = max(list(links.get("inter_out", {}).values()) + [0]) if links else None
        bound = busiest * 8 / (link_gbit * 1e9) if busiest else None
        rows.append(
            {
                "strategy": name,
                "seconds": s["seconds"],
                "raw_seconds": s["raw_seconds"],
                "bytes_max": s["bytes_max"],
                "node_out_bytes_max": busiest,
                "link_bound_seconds": bound,
                "measured_over_link_bound": s["seconds"] / bound if bound else None,
                "links_match_plan": s.get("links_match"),
            }
        )
    return rows


def write_outputs(rows: list[dict], args, out: Path, wall_s: float, sent: list[int]) -> None:
    head = f"{args.nodes} nodes, link {args.link_gbit:g} Gbit/s (tbf), {args.model}"
    head += f", train {args.train}, gen {args.gen}"
    lines = [
        f"# {head}",
        "",
        "| strategy | measured s | busiest node sent (B) | link-bound s | measured / link-bound |",
    ]
    lines.append("|---|---|---|---|---|")
    fmt = lambda v, f: "n/a" if v is None else format(v, f)  # noqa: E731
    for r in rows:
        cells = [r["strategy"], fmt(r["seconds"], ".4f"), fmt(r["node_out_bytes_max"], "d")]
        cells += [fmt(r["link_bound_seconds"], ".4f"), fmt(r["measured_over_link_bound"], ".2f")]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"bytes each node sent over its link in the whole run: {sent}; wall {wall_s:.0f} s"]
    text = "\n".join(lines)
    (out / "transition.md").write_text(text + "\n")
    with open(out / "transition.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(text)  # noqa: T201


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    return inner(args) if args.inner and "RANK" in os.environ else outer(args)


if __name__ == "__main__":
    sys.exit(main())
