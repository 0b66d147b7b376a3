"""A generation-DP rank's rollout rows, the same wherever its engine runs.

The colocated actor (`ActorRolloutWorker.generate_sequences`) and a separate rollout pool's
rank (`RolloutWorker.generate`) both generate through `Generation`: the recipe's sampling for
the step and rank (`rollout_sampling`), single-turn on the engine or multi-turn through the
recipe's agent (`rollout.agent`: rl3d's tool loop, or a user's agent program against an
OpenAI-compatible endpoint), and the rows as the batch the trainer takes. Training
rounds, an algorithm's extra rounds (DAPO's refill, ReMax's greedy baseline) and validation
all come here, so a run generates the same rows on either placement.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from rl3d.config import RL3DConfig
from rl3d.data.images import IMAGES
from rl3d.single_controller.batch import PAD_VALUES, PROMPT_WIDTH, ROUTING, DataBatch
from rl3d.single_controller.dispatch import INPUT_ROW

TRAJECTORY = "trajectory"  # the agent's record of each row (multi-turn only)


def rollout_sampling(cfg: RL3DConfig, *, step: int, gen_dp_rank: int, greedy: bool = False):
    """The engine's sampling for a step's rollout on one generation-DP rank: the recipe's
    `rollout` settings and a seed of (trainer seed, step, rank), the same wherever it runs
    (colocated actor or a separate rollout pool). `greedy`: one temperature-0 response per
    prompt (ReMax's baseline, validation's greedy answers). It stops at `rollout.stop_token_ids`
    and the model's end ids (`rl3d.rollout.stops`)."""
    from rl3d.rollout import SamplingParams
    from rl3d.rollout.stops import stop_token_ids

    ro = cfg.rollout
    params = SamplingParams(
        temperature=ro.temperature,
        top_p=ro.top_p,
        top_k=ro.top_k,
        max_new_tokens=ro.max_new_tokens,
        stop_token_ids=stop_token_ids(ro, cfg.data, cfg.model.hf_path),
        n=ro.n,
        seed=cfg.trainer.seed * 100003 + step * 1009 + gen_dp_rank,
    )
    return dataclasses.replace(params, temperature=0.0, top_p=1.0, top_k=-1, n=1) if greedy else params


@dataclass
class Generated:
    batch: DataBatch
    # the engine's output row of each batch row (single-turn); None for an agent's rows,
    # each from several engine calls
    engine_rows: list[int] | None


class Generation:
    """The rollout of one generation-DP rank on `engine`: multi-turn when the recipe names an
    agent (`rollout.agent`, `rl3d.agents`), else single-turn."""

    def __init__(self, cfg: RL3DConfig, engine: Any, tokenizer: Any, *, pad_token_id: int):
        self.cfg, self.engine, self.pad_token_id = cfg, engine, pad_token_id
        self.agent = None
        self.images = None  # RuntimeImages, made at the first prompts with images
        if cfg.rollout.agent.enabled:
            from rl3d.agents import build_agent

            self.agent = build_agent(cfg.rollout.agent, engine, tokenizer)

    @property
    def multi_turn(self) -> bool:
        return self.agent is not None

    def generate(
        self, prompts: DataBatch, *, step: int, gen_dp_rank: int, greedy: bool = False
    ) -> Generated | None:
        """This rank's share of the prompts as rows sorted by prompt (a prompt's responses in the
        engine's order); None for an empty share."""
        if not len(prompts):
            return None
        params = rollout_sampling(self.cfg, step=step, gen_dp_rank=gen_dp_rank, greedy=greedy)
        if IMAGES in prompts:
            return self._image_rollout(prompts, params)
        if self.agent is not None:
            return Generated(self._agent_rollout(prompts, params), None)
        out = self.engine.generate(list(prompts["prompt_ids"]), params)
        # raw (temperature-1) log-probs are what the trainer recomputes as the old log-prob
        logps = out.token_logprobs(raw=out.raw_logprobs is not None)
        responses, index = out.responses(), out.prompt_index.tolist()
        order = sorted(range(len(out)), key=lambda j: index[j])  # stable: engine order within a prompt
        rows = [(index[j], responses[j], logps[j], out.finish_reasons[j]) for j in order]
        batch = rows_to_batch(prompts, rows, self.pad_token_id)
        if out.routing is not None:  # the engine's record (algorithm.routing_replay: rollout)
            batch.set(ROUTING, routing_columns(batch, [out.routing[j] for j in order]))
        return Generated(batch, order)

    def _image_rollout(self, prompts: DataBatch, params) -> Generated | None:
        """Single-turn rows of prompts with images (`rl3d.rollout.vision`): each prompt's images
        decoded and processed once for the vision tower; a prompt whose image no longer decodes
        is dropped (logged and counted by `self.images`), its rows left out of the batch."""
        from rl3d.workers.vision_inputs import image_pixels

        if self.agent is not None:
            raise ValueError("rollout.agent: prompts with images (data.image_key) run single-turn only")
        if self.images is None:
            from rl3d.data.images import RuntimeImages

            self.images = RuntimeImages()
        kept, pixels = image_pixels(self.engine, self.images, prompts, self.cfg.model.hf_path)
        if not kept:
            return None
        ids = [prompts["prompt_ids"][i] for i in kept]
        out = self.engine.generate(ids, params, images=pixels)
        logps = out.token_logprobs(raw=out.raw_logprobs is not None)
        responses, index = out.responses(), out.prompt_index.tolist()
        order = sorted(range(len(out)), key=lambda j: index[j])
        rows = [(kept[index[j]], responses[j], logps[j], out.finish_reasons[j]) for j in order]
        return Generated(rows_to_batch(prompts, rows, self.pad_token_id), order)

    def _agent_rollout(self, prompts: DataBatch, params) -> DataBatch:
        """The agent's rows (`rl3d.agents.base.AgentRow`) as a batch. A row's first prompt fills
        the prompt columns (its head when longer than the step's prompt width) and the rest of it
        is response tokens outside the loss, so every token is one the engine saw or generated.
        Tokens outside the loss (tool results, template text) are in the context
        (`attention_mask` 1) with `response_mask` 0 and `rollout_logp` 0."""
        agent_rows = self.agent.rollout(prompts, params)  # prompt-major
        width = prompt_width(prompts)
        rows, heads, masks = [], [], []
        for row in agent_rows:
            k = min(len(row.prompt_ids), width)
            rest = len(row.prompt_ids) - k
            heads.append(row.prompt_ids[:k])
            rows.append(
                (
                    row.prompt_index,
                    row.prompt_ids[k:] + row.response_ids,
                    [0.0] * rest + row.logprobs,
                    row.finish_reason,
                )
            )
            masks.append([0] * rest + row.mask)
        batch = rows_to_batch(prompts, rows, self.pad_token_id, prompt_ids=heads)
        for i, mask in enumerate(masks):
            batch["response_mask"][i, : len(mask)] = torch.tensor(mask, dtype=torch.long)
        return batch.set(TRAJECTORY, [row.record for row in agent_rows])


