"""Routing replay over pipeline stages: a tiny Qwen3-MoE (2 layers) at PP=2 on gloo, each stage
holding one MoE layer. The old-log-prob forward's record holds both stages' layers on both
stages and equals HF transformers' router top-k of the same weights; replaying another record,
each stage's router chooses exactly it for its own layer, and the mismatch counts sum both
stages' decisions (counted exactly with the record's own layer 0, so that layer 1 reads the
hidden states it was recorded on)."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from rl3d.testing.spawn import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[3]
RECIPE = ROOT / "recipes/quickstart_cpu_grpo.yaml"
B, P, R = 6, 5, 4


def make_batch(vocab: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (B, P + R), generator=gen)
    prompt_len = torch.tensor([5, 3, 1, 4, 5, 2])
    resp_len = torch.tensor([4, 1, 3, 4, 2, 3])
    cols = torch.arange(P + R)
    mask = ((cols >= P - prompt_len[:, None]) & (cols < P + resp_len[:, None])).long()
    return {"input_ids": ids * mask, "attention_mask": mask, "responses": ids[:, P:] * mask[:, P:],
            "response_mask": mask[:, P:]}  # fmt: skip


def worker(rank, world, hf_dir, tensors, foreign):
    from rl3d.config import load_config
    from rl3d.config.pools import role_pools
    from rl3d.engine import MegatronEngine
    from rl3d.models.bootstrap import destroy_megatron, init_megatron
    from rl3d.models.routing_replay import token_routing
    from rl3d.models.spec import spec_of
    from rl3d.single_controller.batch import ROUTING, DataBatch

    overrides = ["model.name=null", f"model.hf_path={hf_dir}", "model.dtype=float32",
                 "actor.parallel={tp: 1, pp: 2, dp: 1}", "launch.nproc_per_node=2"]  # fmt: skip
    cfg = load_config(RECIPE, overrides).config
    groups = init_megatron(role_pools(cfg)[0].layout, seed=cfg.trainer.seed)
    spec = spec_of(cfg.model)
    role = MegatronEngine.from_config(
        spec, groups, role="actor", model=cfg.model, seed=1, hf_path=hf_dir, routing_replay=True
    )
    batch = DataBatch(dict(tensors))

    def extract(output, micro):
        return torch.zeros(()), {}

    role.run_forward(batch, 3, extract, record_routing=True)
    record = role.replay.result[ROUTING]
    maps = []
    (layer,) = role.model.decoder.layers  # this stage's one layer
    layer.mlp.router.register_forward_hook(lambda _m, _a, out: maps.append(out[1]))
    with_foreign = batch.union(DataBatch({ROUTING: foreign}))
    role.run_forward(with_foreign, B, extract)  # one micro-batch
    mixed = foreign.clone()
    mixed[:, :, 0] = record[:, :, 0]
    role.run_forward(batch.union(DataBatch({ROUTING: mixed})), 3, extract)
    counts = role.replay.result
    ids_NLK, real_N = token_routing(with_foreign[ROUTING], with_foreign, spec.moe_top_k)
    want = F.one_hot(ids_NLK[:, layer.layer_number - 1], spec.num_experts).sum(1).bool()
    chose_it = torch.equal(maps[0][real_N], want[real_N])
    destroy_megatron()
    return layer.layer_number - 1, record, counts.tensors, chose_it


def test_pp2_records_and_replays_each_stages_layers(tmp_path):
    from transformers import AutoModelForCausalLM

    from rl3d.single_controller.batch import ROUTING_DECISIONS, ROUTING_DIFFER
    from rl3d.testing.tiny_hf import save_tiny_hf_model

    hf_dir = tmp_path / "tiny-qwen3-moe"
    save_tiny_hf_model("tiny-qwen3-moe", hf_dir, seed=5)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    k, E, L = model.config.num_experts_per_tok, model.config.num_experts, model.config.num_hidden_layers
    tensors = make_batch(model.config.vocab_size)
    gen = torch.Generator().manual_seed(1)
    foreign = torch.rand(B, P + R, L, E, generator=gen).argsort(-1)[..., :k].to(torch.int16)
    results = run_distributed(worker, 2, str(hf_dir), tensors, foreign, timeout_s=300)
    assert [r[0] for r in results] == [0, 1]  # one layer per stage
    record = results[0][1]
    assert torch.equal(record, results[1][1])  # both stages' layers on both stages
    real_BT = tensors["attention_mask"].bool()
    mask = tensors["attention_mask"]
    with torch.no_grad():
        out = model(input_ids=tensors["input_ids"], attention_mask=mask,
                    position_ids=(mask.cumsum(-1) - 1).clamp(min=0), output_router_logits=True)  # fmt: skip
    hf = torch.stack([torch.topk(lg.view(B, P + R, E), k, dim=-1).indices for lg in out.router_logits], 2)
    same = (hf[real_BT].sort(-1).values == record[real_BT].long().sort(-1).values).all(-1).float().mean()
    assert same >= 0.99, same  # fp32 rounding may break a near tie
    assert all(r[3] for r in results)  # each stage's router chose the foreign record
    mixed = foreign.clone()
    mixed[:, :, 0] = record[:, :, 0]
    differ_BTL = (record.sort(-1).values != mixed.sort(-1).values).any(-1) & real_BT[..., None]
    assert differ_BTL[..., 1].sum() > 0
    for _, _, counts, _ in results:
        assert torch.equal(counts[ROUTING_DIFFER], differ_BTL.sum((1, 2)).float())
        assert torch.equal(counts[ROUTING_DECISIONS], real_BT.sum(1).float() * L)
