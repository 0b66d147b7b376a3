"""Model shape specs (pure Python): the numbers every other part of rl3d plans from.

Published shapes come from shared/MODELS.md. `get_model_spec` also accepts
scaled-down shapes such as `llama2-70b-shape-1/64`, which keep a model's layer proportions
(hidden, ffn and vocab divided by 64; layers and head counts kept) for measured benchmarks.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a Llama/Qwen2-family decoder (RMSNorm, SwiGLU, RoPE, GQA)."""

    name: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int  # KV heads
    vocab_size: int
    tied_embeddings: bool = False
    qkv_bias: bool = False
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    max_position_embeddings: int = 4096

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"model {self.name}: hidden_size {self.hidden_size} not divisible by "
                f"num_attention_heads {self.num_attention_heads}"
            )
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"model {self.name}: num_attention_heads {self.num_attention_heads} not divisible "
                f"by num_query_groups {self.num_query_groups}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    def num_params(self) -> int:
        """Unpadded parameter count (the HF checkpoint's)."""
        h, f, hd = self.hidden_size, self.ffn_hidden_size, self.head_dim
        qkv = (self.num_attention_heads + 2 * self.num_query_groups) * hd * h
        if self.qkv_bias:
            qkv += (self.num_attention_heads + 2 * self.num_query_groups) * hd
        layer = qkv + self.num_attention_heads * hd * h + 3 * h * f + 2 * h
        emb = self.vocab_size * h * (1 if self.tied_embeddings else 2)
        return self.num_layers * layer + emb + h


_LLAMA2 = dict(rope_theta=10000.0, norm_eps=1e-5, max_position_embeddings=4096)
_LLAMA3 = dict(rope_theta=500000.0, norm_eps=1e-5, max_position_embeddings=8192)
_QWEN25 = dict(rope_theta=1000000.0, norm_eps=1e-6, qkv_bias=True, max_position_embeddings=32768)

MODEL_SPECS: dict[str, ModelSpec] = {
    s.name: s
    for s in [
        ModelSpec("llama2-7b", 32, 4096, 11008, 32, 32, 32000, **_LLAMA2),
        ModelSpec("llama2-13b", 40, 5120, 13824, 40, 40, 32000, **_LLAMA2),
        ModelSpec("llama2-34b", 48, 8192, 22016, 64, 8, 32000, **{**_LLAMA2, "rope_theta": 1e6}),
        ModelSpec("llama2-70b", 80, 8192, 28672, 64, 8, 32000, **_LLAMA2),
        ModelSpec("llama3-8b", 32, 4096, 14336, 32, 8, 128256, **_LLAMA3),
        ModelSpec("llama3-70b", 80, 8192, 28672, 64, 8, 128256, **_LLAMA3),
        ModelSpec("qwen2.5-7b", 28, 3584, 18944, 28, 4, 152064, **_QWEN25),
        ModelSpec("qwen2.5-72b", 80, 8192, 29568, 64, 8, 152064, **_QWEN25),
        # Tiny models for tests and the CPU demo (random weights, built from these shapes).
        ModelSpec("tiny-llama", 2, 64, 176, 8, 4, 256, max_position_embeddings=512),
        ModelSpec("tiny-llama-mha", 2, 64, 128, 4, 4, 256, max_position_embeddings=512),
        ModelSpec("tiny-llama-odd-vocab", 2, 64, 128, 8, 2, 250, max_position_embeddings=512),
        ModelSpec(
            "tiny-qwen2",
            2,
            64,
            160,
            8,
            2,
            256,
            qkv_bias=True,
            tied_embeddings=True,
            rope_theta=1e6,
            norm_eps=1e-6,
            max_position_embeddings=512,
        ),
    ]
}

_SCALED = re.compile(r"^(?P<base>.+)-shape-1/(?P<k>\d+)$")


def get_model_spec(name: str) -> ModelSpec:
    """Look up a spec by name; `BASE-shape-1/K` divides hidden, ffn and vocab by K."""
    m = _SCALED.match(name)
    if m:
        base, k = get_model_spec(m["base"]), int(m["k"])
        if k < 1 or base.hidden_size % k or base.ffn_hidden_size % k:
            raise ValueError(f"model {name!r}: 1/{k} does not divide hidden and ffn of {base.name}")
        hidden = base.hidden_size // k
        heads = base.num_attention_heads
        while hidden % heads:  # keep GQA ratio, drop heads until they divide the hidden size
            heads //= 2
        groups = max(1, base.num_query_groups * heads // base.num_attention_heads)
        return replace(
            base,
            name=name,
            hidden_size=hidden,
            ffn_hidden_size=base.ffn_hidden_size // k,
            vocab_size=max(1, base.vocab_size // k),
            num_attention_heads=heads,
            num_query_groups=groups,
        )
    if name not in MODEL_SPECS:
        close = difflib.get_close_matches(name, list(MODEL_SPECS), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown model {name!r}{hint}; known: {', '.join(MODEL_SPECS)}")
    return MODEL_SPECS[name]
