"""`rl3d plan RECIPE --auto-layout --gpus N`: simulate the recipe's own run layout, search the
layouts of its roles on N devices, and print the best few and the chosen one as recipe
overrides that `rl3d train` and `rl3d validate` accept.

Every reported candidate is validated as a recipe (the recipe, its command-line overrides,
then the candidate's) before it is listed; one the loader refuses is dropped and counted. The
search itself skips an actor layout the loader refuses by an `actor.parallel`, `actor.lora` or
`actor.recompute` key (asked once per layout, sequence parallelism and recompute, with every
role on the actor's devices), so refused layouts (a mixture of experts at a tensor-parallel
size its trainer does not run, LoRA under sequence parallelism, say) never crowd out the ones
it takes. The overrides state each trained role's `parallel.sequence_parallel` and `recompute`.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
from collections.abc import Callable

from rl3d.config import RL3DConfig, load_config
from rl3d.config.errors import ConfigError
from rl3d.planning.devices import DeviceClass, get_device
from rl3d.planning.layout_search import Candidate, PoolChoice, search_run_layouts
from rl3d.planning.memory import plan_memory
from rl3d.planning.recipe import run_layout_of, workload_of
from rl3d.planning.simulator import simulate
from rl3d.planning.workload import PoolLayout, RunLayout

logger = logging.getLogger(__name__)

# the config section that places each movable role (its `colocate` and `parallel` keys)
SECTIONS = {
    "critic": "critic",
    "reference": "reference",
    "reward_model": "reward.model",
    "cost_model": "reward.cost_model",
}
MAX_VALIDATIONS = 60
# a refusal by one of these keys rules the actor's layout out of the search
ACTOR_KEYS = ("actor.parallel", "actor.lora", "actor.recompute")


def _parallel(section: str, lay) -> list[str]:
    return [
        f"{section}.parallel.tp={lay.t}",
        f"{section}.parallel.pp={lay.p}",
        f"{section}.parallel.dp={lay.d}",
    ]


def _runs(section: str, role: str, pool: PoolLayout) -> list[str]:
    """How trained role `role` runs in `pool`: its sequence parallelism and recompute."""
    split = "true" if role in pool.sequence_parallel else "false"
    recompute = "full" if role in pool.recompute else "none"
    return [f"{section}.parallel.sequence_parallel={split}", f"{section}.recompute={recompute}"]


def overrides_of(run_layout: RunLayout, gpus_per_node: int, *, ep: bool = False) -> list[str]:
    """The recipe overrides that put a run in `run_layout`; `ep`: state the actor's expert
    parallelism too (a mixture of experts)."""
    actor = run_layout.pool_of("actor")
    out = _parallel("actor", actor.layout) + ([f"actor.parallel.ep={actor.layout.ep}"] if ep else [])
    out += _runs("actor", "actor", actor)
    for role, section in SECTIONS.items():
        if any(role in p.roles for p in run_layout.pools):
            pool = run_layout.pool_of(role)
            own = pool is not actor
            out.append(f"{section}.colocate={'false' if own else 'true'}")
            if own or role == "critic":  # a colocated critic states the actor's layout
                out += _parallel(section, pool.layout)
            if role == "critic":
                out += _runs(section, role, pool)
    rollout = run_layout.separate
    if rollout is None:
        out += [
            "rollout.placement=colocated",
            f"rollout.t_g={run_layout.t_g}",
            f"rollout.p_g={run_layout.p_g}",
        ]
    else:
        out += [
            "rollout.placement=separate",
            f"rollout.pool.tp={rollout.layout.t}",
            f"rollout.pool.dp={rollout.layout.d}",
        ]
    world = run_layout.world
    nnodes = 1 if world <= gpus_per_node else world // gpus_per_node
    return out + [f"launch.nnodes={nnodes}", f"launch.nproc_per_node={world // nnodes}"]


def actor_layout_check(
    load: Callable[[list[str]], RL3DConfig], roles: tuple[str, ...], gpus_per_node: int, *, ep: bool
) -> Callable[[PoolChoice], bool]:
    """`ok(choice)`: False when the recipe refuses the actor in `choice` (a layout, sequence
    parallelism, recompute) by one of `ACTOR_KEYS` (the loader's own checks, with every role on
    the actor's devices, running as the actor does); any other refusal is left to the
    candidate's own validation."""

    @functools.cache
    def ok(choice: PoolChoice) -> bool:
        try:
            load(overrides_of(RunLayout(pools=(choice.pool("actor", roles),)), gpus_per_node, ep=ep))
        except ConfigError as err:
            return not (err.key or "").startswith(ACTOR_KEYS)
        except ValueError:
            return True
        return True

    return ok


def _entry(c: Candidate, overrides: list[str]) -> dict:
    return {"layout": c.run_layout.describe(), "overrides": overrides, **c.estimate.to_json()}


def auto_layout(
    cfg: RL3DConfig, load: Callable[[list[str]], RL3DConfig], *, gpus: int, device: DeviceClass, top: int
) -> dict:
    """{"recipe", "best", "candidates", "rejected"}. `load(overrides)` loads the recipe with a
    candidate's overrides (ValueError when the loader refuses them); a loaded candidate fits
    when the step simulator's footprint and the memory plan (`plan_memory`) both say so."""
    w = workload_of(cfg)
    own = run_layout_of(cfg)
    mine = simulate(w, own, device)
    listed, rejected = [], []
    ep = w.actor.is_moe
    actor_ok = actor_layout_check(load, w.roles, device.gpus_per_node, ep=ep)
    for c in search_run_layouts(w, device, gpus, rollout_pool=True, actor_ok=actor_ok)[:MAX_VALIDATIONS]:
        if len(listed) >= top:
            break
        overrides = overrides_of(c.run_layout, device.gpus_per_node, ep=ep)
        try:
            loaded = load(overrides)
        except ValueError as err:  # ConfigError: the key and the reason
            rejected.append({"layout": c.run_layout.describe(), "error": str(err)})
            continue
        plan = plan_memory(loaded, device_bytes=device.memory_bytes)
        entry = _entry(c, overrides) | {"memory_plan_peak_gb": plan.worst().peak_bytes / 1e9}
        listed.append(entry | {"fits": bool(c.estimate.fits and plan.fits)})
    fitting = [e for e in listed if e["fits"]]
    best = min(fitting, key=lambda e: e["step_seconds"]) if fitting else None
    if best is not None:  # per device, so a recipe on another device count compares too
        gain = (best["throughput_tokens_per_s"] / gpus) / (mine.throughput / own.world)
        best = best | {"gain_over_recipe": gain}
    recipe_plan = plan_memory(cfg, device_bytes=device.memory_bytes)
    return {
        "device": device.name,
        "gpus": gpus,
        "recipe": {
            "layout": own.describe(),
            "gpus": own.world,
            **mine.to_json(),
            "fits": bool(mine.fits and recipe_plan.fits),
            "memory_plan_peak_gb": recipe_plan.worst().peak_bytes / 1e9,
        },
        "best": best,
        "candidates": listed,
        "rejected": rejected,
    }


def format_auto_layout(out: dict) -> str:
    rec = out["recipe"]
    lines = [
        f"simulated on {out['gpus']} x {out['device']} (rl3d.planning.devices; stages in seconds)",
        f"recipe: {rec['layout']} on {rec['gpus']}: step {rec['step_seconds']:.2f} s "
        f"({rec['bottleneck']}), fits {'yes' if rec['fits'] else 'no'}",
        "",
        f"{'step s':>9} {'fits':>4}  {'bottleneck':<14} layout",
    ]
    for e in out["candidates"]:
        fits = "yes" if e["fits"] else "no"
        lines.append(f"{e['step_seconds']:>9.2f} {fits:>4}  {e['bottleneck']:<14} {e['layout']}")
    if out["rejected"]:
        lines.append(
            f"({len(out['rejected'])} layouts the recipe refused, e.g. {out['rejected'][0]['error']})"
        )
    best = out["best"]
    if best is None:
        lines.append("no layout fits: use more devices or a larger device class")
        return "\n".join(lines)
    stages = ", ".join(f"{k} {v:.2f}" for k, v in best["stages"].items())
    lines += [
        "",
        f"chosen: {best['layout']}: step {best['step_seconds']:.2f} s, "
        f"{best['gain_over_recipe']:.2f}x the recipe's simulated throughput per device",
        f"  stages: {stages}",
        "  overrides: " + " ".join(best["overrides"]),
    ]
    return "\n".join(lines)


def run_auto_layout(args: argparse.Namespace, recipe: str, base_overrides: list[str], cfg: RL3DConfig) -> str:
    def load(overrides: list[str]) -> RL3DConfig:
        return load_config(recipe, [*base_overrides, *overrides]).config

    gpus = args.gpus if args.gpus is not None else run_layout_of(cfg).world
    device = get_device(args.device, args.gpus_per_node)
    if gpus > device.gpus_per_node and gpus % device.gpus_per_node:
        raise ValueError(f"--gpus {gpus} must be a multiple of --gpus-per-node {device.gpus_per_node}")
    out = auto_layout(cfg, load, gpus=gpus, device=device, top=args.top)
    return json.dumps(out) if args.json else format_auto_layout(out)
