"""Several simulated nodes on one machine: a network namespace per node, joined by a bridge.

    reason = netns_unavailable_reason()          # None where namespaces can be made (root + `ip`)
    with SimNodes(2, rate_mbit=200) as nodes:    # node0, node1 at 10.213.0.1, .2; ~0.5 s
        proc = nodes[1].popen(["python", "-m", "http.server"], env=env)
        nodes[0].run(["getent", "hosts", "node1"])
        nodes.set_link(1, up=False)              # node1 loses the inter-node link (a fault)

Each node has its own network namespace (address 10.213.0.<i+1>/24 on its `eth0`, a veth whose
other end sits on a bridge in the root namespace), its own hostname (each command runs in a UTS
namespace of its own that carries the node's name) and an /etc/hosts that names every node
(/etc/netns/<ns>/hosts, bound over /etc/hosts in a mount namespace of the command's own, as
`ip netns exec` would). The root namespace gets no
address on the bridge and nothing is routed, so the nodes reach each other and nothing else.

`rate_mbit` shapes each node's egress with `tbf` (rate and burst), so every byte between two
nodes crosses one link of that rate; `link_bytes(i)` counts what node i sent and received.

Names carry the creating process's pid (`r3n<pid>k<nn>...`): `close()` removes what this object
made (every process still in a node's namespace, the namespaces, the bridge, the veths, the
hosts files), and creating a new `SimNodes` first removes what a crashed earlier run left, by
the prefix, where the pid in the name is no longer alive.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

PREFIX = "r3n"  # every namespace and link this module makes starts with it
SUBNET = "10.213.0"  # private to each bridge: the root namespace has no address on it
NETNS_DIR = Path("/run/netns")
HOSTS_DIR = Path("/etc/netns")  # iproute2 binds /etc/netns/<ns>/<file> over /etc/<file>
_NAME = re.compile(rf"^{PREFIX}([0-9a-f]+)k[0-9a-f]{{2}}")
_counter = itertools.count()
_reason: list[str | None] = []  # cached probe result


class NetnsError(RuntimeError):
    """A namespace, link or qdisc could not be made (the message holds the command's stderr)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {proc.stderr.strip()}")
    return proc


def netns_unavailable_reason() -> str | None:
    """None when network namespaces, veths and a bridge can be made here; else why not."""
    if _reason:
        return _reason[0]
    reason = None
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        reason = "simulated nodes need root (network namespaces, veth pairs, tc)"
    elif not all(shutil.which(tool) for tool in ("ip", "unshare", "nsenter")):
        reason = "simulated nodes need `ip` (iproute2), `unshare` and `nsenter` (util-linux)"
    else:
        probe = f"{PREFIX}{os.getpid():x}kprobe"
        made = _ip("netns", "add", probe, check=False)
        if made.returncode != 0:
            reason = f"`ip netns add` failed: {made.stderr.strip()}"
        else:
            _ip("netns", "del", probe, check=False)
    _reason.append(reason)
    return reason


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_netns_processes(netns: str, timeout_s: float = 5.0) -> None:
    """TERM, then KILL, every process in the namespace (daemons that detached included)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = [int(p) for p in _ip("netns", "pids", netns, check=False).stdout.split()]
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + timeout_s
        while pids and time.monotonic() < deadline:
            pids = [p for p in pids if _alive(p)]
            time.sleep(0.05)
        if not pids:
            return


def _remove(netns_names: list[str], link_names: list[str]) -> None:
    for netns in netns_names:
        _kill_netns_processes(netns)
    for link in link_names:  # a veth goes with its peer; removing it here makes that synchronous
        _ip("link", "del", link, check=False)
    for netns in netns_names:
        _ip("netns", "del", netns, check=False)
        shutil.rmtree(HOSTS_DIR / netns, ignore_errors=True)
    if HOSTS_DIR.is_dir() and not any(HOSTS_DIR.iterdir()):
        HOSTS_DIR.rmdir()


def _ours(names: list[str], *, tag: str | None = None) -> list[str]:
    """The names this module made: those of `tag`, or (no tag) those of dead processes."""
    keep = []
    for name in names:
        match = _NAME.match(name)
        if match and (name.startswith(tag) if tag else not _alive(int(match.group(1), 16))):
            keep.append(name)
    return keep


def _netns_names() -> list[str]:
    return [line.split()[0] for line in _ip("netns", "list", check=False).stdout.splitlines() if line.strip()]


def _link_names() -> list[str]:
    out = _ip("-o", "link", "show", check=False).stdout
    return [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line]


def remove_stale() -> list[str]:
    """Remove the namespaces, links and hosts files of SimNodes whose process died; their names."""
    hosts = [p.name for p in HOSTS_DIR.iterdir()] if HOSTS_DIR.is_dir() else []
    netns = sorted(set(_ours(_netns_names())) | set(_ours(hosts)))
    links = _ours(_link_names())
    _remove(netns, links)
    return netns + links


@dataclass(frozen=True)
class SimNode:
    """One simulated node: run commands in its namespace, under its hostname."""

    index: int
    hostname: str
    address: str
    netns: str
    host_link: str  # the veth's end on the bridge, in the root namespace
    owner: SimNodes

    def command(self, argv: list[str]) -> list[str]:
        """`argv` as run on this node: its network namespace, hosts file and hostname."""
        # not `ip netns exec`: it remounts /sys, without the cgroup fs that slurmd needs
        setup = 'mount --bind "$1" /etc/hosts && hostname "$0" && shift && exec "$@"'
        hosts = str(HOSTS_DIR / self.netns / "hosts")
        enter = ["nsenter", f"--net={NETNS_DIR / self.netns}", "unshare", "--mount", "--uts"]
        return [*enter, "sh", "-c", setup, self.hostname, hosts, *argv]

    def popen(self, argv: list[str], **kwargs) -> subprocess.Popen:
        """Start `argv` on this node (in a session of its own); `SimNodes.close()` ends it."""
        kwargs.setdefault("start_new_session", True)
        proc = subprocess.Popen(self.command(argv), **kwargs)
        self.owner.processes.append(proc)
        return proc

    def run(self, argv: list[str], *, timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run(self.command(argv), timeout=timeout, **kwargs)

    def pids(self) -> list[int]:
        """Every process in this node's network namespace."""
        return [int(p) for p in _ip("netns", "pids", self.netns, check=False).stdout.split()]

    def kill_all(self) -> None:
        """Kill every process on this node (a node that crashed)."""
        _kill_netns_processes(self.netns, timeout_s=2.0)


class SimNodes:
    """K simulated nodes joined by a bridge; a context manager (see the module doc)."""

    def __init__(
        self,
        num_nodes: int = 2,
        *,
        rate_mbit: float | None = None,
        burst_kb: float = 64.0,
        latency_ms: float = 100.0,
        hostname_prefix: str = "node",
    ):
        assert 1 <= num_nodes <= 16, num_nodes
        self.num_nodes = num_nodes
        self.rate_mbit, self.burst_kb, self.latency_ms = rate_mbit, burst_kb, latency_ms
        self.tag = f"{PREFIX}{os.getpid():x}k{next(_counter) % 256:02x}"
        self.bridge = f"{self.tag}b"
        self.nodes = [
            SimNode(
                index=i,
                hostname=f"{hostname_prefix}{i}",
                address=f"{SUBNET}.{i + 1}",
                netns=f"{self.tag}n{i:x}",
                host_link=f"{self.tag}v{i:x}",
                owner=self,
            )
            for i in range(num_nodes)
        ]
        self.processes: list[subprocess.Popen] = []

    def __enter__(self) -> SimNodes:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __getitem__(self, index: int) -> SimNode:
        return self.nodes[index]

    def __iter__(self):
        return iter(self.nodes)

    def __len__(self) -> int:
        return self.num_nodes

    def start(self) -> None:
        remove_stale()
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "up")
            hosts = "127.0.0.1 localhost\n" + "".join(f"{n.address} {n.hostname}\n" for n in self.nodes)
            for node in self.nodes:
                _ip("netns", "add", node.netns)
                veth = ("type", "veth", "peer", "name", "eth0", "netns", node.netns)
                _ip("link", "add", node.host_link, *veth)
                _ip("link", "set", node.host_link, "master", self.bridge, "up")
                _ip("-n", node.netns, "addr", "add", f"{node.address}/24", "dev", "eth0")
                _ip("-n", node.netns, "link", "set", "eth0", "up")
                _ip("-n", node.netns, "link", "set", "lo", "up")
                (HOSTS_DIR / node.netns).mkdir(parents=True, exist_ok=True)
                (HOSTS_DIR / node.netns / "hosts").write_text(hosts)
                if self.rate_mbit:
                    self.shape(node.index, self.rate_mbit, self.burst_kb, self.latency_ms)
        except BaseException:
            self.close()
            raise

    def shape(self, index: int, rate_mbit: float, burst_kb: float = 64.0, latency_ms: float = 100.0) -> None:
        """Limit node `index`'s egress (so every transfer it sends) to `rate_mbit` with `tbf`;
        `latency_ms` bounds how long a packet may wait in its queue (the queue's length)."""
        node = self.nodes[index]
        tc = [
            "ip", "netns", "exec", node.netns, "tc", "qdisc", "replace", "dev", "eth0", "root", "tbf",
            "rate", f"{rate_mbit}mbit", "burst", f"{burst_kb}kb", "latency", f"{latency_ms}ms",
        ]  # fmt: skip
        proc = subprocess.run(tc, capture_output=True, text=True, timeout=30)
        if proc.returncode != 0:
            raise NetnsError(f"{' '.join(tc)}: {proc.stderr.strip()}")

    def set_link(self, index: int, *, up: bool) -> None:
        """Plug node `index`'s cable in or out: the bridge side of its veth goes up or down."""
        _ip("link", "set", self.nodes[index].host_link, "up" if up else "down")
        if up:  # forget the failed ARP lookups of the outage, or "no route to host" lingers
            for node in self.nodes:
                _ip("-n", node.netns, "neigh", "flush", "all", check=False)

    def link_bytes(self, index: int) -> tuple[int, int]:
        """(bytes node `index` sent, bytes it received) over its link so far."""
        stats = Path("/sys/class/net") / self.nodes[index].host_link / "statistics"
        # the bridge side's rx is what the node sent
        return int((stats / "rx_bytes").read_text()), int((stats / "tx_bytes").read_text())

    def close(self) -> None:
        for proc in self.processes:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        for proc in self.processes:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        netns = _ours(_netns_names(), tag=self.tag)
        links = _ours(_link_names(), tag=self.tag)
        _remove(netns + [n.netns for n in self.nodes if n.netns not in netns], links)

    def leftovers(self) -> list[str]:
        """Namespaces, links and hosts files of this object still present (empty after close)."""
        hosts = [p.name for p in HOSTS_DIR.iterdir()] if HOSTS_DIR.is_dir() else []
        return _ours(_netns_names() + _link_names() + hosts, tag=self.tag)
