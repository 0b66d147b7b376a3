"""The engine: one megatron-core model of a role (actor, critic, reference, reward model) on this
rank, with what the workers need from it: batched forward over micro-batches (`run_forward`),
PPO-style training over mini/micro-batches and epochs (`train_minibatches`), the training shards
under their global names (what a transition moves), host/device residency (`to_host`,
`resident`), its dist checkpoint (`save`, `load`). Its model techniques are features
(`rl3d.engine.features`), built from the role's recipe section and applied in one table's order:
the engine never branches on one.

    engine = MegatronEngine.from_config(spec, groups, role="actor", model=cfg.model, seed=1,
                                        batching=cfg.actor, optim=cfg.actor.optim)

Sequences in a batch are `input_ids` = [left-padded prompt | right-padded response], with
`attention_mask` over both; `response_mask` [B, R] marks the response tokens. Token t's
log-prob comes from the logits at position t-1, so a response of R tokens reads positions
P-1 .. T-2 (P prompt columns, T = P + R).

With packing (`rl3d.engine.techniques.Packing`), each micro-batch's sequences run as one row
without pads and outputs come back in the same per-sample `[B, R]` layout.

With `batches.response_outputs` (on for the actor and the reference, which read log-probs of
response tokens only: `micro_batches.RESPONSE_ONLY_ROLES`) the output layer runs on positions
P-1 .. T-2 alone: the vocabulary projection, the log-softmax over it and their backward then cost
R/T of the whole sequence's. It rounds differently from the whole-sequence forward (within 1e-6,
not bit for bit); `benchmarks/real_model_step/profile_update.py ab` measures its gain.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rl3d.config import ModelConfig
from rl3d.config import OptimConfig as OptimSection
from rl3d.config.lora import LoraConfig
from rl3d.engine.features import Features, FeatureSource
from rl3d.engine.micro_batches import MicroBatches
from rl3d.engine.techniques import Lora, Offload, RoutingReplay, features_from
from rl3d.models.bootstrap import MegatronGroups
from rl3d.models.builder import rank_param_names
from rl3d.models.packing import PACKED
from rl3d.models.params import OUTPUT_LAYER, local_param, model_tensors
from rl3d.models.spec import ModelSpec
from rl3d.models.training import SkippedSteps, unwrap_model
from rl3d.single_controller.batch import DataBatch, mini_batch_rows
from rl3d.utils.dtypes import torch_dtype

logger = logging.getLogger(__name__)
# A metric row's weight in the step's mean (packed micro-batches differ in size, so their rows
# count by what the loss averages over: tokens or sequences); rows without it count once.
METRIC_WEIGHT = "_weight"
MAX_FP16_SKIPS = 40  # from 2^32, halving per overflow reaches a usable loss scale well within this


@dataclass(frozen=True)
class Training:
    """What makes an engine trainable: its optimizer section, and the run's steps (the schedule)."""

    optim: OptimSection
    total_steps: int = 1


@dataclass(frozen=True)
class InitialWeights:
    """Where an engine's weights start: an HF directory (`hf_path`), else a copy of another
    engine's network (`copy_of`: the critic takes the actor's, all but the head), else the
    seeded initialization."""

    hf_path: str | None = None
    copy_of: MegatronEngine | None = None


