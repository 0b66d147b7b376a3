"""The README and docs/ hold together: every relative link and anchor resolves, the README stays
short enough to read in five minutes, no issue number sits in the code or the docs (they
say how things work, not how the work went), and docs/extending.md's walkthroughs name files
that exist and count them right."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 300
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)
# "issue" then a number, or "issue #", or "(issue 25)"-style history
_ISSUE_NUMBER = re.compile(r"\bissues?\s+#?\d+|\bissue\s+#", re.I)
# A code span is a repository path when all of it is one: a top folder of the repository, then
# path characters only (`<name>` marks a new file's name); `a/b` or `rl3d.models` is not one.
_SPAN = re.compile(r"`([^`]*)`")  # across line breaks, as markdown pairs them
_REPO_PATH = re.compile(r"(?:src|tests|yaml|recipes|docs|benchmarks|kernels)/[\w.<>/-]*")
_FILES_TOUCHED = re.compile(r"^Files touched: (\d+)\b", re.M)
EXTENDING = ROOT / "docs" / "extending.md"
WALKTHROUGHS = ("A policy loss", "A model family", "A model technique", "A rollout placement", "A backend")


def _prose(text: str) -> str:
    """The text outside fenced code blocks, whose '#' lines and brackets are code, not markdown."""
    return _FENCE.sub("", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    for heading in _HEADING.findall(_prose(path.read_text(encoding="utf-8"))):
        base = slug(heading)
        name, n = base, 0
        while name in found:  # GitHub numbers repeated headings: x, x-1, x-2
            n += 1
            name = f"{base}-{n}"
        found.add(name)
    return found


def relative_links(path: Path) -> list[str]:
    prose = _CODE_SPAN.sub("", _prose(path.read_text(encoding="utf-8")))
    return [t for t in _LINK.findall(prose) if not re.match(r"[a-z][a-z0-9+.-]*:", t, re.I)]


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def broken_links(path: Path) -> list[str]:
    broken = []
    for target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(f"{target}: no file {_shown(dest)}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor} in {_shown(dest)}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page):
    broken = broken_links(page)
    assert not broken, f"{_shown(page)}: " + "; ".join(broken)


def test_readme_is_at_most_300_lines():
    n = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES})"


def test_no_issue_numbers_in_code_or_docs():
    files = [
        *PAGES,
        *(ROOT / "src").rglob("*.py"),
        *(ROOT / "benchmarks").rglob("*.py"),
        *(ROOT / "benchmarks").rglob("*.md"),
        *(ROOT / "recipes").glob("*.yaml"),
        *(p for p in (ROOT / "tests").rglob("*.py") if p.name != Path(__file__).name),
    ]
    found = [
        f"{f.relative_to(ROOT)}:{i}: {line.strip()}"
        for f in files
        for i, line in enumerate(f.read_text(encoding="utf-8").splitlines(), start=1)
        if _ISSUE_NUMBER.search(line)
    ]
    assert not found, "issue numbers (say how it works, not which issue asked):\n" + "\n".join(found)


def test_the_checkers_see_what_they_check(tmp_path):
    page = tmp_path / "page.md"
    other = tmp_path / "other.md"
    other.write_text("# Warm start: SFT (`actor.warm_start`)\n\n## Same\n\n## Same\n")
    page.write_text(
        "[ok](other.md#warm-start-sft-actorwarm_start) [dup](other.md#same-1) [web](https://x.org/y)\n"
        "`[not a link](nowhere.md)`\n```\n[in code](nowhere.md)\n# not a heading\n```\n"
        "[gone](missing.md) [bad anchor](other.md#nope) [self](#also-nope)\n"
    )
    assert broken_links(page) == [
        f"missing.md: no file {tmp_path / 'missing.md'}",
        f"other.md#nope: no heading with anchor #nope in {other}",
        f"#also-nope: no heading with anchor #also-nope in {page}",
    ]
    assert _ISSUE_NUMBER.search("as reported in issue 19") and _ISSUE_NUMBER.search("(Issue #7)")
    assert not _ISSUE_NUMBER.search("a known issue with gloo; 2 issues remain")


def repo_paths(text: str) -> list[str]:
    """The repository paths `text` names in code spans outside fenced blocks, each once, in order."""
    return list(dict.fromkeys(s for s in _SPAN.findall(_prose(text)) if _REPO_PATH.fullmatch(s)))


def missing_paths(paths: list[str], root: Path = ROOT) -> list[str]:
    """The paths that name nothing under `root`; a new file's (with a `<name>` part) needs its folder."""

    def existing_part(path: str) -> str:
        return path.split("<")[0].rpartition("/")[0] if "<" in path else path

    return [p for p in paths if not (root / existing_part(p)).exists()]


def walkthroughs(text: str) -> dict[str, str]:
    """Each section (a heading to the next heading) that states `Files touched: N`, by its heading."""
    prose = _prose(text)
    heads = list(_HEADING.finditer(prose))
    ends = [h.start() for h in heads[1:]] + [len(prose)]
    sections = {h[1]: prose[h.end() : end] for h, end in zip(heads, ends)}
    return {title: body for title, body in sections.items() if _FILES_TOUCHED.search(body)}


def miscounted(text: str) -> list[str]:
    """The walkthroughs whose stated count is not the number of distinct paths they name."""
    wrong = []
    for title, body in walkthroughs(text).items():
        stated, listed = [int(n) for n in _FILES_TOUCHED.findall(body)], repo_paths(body)
        if stated != [len(listed)]:
            wrong.append(f"{title}: states {stated}, names {len(listed)}: {listed}")
    return wrong


def test_extending_names_only_paths_that_exist():
    paths = repo_paths(EXTENDING.read_text(encoding="utf-8"))
    assert len(paths) > 40, paths  # the walkthroughs' files are seen
    missing = missing_paths(paths)
    assert not missing, "docs/extending.md names paths that do not exist: " + ", ".join(missing)


def test_each_walkthrough_counts_the_files_it_names():
    text = EXTENDING.read_text(encoding="utf-8")
    assert tuple(walkthroughs(text)) == WALKTHROUGHS
    wrong = miscounted(text)
    assert not wrong, "docs/extending.md: " + "; ".join(wrong)


def test_the_path_checks_see_what_they_check(tmp_path):
    (tmp_path / "src" / "pkg").mkdir(parents=True)
    (tmp_path / "src" / "pkg" / "here.py").write_text("")
    sample = (
        "# Title\n\n`src/pkg/here.py` and `a/b`, `rl3d.pkg`, `x.py`, `src/pkg/gone.py`\n"
        "```\n`src/in/a/fence.py`\n```\n"
        "## Two\n\n1. `src/pkg/<name>.py` (new) and `src/pkg/here.py`\n"
        "2. `tests/nowhere/<name>.py` over a\nline `docs/x\ny.md`\n\nFiles touched: 2\n"
        "## Three\n\n`src/pkg/here.py`\n\nFiles touched: 2\n"
    )
    paths = repo_paths(sample)
    assert paths == ["src/pkg/here.py", "src/pkg/gone.py", "src/pkg/<name>.py", "tests/nowhere/<name>.py"]
    assert missing_paths(paths, tmp_path) == ["src/pkg/gone.py", "tests/nowhere/<name>.py"]
    assert list(walkthroughs(sample)) == ["Two", "Three"]
    assert miscounted(sample) == [
        "Two: states [2], names 3: ['src/pkg/<name>.py', 'src/pkg/here.py', 'tests/nowhere/<name>.py']",
        "Three: states [2], names 1: ['src/pkg/here.py']",
    ]