def prompt_width(prompts: DataBatch) -> int:
    """The prompt columns of a step's rows: one width on every generation-DP rank (its share's
    rows then concatenate); responses are right-padded, so their widths may differ per rank."""
    return prompts.info.get(PROMPT_WIDTH) or max(len(ids) for ids in prompts["prompt_ids"])


def rows_to_batch(
    prompts: DataBatch, rows: list, pad_token_id: int, *, prompt_ids: list[list[int]] | None = None
) -> DataBatch:
    """(prompt row, response ids, log-probs, finish reason) rows as the trainer's batch: prompts
    left-padded, responses right-padded. `prompt_ids`: each row's prompt tokens (at most
    `prompt_width` of them) when they are not its prompt row's."""
    P = prompt_width(prompts)
    R = max(max(len(r) for _, r, _, _ in rows), 1)
    B = len(rows)
    prompt = torch.full((B, P), pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros(B, P, dtype=torch.long)
    resp = torch.full((B, R), pad_token_id, dtype=torch.long)
    resp_mask = torch.zeros(B, R, dtype=torch.long)
    rollout_logp = torch.zeros(B, R)
    for i, (p, r, lp, _) in enumerate(rows):
        ids = prompts["prompt_ids"][p] if prompt_ids is None else prompt_ids[i]
        prompt[i, P - len(ids) :] = torch.tensor(ids)
        prompt_mask[i, P - len(ids) :] = 1
        resp[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        resp_mask[i, : len(r)] = 1
        rollout_logp[i, : len(lp)] = torch.tensor(lp)
    meta = {k: [prompts[k][p] for p, *_ in rows] for k in prompts.meta if k != "uid"}
    meta["finish_reason"] = [f for *_, f in rows]
    meta["response_ids"] = [r for _, r, _, _ in rows]
    return DataBatch(
        {
            "input_ids": torch.cat([prompt, resp], 1),
            "attention_mask": torch.cat([prompt_mask, resp_mask], 1),
            "responses": resp,
            "response_mask": resp_mask,
            "rollout_logp": rollout_logp,
            "uid": torch.tensor([prompts["uid"][p] for p, *_ in rows]),
            INPUT_ROW: torch.tensor([p for p, *_ in rows]),
        },
        meta,
        {PAD_VALUES: {"input_ids": pad_token_id, "responses": pad_token_id}},
    )


def routing_columns(batch: DataBatch, records: list[torch.Tensor]) -> torch.Tensor:
    """Each row's routing record [prompt + response tokens, layers, k] placed in the batch's
    columns: [B, T, layers, k], zeros at padding (left of the prompt, right of the response)."""
    mask_BT = batch["attention_mask"]
    out = torch.zeros(*mask_BT.shape, *records[0].shape[1:], dtype=records[0].dtype)
    for i, record in enumerate(records):
        cols = mask_BT[i].nonzero().squeeze(-1)
        assert len(cols) == record.shape[0], (
            f"row {i}: {record.shape[0]} routed tokens, {len(cols)} in the batch"
        )
        out[i, cols] = record
    return out
