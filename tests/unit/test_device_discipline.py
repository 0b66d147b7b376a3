"""Static checks over `src/rl3d` (ast) for the GPU-path bugs that no CPU run can see:

- a device decided by `torch.cuda.is_available()` instead of the configured device;
- a process group made anywhere but the device module, which binds a CUDA rank to its GPU
  (`torch.cuda.set_device(LOCAL_RANK)`) before NCCL exists;
- a tensor made without `device=` and handed to a collective (a CPU tensor on an NCCL group).
"""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "rl3d"
DEVICE_MODULE = "utils/device.py"
# where asking whether CUDA exists is not a device decision
IS_AVAILABLE_OK = {
    DEVICE_MODULE: "the device module decides",
    "models/cpu_shim.py": "the shim's own default when no device is given",
    "checkpoint/rng.py": "captures CUDA generator states if there are any",
    "models/dist_checkpoint.py": "captures CUDA generator states if there are any",
    "ops/cuda_ext.py": "whether the compiled extension can be used at all",
}
INIT_OK = {DEVICE_MODULE: "binds the GPU first", "testing/spawn.py": "the tests' gloo harness"}
COLLECTIVES = {"all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce", "reduce_scatter"}
FACTORIES = {"tensor", "zeros", "ones", "empty", "full", "arange", "zeros_like"}


def _sources() -> dict[str, ast.Module]:
    return {str(p.relative_to(SRC)): ast.parse(p.read_text(encoding="utf-8")) for p in SRC.rglob("*.py")}


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def _calls(tree: ast.AST, name: str) -> list[ast.Call]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and _dotted(n.func).endswith(name)]


def cuda_checks_outside_the_device_module(sources) -> list[str]:
    return [
        f"{path}:{c.lineno}"
        for path, tree in sources.items()
        if path not in IS_AVAILABLE_OK
        for c in _calls(tree, "cuda.is_available")
    ]


def process_groups_outside_the_device_module(sources) -> list[str]:
    return [
        f"{path}:{c.lineno}"
        for path, tree in sources.items()
        if path not in INIT_OK
        for c in _calls(tree, "init_process_group")
        if _dotted(c.func) in ("dist.init_process_group", "torch.distributed.init_process_group")
    ]


def collective_tensors_without_device(sources) -> list[str]:
    """Names bound to `torch.<factory>(...)` without `device=` in a function, then passed to a
    `dist.<collective>` in the same function."""
    found = []
    for path, tree in sources.items():
        for fn in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            hostless = {}
            for node in ast.walk(fn):
                if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
                    call = node.value
                    made = _dotted(call.func)
                    if made.startswith("torch.") and made.split(".")[-1] in FACTORIES:
                        if not any(k.arg == "device" for k in call.keywords) and not made.endswith("_like"):
                            hostless.update(
                                {t.id: node.lineno for t in node.targets if isinstance(t, ast.Name)}
                            )
            for call in (n for n in ast.walk(fn) if isinstance(n, ast.Call)):
                name = _dotted(call.func)
                if name.startswith("dist.") and name.split(".")[-1] in COLLECTIVES and call.args:
                    arg = call.args[0]
                    if isinstance(arg, ast.Name) and arg.id in hostless:
                        found.append(f"{path}:{call.lineno} ({arg.id}, made at line {hostless[arg.id]})")
    return found


def test_no_device_decision_by_cuda_availability():
    assert cuda_checks_outside_the_device_module(_sources()) == []


def test_process_groups_only_through_the_device_module():
    assert process_groups_outside_the_device_module(_sources()) == []


def test_the_device_module_binds_the_gpu_before_nccl_exists():
    fn = next(
        n
        for n in ast.walk(_sources()[DEVICE_MODULE])
        if isinstance(n, ast.FunctionDef) and n.name == "init_process_group"
    )
    set_device = min(c.lineno for c in _calls(fn, "cuda.set_device"))
    nccl = [c for c in _calls(fn, "init_process_group") if any(k.arg == "device_id" for k in c.keywords)]
    assert nccl and set_device < nccl[0].lineno


def test_collective_tensors_are_made_on_a_device():
    assert collective_tensors_without_device(_sources()) == []


def test_the_checks_see_each_bug_class():
    """Each check flags the shape of code it is there for (the code the GPU review found)."""
    bad = {
        "train.py": ast.parse(
            "import torch, torch.distributed as dist\n"
            "def main():\n"
            "    backend = 'nccl' if torch.cuda.is_available() else 'gloo'\n"
            "    dist.init_process_group(backend)\n"
        ),
        "workers/role.py": ast.parse(
            "import torch, torch.distributed as dist\n"
            "def step(group, n):\n"
            "    total = torch.tensor([float(n)])\n"
            "    dist.all_reduce(total, group=group)\n"
            "    ok = torch.tensor([1.0], device='cuda')\n"
            "    dist.all_reduce(ok, group=group)\n"
        ),
    }
    assert cuda_checks_outside_the_device_module(bad) == ["train.py:3"]
    assert process_groups_outside_the_device_module(bad) == ["train.py:4"]
    assert collective_tensors_without_device(bad) == ["workers/role.py:4 (total, made at line 3)"]
