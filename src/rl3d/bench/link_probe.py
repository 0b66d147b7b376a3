"""What the inter-node link really gives gloo, measured in the benchmark's own run.

`calibrate_link` runs on every rank after the strategies (collective: every rank calls it) and
times, between the first rank of node 0 and the first rank of node 1:
- `alpha_s`: one tiny all-gather of the pair (one ring step across the link), the per-call
  latency `rl3d.bench.link_model` charges per step;
- `stream_gbit`: one send of `nbytes` one way (a single TCP stream over the link);
- `duplex_gbit`: an all-gather of `nbytes` per rank (both directions at once, as a ring does);
- `tcp_duplex_gbit`: the same two-way exchange on a plain TCP socket between the two (no
  gloo): what the link itself gives two-way traffic;
- `local_gbit`, `local_alpha_s`: one send of 4 x `nbytes`, and the tiny all-gather, between
  the first two ranks of node 0, where node 0 has two (None otherwise).
The model predicts at the link's nominal rate; these say how far gloo's traffic gets from it.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from rl3d.hybrid_engine.nodes import NodeMap

TINY_CALLS = 41


def _tcp_two_way(me: int, a: int, b: int, nbytes: int, repeats: int) -> float:
    """Median seconds of `nbytes` each way at once over one TCP connection from rank a to rank b
    (every rank calls it; the others wait at the barriers)."""
    import socket
    import threading

    server, conn = None, None
    port = [0]
    if me == b:
        server = socket.create_server(("", 0))
        port = [server.getsockname()[1]]
    dist.broadcast_object_list(port, src=b)
    host = [socket.gethostname()]
    dist.broadcast_object_list(host, src=b)
    if me == a:
        conn = socket.create_connection((host[0], port[0]))
    elif me == b:
        conn, _ = server.accept()
    payload = b"x" * nbytes
    times = []
    for _ in range(repeats + 1):  # the first one warms the connection up
        dist.barrier()
        start = time.perf_counter()
        if conn is not None:
            got = [0]

            def receive(conn=conn, got=got):
                while got[0] < nbytes:
                    got[0] += len(conn.recv(min(1 << 20, nbytes - got[0])))

            reader = threading.Thread(target=receive)
            reader.start()
            conn.sendall(payload)
            reader.join()
        seconds = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device="cpu")
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        times.append(float(seconds.item()))
    for sock in (conn, server):
        if sock is not None:
            sock.close()
    return statistics.median(times[1:])


def calibrate_link(nodes: NodeMap, *, nbytes: int = 2_000_000, repeats: int = 3) -> dict:
    from rl3d.bench.measured import _timed

    device = torch.device("cpu")
    me = dist.get_rank()
    a, b = nodes.nodes[0][0], nodes.nodes[1][0]
    pair = dist.new_group([a, b])
    numel = nbytes // 4
    buf = torch.zeros(numel, device=device)
    tiny = torch.zeros(1, device=device)

    def median(fn) -> float:
        fn()  # warm-up (connections, allocations)
        return statistics.median(_timed(fn, device) for _ in range(repeats))

    def latency(group=pair, members=(a, b)) -> float:
        """The median of TINY_CALLS tiny all-gathers timed one by one on `members[0]` (a median,
        not a mean: on a shared CPU a few calls wait for the scheduler)."""
        times = []
        if me in members:
            outs = [torch.empty(1, device=device), torch.empty(1, device=device)]
            for _ in range(TINY_CALLS):
                start = time.perf_counter()
                dist.all_gather(outs, tiny, group=group)
                times.append(time.perf_counter() - start)
        median_s = statistics.median(times) if me == members[0] else 0.0
        mine = torch.tensor([median_s], dtype=torch.float64, device=device)
        dist.all_reduce(mine)
        return float(mine.item())

    def stream(src=a, dst=b, tensor=buf):
        if me == src:
            dist.send(tensor, dst=dst)
        elif me == dst:
            dist.recv(tensor, src=src)

    def duplex():
        if me in (a, b):
            outs = [torch.empty(numel, device=device), torch.empty(numel, device=device)]
            dist.all_gather(outs, buf, group=pair)

    gbit = lambda seconds, size=nbytes: size * 8 / seconds / 1e9  # noqa: E731
    out = {
        "bytes": nbytes,
        "alpha_s": latency(),
        "stream_gbit": gbit(median(stream)),
        "duplex_gbit": gbit(median(duplex)),
        "tcp_duplex_gbit": gbit(_tcp_two_way(me, a, b, nbytes, repeats)),
        "local_gbit": None,
        "local_alpha_s": None,
    }
    if len(nodes.nodes[0]) > 1:
        big = torch.zeros(4 * numel, device=device)
        mate = nodes.nodes[0][1]
        mates = dist.new_group([a, mate])
        out["local_gbit"] = gbit(median(lambda: stream(a, mate, big)), 4 * nbytes)
        out["local_alpha_s"] = latency(mates, (a, mate))
        dist.destroy_process_group(mates)
    dist.destroy_process_group(pair)
    return out
