"""Which megatron model each role runs and how it trains: what the memory plan reads of a
recipe for one role. Which techniques a role has, and what each does to its footprint, the plan
asks of the role's features (`rl3d.engine.features`), built from the section the role's worker
builds its engine from. Recipe roles (`roles.<name>`) hold what their worker builds, unknown to
the plan: they are listed as not planned."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rl3d.config.lora import LoraConfig
from rl3d.config.schema import RL3DConfig
from rl3d.costs.micro_batch import MicroBatchShape
from rl3d.engine.features import Features, FeatureSource, Footprint
from rl3d.engine.techniques import features_from
from rl3d.models.spec import ModelSpec
from rl3d.parallel.layout import ParallelLayout
from rl3d.planning.memory_activations import activation_bytes, pipeline_buffer_bytes
from rl3d.planning.memory_train import RoleBytes, layout_static_bytes, stage_numels
from rl3d.utils.dtypes import DTYPE_BYTES

OFFLOADABLE = ("params", "grads", "optimizer")  # `<role>.offload`; "optimizer" takes the master copy too


@dataclass(frozen=True)
class RoleModel:
    """A role's model on its pool: the megatron role it builds, how it runs micro-batches, and
    what its engine's features are built from (`key`, `section`, `lora`, `routing_replay`: what
    its worker gives `rl3d.engine.MegatronEngine.from_config`)."""

    name: str
    model_role: str  # "actor" (language-model head) or "critic" (value head)
    trainable: bool
    micro_batch_size: int
    mini_batch_size: int
    distributed_optimizer: bool
    key: str  # the recipe section that sets it (refusals and the features' errors name it)
    section: Any  # that section as its worker gives the engine (`batching`)
    lora: LoraConfig | None = None
    routing_replay: bool = False

    def source(self, spec: ModelSpec, tp: int) -> FeatureSource:
        """What the role's engine builds its features from on a rank of TP size `tp`."""
        return FeatureSource(
            self.key, self.section, spec, tp, lora=self.lora, routing_replay=self.routing_replay
        )

    def features(self, spec: ModelSpec, tp: int) -> Features:
        """The features the role's engine has on a rank of TP size `tp` (`features_from`)."""
        return features_from(self.source(spec, tp))


def role_model(cfg: RL3DConfig, name: str) -> RoleModel | None:
    """The plan's view of role `name`, or None for a role whose memory it does not know."""
    actor = cfg.actor
    if name == "actor":
        return RoleModel(
            name, "actor", True, actor.micro_batch_size, actor.mini_batch_size,
            actor.optim.distributed_optimizer, key="actor", section=actor,
            lora=actor.lora, routing_replay=cfg.algorithm.routing_replay != "none",
        )  # fmt: skip
    if name in ("critic", "cost_critic"):
        c = cfg.critic
        return RoleModel(
            name, "critic", True, c.micro_batch_size, c.mini_batch_size, c.optim.distributed_optimizer,
            key="critic", section=c,
        )  # fmt: skip
    if name == "reference":
        ref = cfg.reference.batching_of(actor)  # the actor's forward-only micro-batches
        micro = actor.log_prob_micro_batch_size or actor.micro_batch_size
        return RoleModel(
            name, "actor", False, micro, actor.mini_batch_size, False,
            key="reference", section=ref,
        )  # fmt: skip
    if name in ("reward_model", "cost_model"):
        key = "model" if name == "reward_model" else "cost_model"
        rm = getattr(cfg.reward, key)
        return RoleModel(
            name, "critic", False, rm.micro_batch_size, rm.micro_batch_size, False,
            key=f"reward.{key}", section=rm,
        )  # fmt: skip
    return None


