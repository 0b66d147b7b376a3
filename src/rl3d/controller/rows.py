"""A step whose rollout gave more rows than `prompts_per_step * n`, fitted to the training layout.

An agent's session may give several rows (`rollout.agent.max_rows_per_session`), so a step can
hold any number of rows, while training deals each mini-batch evenly over the data-parallel
ranks in equal micro-batches. `fit_rows` pads such a batch with empty rows (copies of its first
row with nothing in the loss, one group of their own) up to a row count every training role
can split, and records the step's nominal sample count (`NOMINAL_ROWS`): each role then cuts
the batch into as many mini-batches as the recipe asks for over `prompts_per_step * n` samples,
each proportionally larger, so a step makes the same number of optimizer updates.
"""

from __future__ import annotations

import math

import torch

from rl3d.config import RL3DConfig
from rl3d.config.async_rollout import ROLLOUT_POOL
from rl3d.config.pools import role_pools
from rl3d.single_controller.batch import NOMINAL_ROWS, DataBatch

PAD_GROUP = -1  # the uid of the padding rows: one group, equal scores, so no advantage either


def one_row_per_sample(batch: DataBatch) -> DataBatch:
    """An agent session's first row only (its chain of turns), for what counts samples rather
    than trains on them (validation's means and pass@k); other batches as they are."""
    records = batch["trajectory"] if "trajectory" in batch else None
    if not records or not any("agent" in r for r in records):
        return batch
    seen: set[str] = set()
    keep = []
    for i, record in enumerate(records):
        session = record.get("agent", {}).get("session", i)
        if session not in seen:
            seen.add(session)
            keep.append(i)
    return batch if len(keep) == len(batch) else batch.select(keep)


def row_multiple(cfg: RL3DConfig) -> int:
    """The row counts every training role splits evenly are the multiples of this: each
    optimized role's mini-batches (as many as over the nominal samples) deal over its
    data-parallel ranks in whole micro-batches; every trainer-side pool deals over its ranks."""
    samples = cfg.data.prompts_per_step * cfg.rollout.n
    sections = [cfg.actor, cfg.critic] if cfg.critic_enabled else [cfg.actor]
    units = [samples // s.mini_batch_size * s.parallel.dp * s.micro_batch_size for s in sections]
    units += [pool.layout.d for pool in role_pools(cfg) if pool.name != ROLLOUT_POOL]
    return math.lcm(*units)


def fit_rows(batch: DataBatch, cfg: RL3DConfig) -> tuple[DataBatch, int]:
    """`batch` padded for training when its rows are not the recipe's `prompts_per_step * n`,
    and the number of real rows (the first ones)."""
    nominal, rows = cfg.data.prompts_per_step * cfg.rollout.n, len(batch)
    if rows == nominal:
        return batch, rows
    unit = row_multiple(cfg)
    target = math.ceil(rows / unit) * unit
    if target - rows == 1:  # a group of one has no group statistics (GRPO, RLOO need two)
        target += unit
    pad = batch.select([0] * (target - rows))
    pad.tensors["response_mask"] = torch.zeros_like(pad["response_mask"])
    pad.tensors["uid"] = torch.full_like(pad["uid"], PAD_GROUP)
    padded = DataBatch.concat([batch, pad]) if len(pad) else batch
    padded.info[NOMINAL_ROWS] = nominal
    return padded, rows
