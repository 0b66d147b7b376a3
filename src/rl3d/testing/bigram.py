"""A real `TorchRolloutEngine` that follows a script: the *bigram machine*.

Every layer's output projections are zero, so the residual stream is the current token's
embedding (one-hot), and the output layer maps token t to a large logit on `next_of[t]`. The
next token is then a fixed function of the last one (log-prob ~0 at temperature 1), so a test
picks what the policy writes by the prompt's last token, on the engine training uses.
"""

from __future__ import annotations

import torch


def bigram_weights(spec, next_of: dict[int, int], scale: float = 60.0) -> dict[str, torch.Tensor]:
    """Full (t=1) weights of `spec` (a `ModelSpec`) whose greedy successor of token t is `next_of[t]`."""
    from rl3d.hybrid_engine.params import model_params
    from rl3d.hybrid_engine.weights import full_model

    full = full_model(model_params(spec, train_tp=1), seed=0, dtype=torch.float32)
    hidden = spec.hidden_size
    assert spec.vocab_size <= hidden, "the one-hot embedding needs vocab_size <= hidden_size"
    emb = torch.zeros_like(full["embedding.word_embeddings.weight"])
    emb[: spec.vocab_size, : spec.vocab_size] = torch.eye(spec.vocab_size)
    out = torch.zeros_like(full["output_layer.weight"])
    for token, nxt in next_of.items():
        out[nxt, token] = scale / hidden**0.5  # the final norm scales a one-hot row to sqrt(hidden)
    full = {k: torch.zeros_like(v) if k.endswith(("linear_proj.weight", "linear_fc2.weight")) else v
            for k, v in full.items()}  # fmt: skip
    full["embedding.word_embeddings.weight"], full["output_layer.weight"] = emb, out
    for k in full:
        if k.endswith("layernorm.weight"):
            full[k] = torch.ones_like(full[k])
    return full


def bigram_engine(spec_name: str, next_of: dict[int, int], **engine_kwargs):
    """A `TorchRolloutEngine` over `bigram_weights` of the named model spec."""
    from rl3d.models.spec import get_model_spec
    from rl3d.rollout import TorchRolloutEngine

    spec = get_model_spec(spec_name)
    return TorchRolloutEngine(spec, bigram_weights(spec, next_of), **engine_kwargs)
