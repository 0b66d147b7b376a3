"""The workers of the RL dataflow: actor+rollout (with the 3D-HybridEngine), critic, reference
and reward. Each method declares its dispatch mode; the controller calls them through a worker
group and never touches another rank's tensors.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from rl3d import algos
from rl3d.config import RL3DConfig
from rl3d.engine import METRIC_WEIGHT, MegatronEngine, forward_micro_batch
from rl3d.models.bootstrap import MegatronGroups
from rl3d.models.logprobs import vocab_parallel_logprobs_entropy
from rl3d.models.spec import ModelSpec
from rl3d.single_controller.batch import ROUTING, DataBatch
from rl3d.single_controller.dispatch import Dispatch, DispatchInfo, register
from rl3d.workers.context import RoleContext

logger = logging.getLogger(__name__)


def _megatron_info(groups: MegatronGroups, gen=None, *, mini_batch_size: int) -> DispatchInfo:
    """Where this rank sits in its megatron grid, and (`gen`: the actor's GenerationLayout) in
    the generation layout. Each `mini_batch_size` consecutive samples are dealt to the DP ranks
    by token count (0: contiguous chunks), so an optimizer step trains on the same samples
    whatever the DP size, padded or packed."""
    info = DispatchInfo(
        dp_rank=groups.dp_rank,
        dp_size=groups.layout.d,
        is_collector=groups.holds_outputs,
        token_balance=mini_batch_size,
    )
    if gen is None:
        return info
    coords = gen.coords(groups.rank)
    return dataclasses.replace(
        info,
        gen_dp_rank=coords.dp_g,
        gen_dp_size=gen.d_g * gen.train.d,  # CP ranks generate as data replicas
        is_gen_collector=coords.tp_g == 0,
    )


def _count_unit(mode: str):
    """What a loss aggregation averages over: tokens (token-mean) or sequences."""
    if mode == "token-mean":
        return lambda m: float(m["response_mask"].sum())
    return lambda m: float((m["response_mask"].sum(-1) > 0).sum())


def _mean_metrics(rows: list[dict]) -> dict[str, float]:
    """Each key's mean over the rows that have it, weighted by a row's METRIC_WEIGHT (else 1)."""
    out = {}
    for key in sorted({k for r in rows for k in r} - {METRIC_WEIGHT}):
        have = [(r.get(METRIC_WEIGHT, 1.0), r[key]) for r in rows if key in r]
        total = sum(w for w, _ in have)
        out[key] = sum(w * v for w, v in have) / total if total else sum(v for _, v in have) / len(have)
    return out


def _train(role: MegatronEngine, section, batch: DataBatch, loss_of, loss_agg_mode: str, prefix: str):
    """PPO epochs over mini/micro-batches of one role; its metrics (last PP stage), else None."""
    rows = role.train_minibatches(
        batch,
        mini_batch_size=section.mini_batch_size,
        micro_batch_size=section.micro_batch_size,
        epochs=section.ppo_epochs,
        loss_of=loss_of,
        count_unit=_count_unit(loss_agg_mode),
    )
    if not role.groups.is_last_stage:
        return None
    out = _mean_metrics(rows)
    for key in ("grad_norm", "skipped_steps"):
        if key in out:
            out[f"{prefix}/{key}"] = out.pop(key)
    out[f"{prefix}/lr"] = float(role.optimizer.param_groups[0]["lr"])
    return out


class _LogProbMixin:
    spec: ModelSpec
    groups: MegatronGroups

    def _logp_entropy(self, output: torch.Tensor, micro: DataBatch, role: MegatronEngine):
        logits = role.response_slice(output, micro)
        return vocab_parallel_logprobs_entropy(
            logits, micro["responses"], self.groups.tp_group, vocab_size=self.spec.vocab_size
        )

    def _forward_logprobs(
        self,
        role: MegatronEngine,
        batch: DataBatch,
        micro_batch_size: int,
        key: str,
        *,
        routing: bool = False,
    ):
        """`key`'s log-probs and entropies; with `routing` (the actor's old log-probs under
        `algorithm.routing_replay`) also the forward's routing record or replay counts."""

        def extract(output, micro):
            logp, entropy = self._logp_entropy(output, micro, role)
            return torch.zeros(()), {key: logp.detach(), "entropy": entropy.detach()}

        record = routing and self.cfg.algorithm.routing_replay == "old"
        outs = role.run_forward(batch, micro_batch_size, extract, record_routing=record)
        if outs is None:
            return None
        out = DataBatch(
            {
                key: torch.cat([o[key] for o in outs]),
                f"{key}_entropy": torch.cat([o["entropy"] for o in outs]),
            }
        )
        return out.union(role.replay.result) if routing and role.replay is not None else out


