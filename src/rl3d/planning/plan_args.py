"""`rl3d plan`'s `--memory` and `--auto-place` flags, apart from the plan and the search so
that building the parser stays free of torch (`rl3d plan` is pure Python over shapes)."""

from __future__ import annotations

import argparse

DEVICE_NAMES = ("a100", "h100", "h200")  # rl3d.planning.devices.DEVICES, checked there


def add_auto_place_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--auto-place", action="store_true", help="search placements of the recipe's roles")
    parser.add_argument("--gpus", type=int, help="devices to place on (--auto-place; default: the recipe's)")
    parser.add_argument("--gpus-per-node", type=int, default=None, help="default: the device class's 8")
    parser.add_argument("--device", default="a100", choices=DEVICE_NAMES, help="device class (--auto-place)")
    parser.add_argument("--top", type=int, default=8, help="candidates listed (--auto-place)")


def add_memory_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--memory", action="store_true", help="print the per-rank GPU memory plan of RECIPE")
    parser.add_argument(
        "--device-gib",
        type=float,
        default=None,
        help="device memory per GPU in GiB (--memory; default: none)",
    )
