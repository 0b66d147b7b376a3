"""Transition benchmark: `python benchmarks/transition/run.py --mode modeled|measured ...`.

The same as `rl3d bench transition ...` (the logic lives in `rl3d.bench`); see README.md here.
"""

import sys

from rl3d.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "transition", *sys.argv[1:]]))
