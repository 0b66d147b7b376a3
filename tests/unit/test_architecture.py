"""The package layering holds: no import cycle between rl3d's top-level packages, no source file
over 500 lines, and the single-controller protocol stays a leaf (built from the source with ast,
so a lazy import inside a function counts as much as one at the top)."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "rl3d"
MAX_LINES = 500


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
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
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


def test_single_controller_is_a_leaf_below_workers_and_controller():
    deps = package_graph().get("single_controller", set())
    assert not deps & {"workers", "controller", "config", "launch", "algos"}, deps


def test_no_source_file_over_the_line_limit():
    long = {
        str(p.relative_to(SRC)): n
        for p in SRC.rglob("*.py")
        if (n := p.read_text(encoding="utf-8").count("\n")) > MAX_LINES
    }
    assert not long, f"files over {MAX_LINES} lines: {long}"
