"""Rollout benchmark: `python benchmarks/rollout_vs_generate.py [--json] [--model ...] [--batch ...]`.

The same as `rl3d bench rollout ...` (the logic lives in `rl3d.bench.rollout`): the torch rollout
engine's tokens/s against HF `generate` on the same tiny model and batch, on CPU.
"""

import sys

from rl3d.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "rollout", *sys.argv[1:]]))
