"""Offload around generation on a real megatron role (gloo, CPU): the role's parameter, gradient
and optimizer storages really leave (zero bytes held, the bytes in separate host buffers), come
back byte for byte, and training after the round trip equals training without it bit for bit
(torch.equal of every parameter and Adam state after two optimizer steps). The CUDA part (bytes
freed per torch.cuda.memory_allocated) runs in benchmarks/gpu_session.sh."""

import pytest
import torch

from rl3d.config import OptimConfig
from rl3d.engine import Features, InitialWeights, MegatronEngine, Training
from rl3d.engine.techniques import Offload
from rl3d.models.offload import OFFLOAD_KINDS, kind_tensors
from rl3d.models.spec import get_model_spec
from rl3d.single_controller.batch import DataBatch

B, P, R = 4, 5, 3


def make_role(groups, hf_dirs, dtype, offload=()):
    return MegatronEngine(
        get_model_spec("tiny-llama"),
        groups,
        role="actor",
        params_dtype=dtype,
        seed=3,
        training=Training(OptimConfig(lr=1e-2, weight_decay=0.01), total_steps=10),
        weights=InitialWeights(hf_path=hf_dirs["tiny-llama"]),
        features=Features([Offload(offload)] if offload else []),
    )


def batch_of(step, vocab):
    ids = torch.randint(3, vocab, (B, P + R), generator=torch.Generator().manual_seed(step))
    mask = torch.ones(B, P + R, dtype=torch.long)
    mask[:2, :2] = 0
    return DataBatch(
        {"input_ids": ids, "attention_mask": mask, "responses": ids[:, P:],
         "response_mask": torch.ones(B, R, dtype=torch.long)}
    )  # fmt: skip


def train(role, step):
    def loss_of(output, micro):
        logits = role.response_slice(output, micro).float()
        return torch.log_softmax(logits, -1).gather(-1, micro["responses"][..., None]).mean().neg(), {}

    role.train_minibatches(
        batch_of(step, role.spec.vocab_size), mini_batch_size=B, micro_batch_size=2, epochs=1,
        loss_of=loss_of, count_unit=lambda m: float(m["response_mask"].sum()),
    )  # fmt: skip


def state(role):
    """Every tensor of every kind, cloned, in a fixed order."""
    return {k: [t.clone() for t in kind_tensors(role.ddp, role.optimizer, k)] for k in OFFLOAD_KINDS}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_offload_round_trip_is_bit_exact_and_frees_the_storages(groups_1x1, tiny_hf_dirs, dtype):
    plain = make_role(groups_1x1, tiny_hf_dirs, dtype)
    moved = make_role(groups_1x1, tiny_hf_dirs, dtype, offload=OFFLOAD_KINDS)
    for step in range(2):
        train(plain, step)
        train(moved, step)
        before = state(moved)
        held = moved.offload.device_bytes()
        assert all(held[k] > 0 for k in OFFLOAD_KINDS), held
        if dtype == torch.bfloat16:  # fp32 master copies and Adam's two states: ~12 bytes a param
            assert held["optimizer"] == pytest.approx(6 * held["params"], rel=0.01)
        freed = moved.to_host()
        assert freed == sum(held.values())
        assert moved.offload.device_bytes() == dict.fromkeys(OFFLOAD_KINDS, 0)
        for kind in OFFLOAD_KINDS:  # every tensor's storage is gone, views included
            assert all(
                t.untyped_storage().nbytes() == 0 for t in kind_tensors(moved.ddp, moved.optimizer, kind)
            )
        scratch = [
            torch.full_like(t, 7.0) for ts in before.values() for t in ts
        ]  # "generation" reuses memory
        assert moved.to_host() == 0  # already on the host
        moved.resident()
        del scratch
        after = state(moved)
        for kind in OFFLOAD_KINDS:
            assert all(torch.equal(a, b) for a, b in zip(before[kind], after[kind], strict=True)), kind
        moved.to_host()  # the next use brings them back by itself
    train(plain, 2)
    train(moved, 2)
    for kind in OFFLOAD_KINDS:
        pairs = zip(state(plain)[kind], state(moved)[kind], strict=True)
        assert all(torch.equal(a, b) for a, b in pairs), kind


def test_only_the_named_kinds_leave(groups_1x1, tiny_hf_dirs):
    role = make_role(groups_1x1, tiny_hf_dirs, torch.bfloat16, offload=("optimizer",))
    train(role, 0)
    params = [t.untyped_storage().nbytes() for t in kind_tensors(role.ddp, role.optimizer, "params")]
    role.to_host()
    assert [t.untyped_storage().nbytes() for t in kind_tensors(role.ddp, role.optimizer, "params")] == params
    assert role.offload.device_bytes() == {"optimizer": 0}
    shards = role.global_shards()  # a use of the model: everything resident again
    assert role.offload.device_bytes()["optimizer"] > 0 and all(t.numel() for t in shards.values())


def test_a_frozen_role_offloads_its_params(groups_1x1, tiny_hf_dirs):
    reference = MegatronEngine(
        get_model_spec("tiny-llama"),
        groups_1x1,
        role="reference",
        params_dtype=torch.float32,
        seed=3,
        weights=InitialWeights(hf_path=tiny_hf_dirs["tiny-llama"]),
        features=Features([Offload(("params",))]),
    )
    before = {n: t.clone() for n, t in reference.global_shards().items()}
    assert reference.to_host() == sum(t.nbytes for t in before.values())
    assert reference.offload.device_bytes() == {"params": 0}
    after = reference.global_shards()
    assert all(torch.equal(after[n], t) for n, t in before.items())
