"""The package layering holds: every top-level package imports only from the layers below it (`LAYERS`, the
one statement of the order), no import cycle between packages nor between modules, no source file over 500
lines, the single-controller protocol stays a leaf, the planner never imports the benchmark, no module
below `config` reads the whole recipe and no worker imports a model technique's module (the engine applies
them as features). The graphs are built from the source with ast, so a lazy import
inside a function, or one only for type checking, counts as much as one at the top."""

import ast
import functools
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "rl3d"
MAX_LINES = 500

# rl3d's packages, lowest layer first: a package imports only from packages of lower layers.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("utils", "logging", "_kernels"),  # helpers; `_kernels` holds the CUDA sources
    ("parallel", "tools"),  # layouts and process groups; the tools a policy calls
    ("ops", "single_controller", "data"),  # resharding kernels; the role protocol; datasets
    ("models", "algos", "rewards"),  # megatron-core models; algorithm functions; reward functions
    ("hybrid_engine", "rollout"),  # planning and moving weights between layouts; generation
    ("weight_sync", "costs"),  # a transition's transport to another pool; cluster and transition costs
    ("agents",),  # an OpenAI-compatible endpoint over a rollout engine; users' agents drive the rollout
    ("config",),  # typed recipe sections: every layer below works without reading a recipe
    ("engine",),  # a megatron model of a role on its grid, its techniques as features
    ("workers",),  # one class per role: which columns it computes, which loss it trains
    ("checkpoint", "testing"),  # run checkpoints; kits for tests and benchmarks (tiny models, spawn)
    ("controller", "bench"),  # the RL loop and its assembly; benchmarks
    (
        "planning",
    ),  # plans made from a recipe before a run: memory per rank, the step simulator, the layout search
    ("launch",),  # torchrun, Ray, SLURM
    ("train", "cli"),  # entry points
)

# Module circles still allowed, each the set of its modules (none). The test fails on any other
# circle, and on an entry here whose circle is gone (delete it then).
KNOWN_MODULE_CIRCLES: set[frozenset[str]] = set()


@functools.cache
def _nodes(path: Path) -> tuple[ast.AST, ...]:
    """Every node of a source file (parsed once for all the checks)."""
    return tuple(ast.walk(ast.parse(path.read_text(encoding="utf-8"))))


def _package_of(path: Path) -> str:
    rel = path.relative_to(SRC).parts
    return rel[0].removesuffix(".py")


def _imported_modules(path: Path) -> set[str]:
    rel = path.relative_to(SRC).with_suffix("").parts
    here = ["rl3d", *rel]
    if here[-1] == "__init__":
        here = here[:-1]
    else:
        here = here[:-1]  # a module's relative imports start from its package
    found = set()
    for node in _nodes(path):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level + 1]
                found.add(".".join(base + ([node.module] if node.module else [])))
            elif node.module:
                found.add(node.module)
    return found


def package_graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for path in SRC.rglob("*.py"):
        pkg = _package_of(path)
        for name in _imported_modules(path):
            parts = name.split(".")
            if parts[0] == "rl3d" and len(parts) > 1 and parts[1] != pkg:
                edges.setdefault(pkg, set()).add(parts[1])
    return edges


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if not state.get(nxt) and (cycle := visit(nxt, stack)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if not state.get(node) and (cycle := visit(node, [])):
            return cycle
    return None


def test_no_import_cycle_between_top_level_packages():
    cycle = find_cycle(package_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_checker_sees_a_cycle_when_there_is_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}}) is None


def layer_violations(edges: dict[str, set[str]], layers=LAYERS) -> list[str]:
    level = {pkg: i for i, layer in enumerate(layers) for pkg in layer}
    return [
        f"{pkg} (layer {level[pkg]}) imports {dep} (layer {level[dep]})"
        for pkg, deps in sorted(edges.items())
        for dep in sorted(deps)
        if level[dep] >= level[pkg]
    ]


def test_every_package_has_a_layer():
    packages = {p.name.removesuffix(".py") for p in SRC.iterdir() if p.suffix == ".py" or p.is_dir()}
    packages -= {"__init__", "__pycache__"}
    placed = {pkg for layer in LAYERS for pkg in layer}
    assert packages <= placed, f"packages without a layer in LAYERS: {sorted(packages - placed)}"