class ActorRolloutWorker(_LogProbMixin):
    """The megatron actor colocated with the rollout engine: it trains; its generation side
    (`rollout`, a `ColocatedRollout`) loads its weights into the engine through the
    3D-HybridEngine (`reshard`) and generates."""

    def __init__(self, ctx: RoleContext):
        from rl3d.workers.colocated_rollout import ColocatedRollout

        cfg, spec, groups = ctx.cfg, ctx.spec, ctx.groups
        self.cfg, self.spec, self.groups = cfg, spec, groups
        self.role = MegatronEngine.from_config(
            spec,
            groups,
            role="actor",
            model=cfg.model,
            seed=cfg.trainer.seed,
            batching=cfg.actor,
            optim=cfg.actor.optim,
            total_steps=cfg.trainer.total_steps,
            hf_path=cfg.model.hf_path,
            lora=cfg.actor.lora,
            routing_replay=cfg.algorithm.routing_replay != "none",
        )
        self.rollout = ColocatedRollout(ctx, self.role)
        self.policy_loss = algos.policy_loss_of(cfg.algorithm)

    def start_engine(self, colocated: list[MegatronEngine]) -> None:
        """Launch the rollout engine once every role on this rank exists (`ColocatedRollout.start`)."""
        self.rollout.start(colocated)

    def dispatch_info(self) -> DispatchInfo:
        return _megatron_info(self.groups, self.rollout.gen, mini_batch_size=self.cfg.actor.mini_batch_size)

    @register(Dispatch.ONE_TO_ALL)
    def reshard(self) -> dict[str, float]:
        """Training layout -> generation layout, loaded into the engine; `reshard/*` metrics."""
        return self.rollout.publish()

    @register(Dispatch.GENERATION_COMPUTE)
    def generate_sequences(self, prompts: DataBatch, *, step: int, greedy: bool = False) -> DataBatch | None:
        """Sample this generation-DP rank's share of the prompts (the backend deals them out and
        collects the rows from generation-TP rank 0).

        `greedy`: one temperature-0 response per prompt (ReMax's baseline)."""
        return self.rollout.generate(prompts, step=step, greedy=greedy)

    @register(Dispatch.ONE_TO_ALL)
    def release_generation(self) -> None:
        """After rollout: drop the generation buffer and the engine's memory."""
        self.rollout.release()

    def pause_generation(self) -> None:
        """Free the KV cache but keep the engine's weights (before a checkpoint)."""
        self.rollout.pause()

    def _check_record(self, batch: DataBatch) -> None:
        """`routing_replay: rollout` without the engine's record in the rows would route by the
        trainer's own routers without a word: refuse the batch."""
        if self.cfg.algorithm.routing_replay == "rollout" and ROUTING not in batch:
            raise RuntimeError(
                "algorithm.routing_replay='rollout': the batch has no routing record (`routing`): "
                "its rows came from an engine that did not record one"
            )

    @register(Dispatch.MEGATRON_COMPUTE)
    def compute_log_prob(self, batch: DataBatch) -> DataBatch | None:
        self._check_record(batch)
        return self._forward_logprobs(
            self.role, batch, forward_micro_batch(self.cfg.actor, len(batch)), "old_logp", routing=True
        )

    @register(Dispatch.MEGATRON_COMPUTE)
    def update_actor(self, batch: DataBatch) -> dict[str, float] | None:
        """PPO epochs with the recipe's policy loss (`algorithm.policy_loss`, its clips bound, the
        rollout correction applied) and, when the KL goes in the loss (GRPO), the reference KL
        term. Without `old_logp` in the batch (skipped on policy: `actor.recompute_old_logp`)
        pi_old is the policy being updated: its own log-probs, detached."""
        self._check_record(batch)
        al, kl = self.cfg.algorithm, self.cfg.algorithm.kl
        kl_in_loss = kl.coef > 0 and al.kl_apply_to == "loss"

        def loss_of(output, micro):
            logp, entropy = self._logp_entropy(output, micro, self.role)
            loss, metrics = self.policy_loss(
                logp_BT=logp,
                old_logp_BT=micro["old_logp"] if "old_logp" in micro else logp.detach(),
                adv_BT=micro["advantages"],
                mask_BT=micro["response_mask"].bool(),
                entropy_BT=entropy,
                ref_logp_BT=micro["ref_logp"] if kl_in_loss else None,
                kl_loss_coef=kl.coef if kl_in_loss else 0.0,
                kl_estimator=al.kl_estimator,
                rollout_logp_BT=micro["rollout_logp"],
            )
            return loss, {(k if "/" in k else f"actor/{k}"): v.detach() for k, v in metrics.items()}

        return _train(self.role, self.cfg.actor, batch, loss_of, self.cfg.algorithm.loss_agg_mode, "actor")


