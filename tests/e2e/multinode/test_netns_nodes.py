"""The simulated-node fixture itself: two namespaces with their own hostnames and addresses,
TCP across, a tbf-shaped link at roughly its rate, and nothing left behind afterwards (nor by a
run that was killed)."""

import signal
import subprocess
import sys
import time

import pytest

from rl3d.testing.netns import SimNodes, netns_unavailable_reason

pytestmark = pytest.mark.e2e

SERVER = """
import socket, sys, time
srv = socket.create_server(("0.0.0.0", 5601))
print("listening", flush=True)
conn, _ = srv.accept()
total, start = 0, None
while chunk := conn.recv(1 << 16):
    start = start or time.perf_counter()
    total += len(chunk)
print(total, total / (time.perf_counter() - start), flush=True)
"""
CLIENT = """
import socket, sys
conn = socket.create_connection((sys.argv[1], 5601), timeout=10)
conn.sendall(b"x" * int(sys.argv[2]))
conn.close()
"""


def send_across(nodes: SimNodes, num_bytes: int) -> tuple[int, float]:
    """node1 -> node0 over TCP by hostname; (bytes received, bytes/s measured by the receiver)."""
    server = nodes[0].popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
    assert server.stdout.readline().strip() == "listening"
    client = nodes[1].run([sys.executable, "-c", CLIENT, "node0", str(num_bytes)], timeout=60)
    assert client.returncode == 0, client.stderr
    received, rate = server.stdout.readline().split()
    server.wait(timeout=10)
    return int(received), float(rate)


def test_two_nodes_have_own_names_and_talk_over_tcp(sim_nodes):
    for node in sim_nodes:
        names = node.run(["sh", "-c", "hostname; getent hosts node0 node1"])
        assert names.returncode == 0, names.stderr
        lines = names.stdout.split("\n")
        assert lines[0] == node.hostname
        assert f"{sim_nodes[0].address} " in lines[1] and f"{sim_nodes[1].address} " in lines[2]
    sent_before, _ = sim_nodes.link_bytes(1)
    received, _ = send_across(sim_nodes, 4_000_000)
    assert received == 4_000_000
    assert sim_nodes.link_bytes(1)[0] - sent_before >= 4_000_000  # counted on node1's link


def test_shaped_link_runs_near_its_rate(make_sim_nodes):
    nodes = make_sim_nodes(2, rate_mbit=40, burst_kb=32)
    _, rate = send_across(nodes, 2_500_000)  # ~0.5 s at 40 Mbit/s
    assert 0.6 * 5e6 < rate < 1.15 * 5e6, rate  # 40 Mbit/s = 5 MB/s


def test_link_down_cuts_the_node_off(sim_nodes):
    sim_nodes.set_link(1, up=False)
    probe = [sys.executable, "-c", "import socket; socket.create_connection(('node0', 5602), timeout=2)"]
    cut = sim_nodes[1].run(probe)
    assert cut.returncode != 0 and ("timed out" in cut.stderr or "No route" in cut.stderr), cut.stderr
    sim_nodes.set_link(1, up=True)
    back = sim_nodes[1].run(probe)
    assert "refused" in back.stderr  # reachable again: nobody listens on 5602


def test_close_removes_everything_and_stale_runs_are_swept():
    reason = netns_unavailable_reason()
    if reason:
        pytest.skip(f"no simulated nodes: {reason}")
    with SimNodes(2) as nodes:
        daemon = nodes[0].popen(["sleep", "600"])
        assert nodes.leftovers() and daemon.poll() is None
    assert nodes.leftovers() == [] and daemon.poll() is not None

    # a run that was SIGKILLed leaves its nodes; the next SimNodes sweeps them
    code = "from rl3d.testing.netns import SimNodes; n = SimNodes(2); n.start(); print(n.tag, flush=True); "
    code += "n[1].popen(['sleep', '600']); import time; time.sleep(600)"
    crashed = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    tag = crashed.stdout.readline().strip()
    time.sleep(0.3)
    crashed.send_signal(signal.SIGKILL)
    crashed.wait()
    stale = SimNodes(2)
    stale.tag = tag  # look at the dead run's names
    assert len(stale.leftovers()) == 2 + 3 + 2  # 2 namespaces, bridge + 2 veths, 2 hosts files
    with SimNodes(1):
        assert stale.leftovers() == []
