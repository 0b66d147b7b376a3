"""Per-call software cost of each transition mechanism, fitted from the real executors on gloo.

`rl3d bench transition --mode measured --fit-overhead` runs every strategy's executor
(`Resharder`) over a grid that varies the number of calls at fixed bytes (the bucket size:
hybridflow, hybridflow_v and openrlhf's broadcast are bucketed) and the bytes at fixed calls
(the same model at two widths: ds_chat and openrlhf issue one call per parameter), and fits
per strategy, by least squares,

    seconds = alpha x calls + beta x bytes

where calls are the collective and point-to-point calls the executor issued and bytes what
its busiest rank received (both counted by `CountedComm`). alpha is the mechanism's cost per
call on this machine (Python loop, packing, gloo's call); 1/beta its achieved bandwidth. The
residual (RMS, and relative to the mean time) says how well two terms explain the runs.

`--mode modeled --overhead measured` then charges every modelled call the fitted alpha of its
mechanism instead of NCCL's per-call latency (verl_2024, which has no executor here, takes
hybridflow's; hybridflow_overlap follows hybridflow). The bytes stay on the modelled cluster's
links: gloo's loopback bandwidth says nothing about a 200 Gb/s network, so beta is reported,
never used. Nothing is fitted to the paper's figures.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

FIT_LAYOUT = ((1, 2, 1), 1, 1)  # 2 training ranks (+2 rollout ranks for openrlhf): 4 processes
FIT_MODELS = ("llama2-7b-shape-1/64", "llama2-7b-shape-1/32", "llama2-13b-shape-1/64")
FIT_BUCKETS_MB = (0.125, 0.5, 2.0)
FIT_STRATEGIES = ("hybridflow", "hybridflow_v", "ds_chat", "openrlhf")
DEFAULT_FIT_PATH = Path("benchmarks/transition/overhead/overhead_fit.json")


def fit_worker(rank, world, models, buckets_mb, strategies, repeats, dtype_name):
    import torch
    import torch.distributed as dist

    from rl3d.bench.measured import _timed
    from rl3d.hybrid_engine.executor import Resharder
    from rl3d.hybrid_engine.params import model_params, stages_of
    from rl3d.hybrid_engine.weights import SeededFullModel, training_shards, zero_shards
    from rl3d.models.spec import get_model_spec
    from rl3d.parallel import GenerationLayout, ParallelLayout
    from rl3d.parallel.groups import build_hybrid_groups
    from rl3d.utils.device import collective_device
    from rl3d.utils.dtypes import torch_dtype

    (layout, t_g, p_g) = FIT_LAYOUT
    dtype, device = torch_dtype(dtype_name), collective_device()
    train = ParallelLayout(*layout)
    n = train.world_size
    groups = build_hybrid_groups(
        GenerationLayout.from_training(train, t_g, p_g), timeout_s=600, rollout_ranks=n
    )
    samples = []
    for model in models:
        spec = get_model_spec(model)
        params = model_params(spec, train_tp=train.t)
        full = SeededFullModel(params, seed=0, dtype=dtype)
        shards, zero = {}, {}
        if rank < n:
            c = train.coords(rank)
            shards = training_shards(
                full, params, pp_rank=c.pp, pp=train.p, tp_rank=c.tp, tp=train.t, num_layers=spec.num_layers
            )
            unpiped = [p for p in params if stages_of(p, spec.num_layers, 1)]
            zero = zero_shards(full, unpiped, rank=rank, world=n)
        for strategy in strategies:
            for bucket_mb in buckets_mb:
                engine = Resharder(
                    spec, groups, strategy=strategy, bucket_mb=bucket_mb, dtype=dtype, device=device
                )
                kwargs = {"zero_shards": zero} if engine.impl.needs_zero_shards else {}

                def once(engine=engine, kwargs=kwargs, shards=shards):
                    weights = engine.to_generation(shards, **kwargs)
                    if weights is not None:
                        weights.release()

                times = [_timed(once, device) for _ in range(1 + repeats)][1:]
                got = torch.tensor([engine.last_stats.calls, engine.last_stats.recv_bytes], device=device)
                dist.all_reduce(got, op=dist.ReduceOp.MAX)
                samples.append(
                    {
                        "strategy": strategy,
                        "model": model,
                        "bucket_mb": bucket_mb,
                        "calls": int(got[0]),
                        "bytes": int(got[1]),
                        "seconds": statistics.median(times),
                    }
                )
                if rank == 0:  # progress: one line per configuration
                    sys.stderr.write(
                        f"  fit {strategy} {model} bucket {bucket_mb:g} MB: {int(got[0])} calls, "
                        f"{int(got[1]) / 1e6:.1f} MB, {statistics.median(times) * 1e3:.1f} ms\n"
                    )
    return samples


def fit(samples: list[dict]) -> dict:
    """Per strategy: least squares of seconds on (calls, bytes), no intercept, and residuals."""
    import numpy as np

    out = {}
    for strategy in dict.fromkeys(s["strategy"] for s in samples):
        rows = [s for s in samples if s["strategy"] == strategy]
        a = np.array([[s["calls"], s["bytes"]] for s in rows], dtype=float)
        y = np.array([s["seconds"] for s in rows])
        scale = a.max(axis=0)
        scale[scale == 0] = 1
        coef, *_ = np.linalg.lstsq(a / scale, y, rcond=None)
        alpha, beta = coef / scale
        resid = y - a @ np.array([alpha, beta])
        rms = float(np.sqrt(np.mean(resid**2)))
        out[strategy] = {
            "alpha_s_per_call": float(alpha),
            "beta_s_per_byte": float(beta),
            "bandwidth_GBps": float(1 / beta / 1e9) if beta > 0 else None,
            "rms_residual_s": rms,
            "relative_residual": rms / float(np.mean(y)),
            "samples": len(rows),
            "calls_range": [int(a[:, 0].min()), int(a[:, 0].max())],
            "bytes_range": [int(a[:, 1].min()), int(a[:, 1].max())],
        }
    return out


def run_fit(
    *, repeats: int = 3, dtype: str = "float32", models=FIT_MODELS, buckets_mb=FIT_BUCKETS_MB
) -> dict:
    from rl3d.testing.spawn import run_distributed

    start = time.perf_counter()
    world = 2 * FIT_LAYOUT[0][0] * FIT_LAYOUT[0][1] * FIT_LAYOUT[0][2]
    samples = run_distributed(
        fit_worker, world, tuple(models), tuple(buckets_mb), FIT_STRATEGIES, repeats, dtype, timeout_s=1800
    )[0]
    return {
        "layout": {"train": FIT_LAYOUT[0], "gen": FIT_LAYOUT[1:]},
        "dtype": dtype,
        "repeats": repeats,
        "samples": samples,
        "fit": fit(samples),
        "wall_seconds": time.perf_counter() - start,
    }


ALPHA_SOURCE = {"verl_2024": "hybridflow"}  # no executor of its own here


def load_fit(path: Path | str = DEFAULT_FIT_PATH) -> dict:
    path = Path(path)
    if not path.exists():
        raise ValueError(
            f"no overhead fit at {path}: run `rl3d bench transition --mode measured --fit-overhead` first"
        )
    return json.loads(path.read_text())["fit"]


def apply_overhead(result: dict, fitted: dict) -> dict:
    """Re-cost the modelled points: each call costs its mechanism's fitted alpha instead of NCCL's
    latency (bandwidth terms unchanged). Mutates and returns `result`."""
    from rl3d.bench.modeled import overlapped_seconds, reductions

    for point in result["points"]:
        st = point["strategies"]
        for name, s in st.items():
            if name == "hybridflow_overlap":
                continue
            alpha = fitted[ALPHA_SOURCE.get(name, name)]["alpha_s_per_call"]
            s["nccl_latency_seconds"] = s["latency_seconds"]
            s["latency_seconds"] = s["calls"] * alpha
            s["seconds"] = s["seconds"] - s["nccl_latency_seconds"] + s["latency_seconds"]
        if "hybridflow_overlap" in st:
            hf, opt = st["hybridflow"], point["optimizer_seconds"]
            visible = overlapped_seconds(hf["seconds"], hf["calls"], opt)
            st["hybridflow_overlap"] |= {
                "seconds": visible,
                "latency_seconds": hf["latency_seconds"],
                "terms": {
                    "transition": hf["seconds"],
                    "optimizer_step": opt,
                    "hidden": hf["seconds"] - visible,
                },
            }
    result["reductions"] = reductions(result["points"])
    result["overhead"] = {
        "source": "measured",
        "alpha_s_per_call": {k: v["alpha_s_per_call"] for k, v in fitted.items()},
    }
    return result
