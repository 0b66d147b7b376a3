"""The run's system directories are read-only all the way down: a mount under a bound directory
(common in containers: a volume under /usr or /etc) is read-only inside the run too."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rl3d.tools.python_sandbox import SandboxConfig, isolation_problem

FAST = {"cpu_seconds": 2, "wall_seconds": 20, "memory_mb": 256}
PROBLEM = isolation_problem(SandboxConfig(**FAST))
pytestmark = pytest.mark.skipif(
    PROBLEM is not None or os.geteuid() != 0 or not shutil.which("unshare"),
    reason=f"needs root, unshare and kernel isolation ({PROBLEM})",
)
# directories under the bound system directories this test may cover with a tmpfs of its own
SUBMOUNTS = [d for d in ("/usr/src", "/usr/games", "/usr/share/doc", "/etc/opt") if os.path.isdir(d)]

# Runs in a mount namespace of the test's own: mounts a writable tmpfs on each directory, checks
# that it is writable there, then asks the sandbox to write into it.
SCRIPT = """
import json, os, subprocess, sys
sys.path.insert(0, sys.argv[1])
from rl3d.tools.python_sandbox import SandboxConfig, run_python, to_result
dirs = json.loads(sys.argv[2])
for d in dirs:
    subprocess.run(["mount", "-t", "tmpfs", "rl3d-test-submount", d], check=True)
    open(d + "/host-can-write", "w").close()
code = "import os\\n" + "".join(
    f"try:\\n    open({d + '/probe'!r}, 'w').close()\\n    print('wrote', {d!r})\\n"
    f"except OSError as e:\\n    print('refused', {d!r}, e.errno)\\n" for d in dirs)
config = SandboxConfig(cpu_seconds=2, wall_seconds=20, memory_mb=256)
raw = run_python(code, config)
print(json.dumps({"stdout": raw.stdout, "ok": to_result(raw, config).ok,
                  "left": [d for d in dirs if os.path.exists(d + "/probe")]}))
"""


@pytest.mark.skipif(not SUBMOUNTS, reason="no directory under /usr or /etc to mount on here")
def test_a_mount_under_a_bound_system_directory_is_read_only_inside():
    src = str(Path(__file__).resolve().parents[3] / "src")
    command = ["unshare", "--mount", "--propagation", "private", sys.executable, "-c", SCRIPT]
    proc = subprocess.run([*command, src, json.dumps(SUBMOUNTS)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.splitlines()[-1])
    assert report["ok"], report
    # EROFS (30) for every submount: written nowhere, inside or on the host's side of the tmpfs
    assert report["stdout"].splitlines() == [f"refused {d} 30" for d in SUBMOUNTS], report
    assert report["left"] == []


# Without mount_setattr (Linux before 5.12) each mount under the bind is remounted on its own.
FALLBACK = """
import ctypes, os, subprocess, sys, tempfile
sys.path.insert(0, sys.argv[1])
import _sandbox_init as init
sub = sys.argv[2]
subprocess.run(["mount", "-t", "tmpfs", "rl3d-test-submount", sub], check=True)
target = tempfile.mkdtemp()
mount = init._Mounter(ctypes.CDLL(None, use_errno=True))
mount("/usr" if sub.startswith("/usr/") else "/etc", target, None, init.MS_BIND | init.MS_REC)
mount.remount_each(target, init.MS_RDONLY | init.MS_NOSUID | init.MS_NODEV)
inside = target + sub[4:]
try:
    open(inside + "/probe", "w").close()
    print("wrote", inside)
except OSError as e:
    print("refused", e.errno)
"""


@pytest.mark.skipif(not SUBMOUNTS, reason="no directory under /usr or /etc to mount on here")
def test_the_fallback_remounts_every_mount_under_a_bind():
    tools = str(Path(__file__).resolve().parents[3] / "src" / "rl3d" / "tools")
    command = ["unshare", "--mount", "--propagation", "private", sys.executable, "-c", FALLBACK]
    proc = subprocess.run([*command, tools, SUBMOUNTS[0]], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["refused", "30"], proc.stdout
