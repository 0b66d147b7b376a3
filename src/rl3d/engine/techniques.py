"""The model techniques a megatron role can have, one feature each (`rl3d.engine.features`), and
`TECHNIQUES`, the table the engine applies them from, in its order: each is built from the role's
recipe section (`FeatureSource`) and is absent where the section leaves it off.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Any

from rl3d.config.lora import LoraConfig
from rl3d.engine.features import Feature, Features, FeatureSource, Footprint
from rl3d.single_controller.batch import ROUTING, DataBatch


class SequenceParallel(Feature):
    """`<role>.parallel.sequence_parallel`: the hidden states between TP blocks split along the
    sequence (`rl3d.models.sequence_parallel`); every forward's length is then a multiple of the
    TP size."""

    name = "sequence_parallel"

    @classmethod
    def from_source(cls, source: FeatureSource) -> SequenceParallel | None:
        from rl3d.models.sequence_parallel import resolve_sequence_parallel

        setting = getattr(source.setting("parallel", None), "sequence_parallel", "auto")
        return cls() if resolve_sequence_parallel(setting, is_moe=source.spec.is_moe, tp=source.tp) else None

    def model_options(self, engine: Any) -> dict[str, Any]:
        return {"sequence_parallel": True}

    def footprint(self, plain: Footprint) -> Footprint:
        """The hidden states between the blocks split over TP, the length padded to a multiple."""
        from rl3d.models.sequence_parallel import padded_length

        batch = plain.batch
        split = replace(batch, seq_len=padded_length(batch.seq_len, plain.tp), sequence_parallel=True)
        return replace(plain, batch=split)


class Packing(Feature):
    """`<role>.packing`: each micro-batch's sequences run as one row without pads
    (`rl3d.models.packing`); `max_tokens` (`<role>.max_tokens_per_micro_batch`) then forms
    micro-batches by a token budget instead of a number of sequences."""

    name = "packing"

    def __init__(self, max_tokens: int | None = None, *, key: str = "packing"):
        self.max_tokens, self.key = max_tokens, key  # key: the setting errors name
        self.te = False  # Transformer Engine's attention takes the packed row (else per-sequence rope)

    @classmethod
    def from_source(cls, source: FeatureSource) -> Packing | None:
        budget, section = source.setting("max_tokens_per_micro_batch", None), source.key
        if not source.setting("packing", False):
            if budget is not None:
                raise ValueError(f"{section}.max_tokens_per_micro_batch needs {section}.packing: true")
            return None
        return cls(budget, key=f"{section}.packing")

    def model_options(self, engine: Any) -> dict[str, Any]:
        """Before the model is built: packing on CUDA takes Transformer Engine's attention, or is
        refused naming the setting (`rl3d.models.builder.use_transformer_engine`)."""
        from rl3d.models.builder import use_transformer_engine

        self.te = use_transformer_engine(engine.groups.device, packed=True, key=self.key)
        # packed micro-batches differ in length: PP stages then exchange shapes before tensors
        return {"packed": True} | ({"variable_seq_lengths": True} if engine.groups.layout.p > 1 else {})

    def footprint(self, plain: Footprint) -> Footprint:
        """One row of the micro-batch's sequences (each already padded to sequence parallelism's
        multiple), or of the token budget padded to it; the loss reads the whole row. Its
        attention is the builder's decision, as in `model_options` (refused the same way)."""
        import torch

        from rl3d.models.builder import use_transformer_engine
        from rl3d.models.sequence_parallel import padded_length

        device = torch.device("cuda" if plain.cuda else "cpu")
        te = plain.transformer_engine
        fused = use_transformer_engine(device, packed=True, key=self.key, transformer_engine=te)
        batch = plain.batch
        multiple = plain.tp if batch.sequence_parallel else 1
        tokens = padded_length(self.max_tokens or batch.rows * batch.seq_len, multiple)
        row = replace(batch, seq_len=tokens, rows=1, response_len=tokens, flash=fused)
        return replace(plain, batch=row)


class Recompute(Feature):
    """`<role>.recompute: full`: every layer its own checkpoint, one layer's activations held at a
    time (the trained roles' sections)."""

    name = "recompute"

    @classmethod
    def from_source(cls, source: FeatureSource) -> Recompute | None:
        return cls() if source.setting("recompute", "none") == "full" else None

    def model_options(self, engine: Any) -> dict[str, Any]:
        return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}

    def footprint(self, plain: Footprint) -> Footprint:
        return replace(plain, batch=replace(plain.batch, recompute=True))


class RoutingReplay(Feature):
    """`algorithm.routing_replay`: a mixture of experts' forwards replay a batch's routing record,
    or record their own (`rl3d.models.routing_replay`); `replay.result` holds the last record or
    the replay's mismatch counts."""

    name = "routing_replay"

    def __init__(self) -> None:
        self.replay = None

    @classmethod
    def from_source(cls, source: FeatureSource) -> RoutingReplay | None:
        return cls() if source.routing_replay else None

    def attach(self, engine: Any) -> None:
        from rl3d.models.routing_replay import RoutingReplay as Replay

        self.replay = Replay(engine.model, engine.spec, engine.groups)

    def session(self, batch: DataBatch, *, record: bool = False) -> contextlib.AbstractContextManager:
        return self.replay.session(batch, record=record)

    def around_forward(self, micro: DataBatch, *, lead: int, trail: int) -> contextlib.AbstractContextManager:
        return self.replay.forward(micro)

    def after_update(self, batch: DataBatch) -> dict[str, float]:
        if ROUTING not in batch:
            return {}
        return {"moe/routing_mismatch_update": self.replay.mismatch(self.replay.result)}  # collective over DP