def test_packages_import_only_from_lower_layers():
    violations = layer_violations(package_graph())
    assert not violations, violations


def test_the_layer_check_sees_an_upward_import():
    layers = (("low",), ("mid", "side"), ("high",))
    assert layer_violations({"high": {"mid", "low"}, "mid": {"low"}}, layers) == []
    assert layer_violations({"mid": {"high", "side"}}, layers) == [
        "mid (layer 1) imports high (layer 2)",
        "mid (layer 1) imports side (layer 1)",
    ]


def _module_name(path: Path) -> str:
    parts = ["rl3d", *path.relative_to(SRC).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_graph() -> dict[str, set[str]]:
    """Module -> the rl3d modules it imports. `from pkg import name` imports `pkg` (its
    `__init__` runs) and, where `name` is a submodule, that submodule too."""
    files = {_module_name(p): p for p in SRC.rglob("*.py")}

    def resolve(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {}
    for module, path in files.items():
        here = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        targets: list[str] = []
        for node in _nodes(path):
            if isinstance(node, ast.Import):
                targets += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(
                        here[: len(here) - node.level + 1] + ([node.module] if node.module else [])
                    )
                targets += [base] + [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in files]
        found = {resolve(t) for t in targets if t.split(".")[0] == "rl3d"}
        edges[module] = {t for t in found if t and t != module}
    return edges


def module_circles(edges: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: set[frozenset[str]] = set()

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in edges.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                circles.add(frozenset(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return circles


def test_no_import_circle_between_modules():
    circles = module_circles(module_graph())
    new = [sorted(c) for c in circles - KNOWN_MODULE_CIRCLES]
    assert not new, f"module import circles: {new}"
    stale = [sorted(c) for c in KNOWN_MODULE_CIRCLES - circles]
    assert not stale, f"no longer a circle, remove from KNOWN_MODULE_CIRCLES: {stale}"


def test_the_module_check_sees_a_circle():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert module_circles(edges) == {frozenset("abc")}
    assert module_circles({"a": {"b"}, "b": set()}) == set()


def test_single_controller_is_a_leaf_below_workers_and_controller():
    deps = package_graph().get("single_controller", set())
    assert not deps & {"workers", "controller", "config", "launch", "algos"}, deps


def test_the_planner_does_not_import_the_benchmark():
    # the layers would allow it (planning sits above bench); what both need lives in rl3d.costs
    deps = package_graph().get("planning", set())
    assert "bench" not in deps, "rl3d.planning imports rl3d.bench: move what it needs into rl3d.costs"


# the packages below `config`: they take a recipe's sections or plain values, never the recipe
BELOW_CONFIG = {pkg for layer in LAYERS[: LAYERS.index(("config",))] for pkg in layer}


def whole_recipe_reads(source: str) -> list[str]:
    """The functions of `source` that take the whole recipe: an annotation or a docstring naming
    `RL3DConfig`, or reads of two or more of its sections off one object (`cfg.data.x` and
    `cfg.model.y`; the sections of `self` itself do not count)."""
    from dataclasses import fields

    from rl3d.config.schema import RL3DConfig

    sections = {f.name for f in fields(RL3DConfig)}
    found = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        args = [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs, fn.args.vararg, fn.args.kwarg]
        notes = [a.annotation for a in args if a is not None] + [fn.returns]
        if any("RL3DConfig" in ast.unparse(n) for n in notes if n is not None):
            found.append(f"{fn.name}: annotated RL3DConfig")
        if "RL3DConfig" in (ast.get_docstring(fn) or ""):
            found.append(f"{fn.name}: its docstring says it takes an RL3DConfig")
        read: dict[str, set[str]] = {}
        for node in ast.walk(fn):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
                if node.value.attr in sections:
                    read.setdefault(ast.unparse(node.value.value), set()).add(node.value.attr)
        found += [
            f"{fn.name}: reads {', '.join(sorted(s))} off {obj}"
            for obj, s in sorted(read.items())
            if len(s) > 1 and obj != "self"
        ]
    return found


def test_no_module_below_config_reads_the_whole_recipe():
    found = {
        str(path.relative_to(SRC)): reads
        for path in sorted(SRC.rglob("*.py"))
        if _package_of(path) in BELOW_CONFIG
        and (reads := whole_recipe_reads(path.read_text(encoding="utf-8")))
    }
    assert not found, f"pass these the recipe's sections or plain values, not the recipe: {found}"


def test_the_recipe_check_sees_a_whole_recipe():
    old_stops = (
        "def end_token_ids(cfg: Any) -> frozenset[int]:\n"
        "    return set(model_eos_token_ids(cfg.model.hf_path)) if cfg.data.train_files else set()\n"
    )
    assert whole_recipe_reads(old_stops) == ["end_token_ids: reads data, model off cfg"]
    typed = 'def f(cfg: "RL3DConfig"):\n    """Run `cfg` (an `RL3DConfig`)."""\n    return cfg.rollout.n\n'
    assert whole_recipe_reads(typed) == [
        "f: annotated RL3DConfig",
        "f: its docstring says it takes an RL3DConfig",
    ]
    sections = (
        "def f(self, rollout, data):\n    return rollout.n, data.train_files.x, self.model.x, self.data.x\n"
    )
    assert whole_recipe_reads(sections) == []


def test_no_source_file_over_the_line_limit():
    long = {
        str(p.relative_to(SRC)): n
        for p in SRC.rglob("*.py")
        if (n := p.read_text(encoding="utf-8").count("\n")) > MAX_LINES
    }
    assert not long, f"files over {MAX_LINES} lines: {long}"


# A model technique's modules: the engine applies them as features (`rl3d.engine.techniques`); a worker
# that imports one is asking "is it on?" again.
TECHNIQUE_MODULES = (
    "rl3d.engine.techniques",
    "rl3d.engine.micro_batches",
    "rl3d.models.lora",
    "rl3d.models.lora_peft",
    "rl3d.models.moe_metrics",
    "rl3d.models.offload",
    "rl3d.models.packing",
    "rl3d.models.routing_replay",
    "rl3d.models.sequence_parallel",
)


def technique_imports(edges: dict[str, set[str]], package: str = "rl3d.workers") -> list[str]:
    return sorted(
        f"{module} imports {dep}"
        for module, deps in edges.items()
        if module == package or module.startswith(package + ".")
        for dep in deps
        if dep in TECHNIQUE_MODULES
    )


def test_no_worker_imports_a_model_technique():
    found = technique_imports(module_graph())
    assert not found, f"workers reach techniques through rl3d.engine's features only: {found}"


def test_the_technique_check_sees_one():
    edges = {
        "rl3d.workers.roles": {"rl3d.models.lora", "rl3d.engine"},
        "rl3d.engine.megatron": {"rl3d.models.lora"},
    }
    assert technique_imports(edges) == ["rl3d.workers.roles imports rl3d.models.lora"]


# How a feature branch is counted: a condition (`if`, `while`, a conditional expression or a
# comprehension's `if`) whose source names a model technique.
TECHNIQUE_WORDS = re.compile(
    r"pack|lora|adapter|moe|expert|replay|routing|recompute|sequence_parallel|offload|\bte\b|fp16|float16",
    re.IGNORECASE,
)
MAX_WORKER_FEATURE_BRANCHES = 9


def feature_branches(source: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        tests = []
        if isinstance(node, ast.If | ast.IfExp | ast.While):
            tests = [node.test]
        elif isinstance(node, ast.comprehension):
            tests = node.ifs
        found += [f"line {t.lineno}: {text}" for t in tests if TECHNIQUE_WORDS.search(text := ast.unparse(t))]
    return found


def test_workers_hardly_branch_on_model_techniques():
    found = {
        str(p.relative_to(SRC)): branches
        for p in sorted((SRC / "workers").glob("*.py"))
        if (branches := feature_branches(p.read_text(encoding="utf-8")))
    }
    total = sum(len(b) for b in found.values())
    assert total <= MAX_WORKER_FEATURE_BRANCHES, f"{total} feature branches in workers/: {found}"


def test_the_branch_count_sees_a_feature_branch():
    source = "if self.lora is not None:\n    x = 1\ny = [m for m in micro if m.packed]\nz = a if b else c\n"
    assert feature_branches(source) == ["line 1: self.lora is not None", "line 3: m.packed"]


def test_the_engine_takes_at_most_eight_parameters():
    import inspect

    from rl3d.engine import MegatronEngine

    params = [p for p in inspect.signature(MegatronEngine.__init__).parameters if p != "self"]
    assert len(params) <= 8, params