class CriticWorker:
    """The value model: the actor's initial network (copied from `init_from`, the colocated
    actor, or loaded from `init_path`) with a scalar value head.

    `kind="cost"` is Safe-RLHF's cost critic: the same model and losses on the cost values and
    returns (batch keys `cost_values`, `cost_returns`; metrics under `cost_critic/`)."""

    def __init__(self, ctx: RoleContext, *, kind: str = "reward"):
        assert kind in ("reward", "cost"), kind
        cfg, spec, groups = ctx.cfg, ctx.spec, ctx.groups
        self.cfg, self.groups = cfg, groups
        prefix = "" if kind == "reward" else "cost_"
        self.values_key, self.returns_key, self.name = (
            f"{prefix}values",
            f"{prefix}returns",
            f"{prefix}critic",
        )
        self.role = MegatronEngine.from_config(
            spec,
            groups,
            role="critic",
            model=cfg.model,
            seed=cfg.trainer.seed + (1 if kind == "reward" else 2),
            batching=cfg.critic,
            optim=cfg.critic.optim,
            total_steps=cfg.trainer.total_steps,
            hf_path=ctx.init_path,
            init_from=ctx.init_from,
        )

    def dispatch_info(self) -> DispatchInfo:
        return _megatron_info(self.groups, mini_batch_size=self.cfg.critic.mini_batch_size)

    def _values(self, output, micro):
        return self.role.response_slice(output, micro)[..., 0].float()

    @register(Dispatch.MEGATRON_COMPUTE)
    def compute_values(self, batch: DataBatch) -> DataBatch | None:
        key = self.values_key
        outs = self.role.run_forward(
            batch,
            self.cfg.critic.micro_batch_size,
            lambda o, m: (torch.zeros(()), {key: self._values(o, m)}),
        )
        return None if outs is None else DataBatch({key: torch.cat([o[key] for o in outs])})

    @register(Dispatch.MEGATRON_COMPUTE)
    def update_critic(self, batch: DataBatch) -> dict[str, float] | None:
        al = self.cfg.algorithm

        def loss_of(output, micro):
            loss, metrics = algos.clipped_value_loss(
                values_BT=self._values(output, micro),
                old_values_BT=micro[self.values_key],
                returns_BT=micro[self.returns_key],
                mask_BT=micro["response_mask"].bool(),
                clip_range=al.value_clip_range,
                loss_agg_mode=al.loss_agg_mode,
            )
            return loss, {f"{self.name}/{k}": v.detach() for k, v in metrics.items()}

        return _train(self.role, self.cfg.critic, batch, loss_of, al.loss_agg_mode, self.name)


