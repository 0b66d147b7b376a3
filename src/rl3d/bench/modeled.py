"""Modelled transition times at full scale (HybridFlow, EuroSys'25, section 8.4, Fig. 14).

The planner's exact per-rank bytes for every strategy, turned into seconds by the alpha-beta
model of `cost_model.Cluster`. No GPU, no tensors.

Layouts (the paper names only "the smallest number of GPUs that runs without OOM, up to 128"),
chosen here and stated: a 16/32/64/128-GPU training job for 7B/13B/34B/70B, tensor parallel
within a node (t = 8, so a TP group is one 8-GPU node), pipeline stages to fit the model's
training state (BF16 weights, FP32 grads and Adam: 16-18 bytes a parameter over t*p GPUs), and
d = 2. Generation uses the smallest t_g whose weights plus a 1024-prompt x 2048-token KV cache
share fits comfortably in 80 GB (what `rl3d plan --auto` also picks), with p_g = 1 as vLLM 0.3
ran it.
"""

from __future__ import annotations

from dataclasses import dataclass

from rl3d.bench.cost_model import Cluster, strategy_seconds
from rl3d.hybrid_engine.plan import plan_transition
from rl3d.hybrid_engine.strategy import STRATEGIES
from rl3d.models.spec import get_model_spec
from rl3d.parallel import ParallelLayout


@dataclass(frozen=True)
class PaperLayout:
    model: str
    p: int
    t: int
    d: int
    t_g: int
    p_g: int

    @property
    def gpus(self) -> int:
        return self.p * self.t * self.d


PAPER_LAYOUTS = {
    "llama2-7b": PaperLayout("llama2-7b", 1, 8, 2, 2, 1),
    "llama2-13b": PaperLayout("llama2-13b", 2, 8, 2, 4, 1),
    "llama2-34b": PaperLayout("llama2-34b", 4, 8, 2, 4, 1),
    "llama2-70b": PaperLayout("llama2-70b", 8, 8, 2, 8, 1),
}

DEFAULT_CLUSTER = Cluster()

# The paper's reported reductions of the actor's transition time by the 3D-HybridEngine.
PAPER_CLAIMS = {
    "average_reduction": 0.552,  # over all model sizes and baselines (11.7 s on average)
    "70b_vs_openrlhf": 0.891,  # 78.2 s
    "70b_vs_ds_chat_up_to": 0.712,
}


def model_transition(name: str, cluster: Cluster = DEFAULT_CLUSTER, dtype: str = "bfloat16") -> dict:
    lay = PAPER_LAYOUTS[name]
    plan = plan_transition(
        get_model_spec(name), ParallelLayout(lay.p, lay.t, lay.d), lay.t_g, lay.p_g, dtype=dtype
    )
    strategies = {
        s: {
            "bytes_max": plan.strategies[s].comm_bytes_max,
            "seconds": strategy_seconds(plan, s, cluster),
            "peak_param_bytes": plan.strategies[s].peak_param_bytes,
            "redundant_bytes": plan.strategies[s].redundant_bytes,
        }
        for s in STRATEGIES
    }
    layout = {
        "gpus": lay.gpus,
        "p": lay.p,
        "t": lay.t,
        "d": lay.d,
        "t_g": lay.t_g,
        "p_g": lay.p_g,
        "d_g": plan.gen.d_g,
        "model_bytes": plan.model_bytes,
    }
    return {"layout": layout, "strategies": strategies}


def run_modeled(models: list[str], cluster: Cluster = DEFAULT_CLUSTER) -> dict:
    unknown = [m for m in models if m not in PAPER_LAYOUTS]
    if unknown:
        raise ValueError(f"no paper layout for {unknown[0]!r}; modelled models: {', '.join(PAPER_LAYOUTS)}")
    out = {"models": {m: model_transition(m, cluster) for m in models}}
    out["reductions"] = reductions(out["models"])
    out["paper"] = PAPER_CLAIMS
    out["cluster"] = vars(cluster)
    return out


def reductions(models: dict) -> dict:
    """1 - hybridflow / baseline for each model and baseline, plus the average over all."""
    per = {}
    for name, m in models.items():
        hf = m["strategies"]["hybridflow"]["seconds"]
        per[name] = {
            base: 1 - hf / m["strategies"][base]["seconds"]
            for base in ("hybridflow_v", "ds_chat", "openrlhf")
            if m["strategies"][base]["seconds"] > 0
        }
    values = [v for d in per.values() for k, v in d.items() if k in ("ds_chat", "openrlhf")]
    return {
        "per_model": per,
        "average_vs_ds_chat_and_openrlhf": sum(values) / len(values) if values else None,
    }
