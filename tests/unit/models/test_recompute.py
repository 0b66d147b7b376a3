"""`actor.recompute: full` (megatron's uniform full recompute, one layer per checkpoint) runs on
CPU: the same outputs and gradients bit for bit as keeping every activation, with a fraction of
the bytes autograd saves."""

import torch

from rl3d.engine import Features, MegatronEngine
from rl3d.engine.micro_batches import attention_mask_4d, position_ids_of
from rl3d.engine.techniques import Recompute
from rl3d.models.spec import get_model_spec
from rl3d.planning.held import SavedActivations


def _run(role: MegatronEngine, ids: torch.Tensor, mask: torch.Tensor):
    model = role.model
    model.zero_grad(set_to_none=True)
    with SavedActivations(model) as saved:
        out = model(ids, position_ids_of(mask), attention_mask_4d(mask))
    out.float().pow(2).mean().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()], saved.per_forward[0]


def test_full_recompute_same_gradients_fewer_saved_bytes(groups_1x1):
    spec = get_model_spec("tiny-llama")
    kw = dict(role="actor", params_dtype=torch.float32, seed=3)
    plain = MegatronEngine(spec, groups_1x1, **kw)
    recomputed = MegatronEngine(spec, groups_1x1, features=Features([Recompute()]), **kw)
    assert recomputed.model.config.recompute_granularity == "full"
    recomputed.model.load_state_dict(plain.model.state_dict())
    for model in (plain.model, recomputed.model):
        model.train()
        model.requires_grad_(True)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, spec.vocab_size, (2, 24), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # a left-padded row
    out_a, grads_a, saved_a = _run(plain, ids, mask)
    out_b, grads_b, saved_b = _run(recomputed, ids, mask)
    assert torch.equal(out_a, out_b)
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b, strict=True))
    assert saved_b < saved_a / 3, (saved_a, saved_b)
