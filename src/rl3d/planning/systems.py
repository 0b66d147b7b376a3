"""The HybridFlow paper's end-to-end comparison (EuroSys'25, section 8.2), simulated: rl3d's
chosen run layout against three 2024 systems, each as the mechanisms it runs, on the same step
simulator and device class. Nothing is fitted to the paper's numbers.

- rl3d: the best fitting run layout of `rl3d.planning.layout_search` (rl3d's loop runs the
  stages one after another).
- DeepSpeed-Chat (v0.14, `deepspeed/runtime/hybrid_engine.py`; `applications/DeepSpeed-Chat`):
  every model on all N devices, trained and run with ZeRO-3 and gradient checkpointing (the
  training scripts of both ZeRO-3 systems turn it on for large models; a training pass then
  runs the forward twice), parameters gathered over all N
  devices before each forward and backward of each micro-batch, gradients reduce-scattered;
  the gathers overlap compute, so a pass takes the longer of the two); generation in its hybrid
  engine at its own inference TP (the smallest that fits), after a transition that gathers every
  parameter over all N devices (`rl3d.costs.mechanisms.ds_chat`).
- OpenRLHF (v0.2.5, `openrlhf/trainer/ray/`): each model on its own devices (actor, critic,
  reference, reward model, and vLLM engines), ZeRO-3 inside each pool; the models' forwards run
  at once and the actor and critic train at once (Ray calls in parallel); weights go to vLLM by
  a per-parameter gather and NCCL broadcast (`rl3d.costs.mechanisms.openrlhf`). The split of
  the devices is searched (whole nodes; the best is taken).
- NeMo-Aligner: all models colocated, one 3D layout for training and generation (no
  resharding: generation runs at the training's t and p), the best such layout; Megatron's
  sequence parallelism at t > 1 and full recompute where a layout fits only with it, as rl3d's
  search takes them.
The transition mechanisms' facts and sources: /work/shared/TRANSITION_FACTS.md and
`rl3d.costs.mechanisms`.
"""

from __future__ import annotations

import functools
import math

from rl3d.costs.mechanisms import MECHANISMS, mechanism_cost
from rl3d.costs.micro_batch import MicroBatchShape
from rl3d.costs.optimizer import adam_seconds
from rl3d.hybrid_engine.params import SegmentTable
from rl3d.hybrid_engine.plan import PlanContext, plan_transition
from rl3d.models.spec import get_model_spec
from rl3d.parallel import ParallelLayout
from rl3d.planning.devices import DeviceClass
from rl3d.planning.footprint import USABLE, kv_bytes_per_seq
from rl3d.planning.layout_search import (
    compositions,
    divisors,
    layouts,
    pool_sizes,
    search_run_layouts,
    tp_fits,
)
from rl3d.planning.memory_activations import activation_bytes
from rl3d.planning.simulator import generate_seconds, pass_seconds, simulate
from rl3d.planning.workload import TRAINED, PoolLayout, RunLayout, Workload

ZERO3_PASS_GATHERS = {False: 1, True: 3}  # forward: one gather; training: gather, gather, reduce-scatter
RECOMPUTE = 4 / 3  # gradient checkpointing: a training pass runs the forward twice


