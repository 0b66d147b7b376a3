"""The rollout worker of a separate rollout pool (`rollout.placement: separate`).

It holds a torch rollout engine in the pool's generation layout (t_g = `rollout.pool.tp`) and
no training state. Weights arrive from the actor's training ranks (`rl3d.weight_sync`), each set
a *policy version* (the number of optimizer updates behind it). With partial rollouts the
engine asks, before each forward that makes a token's logits, whether a newer version has been
announced; if so it receives and loads it there and the generation goes on with it (the KV
cache of the tokens before stays as the old weights computed it: the log-probs the engine
records are the ones it really sampled from, which is what the rollout correction needs).
Every token records the version of the logits it was sampled from (`policy_version`, [B, R]).
"""

from __future__ import annotations

import datetime
import logging
import threading
import time

import torch
import torch.distributed as dist

from rl3d.config import RL3DConfig
from rl3d.hybrid_engine.pool import PoolTransition
from rl3d.single_controller.async_link import POLL_S, AsyncLink, AsyncLinkError
from rl3d.single_controller.batch import DataBatch
from rl3d.utils.dtypes import torch_dtype
from rl3d.weight_sync import DeltaReceiver, WeightBridge, receive_weights
from rl3d.workers.generation import Generation
from rl3d.workers.rollout_guard import FAULTS_ENV, Cancelled

logger = logging.getLogger(__name__)
POLICY_VERSION = "policy_version"