class ReferenceWorker(_LogProbMixin):
    """The frozen initial policy: `model.hf_path`, else a copy of `init_from` (the colocated
    actor) or the weights at `init_path` (own pool). With `actor.lora` it builds no model: the
    colocated actor's frozen base, its adapters switched off, is the reference."""

    def __init__(self, ctx: RoleContext):
        cfg, spec, groups = ctx.cfg, ctx.spec, ctx.groups
        self.cfg, self.spec, self.groups = cfg, spec, groups
        if cfg.actor.lora is not None:
            assert ctx.init_from is not None, "actor.lora's reference is the colocated actor (config checks)"
            self.role = ctx.init_from
            return
        warmed = cfg.actor.warm_start is not None  # then the actor's SFT'd weights, never hf_path's
        path = ctx.init_path if warmed else cfg.model.hf_path or ctx.init_path
        self.role = MegatronEngine.from_config(
            spec,
            groups,
            role="reference",
            model=cfg.model,
            seed=cfg.trainer.seed,
            batching=cfg.reference.batching_of(cfg.actor),
            total_steps=cfg.trainer.total_steps,
            hf_path=path,
            init_from=None if path else ctx.init_from,
        )

    def dispatch_info(self) -> DispatchInfo:
        # Forward only, so its shares decide no optimizer step: a packing reference takes the
        # actor's shares; a padded one keeps contiguous chunks (its own pool's dp need only
        # divide the step's samples, not the actor's mini-batch).
        mini = self.cfg.actor.mini_batch_size if self.role.packing else 0
        return _megatron_info(self.groups, mini_batch_size=mini)

    @register(Dispatch.MEGATRON_COMPUTE)
    def compute_ref_log_prob(self, batch: DataBatch) -> DataBatch | None:
        with self.role.adapters_disabled():
            micro = forward_micro_batch(self.cfg.actor, len(batch))
            return self._forward_logprobs(self.role, batch, micro, "ref_logp")


class RewardWorker:
    """Rule rewards and user functions; cheap, so every rank scores the whole batch (ONE_TO_ALL)."""

    def __init__(self, cfg: RL3DConfig, tokenizer):
        from rl3d.rewards import resolve_cost_fn, resolve_reward_fn

        self.cfg, self.tokenizer = cfg, tokenizer
        self.fn = resolve_reward_fn(cfg.reward, cfg.data)
        self.cost_fn = resolve_cost_fn(cfg.reward)  # Safe-RLHF only

    def dispatch_info(self) -> DispatchInfo:
        return DispatchInfo(dp_rank=0, dp_size=1, is_collector=True)

    @register(Dispatch.ONE_TO_ALL, metrics="sum")  # error counts add up over fan-out slices
    def compute_reward(self, batch: DataBatch) -> tuple[DataBatch, dict[str, float]]:
        from rl3d.rewards import RewardInput, score_batch

        inputs = [
            RewardInput(
                prompt_index=int(batch["index"][i]),
                prompt_ids=list(batch["prompt_ids"][i]),
                response_ids=list(batch["response_ids"][i]),
                prompt_text=batch["prompt_text"][i],
                response_text=self.tokenizer.decode(batch["response_ids"][i], skip_special_tokens=True),
                answer=batch["answer"][i],
                finish_reason=batch["finish_reason"][i],
                trajectory=batch["trajectory"][i] if "trajectory" in batch else None,
                data_source=batch["data_source"][i] if "data_source" in batch else None,
            )
            for i in range(len(batch))
        ]
        on_error = self.cfg.reward.on_error
        scores, report = score_batch(self.fn, inputs, on_error=on_error)
        out = DataBatch({"score": torch.tensor(scores, dtype=torch.float32)})
        metrics = {"reward/errors": report.num_errors}
        if self.cost_fn is not None:
            costs, cost_report = score_batch(self.cost_fn, inputs, on_error=on_error)
            out.set("cost", torch.tensor(costs, dtype=torch.float32))
            metrics["cost/errors"] = cost_report.num_errors
        return out, metrics
