"""`rl3d plan`: print the resharding plan, its costs and the reductions, or one JSON object."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any

from rl3d.hybrid_engine.auto import HardwareModel, best_row, search_layouts
from rl3d.hybrid_engine.engine_push import NO_PUSH, EnginePush, plan_engine_push
from rl3d.hybrid_engine.lora_plan import LoraTransition, format_lora, plan_lora_transition
from rl3d.hybrid_engine.moe_plan import format_moe, plan_moe_split
from rl3d.hybrid_engine.plan import TransitionPlan, expert_parts, plan_transition
from rl3d.hybrid_engine.strategy import STRATEGIES
from rl3d.models.lora_names import LORA_TARGETS
from rl3d.models.spec import ModelSpec, get_model_spec
from rl3d.parallel import ParallelLayout
from rl3d.utils.dtypes import DTYPE_BYTES

GB = 1e9


@dataclass(frozen=True)
class RecipeShapes:
    """What `rl3d plan RECIPE` takes from a recipe (`rl3d.planning.recipe.recipe_shapes` reads
    it): the model, the actor's training layout, the generation layout, the training dtype, the
    engine as (rollout.engine, rollout.dtype, model.dtype), the actor's `lora` section (None
    without one) and the bucket size of the push to an engine that takes whole HF tensors (None:
    the engine reads the generation weights in place)."""

    spec: ModelSpec
    train: ParallelLayout
    t_g: int
    p_g: int
    dtype: str
    engine: tuple[str, str | None, str]
    lora: Any = None
    push_bucket_mb: float | None = None


def _ints(text: str, count: int, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if len(values) != count:
        raise ValueError(f"{flag} expects {count} comma-separated integers, got {text!r}")
    return values


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", nargs="?", help="recipe YAML (takes model and layouts from it)")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides for the recipe")
    parser.add_argument("--model", help="model name, e.g. llama2-70b (instead of a recipe)")
    parser.add_argument(
        "--train",
        help="training layout P,T,D, P,T,D,EP or P,T,D,EP,ETP (expert parallelism, expert TP)",
    )
    parser.add_argument("--gen", help="generation layout TG,PG")
    parser.add_argument("--strategy", choices=list(STRATEGIES), action="append", help="only these strategies")
    parser.add_argument("--dtype", default=None, choices=sorted(DTYPE_BYTES), help="default bfloat16")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--auto", action="store_true", help="search every valid (t_g, p_g)")
    parser.add_argument("--gpu-mem-gb", type=float, default=80.0)
    parser.add_argument("--batch", type=int, default=1024, help="sequences generated at once (--auto)")
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--response-len", type=int, default=1024)
    parser.add_argument("--lora-rank", type=int, help="plan the adapters' transition (default: actor.lora)")
    parser.add_argument("--lora-targets", help="q_proj,v_proj,... (default: all seven, or actor.lora's)")
    parser.add_argument(
        "--push-bucket-mb",
        type=float,
        help="plan the push to an engine that takes whole HF tensors (SGLang) in buckets of MB "
        "(default: a recipe's rollout.sglang.bucket_mb with rollout.engine: sglang)",
    )


def _inputs(args: argparse.Namespace, recipe: RecipeShapes | None):
    """(spec, training layout, t_g, p_g, dtype, engine): `engine` is a recipe's
    (rollout.engine, rollout.dtype, model.dtype), None without one."""
    if recipe is not None:
        dtype = args.dtype or recipe.dtype
        return recipe.spec, recipe.train, recipe.t_g, recipe.p_g, dtype, recipe.engine
    if not (args.model and args.train and (args.gen or args.auto)):
        raise ValueError("give a RECIPE, or --model NAME --train P,T,D --gen TG,PG")
    p, t, d, *expert = _ints(args.train, min(max(args.train.count(",") + 1, 3), 5), "--train")
    t_g, p_g = _ints(args.gen, 2, "--gen") if args.gen else (t, p)
    ep, etp = expert[0] if expert else 1, expert[1] if len(expert) > 1 else None
    layout = ParallelLayout(p, t, d, ep=ep, etp=etp)
    return get_model_spec(args.model), layout, t_g, p_g, args.dtype or "bfloat16", None


def identity_line(plan: TransitionPlan, engine: tuple[str, str | None, str] | None = None) -> str | None:
    """What an identity transition means for the rollout engine's weights, or None.
    `engine` is a recipe's (rollout.engine, rollout.dtype, model.dtype)."""
    if not plan.gen.is_identity:
        return None
    head = "identity: each rank's generation shard is its training shard; hybridflow moves 0 bytes"
    if plan.train.ep > 1:
        head = (
            "identity for the dense weights (in place); experts: each rank trains its EP rank's and "
            "receives the others' over its EP group"
        )
    if plan.train.etp is not None and plan.gen.t_g > 1:
        head = (
            "identity for the dense weights (in place); experts: each rank receives the parts of its "
            "generation TP shard it does not train, point to point"
        )
    if engine is None:
        return f"{head}; the torch engine reads the training parameters in place unless rollout.dtype differs"
    name, engine_dtype, train_dtype = engine
    if name != "torch":
        return f"{head}; the {name} engine keeps its own copy of the weights"
    if engine_dtype not in (None, train_dtype):
        return f"{head}; rollout.dtype={engine_dtype} makes the torch engine hold a cast copy"
    return f"{head}; the torch engine reads the training parameters in place (0 bytes copied)"


