"""torchrun, without its own failure report.

`python -m rl3d.launch.torchrun ARGS` is `torchrun ARGS`, except when a rank fails: every rank
already printed its one-line error (`rl3d.train.report_rank_failure`) and `rl3d train` names the
first, so torchrun's traceback and failure table (the launcher's, not the rank's) are left out.
The exit status is still non-zero.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(sys.argv[1:] if argv is None else argv))
    except ChildFailedError as err:
        failed = sorted(err.failures)  # global ranks
        print(f"torchrun: rank(s) {failed} exited with an error", file=sys.stderr)  # noqa: T201
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
