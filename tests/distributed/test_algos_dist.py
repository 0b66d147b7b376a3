"""Cross-rank reductions in rl3d.algos: two gloo ranks, each holding part of a batch, must get the
same statistics as one process holding the concatenated batch.

Losses: each rank returns its share, so the *average* over ranks (what DP gradient averaging
computes) equals the single-process loss, and so does the average of the ranks' gradients.
"""

import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rl3d import algos

WORLD_SIZE = 2
ROWS = {0: slice(0, 3), 1: slice(3, 5)}  # unequal shards
AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")


def _full_batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1234)
    num_rows, num_tokens = 5, 6
    batch = {
        name: torch.randn(num_rows, num_tokens, generator=gen, dtype=torch.float64)
        for name in ("rewards", "values", "old_values", "logp", "old_logp", "adv")
    }
    mask = torch.rand(num_rows, num_tokens, generator=gen) < 0.7
    mask[:, 0] = True
    mask[4] = False  # a padding-only row on rank 1
    batch["mask"] = mask
    batch["costs"] = torch.randn(num_rows, generator=gen, dtype=torch.float64)
    return batch


def _compute(batch: dict[str, torch.Tensor], group: dist.ProcessGroup | None) -> dict[str, torch.Tensor]:
    mask = batch["mask"]
    out = {
        "masked_mean": algos.masked_mean(batch["rewards"], mask, group=group),
        "masked_var": algos.masked_var(batch["rewards"], mask, group=group),
        "whiten": algos.masked_whiten(batch["rewards"], mask, group=group),
        "rpp_adv": algos.reinforce_plus_plus_advantages(
            rewards_BT=batch["rewards"], mask_BT=mask, group=group
        ).adv_BT,
        "gae_adv": algos.compute_advantages(
            "gae", rewards_BT=batch["rewards"], values_BT=batch["values"], mask_BT=mask, group=group, lam=0.9
        ).adv_BT,
        "episode_cost": torch.tensor(algos.episode_cost(batch["costs"], group=group)),
    }
    for mode in AGG_MODES:
        logp = batch["logp"].clone().requires_grad_(True)
        loss, _ = algos.ppo_policy_loss(
            logp_BT=logp,
            old_logp_BT=batch["old_logp"],
            adv_BT=batch["adv"],
            mask_BT=mask,
            loss_agg_mode=mode,
            group=group,
        )
        loss.backward()
        out[f"pg_loss/{mode}"], out[f"pg_grad/{mode}"] = loss.detach(), logp.grad
        values = batch["values"].clone().requires_grad_(True)
        vf_loss, _ = algos.clipped_value_loss(
            values_BT=values,
            old_values_BT=batch["old_values"],
            returns_BT=batch["rewards"],
            mask_BT=mask,
            loss_agg_mode=mode,
            group=group,
        )
        vf_loss.backward()
        out[f"vf_loss/{mode}"], out[f"vf_grad/{mode}"] = vf_loss.detach(), values.grad
    return out


def _worker(rank: int, port: int, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    try:
        dp_group = dist.new_group(list(range(WORLD_SIZE)))
        shard = {name: x[ROWS[rank]] for name, x in _full_batch().items()}
        torch.save(_compute(shard, dp_group), Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.distributed
def test_cross_rank_reductions_equal_single_process_on_concatenated_batch(tmp_path):
    mp.spawn(_worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD_SIZE, join=True)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(WORLD_SIZE)]
    single = _compute(_full_batch(), group=None)

    for key in ("masked_mean", "masked_var", "episode_cost"):
        for result in ranks:
            torch.testing.assert_close(result[key], single[key])
    for key in ("whiten", "rpp_adv", "gae_adv"):
        torch.testing.assert_close(torch.cat([r[key] for r in ranks]), single[key])
    # Global whitening really is global: neither shard alone has zero mean.
    assert all(abs(r["rpp_adv"][r["rpp_adv"] != 0].mean().item()) > 1e-3 for r in ranks)

    for mode in AGG_MODES:
        for kind in ("pg", "vf"):
            mean_loss = sum(r[f"{kind}_loss/{mode}"] for r in ranks) / WORLD_SIZE
            torch.testing.assert_close(mean_loss, single[f"{kind}_loss/{mode}"])
            averaged_grads = torch.cat([r[f"{kind}_grad/{mode}"] for r in ranks]) / WORLD_SIZE
            torch.testing.assert_close(averaged_grads, single[f"{kind}_grad/{mode}"])