class MegatronEngine:
    """One megatron-core model of a role on this rank (see the module docstring); its model
    techniques are `features`, applied from `rl3d.engine.techniques.TECHNIQUES`."""

    def __init__(
        self,
        spec: ModelSpec,
        groups: MegatronGroups,
        *,
        role: str,
        params_dtype: torch.dtype,
        seed: int,
        training: Training | None = None,
        weights: InitialWeights | None = None,
        features: Features | None = None,
    ):
        from rl3d.models.builder import build_gpt

        weights, features = weights or InitialWeights(), features or Features()
        self.spec, self.groups, self.role, self.seed = spec, groups, role, seed
        self.params_dtype = params_dtype
        self.features = features
        self.trainable = training is not None
        options = features.model_options(self)
        self.model = build_gpt(spec, groups, role=role, params_dtype=params_dtype, seed=seed, **options)
        self.ddp = self.model  # wrapped below when trained
        if weights.hf_path:
            from rl3d.models.weights import load_weights

            load_weights(self.model, spec, groups, weights.hf_path, role=role)
        elif weights.copy_of is not None:
            self._copy_from(weights.copy_of)
        features.attach(self)
        # fp16's loss scaler skips its first steps by design; bf16/fp32 have no scaler
        self.skipped = SkippedSteps(max_in_a_row=MAX_FP16_SKIPS if params_dtype == torch.float16 else 1)
        self.optimizer, self.scheduler = None, None
        if training is not None:
            from rl3d.models.training import build_optimizer, build_scheduler, wrap_ddp

            optim = training.optim
            self.ddp = wrap_ddp(
                self.model,
                groups,
                use_distributed_optimizer=optim.distributed_optimizer,
                **features.ddp_options(self),
            )
            self.optimizer = build_optimizer(self.ddp, groups, optim)
            self.scheduler = build_scheduler(self.optimizer, optim, total_steps=training.total_steps)
        features.ready(self)
        self.batches = MicroBatches(self.model, groups, role=role, features=features)

    @property
    def packing(self) -> bool:
        return self.batches.packing is not None

    @property
    def lora(self):
        """The LoRA adapters (`rl3d.models.lora.LoraAdapters`), None without `actor.lora`."""
        lora = self.features.get(Lora)
        return None if lora is None else lora.adapters

    @property
    def replay(self):
        """The routing replay (`rl3d.models.routing_replay.RoutingReplay`), None without it."""
        feature = self.features.get(RoutingReplay)
        return None if feature is None else feature.replay

    @property
    def offload(self):
        """The offloaded storages (`rl3d.models.offload.Offload`), None without `<role>.offload`."""
        feature = self.features.get(Offload)
        return None if feature is None else feature.storage

    def to_host(self) -> int:
        """Move `offload`'s kinds to host memory (around generation); the bytes freed."""
        return 0 if self.offload is None else self.offload.to_host()

    def resident(self) -> None:
        """Bring offloaded tensors back; every use of the model's tensors calls it first."""
        if self.offload is not None:
            self.offload.to_device()

    # -- checkpoint ----------------------------------------------------------------------------
    def save(self, path: Path, *, iteration: int) -> None:
        """This engine's megatron dist checkpoint (weights, optimizer, scheduler) under `path`;
        collective over the engine's ranks. Offloaded tensors come back first."""
        from rl3d.models.dist_checkpoint import save_checkpoint

        self.resident()
        save_checkpoint(
            path,
            ddp=self.ddp,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            groups=self.groups,
            iteration=iteration,
        )

    def load(self, path: Path) -> None:
        """Load what `save` wrote (collective)."""
        from rl3d.models.dist_checkpoint import load_checkpoint

        self.resident()
        load_checkpoint(
            path, ddp=self.ddp, optimizer=self.optimizer, scheduler=self.scheduler, groups=self.groups
        )

    @classmethod
    def from_config(
        cls,
        spec: ModelSpec,
        groups: MegatronGroups,
        *,
        role: str,
        model: ModelConfig,
        seed: int,
        batching: Any = None,
        optim: OptimSection | None = None,
        total_steps: int = 1,
        hf_path: str | None = None,
        init_from: MegatronEngine | None = None,
        lora: LoraConfig | None = None,
        routing_replay: bool = False,
        key: str | None = None,
    ) -> MegatronEngine:
        """An engine built from its recipe sections, the one way every worker and job builds one.

        `model` gives the parameter dtype; `batching` is the role's section (an actor, critic,
        reference or reward-model section; None: padded micro-batches) whose settings turn the
        techniques on (`rl3d.engine.techniques`); `optim` (with `total_steps` for its schedule)
        makes the role trainable, None keeps it forward-only.
        `hf_path` and `init_from` say where the weights start (`InitialWeights`); `lora` (the
        actor's `actor.lora`) freezes them and trains adapters instead; `routing_replay` makes a
        mixture of experts' forwards replay a batch's routing record. Errors name the section's
        settings under `key` (`reward.model`; default: `role`)."""
        source = FeatureSource(
            key or role, batching, spec, groups.layout.t, lora=lora, routing_replay=routing_replay
        )
        return cls(
            spec,
            groups,
            role=role,
            params_dtype=torch_dtype(model.dtype),
            seed=seed,
            training=None if optim is None else Training(optim, total_steps),
            weights=InitialWeights(hf_path=hf_path, copy_of=init_from),
            features=features_from(source),
        )

    def adapters_disabled(self) -> contextlib.AbstractContextManager:
        """While open, a LoRA model computes its frozen base (the reference policy)."""
        return contextlib.nullcontext() if self.lora is None else self.lora.disabled()

    def adapter_shards(self) -> dict[str, torch.Tensor]:
        """This rank's adapter factors under PEFT's keys, split over TP as the actor trains them
        (what `rl3d.hybrid_engine.lora_plan.lora_params` plans): the very fp32 tensors, detached."""
        assert self.lora is not None, f"{self.role} has no LoRA adapters"
        self.resident()
        return {key: param.detach() for key, (param, _) in self.lora.local_factors().items()}

    def lora_state_dict(self) -> dict[str, torch.Tensor]:
        """The adapters as full fp32 host tensors under PEFT's keys (`rl3d.models.lora_names`),
        gathered over TP and PP: every rank of the model gets them all (collective)."""
        assert self.lora is not None, f"{self.role} has no LoRA adapters"
        self.resident()
        return self.lora.state_dict()

    def response_slice(self, output: torch.Tensor, micro: DataBatch) -> torch.Tensor:
        """[B, R, ...]: the outputs that predict (or value) the response tokens."""
        return self.batches.response_slice(output, micro)

    def unwrapped(self) -> torch.nn.Module:
        return unwrap_model(self.ddp)

    def _copy_from(self, source: MegatronEngine) -> None:
        """Every parameter from `source`'s model by its global name (layer specs may name a
        tensor differently: Transformer Engine's fuse the norms into the next linear); the
        critic's value head is its own. A parameter of this model that no global name reaches
        is an error, never a silently kept initial value."""
        mine = self._shards_by_global()
        try:
            theirs = source.global_shards()
        except KeyError as err:
            raise RuntimeError(f"{self.role} from {source.role}: {err.args[0]}") from None
        with torch.no_grad():
            for name, dst in mine.items():
                if self.role == "critic" and name == OUTPUT_LAYER:
                    continue  # the value head
                if name not in theirs or theirs[name].shape != dst.shape:
                    got = tuple(theirs[name].shape) if name in theirs else "nothing"
                    raise RuntimeError(
                        f"{self.role} from {source.role}: {name} {tuple(dst.shape)} has {got} to copy"
                    )
                dst.copy_(theirs[name])
        reached = {t.data_ptr() for t in mine.values()}
        for local, param in self.model.named_parameters():
            if param.data_ptr() not in reached:
                raise RuntimeError(
                    f"{self.role} from {source.role}: parameter {local} has no global name, so nothing "
                    "was copied into it"
                )

    # -- forward -------------------------------------------------------------------------------
    def run_forward(
        self, batch: DataBatch, micro_batch_size: int, extract, *, record_routing: bool = False
    ) -> list[dict] | None:
        """Forward-only over micro-batches; `extract(output, micro) -> (loss, dict)` runs on the
        last pipeline stage, where the list of dicts comes back (None on other stages). When
        packing regrouped the samples, one dict comes back with every (per-sample) value in
        the batch's order. With routing replay, `replay.result` then holds the routing record
        (`record_routing`) or the replay's mismatch counts."""
        from rl3d.models.training import forward_backward

        self.resident()
        self.unwrapped().eval()
        with torch.no_grad(), self.features.session(batch, record=record_routing) as batch:
            micro, order = self.batches.split(batch, micro_batch_size)
            outs = forward_backward(
                self.ddp,
                self.groups,
                self.batches.forward_step(extract),
                micro,
                num_microbatches=len(micro),
                forward_only=True,
                **self.batches.schedule_shape(micro),
            )
        if not self.groups.is_last_stage:
            return None
        if order is None:
            return outs
        inverse = torch.argsort(torch.tensor(order))
        merged = {k: torch.cat([o[k] for o in outs]) for k in outs[0]}
        assert all(v.shape[0] == len(order) for v in merged.values()), "extract must return per-sample values"
        return [{k: v[inverse.to(v.device)] for k, v in merged.items()}]

    def forward_backward(self, batch: DataBatch, micro_batch_size: int, loss_of) -> None:
        """Forward and backward over micro-batches into freshly zeroed gradient buffers, no
        optimizer step (what `rl3d bench packing` times)."""
        from rl3d.models.training import forward_backward

        self.resident()
        micro, _ = self.batches.split(batch, micro_batch_size)
        self.unwrapped().train()
        self.ddp.zero_grad_buffer()
        forward_backward(
            self.ddp,
            self.groups,
            self.batches.forward_step(loss_of),
            micro,
            num_microbatches=len(micro),
            **self.batches.schedule_shape(micro),
        )

    # -- training ------------------------------------------------------------------------------
    def train_minibatches(
        self,
        batch: DataBatch,
        *,
        mini_batch_size: int,
        micro_batch_size: int,
        epochs: int,
        loss_of: Callable[[torch.Tensor, DataBatch], tuple[torch.Tensor, dict]],
        count_unit: Callable,
    ) -> list[dict]:
        """PPO epochs over this DP rank's samples; `mini_batch_size` is global (all DP ranks).

        The per-micro-batch loss is rescaled so that megatron's average over micro-batches and
        DP ranks equals the aggregate over the whole mini-batch (`count_unit(micro)` counts the
        micro-batch's tokens or sequences, whichever the aggregation averages over)."""
        from rl3d.models.training import train_step

        self.resident()
        dp = self.groups.layout.d
        local_mini = mini_batch_rows(mini_batch_size, batch.info, len(batch) * dp) // dp
        metrics: list[dict] = []
        dev = self.groups.device
        self.unwrapped().train()
        self.features.before_update()
        with self.features.session(batch) as batch:
            for _ in range(epochs):
                for mini in batch.chunks_of(local_mini):
                    micro, _ = self.batches.split(mini, micro_batch_size)
                    total = torch.tensor([float(sum(count_unit(m) for m in micro))], device=dev)
                    if dist.get_world_size(self.groups.dp_group) > 1:  # over one rank: its own count
                        dist.all_reduce(total, group=self.groups.dp_group)
                    scale = {id(m): count_unit(m) * len(micro) * dp / max(total.item(), 1.0) for m in micro}

                    def scaled(output, m, scale=scale):
                        loss, info = loss_of(output, m)
                        return loss * scale[id(m)], info

                    outs, grad_norm = train_step(
                        self.ddp,
                        self.optimizer,
                        self.groups,
                        self.batches.forward_step(scaled),
                        micro,
                        num_microbatches=len(micro),
                        scheduler=self.scheduler,
                        skipped=self.skipped,
                        **self.batches.schedule_shape(micro),
                    )
                    if self.groups.is_last_stage:
                        metrics.append(self._perf(micro))
                        for m, o in zip(micro, outs):
                            row = {k: float(v) for k, v in o.items()}
                            if self.packing:  # micro-batches of unequal size: mini-batch means
                                row[METRIC_WEIGHT] = count_unit(m)
                            metrics.append(row)
                        if grad_norm is not None:
                            metrics.append({"grad_norm": float(grad_norm)})
                        metrics.append({"skipped_steps": float(self.skipped.total)})
        after = self.features.after_update(batch)  # collective: every rank of the role
        return metrics + after if self.groups.is_last_stage else metrics

    def _perf(self, micro: list[DataBatch]) -> dict[str, float]:
        """Share of computed token slots that are padding, and slots per micro-batch."""
        real = sum(float(m["attention_mask"].sum()) for m in micro)
        slots = sum(m.info[PACKED].num_tokens if PACKED in m.info else m["input_ids"].numel() for m in micro)
        prefix = "perf/" if self.role == "actor" else f"perf/{self.role}_"
        return {
            f"{prefix}pad_fraction": 1.0 - real / slots,
            f"{prefix}tokens_per_micro_batch": slots / len(micro),
        }

    # -- weights for the 3D-HybridEngine -------------------------------------------------------
    def global_shards(self) -> dict[str, torch.Tensor]:
        """This rank's training parameters under their global (planner) names, as the very
        tensors the model trains (no copy)."""
        self.resident()
        return self._shards_by_global()

    def transition_shards(self, *, merged: bool = True) -> dict[str, torch.Tensor]:
        """`global_shards` in the model's dtype, what a transition moves: the generation engine
        runs in one dtype, and megatron's local spec keeps the norms of a bf16 model in fp32
        without Transformer Engine or apex; those few are cast (copies), the rest are the very
        training tensors. With LoRA and `merged` the adapted weights are merged copies (base +
        scale * B @ A, summed in fp32), so an engine without adapters generates with the adapted
        policy; without `merged`, the frozen base (an engine that takes `adapter_shards`)."""
        dtype = self.params_dtype
        shards = self.global_shards()
        if self.lora is not None and merged:  # the adapted weights: base + scale * B @ A
            for g, delta in self.lora.merged_deltas().items():
                shards[g] = (shards[g].float() + delta).to(dtype)
        return {g: t if t.dtype == dtype else t.to(dtype) for g, t in shards.items()}

    def _shards_by_global(self) -> dict[str, torch.Tensor]:
        layout = self.groups.layout
        local = model_tensors(self.unwrapped())
        names = rank_param_names(self.spec, self.groups, role=self.role)
        shards = {g: local_param(local, n).data for g, n in names.items()}
        if self.spec.tied_embeddings and layout.p > 1 and self.groups.is_last_stage:
            shards[OUTPUT_LAYER] = local[OUTPUT_LAYER].data  # megatron's synced copy
        return shards
