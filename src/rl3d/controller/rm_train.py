"""The reward-model job: `rl3d train RECIPE` on a recipe with `job: reward_model`.

It trains a megatron-core GPTModel with a scalar head (`rl3d.workers.reward_model`) on preference
pairs with the Bradley-Terry loss, on the recipe's TP/PP/DP layout (through `MegatronEngine`, as
the critic), under torchrun like an RL run:

    rl3d train recipes/quickstart_cpu_rm.yaml     # = torchrun ... -m rl3d.controller.rm_train RECIPE

Every `rm.eval_every` steps and at the end it scores the held-out pairs and logs `val/accuracy`
(the chosen response scores higher), `val/margin` (mean r_chosen - r_rejected) and `val/loss`;
`train/*` are the same over each step's batch. At the last step it writes a checkpoint
(`CheckpointManager`, manifest included) whose `reward_model/` directory an RL recipe loads with
`reward.model.path: <run dir>` (`rl3d.config.reward_model`). Outputs in the run directory:
metrics.jsonl, rm_curve.csv, rm_curve.png, rm_summary.json, resolved_config.yaml, logs/.
"""

from __future__ import annotations

import json
import logging
import os
import random
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from rl3d.config.reward_model import RM_WEIGHTS
from rl3d.config.rm_job import RMJobConfig
from rl3d.data.tokenizer import pad_id_of
from rl3d.single_controller.batch import DataBatch
from rl3d.utils.failures import report_rank_failure
from rl3d.utils.lifetime import die_with_rank_if_spawned
from rl3d.workers.reward_model import (
    bradley_terry_loss,
    last_token_scores,
    pair_metrics,
    safety_sign_loss,
    save_reward_model,
    sequence_batch,
)

logger = logging.getLogger("rl3d.rm_train")
die_with_rank_if_spawned(__name__)  # a multiprocessing spawn child of a rank ends with it


# -- data ----------------------------------------------------------------------------------------


def _sign(row: dict, side: str) -> float:
    safe = row.get(f"{side}_safe")
    return 0.0 if safe is None else (-1.0 if safe else 1.0)


def pair_tensors(rows: list[dict], tokenizer, *, max_length: int) -> tuple[DataBatch, int]:
    """The pairs as one batch of 2N sequences, chosen and rejected interleaved (a micro-batch of an
    even size holds whole pairs), with `unsafe` signs (+1/-1, 0 unlabelled); and the number of
    pairs dropped as longer than `max_length`."""
    prompts, responses, signs, dropped = [], [], [], 0
    for row in rows:
        p = tokenizer.encode(row["prompt"])
        c = tokenizer.encode(row["chosen"], add_special_tokens=False)
        r = tokenizer.encode(row["rejected"], add_special_tokens=False)
        if len(p) + max(len(c), len(r)) > max_length or not p:
            dropped += 1
            continue
        prompts += [p, p]
        responses += [c, r]
        signs += [_sign(row, "chosen"), _sign(row, "rejected")]
    if not prompts:
        raise ValueError(f"no preference pair fits data.max_length = {max_length}")
    batch = sequence_batch(prompts, responses, pad_token_id=pad_id_of(tokenizer))
    batch.set("unsafe", torch.tensor(signs))
    return batch, dropped


def load_pairs(cfg: RMJobConfig, run_dir: Path, rank: int) -> tuple[list[dict], list[dict]]:
    """(train rows, held-out rows): the files, or the synthetic rule's pairs written to
    run_dir/data/ by rank 0; held out: `data.val_files`, else a seeded `val_fraction` of train."""
    from rl3d.data.preferences import make_preference_pairs, read_preference_parquet, write_preference_parquet

    data = cfg.data
    files = list(data.train_files)
    if not files:
        syn = data.synthetic
        path = run_dir / "data" / f"{syn.rule}_{syn.num_pairs}_seed{syn.seed}.parquet"
        if rank == 0 and not path.exists():
            write_preference_parquet(make_preference_pairs(syn.rule, syn.num_pairs, seed=syn.seed), path)
        dist.barrier()
        files = [str(path)]
    rows = [r for f in files for r in read_preference_parquet(f)]
    if data.val_files:
        return rows, [r for f in data.val_files for r in read_preference_parquet(f)]
    order = list(range(len(rows)))
    random.Random(cfg.trainer.seed).shuffle(order)
    num_val = max(1, int(len(rows) * data.val_fraction))
    return [rows[i] for i in order[num_val:]], [rows[i] for i in order[:num_val]]


# -- one rank's job ------------------------------------------------------------------------------


