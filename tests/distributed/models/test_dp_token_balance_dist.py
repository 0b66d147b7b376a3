"""Data parallelism deals mini-batches, not contiguous chunks: an actor at DP=2, its samples dealt
to the ranks by `MEGATRON_COMPUTE` with `token_balance` (its mini-batch size), equals the same
actor at DP=1, packed or padded.

Mini-batches are the step's consecutive samples whatever the DP size (each rank holds its part
of every mini-batch), so two optimizer steps over two mini-batches give the DP=1 parameters
within 1e-6, and the log-probs come back in the input order. The ranks' token loads are
balanced where contiguous chunks are not.
"""

import json

import pytest
import test_packing_dist as packing_cases  # its batch maker (same directory)
import torch

from rl3d.testing.spawn import run_distributed

pytestmark = pytest.mark.distributed

MINI, MICRO = 4, 2
RESP_LEN = (10, 1, 9, 2, 1, 10, 2, 8)  # long ones bunch at the front of each half
TOL = 1e-6


def make_batch(vocab):
    return packing_cases.make_batch(vocab, resp_len=RESP_LEN, seed=7)


def worker(rank, world, hf_dir, packing):
    from rl3d.config import OptimConfig
    from rl3d.engine import Features, InitialWeights, MegatronEngine, Training
    from rl3d.engine.techniques import Packing
    from rl3d.models.bootstrap import destroy_megatron, init_megatron
    from rl3d.models.hf_mapping import spec_from_hf_config
    from rl3d.models.logprobs import vocab_parallel_logprobs_entropy
    from rl3d.parallel.layout import ParallelLayout
    from rl3d.single_controller.batch import DataBatch
    from rl3d.single_controller.dispatch import MODES, Dispatch, DispatchInfo

    groups = init_megatron(ParallelLayout(1, 1, world))
    spec = spec_from_hf_config(json.loads(open(f"{hf_dir}/config.json").read()))
    full = DataBatch(make_batch(spec.vocab_size))
    mode = MODES[Dispatch.MEGATRON_COMPUTE]
    slots = {
        balance: mode.slot(
            DispatchInfo(dp_rank=rank, dp_size=world, is_collector=True, token_balance=balance)
        )
        for balance in (0, MINI)
    }
    loads = {b: int(mode.split(full, s)["attention_mask"].sum()) for b, s in slots.items()}
    slot = slots[MINI]
    batch = mode.split(full, slot)
    optim = OptimConfig(lr=1e-3, adam_eps=1e-5, clip_grad=1.0, weight_decay=0.01)
    actor = MegatronEngine(
        spec,
        groups,
        role="actor",
        params_dtype=torch.float32,
        seed=5,
        training=Training(optim, total_steps=10),
        weights=InitialWeights(hf_path=hf_dir),
        features=Features([Packing()] if packing else []),
    )

    def logp_of(output, micro):
        logits = actor.response_slice(output, micro)
        logp, _ = vocab_parallel_logprobs_entropy(
            logits, micro["responses"], groups.tp_group, vocab_size=spec.vocab_size
        )
        return logp * micro["response_mask"]

    def loss_of(output, micro):
        value = -(logp_of(output, micro) * micro["advantages"]).sum() / micro["response_mask"].sum().clamp(
            min=1
        )
        return value, {"loss": value.detach()}

    outs = actor.run_forward(batch, MICRO, lambda o, m: (torch.zeros(()), {"logp": logp_of(o, m)}))
    logp = DataBatch({"logp": torch.cat([o["logp"] for o in outs])})
    before = {k: v.detach().clone() for k, v in actor.unwrapped().named_parameters()}
    rows = actor.train_minibatches(
        batch,
        mini_batch_size=MINI,
        micro_batch_size=MICRO,
        epochs=1,
        loss_of=loss_of,
        count_unit=lambda m: float(m["response_mask"].sum()),
    )
    params = {k: v.detach().clone() for k, v in actor.unwrapped().named_parameters()}
    moved = max((params[k] - v).abs().max().item() for k, v in before.items())
    destroy_megatron()
    perf = [r for r in rows if "perf/pad_fraction" in r]  # one per mini-batch
    return {"slot": slot, "logp": logp, "params": params, "moved": moved, "loads": loads, "perf": perf}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from rl3d.testing.tiny_hf import save_tiny_hf_model

    root = tmp_path_factory.mktemp("hf") / "tiny-qwen2"
    save_tiny_hf_model("tiny-qwen2", root, seed=3)
    return str(root)


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_dp2_trains_the_dp1_mini_batches(hf_dir, packing):
    from rl3d.single_controller.batch import DataBatch
    from rl3d.single_controller.dispatch import MODES, Dispatch

    one = run_distributed(worker, 1, hf_dir, packing, timeout_s=240)[0]
    two = run_distributed(worker, 2, hf_dir, packing, timeout_s=240)
    full = DataBatch(make_batch(256))  # tiny-qwen2: vocab 256
    collected = MODES[Dispatch.MEGATRON_COMPUTE].collect([(r["slot"], r["logp"]) for r in two], "mean", full)
    logp_diff = (collected["logp"] - one["logp"]["logp"]).abs().max().item()
    param_diff = max((two[0]["params"][k] - v).abs().max().item() for k, v in one["params"].items())
    rank_diff = max((two[1]["params"][k] - v).abs().max().item() for k, v in two[0]["params"].items())
    contiguous = [r["loads"][0] for r in two]
    balanced = [r["loads"][MINI] for r in two]
    print(f"logp {logp_diff:.1e}, params {param_diff:.1e}, tokens per rank {contiguous} -> {balanced}")  # noqa: T201
    assert one["moved"] > 1e-4  # two real optimizer steps
    if packing:
        # per-step perf metrics: packed rows hold no pad slot; at DP=1 each mini-batch of 4 runs
        # as 2 packed micro-batches, so a micro-batch carries half the mini-batch's real tokens
        mask = full["attention_mask"]
        expected = [float(mask[k * MINI : (k + 1) * MINI].sum()) / (MINI // MICRO) for k in range(2)]
        assert [r["perf/tokens_per_micro_batch"] for r in one["perf"]] == expected
        assert all(r["perf/pad_fraction"] == 0.0 for res in (one, *two) for r in res["perf"])
    else:  # padded micro-batches compute pad slots; the same two mini-batches at either DP size
        assert all(r["perf/pad_fraction"] > 0.0 for res in (one, *two) for r in res["perf"])
        assert len(one["perf"]) == len(two[0]["perf"]) == 2
    assert logp_diff <= TOL and param_diff <= TOL and rank_diff == 0.0
    assert max(balanced) - min(balanced) < max(contiguous) - min(contiguous)
