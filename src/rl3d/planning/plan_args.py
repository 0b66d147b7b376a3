"""`rl3d plan`'s `--memory` and `--auto-layout` flags, apart from the plan and the search so
that building the parser stays free of torch (`rl3d plan` is pure Python over shapes)."""

from __future__ import annotations

import argparse

DEVICE_NAMES = ("a100", "h100", "h200")  # rl3d.planning.devices.DEVICES, checked there


def add_auto_layout_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--auto-layout",
        action="store_true",
        help="search the layouts of the recipe's roles over resource pools",
    )
    # the flag's old name, still accepted: `rl3d plan` says to use --auto-layout
    parser.add_argument("--auto-place", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--gpus", type=int, help="devices to place on (--auto-layout; default: the recipe's)")
    parser.add_argument("--gpus-per-node", type=int, default=None, help="default: the device class's 8")
    parser.add_argument("--device", default="a100", choices=DEVICE_NAMES, help="device class (--auto-layout)")
    parser.add_argument("--top", type=int, default=8, help="candidates listed (--auto-layout)")


def add_memory_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--memory", action="store_true", help="print the per-rank GPU memory plan of RECIPE")
    parser.add_argument(
        "--device-gib",
        type=float,
        default=None,
        help="device memory per GPU in GiB (--memory; default: none)",
    )
