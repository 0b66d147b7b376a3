"""The `rl3d` command: train, validate, plan, bench, slurm, convert, export, models.

Each subcommand parses its own arguments and calls into the package; this module only routes.
Exit codes: 0 ok, 1 a run or submission that failed, 2 bad input (recipe, arguments).
"""

from __future__ import annotations

import argparse
import sys

from rl3d.config import ConfigError

EXIT_BAD_INPUT = 2
DEVICE_GIB_HELP = "GPU memory in GiB the recipe's memory plan must fit (default: this host's GPU on CUDA)"


def _cmd_validate(args: argparse.Namespace) -> int:
    from rl3d.config import config_to_yaml, load_config
    from rl3d.config.pools import role_pools
    from rl3d.launch.preflight import preflight

    loaded = load_config(args.recipe, args.overrides)
    if getattr(loaded.config, "job", None) == "reward_model":  # a reward-model job (rl3d.controller.rm_train)
        print(f"# {args.recipe}: valid reward-model job; files applied: {', '.join(loaded.files)}")
        print(config_to_yaml(loaded.config), end="")
        return 0
    # ranges always; files, imports and the memory plan on request
    preflight(loaded, check_paths=args.preflight, device_gib=args.device_gib)
    print(f"# {args.recipe}: valid; files applied: {', '.join(loaded.files)}")
    for pool in role_pools(loaded.config):
        ranks = f"{pool.ranks.start}-{pool.ranks.stop - 1}" if pool.size > 1 else str(pool.offset)
        print(f"# pool {pool.name}: world ranks {ranks}, p-t-d {pool.layout}, hosts {', '.join(pool.roles)}")
    print(config_to_yaml(loaded.config), end="")
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from rl3d.launch.train import launch_train

    return launch_train(
        args.recipe,
        args.overrides,
        emit=print,
        dry_run=args.dry_run,
        overwrite=args.overwrite,
        device_gib=args.device_gib,
    )


def _cmd_plan(args: argparse.Namespace) -> int:
    from rl3d.config import load_config
    from rl3d.hybrid_engine.report import run_plan

    try:
        # the recipe is read here: the planner below the config layer takes shapes and layouts
        config = load_config(args.recipe, args.overrides).config if args.recipe else None
        if args.auto_place:
            print("rl3d plan: --auto-place is deprecated, use --auto-layout", file=sys.stderr)
        if args.auto_layout or args.auto_place:
            from rl3d.planning.auto_layout import run_auto_layout

            if config is None:
                raise ValueError("--auto-layout needs a RECIPE")
            print(run_auto_layout(args, args.recipe, args.overrides, config))
        elif args.memory:
            from rl3d.planning.memory_report import run_memory_plan

            print(run_memory_plan(args, config))
        else:
            shapes = None
            if config is not None:  # the recipe path may import torch; --model plans stay pure Python
                from rl3d.planning.recipe import recipe_shapes

                shapes = recipe_shapes(config)
            print(run_plan(args, shapes))
        return 0
    except ValueError as err:
        if isinstance(err, ConfigError):
            raise
        print(f"rl3d plan: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT


def _cmd_bench(args: argparse.Namespace) -> int:
    from rl3d.bench.report import run_bench

    try:
        print(run_bench(args))
        return 0
    except ValueError as err:
        print(f"rl3d bench: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT


def _cmd_export(args: argparse.Namespace) -> int:
    from rl3d.checkpoint.export import export_run

    if (args.dst is None) == (args.lora is None) or (args.merge and args.dst is None):
        print(
            "rl3d export: give --dst DIR (HF weights; --merge for a LoRA run) or --lora DIR", file=sys.stderr
        )
        return EXIT_BAD_INPUT
    try:
        step, dst = export_run(
            args.run_dir,
            args.dst,
            step=args.step,
            max_shard_bytes=args.max_shard_size,
            lora=args.lora,
            merge=args.merge,
        )
    except (ValueError, FileNotFoundError) as err:
        print(f"rl3d export: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    what = "PEFT adapter directory" if args.lora else "HF directory"
    print(f"wrote {what} {dst} from step {step} of {args.run_dir}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rl3d", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def recipe_cmd(name: str, help_text: str) -> argparse.ArgumentParser:
        cmd = sub.add_parser(name, help=help_text)
        cmd.add_argument("recipe", help="recipe YAML file (recipes/*.yaml)")
        cmd.add_argument("overrides", nargs="*", help="key.sub=value overrides, applied last")
        return cmd

    validate = recipe_cmd("validate", "load, check and print the resolved config")
    validate.add_argument(
        "--preflight", action="store_true", help="also check data files, model dir and user code here"
    )
    validate.add_argument("--device-gib", type=float, default=None, help=DEVICE_GIB_HELP)
    validate.set_defaults(func=_cmd_validate)
    train = recipe_cmd("train", "run a recipe (spawns torchrun for its world size)")
    train.add_argument("--dry-run", action="store_true", help="print the launch command and exit")
    train.add_argument(
        "--overwrite", action="store_true", help="delete an earlier run's outputs in the run dir first"
    )
    train.add_argument("--device-gib", type=float, default=None, help=DEVICE_GIB_HELP)
    train.set_defaults(func=_cmd_train)

    plan = sub.add_parser("plan", help="print the 3D-HybridEngine resharding plan and its costs")
    import rl3d.bench  # noqa: F401  registers the baseline strategies the plan table compares against
    from rl3d.hybrid_engine.report import add_plan_arguments
    from rl3d.planning.plan_args import add_auto_layout_arguments, add_memory_arguments

    add_plan_arguments(plan)
    add_memory_arguments(plan)
    add_auto_layout_arguments(plan)
    plan.set_defaults(func=_cmd_plan)
    bench = sub.add_parser("bench", help="benchmarks: `rl3d bench transition ...`, `rl3d bench rollout ...`")
    from rl3d.bench.report import add_bench_arguments

    add_bench_arguments(bench)
    bench.set_defaults(func=_cmd_bench)
    convert = sub.add_parser("convert", help="HF <-> Megatron checkpoints (hf2mcore, mcore2hf)")
    from rl3d.models.cli_convert import add_convert_arguments, run_convert

    add_convert_arguments(convert)
    convert.set_defaults(func=run_convert)
    export = sub.add_parser("export", help="a run's checkpointed actor as an HF directory")
    from rl3d.models.cli_convert import parse_size

    export.add_argument("run_dir", help="the run directory (trainer.run_dir)")
    export.add_argument("--dst", help="output HF directory (replaced atomically)")
    export.add_argument("--lora", help="a LoRA run: write its adapters as this PEFT adapter directory")
    export.add_argument("--merge", action="store_true", help="a LoRA run: --dst gets the adapters merged in")
    export.add_argument("--step", type=int, help="the checkpoint's step (default: the newest complete one)")
    export.add_argument(
        "--max-shard-size", type=parse_size, default=5 * 10**9, help="largest safetensors file (default 5GB)"
    )
    export.set_defaults(func=_cmd_export)
    models = sub.add_parser("models", help="real pretrained models: `rl3d models fetch smollm2-135m`")
    from rl3d.models.cli_models import add_models_arguments, run_models

    add_models_arguments(models)
    models.set_defaults(func=run_models)
    slurm = sub.add_parser(
        "slurm", help="write an sbatch script into the run dir and submit it; status, cancel"
    )
    from rl3d.launch.slurm import add_slurm_arguments, run_slurm

    add_slurm_arguments(slurm)
    slurm.set_defaults(func=run_slurm)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as err:
        print(f"rl3d: config error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
