"""Microbenchmarks of this machine for the step simulator's CPU device class.

Times rl3d's own components with one thread per process (as each quickstart rank runs): a
matmul at the model's shapes, a memory copy, megatron forwards (log-probs) and training passes
(PPO-style mini/micro-batches, Adam) of the recipe's model at 1 and 2 layers and 1-4
micro-batches in one process and at tensor parallelism 2 in two, the critic's (value head,
value loss) likewise, the torch rollout engine at 1 and 2 layers and 1-8 new tokens, the
controller's whole generate stage in a one-rank run and with a separate rollout pool of one
rank (`simulator_stages.py`); and between two processes gloo's all-reduce (CPU seconds per
call, bandwidth fitted) and an object gather of a worker's output. Everything is timed as
process CPU seconds, the quantity the validation measures in its runs: a rank's own work,
without the time it waits for a peer or for a core (gloo blocks while it waits). A row keeps
all `--repeats` and, as its seconds, their low percentile
(`rl3d.planning.calibration.low_percentile`); a fact the least of the repeats.
Writes the calibration JSON that `rl3d.planning.calibration.cpu_device` reads:

    python benchmarks/simulator_microbench.py recipes/quickstart_cpu_ppo.yaml --out calib.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from simulator_stages import _row, cpu_times, separate_rows, stage_rows

from rl3d.bench.cost_model import fit_alpha_beta
from rl3d.config import load_config
from rl3d.models.spec import spec_of
from rl3d.planning.simulator import forward_flops
from rl3d.single_controller.batch import DataBatch
from rl3d.utils.net import free_port


def cpu_min(fn, repeats: int) -> float:
    return min(cpu_times(fn, repeats))


def wall_min(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _gloo_worker(rank: int, port: int, repeats: int, rollout: DataBatch, out) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    rows = []
    for n in [2**k for k in range(10, 23, 2)]:
        t = torch.zeros(n // 4)
        rows.append((1, n, cpu_min(lambda t=t: dist.all_reduce(t), repeats)))
    output = {"old_logp": torch.randn(16, 8), "entropy": torch.randn(16, 8)}  # a rank's share
    gathered: list = [None, None]
    small = torch.zeros(64)
    call_cpu_s = cpu_min(lambda: [dist.all_reduce(small) for _ in range(50)], repeats) / 50
    gather_s = wall_min(lambda: dist.all_gather_object(gathered, output), repeats)
    gather_cpu_s = cpu_min(lambda: dist.all_gather_object(gathered, output), repeats)
    rollout_cpu_s = cpu_min(lambda: dist.all_gather_object(gathered, rollout), repeats)
    if rank == 0:
        out.put(
            {
                "allreduce": rows,
                "gather_s": gather_s,
                "gather_cpu_s": gather_cpu_s,
                "rollout_cpu_s": rollout_cpu_s,
                "call_cpu_s": call_cpu_s,
            }
        )
    dist.destroy_process_group()


def gloo_facts(repeats: int, rollout: DataBatch) -> dict:
    """gloo between two processes, in CPU seconds: all-reduces of 1 KiB-4 MiB (their bandwidth)
    and of 64 floats (per call), an object gather of a forward's outputs and of a replica's
    rollout rows (and the former's wall seconds)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_gloo_worker, args=(r, port, repeats, rollout, queue)) for r in (0, 1)]
    for p in procs:
        p.start()
    got = queue.get(timeout=600)
    for p in procs:
        p.join()
    # a 2-rank ring all-reduce of n bytes sends n bytes each way in all (two halves, twice)
    alpha, bandwidth, r2 = fit_alpha_beta(got["allreduce"])
    return {"gloo_alpha_us": alpha * 1e6, "gloo_gbps": bandwidth / 1e9, "gloo_fit_r2": r2,
            "gather_us": got["gather_s"] * 1e6, "gather_cpu_us": got["gather_cpu_s"] * 1e6,
            "gloo_call_cpu_us": got["call_cpu_s"] * 1e6,
            "gather_rollout_cpu_us": got["rollout_cpu_s"] * 1e6}  # fmt: skip


def batch_of(spec, samples: int, prompt_len: int, response_len: int) -> DataBatch:
    T = prompt_len + response_len
    ids = torch.randint(0, spec.vocab_size, (samples, T))
    logp = -torch.rand(samples, response_len)  # what the policy loss reads besides the model's output
    return DataBatch({
        "input_ids": ids, "attention_mask": torch.ones(samples, T, dtype=torch.long),
        "responses": ids[:, prompt_len:], "response_mask": torch.ones(samples, response_len),
        "old_logp": logp, "rollout_logp": logp, "advantages": torch.randn(samples, response_len),
        "values": torch.randn(samples, response_len), "returns": torch.randn(samples, response_len),
    })  # fmt: skip


def _critic_passes(cfg, role):
    """The critic's forward (its values) and loss (the clipped value loss), as its worker runs them."""
    from rl3d.algos import clipped_value_loss

    def values(output, micro):
        return role.response_slice(output, micro)[..., 0].float()

    def extract(output, micro):
        return torch.zeros(()), {"values": values(output, micro).detach()}

    def loss_of(output, micro):
        loss, metrics = clipped_value_loss(
            values_BT=values(output, micro), old_values_BT=micro["values"], returns_BT=micro["returns"],
            mask_BT=micro["response_mask"].bool(), clip_range=cfg.algorithm.value_clip_range,
            loss_agg_mode=cfg.algorithm.loss_agg_mode,
        )  # fmt: skip
        return loss, {k: v.detach() for k, v in metrics.items()}

    return extract, loss_of


def _role_rows(cfg, groups, batch: DataBatch, layers: int, repeats: int, name: str = "actor") -> list[dict]:
    """Forward and training rows of one role (`name`: actor or critic); at tensor parallelism
    t > 1 each row also counts the layer all-reduces the simulator charges (2 per layer forward,
    4 forward + backward)."""
    from rl3d.algos import policy_loss_of
    from rl3d.engine import Features, MegatronEngine, Training
    from rl3d.engine.techniques import MoE
    from rl3d.models.logprobs import vocab_parallel_logprobs_entropy

    spec = replace(spec_of(cfg.model), num_layers=layers)
    role = MegatronEngine(
        spec,
        groups,
        role=name,
        params_dtype=torch.float32,
        seed=1,
        training=Training(getattr(cfg, name).optim, total_steps=1000),
        features=Features([MoE()] if spec.is_moe else []),  # a trained MoE counts its expert loads
    )

    def logp(output, micro):
        logits = role.response_slice(output, micro)
        return vocab_parallel_logprobs_entropy(
            logits, micro["responses"], groups.tp_group, vocab_size=spec.vocab_size
        )

    def extract(output, micro):
        lp, ent = logp(output, micro)
        return torch.zeros(()), {"old_logp": lp.detach(), "entropy": ent.detach()}

    policy_loss = policy_loss_of(cfg.algorithm)

    def loss_of(output, micro):  # the actor's update: the recipe's policy loss, as the worker calls it
        lp, ent = logp(output, micro)
        loss, metrics = policy_loss(
            logp_BT=lp, old_logp_BT=micro["old_logp"], adv_BT=micro["advantages"],
            mask_BT=micro["response_mask"].bool(), entropy_BT=ent, ref_logp_BT=None, kl_loss_coef=0.0,
            kl_estimator=cfg.algorithm.kl_estimator, rollout_logp_BT=micro["rollout_logp"],
        )  # fmt: skip
        return loss, {k: v.detach() for k, v in metrics.items()}

    critic = name == "critic"
    if critic:
        extract, loss_of = _critic_passes(cfg, role)

    def train(mini: int, micro: int) -> None:
        role.train_minibatches(
            batch, mini_batch_size=mini, micro_batch_size=micro, epochs=1, loss_of=loss_of,
            count_unit=lambda mb: float(mb["response_mask"].sum()),
        )  # fmt: skip

    samples, T = batch["input_ids"].shape
    t = groups.layout.t
    flops, rows, tp = forward_flops(spec, samples * T, T / 2) / t, [], t > 1
    # the critic's rows name its own micro-batch and layer costs; FLOPs as the simulator counts them
    fwd_kind, train_kind, pre = (
        ("critic_forward", "critic_train", "critic_") if critic else ("forward", "train", "")
    )

    def tp_row(row: dict, micro: int, k: int, per_layer: int) -> dict:
        if tp:
            row["kind"] += "_tp"
            if row["kind"].endswith("forward_tp"):
                row["counts"][f"{pre}tp_micro_s"] = k
            else:
                steps = row["counts"][f"{pre}optim_step_s"]
                row["counts"] |= {f"{pre}train_tp_micro_s": k, "train_tp_step_s": steps}
            row |= {"allreduces": k * per_layer * layers, "allreduce_bytes": micro * T * spec.hidden_size * 4}
        return row

    for micro in (samples, samples // 2, samples // 4):
        k = samples // micro
        times = cpu_times(lambda m=micro: role.run_forward(batch, m, extract), repeats)
        counts = {
            f"{pre}call_s": 1,
            f"{pre}call_layer_s": layers,
            f"{pre}micro_s": k,
            f"{pre}layer_s": k * layers,
        }
        rows.append(tp_row(_row(fwd_kind, layers, flops, times, **counts), micro, k, 2))
    quarter = samples // 4
    for mini, micro in ((samples, samples), (samples, quarter), (samples // 2, quarter), (quarter, quarter)):
        k, steps = samples // micro, samples // mini
        times = cpu_times(lambda a=mini, b=micro: train(a, b), repeats)
        counts = {f"{pre}train_call_s": 1, f"{pre}train_call_layer_s": layers, f"{pre}train_micro_s": k,
                  f"{pre}train_layer_s": k * layers, f"{pre}optim_step_s": steps}  # fmt: skip
        row = _row(train_kind, layers, 3 * flops, times, **counts)
        rows.append(tp_row(row, micro, k, 4))
    return rows


def megatron_rows(cfg, repeats: int, rank: int = 0, tp: int = 1, port: int | None = None) -> list[dict]:
    """Forward and training passes of the recipe's model at 1 and 2 layers, on this process as
    rank `rank` of a world of `tp` ranks in tensor parallelism: the actor's and the critic's."""
    from rl3d.models.bootstrap import destroy_megatron, init_megatron
    from rl3d.parallel.layout import ParallelLayout

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port or free_port()}", rank=rank,
                            world_size=tp, timeout=datetime.timedelta(seconds=600))  # fmt: skip
    groups = init_megatron(ParallelLayout(1, tp, 1), seed=1)
    torch.manual_seed(0)  # the same batch on every rank
    samples = cfg.data.prompts_per_step * cfg.rollout.n
    batch = batch_of(spec_of(cfg.model), samples, cfg.data.max_prompt_length, cfg.rollout.max_new_tokens)
    names = ("actor", "critic")
    rows = [r for n in names for layers in (1, 2) for r in _role_rows(cfg, groups, batch, layers, repeats, n)]
    destroy_megatron()
    dist.destroy_process_group()
    return rows


def _tp_worker(rank: int, port: int, recipe: str, repeats: int, out) -> None:
    rows = megatron_rows(load_config(recipe).config, repeats, rank=rank, tp=2, port=port)
    if rank == 0:
        out.put(rows)


def tp_rows(recipe: Path, repeats: int) -> list[dict]:
    """`megatron_rows` at tensor parallelism 2, in two processes (rank 0's timings)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_tp_worker, args=(r, port, str(recipe), repeats, queue)) for r in (0, 1)]
    for p in procs:
        p.start()
    rows = queue.get(timeout=1200)
    for p in procs:
        p.join()
    return rows


def _engine_rows(cfg, layers: int, repeats: int) -> list[dict]:
    """A replica's rollout (t_g = 1, two replicas) of the recipe's first prompts, as the actor's
    worker makes it: the torch engine, the log-probs, the rows as the trainer's batch."""
    from dataclasses import replace as with_

    from rl3d.bench.rollout import random_weights
    from rl3d.controller.assemble import PromptBatches, build_data
    from rl3d.controller.placement import round_uids
    from rl3d.rollout import TorchRolloutEngine
    from rl3d.workers.generation import Generation

    n, P = cfg.rollout.n, cfg.data.max_prompt_length
    prompts = PromptBatches(build_data(cfg).sampler).next_batch()
    prompts.set("uid", round_uids(1, 0, len(prompts)))  # as the trainer's step 1 marks them
    share = prompts.select(list(range(max(1, len(prompts) // 2))))
    spec = replace(spec_of(cfg.model), num_layers=layers)
    engine = TorchRolloutEngine(spec, random_weights(spec, 0))  # the default max_batch_rows, as runs use
    rows, seqs = [], len(share) * n
    for k in (1, 4, 8):
        gen = Generation(
            with_(cfg, rollout=with_(cfg.rollout, max_new_tokens=k)), engine, None, pad_token_id=0
        )
        flops = forward_flops(spec, seqs * P, P / 2) + k * forward_flops(spec, seqs, P + k / 2)
        times = cpu_times(lambda g=gen: g.generate(share, step=1, gen_dp_rank=0), repeats)
        rows.append(_row("generate", layers, flops, times, gen_call_s=1, step_overhead_s=k,
                         decode_layer_s=(k + 1) * layers))  # fmt: skip
    return rows


def rollout_share(cfg) -> DataBatch:
    """A replica's rollout rows of the recipe's first prompts, as the actor's worker returns them."""
    from rl3d.bench.rollout import random_weights
    from rl3d.controller.assemble import PromptBatches, build_data
    from rl3d.controller.placement import round_uids
    from rl3d.rollout import TorchRolloutEngine
    from rl3d.single_controller.batch import to_host
    from rl3d.workers.generation import Generation

    prompts = PromptBatches(build_data(cfg).sampler).next_batch()
    prompts.set("uid", round_uids(1, 0, len(prompts)))
    share = prompts.select(list(range(max(1, len(prompts) // 2))))
    spec = spec_of(cfg.model)
    gen = Generation(cfg, TorchRolloutEngine(spec, random_weights(spec, 0)), None, pad_token_id=0)
    return to_host(gen.generate(share, step=1, gen_dp_rank=0).batch)


def _score_rows(cfg, batch: DataBatch, repeats: int) -> list[dict]:
    """The reward worker's rule reward of a batch of rollouts and of its first half."""
    from rl3d.controller.rank import run_tokenizer
    from rl3d.workers.roles import RewardWorker

    worker, rows = RewardWorker(cfg, run_tokenizer(cfg, spec_of(cfg.model))), []
    for part in (batch, batch.select(list(range(len(batch) // 2)))):
        times = cpu_times(lambda b=part: worker.compute_reward(b), repeats)
        rows.append(_row("score", 0, 0.0, times, score_sample_s=len(part)))
    return rows


def calibrate(recipe: Path, repeats: int) -> dict:
    torch.set_num_threads(1)
    cfg = load_config(recipe).config
    spec = spec_of(cfg.model)
    tokens = cfg.actor.micro_batch_size * (cfg.data.max_prompt_length + cfg.rollout.max_new_tokens)
    a, b = torch.randn(tokens, spec.hidden_size), torch.randn(spec.hidden_size, spec.ffn_hidden_size)
    matmul = cpu_min(lambda: [a @ b for _ in range(20)], repeats * 5) / 20
    big = torch.randn(16 * 2**20 // 4)
    copy = cpu_min(lambda: big.clone(), repeats)
    rollout = rollout_share(cfg)
    facts = {
        "load": os.getloadavg(),
        "matmul_gflops": 2 * tokens * spec.hidden_size * spec.ffn_hidden_size / matmul / 1e9,
        "copy_gbps": 2 * big.numel() * 4 / copy / 1e9,  # read and write
        **gloo_facts(repeats * 4, rollout),
    }
    facts["rows"] = (
        megatron_rows(cfg, repeats)
        + tp_rows(recipe, repeats)
        + [r for L in (1, 2) for r in _engine_rows(cfg, L, repeats)]
        + _score_rows(cfg, rollout, repeats)
        + stage_rows(recipe, repeats)
        + separate_rows(recipe, repeats)
    )
    facts["load_after"] = os.getloadavg()
    return facts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    args.out.write_text(json.dumps(calibrate(args.recipe, args.repeats), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