def _groups_text(name: str, groups: list[list[int]], limit: int = 16) -> str:
    world = sum(len(g) for g in groups)
    if world <= limit:
        return f"{name:<18} {' '.join(str(g) for g in groups)}"
    shown = " ".join(str(g) for g in groups[:3])
    return f"{name:<18} {shown} ... ({len(groups)} groups of {len(groups[0])})"


def _expert_groups_text(gen) -> str:
    if gen.train.etp is not None and gen.t_g > 1:
        parts = expert_parts(gen.train, gen.t_g)
        return (
            f"{'expert parts':<18} {parts} an expert (lcm of etp and t_g), point to point from their holders"
        )
    return _groups_text("expert micro-DP", gen.expert_micro_dp_groups())


def _unit(nbytes: float) -> tuple[str, float]:
    for name, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= size:
            return name, size
    return "B", 1.0


def format_plan(plan: TransitionPlan, engine: tuple[str, str | None, str] | None = None) -> str:
    gen, train = plan.gen, plan.train
    unit, size = _unit(plan.model_bytes)
    lines = [
        f"model {plan.spec.name}: M = {plan.model_bytes / size:.3f} {unit} at {plan.dtype_bytes} bytes/param",
        f"training p-t-d = {train} ({train.world_size} ranks)  ->  generation p_g-t_g-d_g-d = {gen}"
        f"  (d_g = {gen.d_g})",
        _groups_text("training TP", train.tp_groups()),
        _groups_text("generation TP", gen.gen_tp_groups()),
        _groups_text("generation PP", gen.gen_pp_groups()),
        _groups_text("micro-DP", gen.micro_dp_groups()),
        *([_expert_groups_text(gen)] if train.ep > 1 else []),
        _groups_text("generation DP", gen.gen_dp_groups()),
        *filter(None, [identity_line(plan, engine)]),
        "",
        f"{'strategy':<14}{'recv max':>12}{'recv mean':>12}{'peak param':>12}{'redundant':>12}"
        f"   ({unit} per rank)",
    ]
    for name, s in plan.strategies.items():
        lines.append(
            f"{name:<14}{s.comm_bytes_max / size:>12.3f}{s.comm_bytes_mean / size:>12.3f}"
            f"{s.peak_param_bytes / size:>12.3f}{s.redundant_bytes / size:>12.3f}"
        )
    names = list(plan.strategies)
    if len(names) > 1:
        lines += ["", "reduction of recv max / peak param memory against each baseline (1 - this/baseline):"]
        lines.append(f"{'':<14}" + "".join(f"{'vs ' + b:>22}" for b in names))
        for name in names:
            a = plan.strategies[name]
            cells = []
            for base in names:
                b = plan.strategies[base]
                comm = _reduction(a.comm_bytes_max, b.comm_bytes_max)
                peak = _reduction(a.peak_param_bytes, b.peak_param_bytes)
                cells.append("-" if base == name else f"{comm} / {peak}")
            lines.append(f"{name:<14}" + "".join(f"{c:>22}" for c in cells))
    return "\n".join(lines)


def format_push(push: EnginePush) -> str:
    """The transition's last step, the push to an engine that takes whole HF tensors."""
    unit, size = _unit(push.nbytes)
    bucket_unit, bucket_size = _unit(push.bucket_bytes)
    gather_unit, gather_size = _unit(push.gather_bytes)
    peak_unit, peak_size = _unit(push.peak_bytes)
    largest_unit, largest_size = _unit(push.largest_bucket_bytes)
    return (
        f"engine push, per generation rank after the transition: {push.num_tensors} HF tensors, "
        f"{push.nbytes / size:.3f} {unit} in {len(push.buckets)} buckets of <= "
        f"{push.bucket_bytes / bucket_size:.3f} {bucket_unit} (a larger tensor alone; the largest "
        f"{push.largest_bucket_bytes / largest_size:.3f} {largest_unit}), made whole by receiving "
        f"{push.gather_bytes / gather_size:.3f} {gather_unit} from its generation-TP group; "
        f"{push.peak_bytes / peak_size:.3f} {peak_unit} held at its peak"
    )


def _reduction(value: float, baseline: float) -> str:
    return "n/a" if baseline == 0 else f"{100 * (1 - value / baseline):.1f}%"