class RMTrainer:
    def __init__(self, cfg: RMJobConfig, role, train: DataBatch, val: DataBatch):
        self.cfg, self.role, self.groups = cfg, role, role.groups
        self.train, self.val = train, val
        self.cost = cfg.rm.objective == "cost"
        self.rng = torch.Generator().manual_seed(cfg.trainer.seed)
        self.order: list[int] = []

    def _pair_loss(self, output, micro):
        s = last_token_scores(output, micro)
        first, second = s[0::2], s[1::2]  # chosen, rejected
        if self.cost:  # the rejected (less safe) response should cost more
            loss = bradley_terry_loss(second, first) + safety_sign_loss(s, micro["unsafe"].to(s.device))
            m = pair_metrics(second, first)
        else:
            loss = bradley_terry_loss(first, second)
            m = pair_metrics(first, second)
        return loss, {"loss": loss.detach(), **m}

    def _next_pairs(self, n: int) -> list[int]:
        """The next `n` pair indices of a seeded shuffle per epoch (the same on every rank)."""
        while len(self.order) < n:
            num = len(self.train) // 2
            self.order += torch.randperm(num, generator=self.rng).tolist()
        out, self.order = self.order[:n], self.order[n:]
        return out

    def _own_rows(self, pairs: list[int]) -> list[int]:
        dp, d = self.groups.layout.d, self.groups.dp_rank
        share = len(pairs) // dp
        mine = pairs[d * share : (d + 1) * share]
        return [i for p in mine for i in (2 * p, 2 * p + 1)]

    def step(self) -> dict[str, float]:
        rm = self.cfg.rm
        rows = self._own_rows(self._next_pairs(rm.batch_size))
        out = self.role.train_minibatches(
            self.train.select(rows),
            mini_batch_size=2 * rm.batch_size,
            micro_batch_size=2 * rm.micro_batch_size,
            epochs=1,
            loss_of=self._pair_loss,
            count_unit=lambda m: len(m) / 2,
        )
        keys = ("loss", "accuracy", "margin", "grad_norm")
        sums = {k: [float(r[k]) for r in out if k in r] for k in keys}
        local = [sum(v) / len(v) if v else 0.0 for v in sums.values()]
        return dict(zip([f"train/{k}" for k in keys], self._world_mean(local), strict=True))

    def _collects(self) -> bool:
        return self.groups.tp_rank == 0 and self.groups.is_last_stage

    def _world_mean(self, values: list[float]) -> list[float]:
        """The mean over DP of values known on each DP rank's collector (every rank gets it)."""
        t = torch.tensor(
            [*values, 1.0] if self._collects() else [0.0] * (len(values) + 1),
            dtype=torch.float64,
            device=self.groups.device,
        )
        dist.all_reduce(t)
        return (t[:-1] / t[-1]).tolist()

    def evaluate(self) -> dict[str, float]:
        """Held-out pairs, split over DP ranks (pairs d, d + dp, ...); sums over the world."""
        dp, d = self.groups.layout.d, self.groups.dp_rank
        rows = [i for p in range(d, len(self.val) // 2, dp) for i in (2 * p, 2 * p + 1)]
        totals = torch.zeros(
            4, dtype=torch.float64, device=self.groups.device
        )  # correct, margin, loss, pairs
        width = 2 * self.cfg.rm.eval_micro_batch_size
        for start in range(0, len(rows), width):  # one forward per chunk (the last may be short)
            chunk = rows[start : start + width]
            outs = self.role.run_forward(
                self.val.select(chunk),
                len(chunk),
                lambda o, m: (torch.zeros(()), {"s": last_token_scores(o, m)}),
            )
            if outs is not None and self._collects():
                s = torch.cat([o["s"] for o in outs]).double().cpu()
                better, worse = (s[1::2], s[0::2]) if self.cost else (s[0::2], s[1::2])
                diff = better - worse
                loss = -torch.nn.functional.logsigmoid(diff)
                totals += torch.tensor(
                    [float((diff > 0).sum()), float(diff.sum()), float(loss.sum()), len(diff)],
                    device=totals.device,
                )
        dist.all_reduce(totals)
        n = max(float(totals[3]), 1.0)
        return {
            "val/accuracy": float(totals[0]) / n,
            "val/margin": float(totals[1]) / n,
            "val/loss": float(totals[2]) / n,
        }


def run(cfg: RMJobConfig, run_dir: Path) -> dict[str, float]:
    """One rank's part of the job (torch.distributed initialised); the last held-out metrics."""
    from rl3d.checkpoint import CheckpointManager
    from rl3d.data import load_tokenizer
    from rl3d.engine import MegatronEngine
    from rl3d.logging import JsonlMetricsWriter, Progress
    from rl3d.models.bootstrap import init_megatron
    from rl3d.models.spec import spec_of
    from rl3d.parallel import ParallelLayout

    par, rank = cfg.parallel, dist.get_rank()
    spec = spec_of(cfg.model)
    tokenizer = load_tokenizer(cfg.data.tokenizer or cfg.model.hf_path, vocab_size=spec.vocab_size)
    train_rows, val_rows = load_pairs(cfg, run_dir, rank)
    train, dropped = pair_tensors(train_rows, tokenizer, max_length=cfg.data.max_length)
    val, val_dropped = pair_tensors(val_rows, tokenizer, max_length=cfg.data.max_length)
    if dropped or val_dropped:
        logger.warning(
            "dropped %d train and %d held-out pairs longer than data.max_length", dropped, val_dropped
        )
    logger.info(
        "reward model (%s): %d train pairs, %d held out", cfg.rm.objective, len(train) // 2, len(val) // 2
    )
    groups = init_megatron(ParallelLayout(par.pp, par.tp, par.dp), seed=cfg.trainer.seed)
    steps = cfg.trainer.total_steps
    role = MegatronEngine.from_config(
        spec,
        groups,
        role="critic",
        model=cfg.model,
        seed=cfg.trainer.seed,
        optim=cfg.optim,
        total_steps=steps,
        hf_path=cfg.model.hf_path,
    )
    trainer = RMTrainer(cfg, role, train, val)
    writes = rank == 0
    sink = JsonlMetricsWriter(run_dir / "metrics.jsonl", rank=0) if writes and cfg.logging.jsonl else None
    progress = Progress(steps, emit=logger.info if writes else (lambda _: None))
    history: list[dict[str, float]] = []
    metrics = trainer.evaluate() | {"step": 0}
    history.append(metrics)
    for step in range(1, steps + 1):
        metrics = trainer.step()
        if step % cfg.rm.eval_every == 0 or step == steps:
            metrics |= trainer.evaluate()
        if sink is not None:
            sink.log(step, metrics)
        history.append(metrics | {"step": step})
        progress.update(
            1,
            {"acc": metrics["train/accuracy"]}
            | ({"val_acc": metrics["val/accuracy"]} if "val/accuracy" in metrics else {}),
        )
    final = {k: v for k, v in history[-1].items() if k.startswith("val/")}
    manager = CheckpointManager(
        run_dir / "checkpoints",
        keep_last=cfg.keep_last,
        identity={"model": cfg.model.label, "layout": f"reward_model {groups.layout}"},
    )
    meta = {"job": "reward_model", "objective": cfg.rm.objective, "model": cfg.model.label, **final}
    manager.save(
        steps,
        lambda tmp: save_reward_model(role, tmp / RM_WEIGHTS, meta=meta),
        rank=rank,
        world_size=dist.get_world_size(),
        barrier=dist.barrier,
        meta=meta,
    )
    if writes:
        write_rm_summary(history, run_dir, final)
    return final


def write_rm_summary(history: list[dict[str, float]], run_dir: Path, final: dict[str, float]) -> None:
    """rm_summary.json, rm_curve.csv (one row per evaluated step) and rm_curve.png."""
    import csv

    rows = [h for h in history if "val/accuracy" in h]
    with open(run_dir / "rm_curve.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["step", "val_accuracy", "val_margin", "val_loss"])
        for h in rows:
            writer.writerow([h["step"], h["val/accuracy"], h["val/margin"], h["val/loss"]])
    (run_dir / "rm_summary.json").write_text(json.dumps(final | {"steps": history[-1]["step"]}, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(
        [h["step"] for h in rows],
        [h["val/accuracy"] for h in rows],
        marker="o",
        label="held-out pair accuracy",
    )
    train = [h for h in history if "train/accuracy" in h]
    ax.plot(
        [h["step"] for h in train],
        [h["train/accuracy"] for h in train],
        alpha=0.4,
        label="train batch accuracy",
    )
    ax.set_xlabel("step")
    ax.set_ylim(0, 1.02)
    ax.legend()
    ax.set_title("reward model")
    fig.tight_layout()
    fig.savefig(run_dir / "rm_curve.png", dpi=100)
    plt.close(fig)


# -- entry points ----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """The torchrun entry: `torchrun --nproc-per-node N -m rl3d.controller.rm_train RECIPE [k=v ...]`."""
    from rl3d.config import ConfigError, load_config, run_dir_of, write_resolved_config
    from rl3d.logging.process import setup_process, threads_per_rank
    from rl3d.utils.device import init_process_group, resolve_device
    from rl3d.utils.lifetime import die_with_launcher

    die_with_launcher()  # a rank ends with its torchrun, however that ends
    argv = sys.argv[1:] if argv is None else argv
    try:
        loaded = load_config(argv[0], argv[1:])
    except ConfigError as err:
        print(f"rl3d: config error: {err}", file=sys.stderr)  # noqa: T201
        return 2
    cfg = loaded.config
    if not isinstance(cfg, RMJobConfig):
        print(f"rl3d: {argv[0]} is not a reward-model recipe (job: reward_model)", file=sys.stderr)  # noqa: T201
        return 2
    run_dir = run_dir_of(cfg)
    rank = int(os.environ.get("RANK", "0"))
    device = resolve_device(cfg.launch.device)
    threads = threads_per_rank(cfg.launch.nproc_per_node) if device == "cpu" else None
    setup_process(cfg.logging, rank=rank, log_dir=run_dir / "logs", num_threads=threads)
    init_process_group(device, timeout_s=cfg.launch.timeout_s)
    try:
        if rank == 0:
            write_resolved_config(loaded, run_dir)
        final = run(cfg, run_dir)
        if rank == 0:
            logger.info("held-out: %s", ", ".join(f"{k} {v:.4f}" for k, v in final.items()))
        return 0
    except Exception as err:
        return report_rank_failure(err, rank, run_dir / "logs")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
