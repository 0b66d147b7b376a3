"""The generation side of the colocated actor: the rollout engine on the actor's ranks, the
3D-HybridEngine transition that loads the actor's weights into it, and the offload of the
training state while it generates. `ActorRolloutWorker` trains; `ColocatedRollout` publishes and
generates (`rl3d.controller.placement.Colocated` drives it through the worker's dispatch methods).

How weights reach the engine is chosen once, as an object: the whole model every publish
(`FullTransition`), or, with LoRA and an engine that keeps the base (`actor.lora.transition`),
the base once and the adapters every publish (`AdapterTransition`).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from rl3d.config import RL3DConfig
from rl3d.config.lora import adapter_transition
from rl3d.engine import MegatronEngine
from rl3d.single_controller.batch import DataBatch
from rl3d.workers.context import RoleContext
from rl3d.workers.generation import Generation

logger = logging.getLogger(__name__)


class FullTransition:
    """Every publish reshards the whole model from the training layout to the generation
    layout and loads it; an engine that holds its own copy (SGLang) gets it pushed at once, the
    plan's last step (`Resharder.push`, counted in `reshard/engine_*`), and the resharded buffer
    is freed."""

    lora_mode = lora = None  # the engine takes no adapters

    def __init__(self, resharder: Any):
        self.resharder = resharder
        self.weights = None  # the generation buffer while the engine generates on it

    def publish(self, actor: MegatronEngine, engine: Any) -> dict[str, float]:
        self.weights = self.resharder.to_generation(actor.transition_shards())
        self.resharder.push(engine, self.weights)
        metrics = self.resharder.last_stats.metrics()
        # an engine in another dtype than training (`rollout.dtype`) holds a cast copy
        metrics["reshard/peak_bytes"] += getattr(engine, "weight_copy_bytes", 0)
        if getattr(engine, "holds_weights", False):
            self.weights.release()
            self.weights = None
        return metrics

    def release(self) -> None:
        if self.weights is not None:
            self.weights.release()


class AdapterTransition:
    """LoRA, the engine keeping the base: the frozen base is resharded once, at the first
    publish, and kept: the torch engine reads its buffer (not released between steps); SGLang
    gets it pushed (the plan's last step) and keeps its own copy, resumed every step. Every
    publish moves only the adapters, and `reshard/*` count them."""

    def __init__(self, resharder: Any, adapter_resharder: Any, lora: Any):
        self.resharder, self.adapter_resharder, self.lora = resharder, adapter_resharder, lora
        self.lora_mode = lora.engine_mode  # how the torch engine uses the adapters it is given
        self.weights = None  # the base's generation buffer, kept from the first publish on
        self.pushed = False  # an engine that holds its own copy has the base

    def publish(self, actor: MegatronEngine, engine: Any) -> dict[str, float]:
        if self.weights is None and not self.pushed:
            self.weights = self.resharder.to_generation(actor.transition_shards(merged=False))
            base = self.resharder.last_stats
            logger.info("LoRA: the base moved once to the engine: %d bytes received", base.recv_bytes)
            if getattr(engine, "holds_weights", False):
                self.resharder.push(engine, self.weights)
                self.weights.release()
                self.weights, self.pushed = None, True
        if self.pushed:
            engine.resume_weights()  # the base as it was pushed
        else:
            engine.load_weights(self.weights)  # in place: no copy unless rollout.dtype differs
        adapters = self.adapter_resharder.to_generation(actor.adapter_shards())
        engine.load_lora(adapters, self.lora)  # apply mode may read them in place
        metrics = self.adapter_resharder.last_stats.metrics()
        # the engine's own copies: a cast base (rollout.dtype), the merged weights (merge mode)
        metrics["reshard/peak_bytes"] += engine.weight_copy_bytes + engine.lora_copy_bytes
        return metrics

    def release(self) -> None:
        pass  # the base stays for the next publish


def build_transition(cfg: RL3DConfig, spec: Any, hybrid_groups: Any, device: torch.device):
    """The transition of `cfg`'s colocated actor over `hybrid_groups`."""
    from rl3d.hybrid_engine.executor import Resharder
    from rl3d.rollout import push_bucket_mb
    from rl3d.utils.dtypes import torch_dtype

    he = cfg.hybrid_engine
    resharder = Resharder(
        spec,
        hybrid_groups,
        strategy=he.strategy,
        bucket_mb=he.bucket_mb,
        verify=he.verify,
        dtype=torch_dtype(cfg.model.dtype),
        device=device,
        kernel_backend=he.kernel_backend,
        push_bucket_mb=push_bucket_mb(cfg.rollout),
    )
    if not adapter_transition(cfg):
        return FullTransition(resharder)
    from rl3d.hybrid_engine.lora_plan import lora_params

    lora = cfg.actor.lora
    adapters = Resharder(
        spec,
        hybrid_groups,
        params=lora_params(spec, lora.rank, lora.targets),
        dtype=torch.float32,  # the adapters train in fp32 whatever the model's dtype
        device=device,
        verify=he.verify,
    )
    return AdapterTransition(resharder, adapters, lora)


class ColocatedRollout:
    """The rollout engine on the actor's ranks, in the generation layout of `rollout.t_g` and
    `rollout.p_g`, loaded from `actor` (the actor's engine) at each `publish`."""

    def __init__(self, ctx: RoleContext, actor: MegatronEngine):
        from rl3d.parallel import GenerationLayout
        from rl3d.parallel.groups import build_hybrid_groups

        cfg, groups = ctx.cfg, ctx.groups
        self.cfg, self.spec, self.groups, self.actor = cfg, ctx.spec, groups, actor
        self.gen = GenerationLayout.from_training(groups.layout, cfg.rollout.t_g, cfg.rollout.p_g)
        # SGLang's control messages wait through its launch and each generate: a gloo twin of
        # the generation-TP group with the world's timeout
        control = cfg.launch.timeout_s if cfg.rollout.engine == "sglang" and self.gen.t_g > 1 else None
        timeout = cfg.hybrid_engine.timeout_s
        self.hybrid_groups = build_hybrid_groups(self.gen, timeout_s=timeout, control_timeout_s=control)
        self.transition = build_transition(cfg, ctx.spec, self.hybrid_groups, groups.device)
        self.pad_token_id, self.tokenizer = ctx.pad_token_id, ctx.tokenizer
        self.engine, self.generation = None, None  # launched by start
        self.offloading: list[MegatronEngine] = [actor]
        self.generating = False  # the engine's KV cache is resumed and the roles are offloaded

    @property
    def resharder(self) -> Any:
        """The transition's resharder of the model (its plan and last stats)."""
        return self.transition.resharder

    @property
    def weights(self) -> Any:
        """The generation buffer the engine generates on (None once an engine holds its own)."""
        return self.transition.weights

    def start(self, colocated: list[MegatronEngine]) -> None:
        """Launch the rollout engine once every role on this rank exists (`colocated`: the other
        roles' engines), so that SGLang sizes its memory against what training really holds;
        those roles' offload kinds leave the device while it generates."""
        from rl3d.rollout import build_rollout_engine

        cfg = self.cfg
        self.offloading = [self.actor, *(r for r in colocated if r is not self.actor)]  # LoRA's reference
        self.engine = build_rollout_engine(
            cfg.rollout,
            spec=self.spec,
            group=self.hybrid_groups.gen_tp if self.gen.t_g > 1 else None,
            control_group=self.hybrid_groups.gen_tp_control,
            pad_token_id=self.pad_token_id,
            model_path=cfg.model.hf_path,
            device=self.groups.device,
            dtype=cfg.model.dtype,
            seed=cfg.trainer.seed,
            lora_mode=self.transition.lora_mode,
            lora=self.transition.lora,
            record_routing=cfg.algorithm.routing_replay == "rollout",
            push_plan=self.resharder.push_plan,
        )
        # single- or multi-turn (rollout.agent), as a separate rollout pool generates
        self.generation = Generation(cfg, self.engine, self.tokenizer, pad_token_id=self.pad_token_id)

    def publish(self) -> dict[str, float]:
        """Training layout -> generation layout, loaded into the engine; the transition's metrics."""
        if self.engine is None:
            self.start([])
        self.release()  # the previous policy's KV cache and buffer, if still held
        return self.transition.publish(self.actor, self.engine)

    def generate(self, prompts: DataBatch, *, step: int, greedy: bool = False) -> DataBatch | None:
        """This generation-DP rank's rows of `prompts` (None off generation-TP rank 0)."""
        self._enter()
        dp_g = self.gen.coords(self.groups.rank).dp_g
        out = self.generation.generate(prompts, step=step, gen_dp_rank=dp_g, greedy=greedy)
        return None if out is None else out.batch

    def _enter(self) -> None:
        """Before the first generation on these weights: the roles' offload kinds go to host
        memory, then the engine resumes its KV cache (after every rank of its group has emptied
        its allocator cache)."""
        if self.generating:
            return
        freed = sum(role.to_host() for role in self.offloading)
        if freed:
            logger.info("offloaded %.1f MiB of training state for generation", freed / 2**20)
        self.engine.resume_memory()
        self.generating = True

    def release(self) -> None:
        """After rollout: drop the generation buffer and the engine's memory. Nothing is copied
        back: the training weights are the source of truth; offloaded tensors come back when a
        role next uses them."""
        self.transition.release()
        if self.engine is not None:
            self.engine.release_memory()
        self.generating = False

    def pause(self) -> None:
        """Free the KV cache but keep the engine's weights (a checkpoint needs the roles'
        tensors back on the device); the next generation offloads them and resumes the cache."""
        if self.generating:
            self.engine.pause()
            self.generating = False