def role_footprint(
    cfg: RL3DConfig,
    spec: ModelSpec,
    role: RoleModel,
    layout: ParallelLayout,
    pp_rank: int,
    *,
    transformer_engine: bool = True,
) -> Footprint:
    """The role's footprint on a rank of `layout`'s stage `pp_rank`, asked of its features: the
    plain role runs rows of micro_batch_size sequences, each the longest prompt plus the longest
    response, and keeps everything on the device; its features change that (packing: one row of
    sequences or of the token budget, in the attention the builder picks for the plan's device,
    CUDA unless `launch.device` is cpu, and `transformer_engine`, whether the run has it;
    sequence parallelism: the length padded to a multiple of tp; recompute; offload; LoRA's
    adapters)."""
    per_step = max(1, role.mini_batch_size // (layout.d * role.micro_batch_size))
    in_flight = min(layout.p - pp_rank, per_step) if role.trainable else 1
    response = cfg.rollout.max_new_tokens
    batch = MicroBatchShape(
        cfg.data.max_prompt_length + response, role.micro_batch_size, response, False, in_flight=in_flight
    )
    cuda = cfg.launch.device != "cpu"
    plain = Footprint(batch, tp=layout.t, cuda=cuda, transformer_engine=transformer_engine)
    return role.features(spec, layout.t).footprint(plain)


def role_train_bytes(
    cfg: RL3DConfig,
    spec: ModelSpec,
    role: RoleModel,
    layout: ParallelLayout,
    rank: int,
    footprint: Footprint | None = None,
) -> RoleBytes:
    """The role's bytes on pool rank `rank` while it runs its heaviest micro-batch (`footprint`:
    the role's on that rank, `role_footprint`'s where None)."""
    coords = layout.coords(rank)
    if footprint is None:
        footprint = role_footprint(cfg, spec, role, layout, coords.pp)
    dtype_bytes = DTYPE_BYTES[cfg.model.dtype]
    lora = footprint.adapters
    if lora is not None:
        from rl3d.planning.memory_adapters import adapter_numels, lm_head_numels, lora_static_bytes

        where = {"tp": layout.t, "pp": layout.p, "pp_rank": coords.pp}
        numels = stage_numels(spec, role.model_role, **where, ep=layout.ep, etp=layout.etp)
        adapters = adapter_numels(spec, lora.targets, lora.rank, tp=layout.t, pp=layout.p)
        if lora.lm_head and coords.pp == layout.p - 1:
            adapters += lm_head_numels(spec, lora.rank, tp=layout.t)
        static = lora_static_bytes(
            numels,
            adapters,
            dtype_bytes=dtype_bytes,
            dp=layout.d,
            distributed_optimizer=role.distributed_optimizer,
        )
    else:
        static = layout_static_bytes(
            spec,
            role.model_role,
            tp=layout.t,
            pp=layout.p,
            pp_rank=coords.pp,
            dp=layout.d,
            ep=layout.ep,
            etp=layout.etp,
            dtype_bytes=dtype_bytes,
            trainable=role.trainable,
            distributed_optimizer=role.distributed_optimizer,
        )
    shape = footprint.batch
    activations = activation_bytes(
        spec,
        role=role.name,
        tp=layout.t,
        layers=spec.num_layers // layout.p,
        first_layer=coords.pp * (spec.num_layers // layout.p),
        last_stage=coords.pp == layout.p - 1,
        lm_head=role.model_role == "actor",
        shape=shape,
        dtype_bytes=dtype_bytes,
        trains=role.trainable,
        etp=layout.etp,
    )
    p2p = pipeline_buffer_bytes(spec, layout.t, layout.p, shape, dtype_bytes)
    return RoleBytes(
        params=static.params,
        grads=static.grads,
        master=static.master,
        optimizer=static.optimizer,
        activations=activations,
        buffers=p2p,
    )


def resident_in_generation(bytes_: RoleBytes, offload: tuple[str, ...]) -> RoleBytes:
    """What a role keeps on the device while the engine generates: its static bytes less the
    offloaded ones; no activations."""
    return RoleBytes(
        params=0 if "params" in offload else bytes_.params,
        grads=0 if "grads" in offload else bytes_.grads,
        master=0 if "optimizer" in offload else bytes_.master,
        optimizer=0 if "optimizer" in offload else bytes_.optimizer,
    )
