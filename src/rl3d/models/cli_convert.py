"""`rl3d convert`: HF <-> Megatron weights on CPU, no process groups, one tensor at a time.

    rl3d convert hf2mcore --src HF_DIR --dst DIR --tp T --pp P [--ep E]
    rl3d convert mcore2hf --src DIR --dst HF_DIR [--max-shard-size 5GB]

Wiring (rl3d.cli): `add_convert_arguments(subparser)` then `run_convert(args) -> exit code`;
`main(argv)` runs it standalone (`python -m rl3d.models.cli_convert ...`).
"""

from __future__ import annotations

import argparse
import re
import sys

EXIT_BAD_INPUT = 2
_SIZE = re.compile(r"^(\d+)\s*(B|KB|MB|GB|TB)?$", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}


def parse_size(text: str) -> int:
    match = _SIZE.match(text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"bad size {text!r}; use e.g. 5GB, 500MB or a byte count")
    return int(match[1]) * _UNITS[(match[2] or "B").upper()]


def add_convert_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="direction", required=True, metavar="DIRECTION")
    to_mcore = sub.add_parser("hf2mcore", help="HF directory -> Megatron weights sharded for (tp, pp, ep)")
    to_mcore.add_argument("--src", required=True, help="HF directory (config.json + *.safetensors)")
    to_mcore.add_argument("--dst", required=True, help="output Megatron weight directory")
    to_mcore.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    to_mcore.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (default 1)")
    to_mcore.add_argument(
        "--ep", type=int, default=1, help="expert-parallel size, dividing the experts (default 1)"
    )
    to_mcore.add_argument(
        "--etp", type=int, default=None, help="expert tensor-parallel size, dividing tp (default: tp)"
    )
    to_hf = sub.add_parser("mcore2hf", help="Megatron weights (any tp, pp, ep) -> HF directory")
    to_hf.add_argument("--src", required=True, help="Megatron weight directory (rl3d_meta.json)")
    to_hf.add_argument("--dst", required=True, help="output HF directory")
    to_hf.add_argument(
        "--max-shard-size", type=parse_size, default=5 * 10**9, help="largest safetensors file (default 5GB)"
    )


def run_convert(args: argparse.Namespace) -> int:
    from rl3d.models.convert import hf_to_mcore, mcore_to_hf

    try:
        if args.direction == "hf2mcore":
            if args.tp < 1 or args.pp < 1 or args.ep < 1 or (args.etp is not None and args.etp < 1):
                raise ValueError(
                    f"--tp, --pp, --ep and --etp must be positive, got tp={args.tp} pp={args.pp} "
                    f"ep={args.ep} etp={args.etp}"
                )
            meta = hf_to_mcore(args.src, args.dst, tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp)
            etp = "" if meta.etp is None else f" etp={meta.etp}"
            print(f"wrote {args.dst}: {meta.model_type} as tp={meta.tp} pp={meta.pp} ep={meta.ep}{etp}")
        else:
            mcore_to_hf(args.src, args.dst, max_shard_bytes=args.max_shard_size)
            print(f"wrote HF directory {args.dst}")
    except (ValueError, FileNotFoundError, KeyError) as err:
        print(f"rl3d convert: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rl3d convert", description=__doc__.splitlines()[0])
    add_convert_arguments(parser)
    return run_convert(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
