"""The processes `rl3d train` starts run the same code whatever the working directory: the
interpreter does not put that directory ahead of the installed packages (PYTHONSAFEPATH), and user
code named by import path is still found there, after them; glibc's allocator keeps large
blocks unless the user set its keys."""

import platform
import subprocess
import sys

import pytest

from rl3d.launch.torchrun_job import ALLOCATOR_ENV, launch_env
from rl3d.utils.imports import LAUNCH_DIR_ENV

FIND = (
    "import yaml, sys; from rl3d.utils.imports import import_object; "
    "print(yaml.__file__); print(import_object('rl3d_launch_dir_user:answer')())"
)


def test_a_launched_python_prefers_installed_packages_and_finds_user_code(tmp_path, monkeypatch):
    # A directory that holds both a module shadowing an installed package and the user's code.
    (tmp_path / "yaml.py").write_text("raise RuntimeError('the working directory shadowed PyYAML')\n")
    (tmp_path / "rl3d_launch_dir_user.py").write_text("def answer():\n    return 42\n")
    monkeypatch.chdir(tmp_path)
    env = launch_env()
    assert env["PYTHONSAFEPATH"] == "1" and env[LAUNCH_DIR_ENV] == str(tmp_path)
    done = subprocess.run([sys.executable, "-c", FIND], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    yaml_file, answer = done.stdout.split()
    assert not yaml_file.startswith(str(tmp_path)) and answer == "42"
    # Without it, the same directory shadows the installed package: the check can fail.
    bare = {k: v for k, v in env.items() if k != "PYTHONSAFEPATH"}
    shadowed = subprocess.run(
        [sys.executable, "-c", FIND], env=bare, capture_output=True, text=True, timeout=60
    )
    assert shadowed.returncode != 0 and "shadowed PyYAML" in shadowed.stderr


# A launched process that takes a 150 MB block from glibc's malloc, writes it and frees it, four
# times: the minor page faults of the last three (ctypes: glibc's own malloc, no allocator above).
REFAULTS = (
    "import ctypes, resource\n"
    "libc = ctypes.CDLL('libc.so.6')\n"
    "libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]\n"
    "faults = []\n"
    "for _ in range(4):\n"
    "    start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
    "    block = libc.malloc(150 << 20)\n"
    "    ctypes.memset(block, 1, 150 << 20)\n"
    "    libc.free(block)\n"
    "    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start)\n"
    "print(sum(faults[1:]))\n"
)


def _refaults(env: dict[str, str]) -> int:
    done = subprocess.run(
        [sys.executable, "-c", REFAULTS], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return int(done.stdout)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the settings are glibc's")
def test_the_launcher_keeps_large_blocks_and_the_users_value_wins(monkeypatch):
    for key in ALLOCATOR_ENV:
        monkeypatch.delenv(key, raising=False)
    env = launch_env()
    assert {k: env[k] for k in ALLOCATOR_ENV} == ALLOCATOR_ENV
    bare = {k: v for k, v in env.items() if k not in ALLOCATOR_ENV}
    pages = (150 << 20) // 4096  # one block's pages
    assert _refaults(bare) >= 3 * pages * 0.99  # glibc's default: unmapped on free, faulted again
    assert _refaults(env) < pages * 0.01  # kept in the heap: the pages are already there
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert launch_env()["MALLOC_MMAP_THRESHOLD_"] == "65536"
