"""benchmarks/same_metrics.py excuses only what a change says it renamed or added: a renamed
key compares under its new name (a changed value is still a difference), an added key matching
the pattern is dropped from the new run, anything else stays a difference."""

import importlib.util
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
_spec = importlib.util.spec_from_file_location("same_metrics", ROOT / "benchmarks/same_metrics.py")
same_metrics = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(same_metrics)


def _run(path: Path, *rows: dict) -> Path:
    path.mkdir()
    (path / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": i + 1, **r}) + "\n" for i, r in enumerate(rows))
    )
    return path


def test_renamed_and_added_keys_are_excused_and_nothing_else(tmp_path):
    before = _run(tmp_path / "a", {"loss": 0.5, "weight_sync/bytes": 10.0})
    after = _run(tmp_path / "b", {"loss": 0.5, "reshard/bytes": 10.0, "reshard/engine_bytes": 0})
    excused = dict(renamed={"weight_sync/bytes": "reshard/bytes"}, added=re.compile("^reshard/engine_"))
    assert same_metrics.differences(before, after, **excused) == []
    assert len(same_metrics.differences(before, after)) == 3  # unexcused: one gone, two new
    changed = _run(tmp_path / "c", {"loss": 0.5, "reshard/bytes": 11.0, "reshard/engine_bytes": 0})
    assert same_metrics.differences(before, changed, **excused) == [
        "step 1 None rank None: reshard/bytes 10.0 != 11.0"
    ]
    other = _run(tmp_path / "d", {"loss": 0.5, "reshard/bytes": 10.0, "reshard/other": 1})
    assert same_metrics.differences(before, other, **excused) == [
        "step 1 None rank None: reshard/other '<missing>' != 1"
    ]
