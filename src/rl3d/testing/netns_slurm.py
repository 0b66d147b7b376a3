"""A real SLURM cluster over simulated nodes (`rl3d.testing.netns`), for multi-node jobs.

    with SimNodes(2) as nodes, NetnsSlurmCluster(tmp_dir, nodes) as cluster:
        cluster.client(["sbatch", ...])      # clients run on node0, where slurmctld listens
        cluster.wait_for_job(job_id)

slurmctld runs on node0; one slurmd per node, each in its node's namespace under its hostname
(NodeName = hostname, NodeAddr = its address); munged runs in the root namespace, and its
socket (a file) serves every node, so they share one key. Everything else is the one-node
cluster's (`slurm_cluster.LocalSlurmCluster`): one folder, root, no systemd. Closing the
`SimNodes` ends any daemon or job process still running on a node.
"""

from __future__ import annotations

import os
import signal
import subprocess

from rl3d.testing.netns import SimNodes
from rl3d.testing.slurm_cluster import LocalSlurmCluster, _sbin

SLURMD_TIMEOUT_S = 20  # a node that stops answering is declared down after this long


class NetnsSlurmCluster(LocalSlurmCluster):
    def __init__(self, root: str | os.PathLike, nodes: SimNodes, *, cpus: int | None = None, **kwargs):
        super().__init__(root, cpus=cpus, **kwargs)
        self.nodes = nodes
        self.host = nodes[0].hostname

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    def client(self, argv: list[str], timeout: float = 30) -> subprocess.CompletedProcess:
        return self.nodes[0].run(argv, env=self.env, timeout=timeout)

    def _start_daemons(self) -> None:
        self._run(self.nodes[0].command([_sbin("slurmctld"), "-f", str(self.conf)]))
        for node in self.nodes:
            (self.root / "spool" / node.hostname).mkdir(parents=True, exist_ok=True)
            self._run(node.command([_sbin("slurmd"), "-f", str(self.conf)]))

    def _conf_lines(self) -> list[str]:
        r, first = self.root, self.nodes[0]
        per_node = {  # %n: the node's name, so each slurmd has its own spool, pid and log file
            "SlurmctldHost": f"{first.hostname}({first.address})",
            "SlurmdSpoolDir": f"{r / 'spool'}/%n",
            "SlurmdPidFile": f"{r / 'run'}/slurmd-%n.pid",
            "SlurmdLogFile": f"{r / 'log'}/slurmd-%n.log",
        }
        lines = []
        for line in super()._conf_lines():
            key = line.split("=", 1)[0]
            if key == "NodeName":
                lines += [
                    f"NodeName={n.hostname} NodeAddr={n.address} CPUs={self.cpus} State=UNKNOWN"
                    for n in self.nodes
                ]
            else:
                lines.append(f"{key}={per_node[key]}" if key in per_node else line)
        return [*lines, f"SlurmdTimeout={SLURMD_TIMEOUT_S}", "KillWait=5"]

    def stop(self) -> None:
        for node in self.nodes:
            pid_file = self.root / "run" / f"slurmd-{node.hostname}.pid"
            try:
                os.kill(int(pid_file.read_text().split()[0]), signal.SIGTERM)
            except (OSError, ValueError, IndexError):
                pass
            pid_file.unlink(missing_ok=True)
        super().stop()