def _baseline_transition(name: str, w: Workload, n: int, t_g: int, device: DeviceClass) -> float:
    spec = w.actor
    train = ParallelLayout(1, t_g, n // t_g)
    plan = plan_transition(spec, train, t_g, 1, strategies=tuple(dict.fromkeys((name, "ds_chat"))))
    ctx = PlanContext(spec, plan.gen, plan.dtype_bytes, plan.params, SegmentTable(plan.params, train.t))
    cluster = device.cluster()
    return mechanism_cost(MECHANISMS[name](ctx, plan, cluster), cluster)["seconds"]


def zero3_pass(w: Workload, role: str, n: int, device: DeviceClass, *, backward: bool) -> float:
    spec = w.spec(role)
    compute = pass_seconds(spec, ParallelLayout(1, 1, n), device, w, samples=w.samples, backward=backward)
    compute *= RECOMPUTE if backward else 1.0
    if n == 1:
        return compute
    micro = math.ceil(w.samples / (n * w.micro_batch_size))
    gbps = device.link_gbps(n, math.ceil(n / device.gpus_per_node))
    per_gather = (n - 1) / n * spec.num_params() * w.dtype_bytes / (gbps * 1e9)
    per_gather += device.nccl.ring_seconds(n, math.ceil(n / device.gpus_per_node))
    return max(compute, micro * ZERO3_PASS_GATHERS[backward] * per_gather)


def zero3_update(w: Workload, role: str, n: int, device: DeviceClass) -> float:
    steps = w.ppo_epochs * max(1, w.samples // w.mini_batch_size)
    adam = adam_seconds(w.spec(role).num_params() / n, device.hbm_gbps)
    return w.ppo_epochs * zero3_pass(w, role, n, device, backward=True) + steps * adam


def _zero3_static(w: Workload, roles, n: int) -> float:
    per_param = {r: (18 if r in TRAINED else w.dtype_bytes) for r in roles}
    return sum(w.spec(r).num_params() * per_param[r] for r in roles) / n


def _activations(w: Workload, roles) -> float:
    shape = MicroBatchShape(w.seq_len, w.micro_batch_size, w.response_len, w.flash_attention, recompute=True)
    return max(
        (
            activation_bytes(
                w.spec(r),
                role=r,
                tp=1,
                layers=w.spec(r).num_layers,
                last_stage=True,
                lm_head=r == "actor",
                shape=shape,
                dtype_bytes=w.dtype_bytes,
                trains=True,
            )  # fmt: skip
            for r in roles
            if r in TRAINED
        ),
        default=0,
    )


def _generation(
    w: Workload, n: int, resident: float, device: DeviceClass, t_choices
) -> tuple[float, int] | None:
    """(prefill + decode seconds, t_g) at the fastest generation TP that fits, or None."""
    best = None
    for t_g in t_choices:
        budget = device.memory_bytes * USABLE - resident - w.actor.num_params() * w.dtype_bytes / t_g
        if budget < kv_bytes_per_seq(w.actor, t_g, 1, w):
            continue
        seconds = sum(generate_seconds(w.actor, n, t_g, 1, device, w, budget))
        if best is None or seconds < best[0]:
            best = (seconds, t_g)
    return best


def _tp_choices(w: Workload, n: int, device: DeviceClass) -> list[int]:
    return [t for t in divisors(min(n, device.gpus_per_node)) if n % t == 0 and tp_fits(w.actor, t, device)]


def ds_chat(w: Workload, n: int, device: DeviceClass) -> dict | None:
    resident = _zero3_static(w, w.roles, n)
    if resident + _activations(w, w.roles) > device.memory_bytes * USABLE:
        return None
    gen = _generation(w, n, resident, device, _tp_choices(w, n, device))
    if gen is None:
        return None
    stages = {"generate": gen[0]}
    for role in w.roles:
        stages[f"fwd_{role}"] = zero3_pass(w, role, n, device, backward=False)
        if role in TRAINED:
            stages[f"update_{role}"] = zero3_update(w, role, n, device)
    stages["reshard"] = _baseline_transition("ds_chat", w, n, gen[1], device)
    return {
        "stages": stages,
        "step_seconds": sum(stages.values()),
        "layout": f"ZeRO-3 over {n}, gen t_g {gen[1]}",
    }


def openrlhf(w: Workload, n: int, device: DeviceClass) -> dict | None:
    models = list(w.roles)
    usable = device.memory_bytes * USABLE

    @functools.cache
    def pool(role: str, size: int) -> tuple[float, float] | None:  # (forward, update) seconds
        if _zero3_static(w, (role,), size) + _activations(w, (role,)) > usable:
            return None
        update = zero3_update(w, role, size, device) if role in TRAINED else 0.0
        return zero3_pass(w, role, size, device, backward=False), update

    @functools.cache
    def vllm(size: int):
        return _generation(w, size, 0.0, device, _tp_choices(w, size, device))

    @functools.cache
    def sync(actor: int, engines: int) -> float:  # the mechanism's rollout GPUs equal its trainer GPUs
        return _baseline_transition("openrlhf", w, min(actor, engines), 1, device)

    within = [2**k for k in range(8) if 2**k < min(n, device.gpus_per_node)]  # a pool may share a node
    best = None
    for sizes in compositions(n, len(models) + 1, sorted({*within, *pool_sizes(n, device)})):
        parts = [pool(r, s) for r, s in zip(models, sizes)]
        gen = vllm(sizes[-1])
        if gen is None or any(p is None for p in parts):
            continue
        forwards, updates = max(p[0] for p in parts), max(p[1] for p in parts)
        step = gen[0] + forwards + updates
        if best is not None and step >= best["step_seconds"]:
            continue  # the weight sync only adds
        stages = {"generate": gen[0], "forwards": forwards, "updates": updates}
        stages["weight_sync"] = sync(sizes[0], sizes[-1])
        step = sum(stages.values())
        if best is None or step < best["step_seconds"]:
            layout = (
                " ".join(f"{r}[{s}]" for r, s in zip(models, sizes)) + f" vllm[{sizes[-1]}: t_g {gen[1]}]"
            )
            best = {"stages": stages, "step_seconds": step, "layout": layout}
    return best


def nemo_aligner(w: Workload, n: int, device: DeviceClass) -> dict | None:
    best = None
    trained = tuple(r for r in w.roles if r in TRAINED)
    for lay in layouts(w.actor, n, device):
        split = trained if lay.t > 1 else ()
        for recompute in ((), trained):  # recompute only where the layout needs it to fit
            pool = PoolLayout("actor", lay, w.roles, split, recompute)
            run_layout = RunLayout(pools=(pool,), t_g=lay.t, p_g=lay.p)
            est = simulate(w, run_layout, device)
            if est.fits:
                break
        if est.fits and (best is None or est.step_seconds < best["step_seconds"]):
            best = {"stages": est.stages, "step_seconds": est.step_seconds, "layout": run_layout.describe()}
    return best


def rl3d(w: Workload, n: int, device: DeviceClass) -> dict | None:
    fitting = [c for c in search_run_layouts(w, device, n, rollout_pool=True) if c.estimate.fits]
    if not fitting:
        return None
    c = fitting[0]
    return {
        "stages": c.estimate.stages,
        "step_seconds": c.estimate.step_seconds,
        "layout": c.run_layout.describe(),
    }


SYSTEMS = {"rl3d": rl3d, "ds_chat": ds_chat, "openrlhf": openrlhf, "nemo_aligner": nemo_aligner}

# The paper's dataflows (section 8.1): every model the actor's size; 1024 prompts of 1024 tokens
# and 1024-token responses a step. Our choices, stated: 4 mini-batches of 256, micro-batches of
# 2, flash attention and the distributed optimizer on the Megatron side.
PAPER_ROLES = {
    "ppo": ("actor", "critic", "reference", "reward_model"),
    "remax": ("actor", "reference", "reward_model"),
    "safe_rlhf": ("actor", "critic", "cost_critic", "reference", "reward_model", "cost_model"),
}
PAPER_MODELS = ("llama2-7b", "llama2-13b", "llama2-34b", "llama2-70b")
PAPER_GPUS = (16, 32, 64, 128)
PAPER_RANGE = (1.53, 20.57)  # HybridFlow's throughput over the three baselines (abstract)


def paper_workload(algorithm: str, model: str) -> Workload:
    return Workload(
        actor=get_model_spec(model),
        roles=PAPER_ROLES[algorithm],
        prompts=1024,
        generations=2.0 if algorithm == "remax" else 1.0,  # ReMax's greedy response per prompt
        mini_batch_size=256,
        micro_batch_size=2,
        flash_attention=True,
        distributed_optimizer=True,
    )


def compare(algorithm: str, model: str, gpus: int, device: DeviceClass) -> dict:
    """Each system's simulated step (None: it does not fit) and rl3d's throughput ratio."""
    w = paper_workload(algorithm, model)
    out = {name: fn(w, gpus, device) for name, fn in SYSTEMS.items()}
    mine = out["rl3d"]
    ratios = {
        name: r["step_seconds"] / mine["step_seconds"]
        for name, r in out.items()
        if name != "rl3d" and r is not None and mine is not None
    }
    return {"systems": out, "ratios": ratios, "tokens": w.tokens}
