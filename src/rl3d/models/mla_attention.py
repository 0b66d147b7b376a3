"""megatron-core's local core attention for multi-latent attention (DeepSeek-V3).

megatron-core 0.16.1's MLA builds its core attention with `k_channels` (the q/k width, nope +
rope) and `v_channels` (the value width), which only Transformer Engine's attention takes: the
local `DotProductAttention` refuses both and shapes its output as `kv_channels` per head. With
`MLADotProductAttention` in the local layer spec (`with_mla_core_attention`) MLA runs without TE,
on CPU too: the same scores (q.k times MLA's softmax scale, megatron's masked softmax), the output
`v_channels` wide per head.

Without Transformer Engine megatron's TE names in `multi_latent_attention` are mocks, yet its
`HAVE_TE` reads True and MLA's constructor calls `isinstance(..., TELinear)` on a mock;
`with_mla_core_attention` sets that module's `HAVE_TE` to False where `TELinear` is no class.
"""

from __future__ import annotations

from typing import Any


def mla_dot_product_attention_class() -> type:
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.utils import divide

    class MLADotProductAttention(DotProductAttention):
        """megatron's local attention with MLA's key and value widths."""

        def __init__(
            self, *args: Any, k_channels: int | None = None, v_channels: int | None = None, **kwargs: Any
        ):
            # megatron's Attention first builds one without them, which MLA then replaces
            super().__init__(*args, **kwargs)
            if v_channels is not None:
                self.hidden_size_per_attention_head = k_channels
                heads = divide(self.config.num_attention_heads, self.pg_collection.tp.size())
                self.hidden_size_per_partition = v_channels * heads

    return MLADotProductAttention


def with_mla_core_attention(layer_spec: Any) -> Any:
    """A copy of a local MLA layer spec (`get_gpt_layer_local_spec(multi_latent_attention=True)`)
    whose core attention is `MLADotProductAttention`; everything else is shared with `layer_spec`."""
    import copy

    import megatron.core.transformer.multi_latent_attention as mla

    if not isinstance(mla.TELinear, type):  # Transformer Engine absent: its names are mocks
        mla.HAVE_TE = False
    spec = copy.copy(layer_spec)
    spec.submodules = copy.copy(layer_spec.submodules)
    attention = copy.copy(spec.submodules.self_attention)
    attention.submodules = copy.copy(attention.submodules)
    attention.submodules.core_attention = mla_dot_product_attention_class()
    spec.submodules.self_attention = attention
    return spec
