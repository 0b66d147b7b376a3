"""Adam's state exists once a training role is built (`make_optimizer_state`), so nothing
allocates it in the middle of the first update, after a rollout engine sized itself from what
was free; and the first steps are the lazy state's bit for bit."""

import torch

from rl3d.config import OptimConfig
from rl3d.engine import InitialWeights, MegatronEngine, Training
from rl3d.models.spec import get_model_spec
from rl3d.single_controller.batch import DataBatch

B, P, R = 4, 5, 3


def _engine(groups, copy_of=None):
    spec = get_model_spec("tiny-llama")
    training = Training(OptimConfig(lr=1e-3), total_steps=4)
    weights = InitialWeights(copy_of=copy_of)
    return MegatronEngine(
        spec, groups, role="actor", params_dtype=torch.float32, seed=3, training=training, weights=weights
    )


def _adams(engine):
    return [o.optimizer for o in getattr(engine.optimizer, "chained_optimizers", None) or [engine.optimizer]]


def _train(engine, step: int) -> None:
    ids = torch.randint(3, engine.spec.vocab_size, (B, P + R), generator=torch.Generator().manual_seed(step))
    batch = DataBatch(
        {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "responses": ids[:, P:],
            "response_mask": torch.ones(B, R, dtype=torch.long),
        }
    )

    def loss_of(output, micro):
        logits = engine.response_slice(output, micro).float()
        return torch.log_softmax(logits, -1).gather(-1, micro["responses"][..., None]).mean().neg(), {}

    engine.train_minibatches(
        batch,
        mini_batch_size=B,
        micro_batch_size=2,
        epochs=1,
        loss_of=loss_of,
        count_unit=lambda m: float(m["response_mask"].sum()),
    )


def _state(engine) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in engine.ddp.parameters()]
    for adam in _adams(engine):
        for group in adam.param_groups:
            for p in group["params"]:
                out += [torch.as_tensor(v).detach().clone() for _, v in sorted(adam.state[p].items())]
    return out


def test_adam_state_is_made_at_build_and_steps_as_the_lazy_one(groups_1x1):
    built = _engine(groups_1x1)
    for adam in _adams(built):
        params = [p for g in adam.param_groups for p in g["params"]]
        assert params and all(set(adam.state[p]) == {"exp_avg", "exp_avg_sq", "step"} for p in params)
        assert all(adam.state[p]["exp_avg"].shape == p.shape for p in params)
    lazy = _engine(groups_1x1, copy_of=built)  # the same starting weights
    for adam in _adams(lazy):
        adam.state.clear()  # torch's default: no state until the first step
    for step in (1, 2):
        _train(built, step)
        _train(lazy, step)
    got, want = _state(built), _state(lazy)
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
