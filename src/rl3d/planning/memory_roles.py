"""Which megatron model each role runs and how it trains: what the memory plan reads of a
recipe for one role. Recipe roles (`roles.<name>`) hold what their worker builds, unknown to
the plan: they are listed as not planned."""

from __future__ import annotations

from dataclasses import dataclass

from rl3d.config.schema import RL3DConfig
from rl3d.models.spec import ModelSpec
from rl3d.parallel.layout import ParallelLayout
from rl3d.planning.memory_activations import MicroBatchShape, activation_bytes, pipeline_buffer_bytes
from rl3d.planning.memory_train import RoleBytes, layout_static_bytes, stage_numels
from rl3d.utils.dtypes import DTYPE_BYTES

OFFLOADABLE = ("params", "grads", "optimizer")  # `<role>.offload`; "optimizer" takes the master copy too


@dataclass(frozen=True)
class RoleModel:
    """A role's model on its pool: the megatron role it builds and how it runs micro-batches."""

    name: str
    model_role: str  # "actor" (language-model head) or "critic" (value head)
    trainable: bool
    micro_batch_size: int
    mini_batch_size: int
    packing: bool
    max_tokens: int | None
    distributed_optimizer: bool
    offload: tuple[str, ...]
    key: str  # the recipe section that sets it (refusals name it)


def _offload(section) -> tuple[str, ...]:
    return tuple(getattr(section, "offload", None) or ())


def role_model(cfg: RL3DConfig, name: str) -> RoleModel | None:
    """The plan's view of role `name`, or None for a role whose memory it does not know."""
    actor = cfg.actor
    if name == "actor":
        return RoleModel(
            name, "actor", True, actor.micro_batch_size, actor.mini_batch_size, actor.packing,
            actor.max_tokens_per_micro_batch, actor.optim.distributed_optimizer, _offload(actor), "actor",
        )  # fmt: skip
    if name in ("critic", "cost_critic"):
        c = cfg.critic
        return RoleModel(
            name, "critic", True, c.micro_batch_size, c.mini_batch_size, c.packing,
            c.max_tokens_per_micro_batch, c.optim.distributed_optimizer, _offload(c), "critic",
        )  # fmt: skip
    if name == "reference":
        ref = cfg.reference.batching_of(actor)  # the actor's micro-batches
        return RoleModel(
            name, "actor", False, actor.micro_batch_size, actor.mini_batch_size, ref.packing,
            ref.max_tokens_per_micro_batch, False, _offload(ref), "reference",
        )  # fmt: skip
    if name in ("reward_model", "cost_model"):
        key = "model" if name == "reward_model" else "cost_model"
        rm = getattr(cfg.reward, key)
        return RoleModel(
            name, "critic", False, rm.micro_batch_size, rm.micro_batch_size, rm.packing,
            rm.max_tokens_per_micro_batch, False, (), f"reward.{key}",
        )  # fmt: skip
    return None


def fused_attention(cfg: RL3DConfig, key: str, *, transformer_engine: bool = True) -> bool:
    """Whether a packing role (section `key`) runs Transformer Engine's fused attention: the
    builder's decision (`rl3d.models.builder.use_transformer_engine`) for a plan's device (CUDA
    unless `launch.device` is cpu) and `transformer_engine`, whether the run has TE. Packing on
    CUDA without it raises `NeedsTransformerEngine` naming `<key>.packing`, as the build would."""
    import torch

    from rl3d.models.builder import use_transformer_engine

    device = torch.device("cpu" if cfg.launch.device == "cpu" else "cuda")
    return use_transformer_engine(
        device, packed=True, key=f"{key}.packing", transformer_engine=transformer_engine
    )


def micro_batch_shape(
    cfg: RL3DConfig,
    role: RoleModel,
    layout: ParallelLayout,
    pp_rank: int,
    *,
    is_moe: bool = False,
    transformer_engine: bool = True,
) -> MicroBatchShape:
    """The largest micro-batch the role runs: rows padded to the longest prompt plus the
    longest response; packed, one row of micro_batch_size sequences (or the token budget), in
    the attention `fused_attention` says (TE's on CUDA, megatron's local on CPU). Under
    sequence parallelism (the role section's `parallel.sequence_parallel`, resolved for a model
    that `is_moe` or not) the length is padded to a multiple of tp."""
    from rl3d.models.sequence_parallel import padded_length, resolve_sequence_parallel

    section = getattr(cfg, role.key, None) if "." not in role.key else None
    setting = getattr(getattr(section, "parallel", None), "sequence_parallel", "auto")
    split = resolve_sequence_parallel(setting, is_moe=is_moe, tp=layout.t)
    multiple = layout.t if split else 1
    length = padded_length(cfg.data.max_prompt_length + cfg.rollout.max_new_tokens, multiple)
    per_step = max(1, role.mini_batch_size // (layout.d * role.micro_batch_size))
    in_flight = min(layout.p - pp_rank, per_step) if role.trainable else 1
    response = cfg.rollout.max_new_tokens
    if role.packing:
        tokens = padded_length(role.max_tokens or role.micro_batch_size * length, multiple)
        flash = fused_attention(cfg, role.key, transformer_engine=transformer_engine)
        return MicroBatchShape(tokens, 1, tokens, flash, role_recompute(cfg, role), in_flight, split)
    rows = role.micro_batch_size
    return MicroBatchShape(length, rows, response, False, role_recompute(cfg, role), in_flight, split)


def role_recompute(cfg: RL3DConfig, role: RoleModel) -> bool:
    section = cfg.critic if role.model_role == "critic" and role.trainable else cfg.actor
    return getattr(section, "recompute", "none") == "full"


def role_train_bytes(
    cfg: RL3DConfig,
    spec: ModelSpec,
    role: RoleModel,
    layout: ParallelLayout,
    rank: int,
    *,
    transformer_engine: bool = True,
) -> RoleBytes:
    """The role's bytes on pool rank `rank` while it runs its heaviest micro-batch
    (`transformer_engine`: whether the run has it, `micro_batch_shape`)."""
    coords = layout.coords(rank)
    dtype_bytes = DTYPE_BYTES[cfg.model.dtype]
    lora = cfg.actor.lora if role.name == "actor" else None
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
    shape = micro_batch_shape(
        cfg, role, layout, coords.pp, is_moe=spec.is_moe, transformer_engine=transformer_engine
    )
    activations = activation_bytes(
        spec,
        tp=layout.t,
        layers=spec.num_layers // layout.p,
        last_stage=coords.pp == layout.p - 1,
        lm_head=role.model_role == "actor",
        shape=shape,
        dtype_bytes=dtype_bytes,
        trains=role.trainable,
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
