"""Variants are objects handed to the one loop, never subclasses of it: no class in `src/rl3d`
derives from `RLTrainer`; both placements are `Placement`s (the protocol in
`rl3d.controller.placement`), the one place that tells colocated from separate is
`placement_of`, and the backends keep no state in module globals."""

import ast
import inspect
from pathlib import Path

import pytest

from rl3d.config import load_config
from rl3d.controller.placement import Colocated, Placement, PoolConnection, SeparatePool, placement_of
from rl3d.models.spec import spec_of

ROOT = Path(__file__).resolve().parents[3]
SRC = ROOT / "src" / "rl3d"
MUTATORS = {"update", "append", "extend", "add", "setdefault", "pop", "popitem", "clear", "insert", "remove"}


def _modules(*packages: str):
    for package in packages:
        for path in sorted((SRC / package).rglob("*.py")):
            yield path, ast.parse(path.read_text(), filename=str(path))


def test_no_class_derives_from_the_trainer():
    subclasses = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ClassDef):
                bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
                if "RLTrainer" in bases:
                    subclasses.append(f"{path.relative_to(SRC)}:{node.name}")
    assert not subclasses, f"subclasses of RLTrainer (hand the loop an object instead): {subclasses}"


def _questions() -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(fn)
        for name, fn in vars(Placement).items()
        if callable(fn) and not name.startswith("_")
    }


def test_the_protocol_asks_the_launch_and_the_loop():
    assert set(_questions()) == {
        "trainer_pools",
        "launch",
        "bind",
        "start",
        "stop",
        "publish",
        "begin_step",
        "first_round",
        "generate",
        "end_step",
    }


@pytest.mark.parametrize("placement", [Colocated, SeparatePool])
def test_each_placement_answers_every_question_with_the_protocols_parameters(placement):
    for name, want in _questions().items():
        got = inspect.signature(getattr(placement, name))
        assert list(got.parameters) == list(want.parameters), (placement.__name__, name, got, want)


def test_placement_of_chooses_from_the_recipe():
    colocated = load_config(ROOT / "recipes/quickstart_cpu_grpo.yaml").config
    separate = load_config(ROOT / "recipes/quickstart_cpu_grpo_async.yaml").config
    assert type(placement_of(colocated, spec_of(colocated.model))) is Colocated
    chosen = placement_of(separate, spec_of(separate.model))
    assert type(chosen) is SeparatePool and chosen.plan.total_bytes > 0
    # the pool's ranks run its loop, not a trainer; colocated, every pool trains
    pools = [type("Pool", (), {"name": n})() for n in ("actor", "rollout")]
    assert [p.name for p in chosen.trainer_pools(pools)] == ["actor"]
    assert Colocated().trainer_pools(pools) == pools


def test_a_separate_placement_launches_through_the_backends_host():
    cfg = load_config(ROOT / "recipes/quickstart_cpu_grpo_async.yaml").config
    placement = placement_of(cfg, spec_of(cfg.model))
    with pytest.raises(RuntimeError, match="launch"):
        placement.link  # noqa: B018 (the loop before the launch: a clear error)
    asked = []

    class Host:
        def start_rollout_pool(self, pool, plan):
            asked.append((pool.name, plan))
            return PoolConnection(link="link", send=lambda: None, rank=3)

    placement.launch(Host())
    assert asked == [("rollout", placement.plan)] and (placement.link, placement.rank) == ("link", 3)
    Colocated().launch(None)  # colocated starts nothing: it never touches the host


def test_only_placement_of_tells_colocated_from_separate():
    """Outside `config/` (where the key is read and validated) and `planning/` (which sizes
    both), nothing reads `rollout.placement` or calls `is_separate` but `placement_of`."""
    found = []
    for path, tree in _modules("controller", "launch", "workers", "engine", "rollout", "single_controller"):
        for node in ast.walk(tree):
            called = isinstance(node, ast.Call) and getattr(node.func, "id", "") == "is_separate"
            read = (
                isinstance(node, ast.Attribute)
                and node.attr == "placement"
                and "rollout" in ast.unparse(node)
            )
            if called or read:
                found.append(f"{path.relative_to(SRC)}:{node.lineno}")
    assert found == ["controller/placement.py:" + str(_placement_of_line())], found


def _placement_of_line() -> int:
    tree = ast.parse((SRC / "controller/placement.py").read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "placement_of")
    return next(
        n.lineno
        for n in ast.walk(fn)
        if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "is_separate"
    )


def test_controller_and_launch_keep_no_state_in_module_globals():
    """A module-level dict, list or set that a function fills (a `global`, a mutating method,
    an item assignment) is state one process shares by accident: it lives on an object."""
    found = []
    for path, tree in _modules("controller", "launch"):
        mutable = {
            t.id
            for node in tree.body
            if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
            if isinstance(t, ast.Name)
            and (
                isinstance(node.value, ast.Dict | ast.List | ast.Set)
                or (
                    isinstance(node.value, ast.Call)
                    and getattr(node.value.func, "id", "") in {"dict", "list", "set"}
                )
            )
        }
        for fn in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, ast.Global):
                    found.append(f"{path.relative_to(SRC)}:{node.lineno} global {node.names}")
                target = None
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr in MUTATORS
                ):
                    target = node.func.value
                if isinstance(node, ast.Assign):
                    target = next((t.value for t in node.targets if isinstance(t, ast.Subscript)), None)
                if isinstance(target, ast.Name) and target.id in mutable:
                    found.append(f"{path.relative_to(SRC)}:{node.lineno} {target.id}")
    assert not found, found
