"""`rl3d models`: real pretrained models in the local cache (rl3d.models.hub).

    rl3d models fetch smollm2-135m [--dir CACHE_ROOT]   # prints the model's HF directory
    rl3d models list [--dir CACHE_ROOT]

Wiring (rl3d.cli): `add_models_arguments(subparser)` then `run_models(args) -> exit code`.
"""

from __future__ import annotations

import argparse
import logging
import sys

EXIT_FAILED, EXIT_BAD_INPUT = 1, 2


def add_models_arguments(parser: argparse.ArgumentParser) -> None:
    from rl3d.models.hub import CACHE_ENV, KNOWN_MODELS

    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    root_help = f"cache root (default ${CACHE_ENV}, else ~/.cache/rl3d/models)"
    fetch = sub.add_parser("fetch", help="download and convert a known model once; print its HF directory")
    fetch.add_argument("name", help=f"a known model: {', '.join(sorted(KNOWN_MODELS))}")
    fetch.add_argument("--dir", help=root_help)
    listing = sub.add_parser("list", help="the known models, and where each is fetched")
    listing.add_argument("--dir", help=root_help)


def run_models(args: argparse.Namespace) -> int:
    from rl3d.models.hub import KNOWN_MODELS, FetchError, ensure_model, is_fetched, model_dir

    if args.action == "list":
        for name, model in sorted(KNOWN_MODELS.items()):
            where = model_dir(name, args.dir)
            state = "fetched" if is_fetched(where) else "not fetched"
            print(f"{name}: {model.about}\n  {state}: {where}")
        return 0
    logging.basicConfig(level=logging.INFO, format="rl3d models: %(message)s")
    try:
        path = ensure_model(args.name, root=args.dir)
    except ValueError as err:
        print(f"rl3d models: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except FetchError as err:
        print(f"rl3d models: {err}", file=sys.stderr)
        return EXIT_FAILED
    print(path)
    return 0
