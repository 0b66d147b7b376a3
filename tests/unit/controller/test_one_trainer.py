"""Variants are objects handed to the one loop, never subclasses of it: no class in `src/rl3d`
derives from `RLTrainer`, and both placements answer the loop's questions."""

import ast
from pathlib import Path

from rl3d.controller.placement import Colocated, SeparatePool

SRC = Path(__file__).resolve().parents[3] / "src" / "rl3d"
LOOP_QUESTIONS = ("start", "stop", "publish", "begin_step", "first_round", "generate", "end_step")


def test_no_class_derives_from_the_trainer():
    subclasses = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ClassDef):
                bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
                if "RLTrainer" in bases:
                    subclasses.append(f"{path.relative_to(SRC)}:{node.name}")
    assert not subclasses, f"subclasses of RLTrainer (hand the loop an object instead): {subclasses}"


def test_both_placements_answer_every_question_of_the_loop():
    for placement in (Colocated, SeparatePool):
        missing = [q for q in LOOP_QUESTIONS if not callable(getattr(placement, q, None))]
        assert not missing, (placement.__name__, missing)