class Lora(Feature):
    """`actor.lora`: the base frozen, low-rank adapters trained instead (`rl3d.models.lora`),
    loaded from a PEFT directory when `init` names one; attached before DDP, so that only the
    adapters get gradient buffers and optimizer states."""

    name = "lora"

    def __init__(self, config: LoraConfig):
        self.config = config
        self.adapters = None

    @classmethod
    def from_source(cls, source: FeatureSource) -> Lora | None:
        return None if source.lora is None else cls(source.lora)

    def attach(self, engine: Any) -> None:
        from rl3d.models.lora import attach_lora

        lora = self.config
        self.adapters = attach_lora(
            engine.model,
            engine.spec,
            engine.groups,
            rank=lora.rank,
            alpha=lora.alpha,
            targets=lora.targets,
            dropout=lora.dropout,
            use_rslora=lora.use_rslora,
            lm_head=lora.lm_head,
            seed=engine.seed,
        )
        if lora.init is not None:
            from rl3d.models.lora_peft import load_peft_adapter

            self.adapters.load_state_dict(load_peft_adapter(lora.init, lora), source=lora.init)

    def footprint(self, plain: Footprint) -> Footprint:
        return replace(plain, adapters=self.config)


class MoE(Feature):
    """A mixture of experts: the router losses of `<role>.moe` (trained roles only: they train the
    router) and the expert-load metrics of each update (`rl3d.models.moe_metrics`)."""

    name = "moe"

    def __init__(self, overrides: dict[str, float] | None = None):
        self.overrides = overrides or {}
        self.load, self.groups = None, None

    @classmethod
    def from_source(cls, source: FeatureSource) -> MoE | None:
        if not source.spec.is_moe:
            return None
        moe = source.setting("moe", None)
        return cls(moe.transformer_overrides() if moe else None)

    def model_options(self, engine: Any) -> dict[str, Any]:
        return dict(self.overrides) if engine.trainable else {}

    def attach(self, engine: Any) -> None:
        if engine.trainable:
            from rl3d.models.moe_metrics import ExpertLoad

            self.load = ExpertLoad(engine.model, engine.spec, engine.groups)
            self.groups = engine.groups

    def around_forward(self, micro: DataBatch, *, lead: int, trail: int) -> contextlib.AbstractContextManager:
        """Sequence parallelism's pad tokens kept out of the expert-load counts."""
        return contextlib.nullcontext() if self.load is None else self.load.excluding(lead, trail)

    def before_update(self) -> None:
        if self.load is not None:
            self.load.reset()

    def after_update(self, batch: DataBatch) -> dict[str, float]:
        return {} if self.load is None else self.load.collect(self.groups)  # collective


class Offload(Feature):
    """`<role>.offload`: the kinds (params, grads, optimizer) that go to host memory while the
    rollout engine generates (`rl3d.models.offload`)."""

    name = "offload"

    def __init__(self, kinds: tuple[str, ...]):
        self.kinds = tuple(kinds)
        self.storage = None

    @classmethod
    def from_source(cls, source: FeatureSource) -> Offload | None:
        kinds = tuple(source.setting("offload", ()))
        return cls(kinds) if kinds else None

    def ready(self, engine: Any) -> None:
        from rl3d.models.offload import Offload as Storage

        self.storage = Storage(engine.ddp, engine.optimizer, kinds=self.kinds, device=engine.groups.device)

    def footprint(self, plain: Footprint) -> Footprint:
        return replace(plain, offload=self.kinds)


class Fusions(Feature):
    """`<role>.megatron`: megatron-core's fused paths (rope, gradient accumulation, overlapped
    gradient reduction), each on where the run can take it unless the section says otherwise
    (`rl3d.models.fusions`). Roles without the section (the reference, a reward model) take the
    defaults; a forward-only engine takes the rope fusion alone."""

    name = "fusions"

    def __init__(self, settings: Any = None, *, frozen_weights: bool = False, key: str = "actor"):
        self.settings, self.frozen_weights, self.key = settings, frozen_weights, key
        self.on: dict[str, bool] = {}  # each fusion on or off, once the engine's device is known

    @classmethod
    def from_source(cls, source: FeatureSource) -> Fusions:
        # a section without one (the reference, a reward model) takes the defaults, so that the
        # reference's rope is computed as the actor's
        settings = source.setting("megatron", None)
        return cls(settings, frozen_weights=source.lora is not None, key=source.key)

    def model_options(self, engine: Any) -> dict[str, Any]:
        from rl3d.models.fusions import DDP_FUSIONS, resolve_fusions

        try:
            self.on = resolve_fusions(
                self.settings, device_type=engine.groups.device.type, frozen_weights=self.frozen_weights
            )
        except ValueError as err:
            raise ValueError(f"{self.key}.{err}") from None
        if not engine.trainable:  # no backward: nothing to accumulate or reduce
            self.on = {name: on and name == "apply_rope_fusion" for name, on in self.on.items()}
        return {name: on for name, on in self.on.items() if name not in DDP_FUSIONS}

    def ddp_options(self, engine: Any) -> dict[str, Any]:
        from rl3d.models.fusions import DDP_FUSIONS

        return {name: self.on[name] for name in DDP_FUSIONS}


# The order the engine applies them in: sequence parallelism's multiple is known before packing
# pads each sequence to it (`Footprint`s follow the same order); replay's routers are set before
# the expert-load hooks count what they route.
TECHNIQUES: tuple[type[Feature], ...] = (
    SequenceParallel,
    Packing,
    Recompute,
    RoutingReplay,
    Lora,
    MoE,
    Offload,
    Fusions,
)


def features_from(source: FeatureSource) -> Features:
    """The techniques `source` turns on, in the table's order."""
    return Features(f for kind in TECHNIQUES if (f := kind.from_source(source)) is not None)