class RolloutWorker:
    def __init__(
        self,
        cfg: RL3DConfig,
        spec,
        *,
        pad_token_id: int,
        tokenizer,
        pool_rank: int,
        bridge: WeightBridge,
        plan: PoolTransition,
        link: AsyncLink,
        device,
    ):
        pool = cfg.rollout.pool
        self.cfg, self.spec, self.pad_token_id = cfg, spec, pad_token_id
        self.pool_rank, self.bridge, self.plan, self.link = pool_rank, bridge, plan, link
        self.tp_rank, self.dp_rank = pool_rank % pool.tp, pool_rank // pool.tp
        self.tp_group, self.device = None, device
        if pool.tp > 1:  # every rank makes every group (new_group is collective over the pool)
            timeout = datetime.timedelta(seconds=cfg.launch.timeout_s)
            for dp in range(pool.dp):
                group = dist.new_group(list(range(dp * pool.tp, (dp + 1) * pool.tp)), timeout=timeout)
                if dp == self.dp_rank:
                    self.tp_group = group
        self.tokenizer = tokenizer
        self.call = threading.local()  # a contained call's cancel event and injected faults
        self._build_engine()
        self.dtype = torch_dtype(cfg.model.dtype)
        # an agent's rows each come from several engine calls: weights change between its
        # calls only (a row is then one version), not within a response
        self.partial = cfg.rollout.async_.partial_rollouts and not self.generation.multi_turn
        self.version = -1
        self.weights = None  # the last weights received (an engine rebuilt loads them)
        self.delta = DeltaReceiver() if plan.delta else None  # the buckets it holds, to apply deltas to
        self.sync_seconds = 0.0
        self._chunk_versions: list[list[int]] = []

    def _build_engine(self) -> None:
        from rl3d.rollout import build_rollout_engine

        cfg = self.cfg
        self.engine = build_rollout_engine(
            cfg.rollout,
            spec=self.spec,
            group=self.tp_group,
            pad_token_id=self.pad_token_id,
            model_path=cfg.model.hf_path,
            device=self.device,
            dtype=cfg.model.dtype,
            seed=cfg.trainer.seed,
            record_routing=cfg.algorithm.routing_replay == "rollout",  # rows carry it to the trainer
        )
        self.generation = Generation(cfg, self.engine, self.tokenizer, pad_token_id=self.pad_token_id)
        self.engine.before_forward = self._before_forward

    def restart_engine(self) -> None:
        """A new engine in place of a failed one, holding the last weights received (the
        policy version stays: the trainer sends the next one as usual)."""
        self._build_engine()
        if self.weights is not None:
            self.engine.load_weights(self.weights)

    # -- weights -------------------------------------------------------------------------------
    def _agreed(self, flag: bool) -> bool:
        """True on every rank of this engine's TP group once on any: they swap weights at the
        same step and stop together."""
        if self.tp_group is None:
            return flag
        value = torch.tensor([int(flag)], device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.tp_group)
        return bool(value.item())

    def agree(self, flag: bool) -> bool:
        """`flag` agreed over this engine's TP ranks (the pool's loop branches on it)."""
        return self._agreed(flag)

    def _announced(self, version: int) -> bool:
        return self._agreed(self.link.weights_announced(version))

    def stopped(self) -> bool:
        return self._agreed(self.link.stopped())

    def poll(self) -> bool:
        """Receive the next version if the trainer announced it; True if weights changed."""
        if not self._announced(self.version + 1):
            return False
        weights, stats = receive_weights(
            self.bridge, self.plan, self.pool_rank, dtype=self.dtype, delta=self.delta
        )
        self.engine.load_weights(weights)
        self.weights = weights
        self.version += 1
        self.sync_seconds += stats.seconds
        logger.debug(
            "rollout rank %d: policy version %d (%d bytes)", self.pool_rank, self.version, stats.recv_bytes
        )
        return True

    def wait_for(self, version: int, timeout_s: float) -> bool:
        """Block until this rank holds `version` or newer; False if the trainer stopped."""
        deadline = time.monotonic() + timeout_s
        while self.version < version:
            if self.poll():
                continue
            if self.stopped():
                return False
            if time.monotonic() > deadline:
                raise AsyncLinkError(
                    f"rollout pool rank {self.pool_rank}: policy version {version} did not come "
                    f"within {timeout_s:.0f} s"
                )
            time.sleep(POLL_S)
        return True

    def _before_forward(self, step: int) -> None:
        call = self.call  # set by a contained call (rl3d.workers.rollout_guard), in its thread
        if step == 0 and getattr(call, "hang_s", 0.0):
            time.sleep(call.hang_s)  # an injected hang (tests only)
        if getattr(call, "cancel", None) is not None and call.cancel.is_set():
            raise Cancelled("the rank stopped waiting for this call (rollout.timeout_s)")
        if step == 0 and getattr(call, "raise_now", False):
            call.raise_now = False
            raise RuntimeError(f"injected engine fault ({FAULTS_ENV})")
        if step == 0:
            self._chunk_versions.append([])
        if self.partial or (step == 0 and not self.generation.multi_turn):
            self.poll()
        self._chunk_versions[-1].append(self.version)

    # -- generation ----------------------------------------------------------------------------
    def generate(self, prompts: DataBatch, *, step: int, greedy: bool = False) -> DataBatch | None:
        """This rank's share of a step's prompts through the colocated actor's `Generation`
        (same seeds, same rows, `greedy` as there), plus `policy_version` per token."""
        self._chunk_versions = []
        out = self.generation.generate(prompts, step=step, gen_dp_rank=self.dp_rank, greedy=greedy)
        if out is None:
            return None
        batch = out.batch
        version_BR = torch.full(batch["responses"].shape, self.version, dtype=torch.long)
        if out.engine_rows is not None:  # single-turn: the version of each token's chunk and step
            params_n = 1 if greedy else self.cfg.rollout.n
            rows_per_chunk = max(1, self.engine.max_batch_rows // params_n) * params_n
            for i, j in enumerate(out.engine_rows):
                versions = self._chunk_versions[j // rows_per_chunk][: len(batch["response_ids"][i])]
                version_BR[i, : len(versions)] = torch.tensor(versions, dtype=torch.long)
        batch.set(POLICY_VERSION, version_BR)
        return batch


def staleness_metrics(batch: DataBatch, step: int) -> dict[str, float]:
    """Token staleness at train step `step` (the trainer then holds policy version step - 1)."""
    mask = batch["response_mask"].bool()
    stale = (step - 1) - batch[POLICY_VERSION][mask]
    if not stale.numel():
        return {"async/staleness_mean": 0.0, "async/staleness_max": 0.0}
    return {"async/staleness_mean": float(stale.float().mean()), "async/staleness_max": float(stale.max())}


def check_staleness(batch: DataBatch, step: int, max_staleness: int) -> None:
    worst = staleness_metrics(batch, step)["async/staleness_max"]
    if worst > max_staleness:
        raise AsyncLinkError(
            f"step {step}: a token is {worst:.0f} policy versions old, over rollout.async.max_staleness "
            f"= {max_staleness}"
        )
