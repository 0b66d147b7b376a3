"""The processes `rl3d train` starts run the same code whatever the working directory: the
interpreter does not put that directory ahead of the installed packages (PYTHONSAFEPATH), and user
code named by import path is still found there, after them."""

import subprocess
import sys

from rl3d.launch.torchrun_job import launch_env
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
