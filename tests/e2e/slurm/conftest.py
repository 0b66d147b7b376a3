"""A real SLURM cluster (slurmctld + slurmd + munged on localhost) for the tests of this folder.

The packages are installed with apt-get when missing and the tests run as root; otherwise every
test here is skipped with the reason. SLURM_CONF points the clients (sbatch, squeue, ...) at it.

The cluster and the runs live in a folder of their own, not under pytest's basetemp: another
pytest session on the same machine prunes old basetemps, daemons' state and running jobs
included.
"""

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from rl3d.testing.slurm_cluster import LocalSlurmCluster, slurm_unavailable_reason


@pytest.fixture(scope="session")
def slurm_cluster():
    reason = slurm_unavailable_reason(install=True)
    if reason:
        pytest.skip(f"no local SLURM cluster: {reason}")
    root = Path(tempfile.mkdtemp(prefix="rl3d-slurm-"))
    cluster = LocalSlurmCluster(root / "cluster")
    cluster.start()
    previous = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(cluster.conf)
    try:
        yield cluster
    finally:
        cluster.stop()
        if previous is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = previous
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def slurm(slurm_cluster):
    """The session's cluster; whatever a test leaves queued or running is cancelled after it."""
    yield slurm_cluster
    queued = subprocess.run(
        ["squeue", "-h", "-o", "%i"], capture_output=True, text=True, env=slurm_cluster.env
    )
    for job_id in queued.stdout.split():
        subprocess.run(["scancel", job_id], env=slurm_cluster.env)


@pytest.fixture
def run_root(slurm_cluster, request) -> Path:
    """A folder for this test's run directories, next to the cluster (see the module doc)."""
    path = slurm_cluster.root.parent / "runs" / re.sub(r"\W", "_", request.node.name)
    path.mkdir(parents=True)
    return path