def format_auto(rows, best, hw: HardwareModel) -> str:
    lines = [
        f"{'t_g':>4}{'p_g':>4}{'d_g':>4}{'transition GB':>15}{'weights GB':>12}{'KV GB':>9}{'fits':>6}"
        f"{'transition s':>14}{'generate s':>12}{'total s':>10}",
    ]
    for r in rows:
        mark = "  <- fastest that fits" if r is best else ""
        lines.append(
            f"{r.t_g:>4}{r.p_g:>4}{r.d_g:>4}{r.transition_bytes / GB:>15.3f}{r.weight_bytes / GB:>12.2f}"
            f"{r.kv_bytes / GB:>9.2f}{'yes' if r.fits else 'no':>6}{r.transition_s:>14.3f}"
            f"{r.generate_s:>12.2f}{r.total_s:>10.2f}{mark}"
        )
    lines.append(
        f"model: {hw.gpu_mem_gb:g} GB x {hw.mem_fraction:g} usable per GPU, HBM {hw.hbm_gbps:g} GB/s, "
        f"NVLink {hw.nvlink_gbps:g} GB/s, IB {hw.ib_gbps:g} GB/s per node (its GPUs share it), "
        f"{hw.alpha_us:g} us per collective "
        "(see rl3d.hybrid_engine.auto)"
    )
    if best is None:
        lines.append("no generation layout fits: lower --batch or use more GPUs")
    return "\n".join(lines)


MAX_WORLD = 1 << 16  # ranks: planning is per rank, and no job has more


def _check_bounds(args: argparse.Namespace, train: ParallelLayout) -> None:
    """Inputs a plan cannot mean: said before any work (a huge world would run for hours)."""
    if train.world_size > MAX_WORLD:
        raise ValueError(f"--train: {train.world_size} ranks; rl3d plan handles at most {MAX_WORLD}")
    for flag, value in (("--gpu-mem-gb", args.gpu_mem_gb), ("--batch", args.batch)):
        if value <= 0:
            raise ValueError(f"{flag} must be > 0, got {value:g}")
    for flag, value in (("--prompt-len", args.prompt_len), ("--response-len", args.response_len)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")


def run_plan(args: argparse.Namespace, recipe: RecipeShapes | None = None) -> str:
    """Entry point of `rl3d plan`; `recipe` holds the model and layouts of the recipe when one is
    given. ValueError (bad layout, model, flag) is reported by the CLI."""
    spec, train, t_g, p_g, dtype, engine = _inputs(args, recipe)
    _check_bounds(args, train)
    if args.auto:
        hw = HardwareModel(gpu_mem_gb=args.gpu_mem_gb)
        rows = search_layouts(
            spec,
            train,
            batch=args.batch,
            prompt_len=args.prompt_len,
            response_len=args.response_len,
            dtype=dtype,
            hw=hw,
        )
        best = best_row(rows)
        if args.json:
            out = {"layouts": [vars(r) | {"total_s": r.total_s, "best": r is best} for r in rows]}
            return json.dumps(out)
        return format_auto(rows, best, hw)
    strategies = tuple(args.strategy) if args.strategy else None
    plan = plan_transition(spec, train, t_g, p_g, dtype=dtype, strategies=strategies)
    lora = _lora_transition(args, recipe, spec, train, t_g, p_g, dtype)
    moe = plan_moe_split(spec, train, t_g, p_g, dtype=dtype) if spec.is_moe else None
    push = _engine_push(args, recipe, plan, dtype)
    if args.json:
        extra = ({"lora": lora.summary()} if lora else {}) | ({"moe": moe} if moe else {})
        return json.dumps(plan.to_json() | {"engine_push": push.summary()} | extra)
    sections = [format_plan(plan, engine)]
    sections += [format_push(push)] if push.buckets else []
    sections += [format_lora(lora)] if lora is not None else []
    sections += [format_moe(moe)] if moe is not None else []
    return "\n\n".join(sections)


def _engine_push(args, recipe, plan: TransitionPlan, dtype: str) -> EnginePush:
    """The transition's last step, the push to an engine that takes whole HF tensors, where
    --push-bucket-mb or the recipe's engine asks for one; else the empty push."""
    mb = args.push_bucket_mb if args.push_bucket_mb is not None else getattr(recipe, "push_bucket_mb", None)
    if mb is None:
        return NO_PUSH
    if not mb > 0:
        raise ValueError(f"--push-bucket-mb must be > 0, got {mb:g}")
    if plan.gen.p_g != 1:  # as rl3d.rollout.factory refuses it
        raise ValueError(f"p_g={plan.gen.p_g}: an engine that takes whole HF tensors generates with p_g = 1")
    return plan_engine_push(plan.spec, plan.params, plan.gen.t_g, dtype=dtype, bucket_bytes=int(mb * 2**20))


def _lora_transition(args, recipe, spec, train, t_g, p_g, dtype) -> LoraTransition | None:
    """The adapter-only transition when --lora-rank is given or the recipe sets actor.lora."""
    lora_cfg = recipe.lora if recipe is not None else None
    rank = args.lora_rank if args.lora_rank is not None else getattr(lora_cfg, "rank", None)
    if rank is None:
        return None
    if args.lora_targets:
        targets = tuple(t.strip() for t in args.lora_targets.split(","))
    else:
        targets = tuple(getattr(lora_cfg, "targets", LORA_TARGETS))
    return plan_lora_transition(spec, train, t_g, p_g, rank=rank, targets=targets, dtype=dtype)
