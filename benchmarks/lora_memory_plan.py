"""The memory plan's bytes of a LoRA actor beside full fine-tuning, on the busiest actor rank of
the shipped GPU recipes (docs/lora.md's table): planned, not measured.

    python benchmarks/lora_memory_plan.py
"""

from __future__ import annotations

from rl3d.config import load_config
from rl3d.planning import plan_memory

GIB = 2**30
RECIPES = ("recipes/gpu_llama2_7b_grpo.yaml", "recipes/gpu_llama2_70b_grpo.yaml")
VARIANTS = {
    "full": [],
    "LoRA r8 all-linear": ["actor.lora.rank=8", "actor.lora.target_modules=[all-linear]"],
    "LoRA r8 q,v": ["actor.lora.rank=8", "actor.lora.target_modules=[q_proj,v_proj]"],
}


def main() -> None:
    print("| recipe | actor | params | grads | master | Adam | actor static | reference | train peak |")
    print("|---|---|---|---|---|---|---|---|---|")
    for recipe in RECIPES:
        for name, overrides in VARIANTS.items():
            plan = plan_memory(load_config(recipe, overrides).config)
            worst = max(plan.ranks, key=lambda r: r.phases["train"]["actor"].static)
            train = worst.phases["train"]
            a, ref = train["actor"], train.get("reference")
            cells = [a.params, a.grads, a.master, a.optimizer, a.static]
            ref_cell = f"{ref.static / GIB:.2f}" if ref is not None else "none"
            row = [recipe.split("/")[-1], name, *(f"{c / GIB:.2f}" for c in cells), ref_cell]
            print("| " + " | ".join([*row, f"{worst.peaks['train'] / GIB:.2f}"]) + " |")


if __name__ == "__main__":
    main()
