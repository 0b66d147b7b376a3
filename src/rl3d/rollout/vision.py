"""LLaVA in the torch rollout engine: the CLIP tower and projector computed from megatron-core's
`LLaVAModel` parameters, and an engine that splices their image embeddings into the decoder.

    engine = LlavaRolloutEngine(llava_spec, {n: p for n, p in model.named_parameters()})
    batch = engine.generate(prompts, params, images=[pixels_0, pixels_1, ...])

A prompt holds one image token per image, as a loaded `PromptItem` and megatron-core's LLaVA do;
`images[i]` is prompt i's pixels, [n_i, 3, size, size] (`rl3d.models.llava.llava_pixel_values`),
or None for a text-only prompt. The engine widens each image token to `num_image_tokens`
positions (HF's layout, `hf_input_ids`), encodes every image of a chunk of prompts in one tower
call, replaces the widened positions' token embeddings with the image embeddings in the prefill,
and then decodes from the decoder's KV cache as for text: the n samples of a prompt share its
prefill, so its images are encoded once. Response tokens are text (an image token the model
generates is embedded as a token, as transformers' `generate` does).

The tower is megatron-core's `CLIPViTModel` as rl3d builds it (`rl3d.models.llava`): patch
convolution without bias, the class token first, learned position embeddings, `ln_pre`, pre-norm
layers with bidirectional attention (one query group per head), no final norm; the class token
dropped under `vision_feature_select_strategy: default`; the projector a two-layer MLP. Under
generation TP (t_g > 1) each sharded matmul runs piece by piece as in `rl3d.rollout.model`:
QKV and fc1 (with their biases) are column-parallel, `linear_proj` and fc2 row-parallel (their
partial products all-reduced, then the whole bias added), so every rank ends with the same
image embeddings.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from rl3d.rollout.base import RolloutBatch, SamplingParams
from rl3d.rollout.model import ShardedWeights, TPComm
from rl3d.rollout.torch_engine import TorchRolloutEngine

DECODER = "language_model."
TOWER = "vision_model."
PROJECTOR = "vision_projection.encoder."


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)  # megatron-core's and CLIP's


ACTIVATIONS = {"quick_gelu": quick_gelu, "gelu": F.gelu}


@dataclass
class VisionWeights:
    """This rank's tower and projector parameters: per megatron-core name (without the model's
    prefix), the pieces of its generation-TP shard (one piece per training-TP shard it holds)."""

    spec: Any  # rl3d.models.llava.LlavaSpec
    pieces: dict[str, list[torch.Tensor]]

    @classmethod
    def from_llava(cls, spec: Any, pieces: Mapping[str, list[torch.Tensor]]) -> VisionWeights:
        """From `LLaVAModel` names (`vision_model.*`, `vision_projection.*`); fails naming what is missing."""
        ours = {n: list(p) for n, p in pieces.items() if n.startswith((TOWER, "vision_projection."))}
        missing = [n for n in vision_param_names(spec) if n not in ours]
        if missing:
            raise ValueError(
                f"LLaVA rollout engine: the weights lack {len(missing)} vision tower / projector "
                f"parameters, e.g. {missing[:3]}"
            )
        return cls(spec, ours)

    def one(self, name: str) -> torch.Tensor:
        return self.pieces[name][0]


def vision_param_names(spec: Any) -> list[str]:
    """The megatron-core names of the tower's and projector's parameters the engine reads."""
    names = [f"{TOWER}class_token", f"{TOWER}conv1.weight", f"{TOWER}position_embeddings.weight"]
    names += [f"{TOWER}ln_pre.{k}" for k in ("weight", "bias")]
    layer = (
        "input_layernorm",
        "self_attention.linear_qkv",
        "self_attention.linear_proj",
        "pre_mlp_layernorm",
        "mlp.linear_fc1",
        "mlp.linear_fc2",
    )
    for i in range(spec.vision_layers):
        names += [f"{TOWER}decoder.layers.{i}.{m}.{k}" for m in layer for k in ("weight", "bias")]
    names += [f"{PROJECTOR}linear_fc{i}.{k}" for i in (1, 2) for k in ("weight", "bias")]
    return names


def _mlp(x: torch.Tensor, w: VisionWeights, prefix: str, act: Any, tp: TPComm) -> torch.Tensor:
    """fc1 (column-parallel, pieces with their bias pieces) -> act -> fc2 (row-parallel: piece j
    consumes fc1 piece j's outputs), all-reduced, then fc2's whole bias."""
    out = None
    for fc1, b1, fc2 in zip(
        w.pieces[prefix + "linear_fc1.weight"],
        w.pieces[prefix + "linear_fc1.bias"],
        w.pieces[prefix + "linear_fc2.weight"],
        strict=True,
    ):
        part = F.linear(act(F.linear(x, fc1, b1)), fc2)
        out = part if out is None else out + part
    return tp.all_reduce(out) + w.one(prefix + "linear_fc2.bias")


def _attention(x: torch.Tensor, w: VisionWeights, prefix: str, tp: TPComm) -> torch.Tensor:
    """Bidirectional self-attention of [N, S, h]; megatron's QKV rows are [q, k, v] per head."""
    N, S, _ = x.shape
    hd = w.spec.vision_hidden_size // w.spec.vision_heads
    out = None
    for qkv_w, qkv_b, proj in zip(
        w.pieces[prefix + "linear_qkv.weight"],
        w.pieces[prefix + "linear_qkv.bias"],
        w.pieces[prefix + "linear_proj.weight"],
        strict=True,
    ):
        qkv = F.linear(x, qkv_w, qkv_b).view(N, S, -1, 3, hd).permute(3, 0, 2, 1, 4)  # [3, N, H, S, hd]
        attn = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])
        part = F.linear(attn.transpose(1, 2).reshape(N, S, -1), proj)
        out = part if out is None else out + part
    return tp.all_reduce(out) + w.one(prefix + "linear_proj.bias")


def encode_images(w: VisionWeights, pixels: torch.Tensor, tp: TPComm) -> torch.Tensor:
    """Image embeddings in the decoder's width, [N, num_image_tokens, hidden], of pixels [N, 3, s, s]."""
    spec, eps = w.spec, w.spec.vision_eps
    h = spec.vision_hidden_size
    x = F.conv2d(pixels, w.one(TOWER + "conv1.weight"), stride=spec.patch_size)
    x = x.flatten(2).transpose(1, 2)  # [N, patches, h]
    x = torch.cat([w.one(TOWER + "class_token").expand(len(x), -1, -1), x], dim=1)
    x = x + w.one(TOWER + "position_embeddings.weight")[: x.shape[1]]
    x = F.layer_norm(x, (h,), w.one(TOWER + "ln_pre.weight"), w.one(TOWER + "ln_pre.bias"), eps)
    act = ACTIVATIONS[spec.vision_act]
    for i in range(spec.vision_layers):
        p = f"{TOWER}decoder.layers.{i}."

        def norm(x: torch.Tensor, which: str, p: str = p) -> torch.Tensor:
            return F.layer_norm(x, (h,), w.one(f"{p}{which}.weight"), w.one(f"{p}{which}.bias"), eps)

        x = x + _attention(norm(x, "input_layernorm"), w, p + "self_attention.", tp)
        x = x + _mlp(norm(x, "pre_mlp_layernorm"), w, p + "mlp.", act, tp)
    if spec.drop_class_token:
        x = x[:, 1:]
    return _mlp(x, w, PROJECTOR, ACTIVATIONS[spec.projector_act], tp)


class LlavaRolloutEngine(TorchRolloutEngine):
    """The torch engine for a LLaVA model (`rl3d.models.llava.LlavaSpec`): its decoder is the
    torch engine's, the tower and projector run once per chunk of prompts before the prefill.
    `stats.images_encoded` (in `RolloutBatch.metrics` as `rollout/images_encoded`) counts the
    images the tower ran."""

    def __init__(self, spec: Any, weights: Any = None, **kwargs: Any):
        self.llava = spec
        self.vision: VisionWeights | None = None
        self._chunk_images: list[torch.Tensor | None] = []
        self.images_encoded = 0
        super().__init__(spec.text, weights, **kwargs)

    def load_weights(self, weights: Any) -> None:
        """The 3D-HybridEngine's `GenerationWeights` of `rl3d.hybrid_engine.vision_plan.llava_params`
        (pieces used in place), or a mapping of `LLaVAModel` parameter names (`language_model.*`,
        `vision_model.*`, `vision_projection.*`) -> this rank's generation-TP shard, a tensor or
        a list of pieces."""
        tp_size, tp_rank = self.tp.size, self.tp.rank
        if isinstance(weights, Mapping):
            pieces = {n: list(t) if isinstance(t, (list, tuple)) else [t] for n, t in weights.items()}
        elif hasattr(weights, "pieces") and hasattr(weights, "full"):
            if weights.released:
                raise RuntimeError("the generation weights were released; reshard before generating")
            from rl3d.ops.layouts import shard_for_tp

            tp_size, tp_rank = weights.gen_tp, weights.gen_tp_rank
            pieces = {n: list(p) for n, p in weights.pieces.items()}
            for n, full in weights.full.items():  # a baseline strategy's whole tensor
                pieces[n] = [shard_for_tp(full, weights.params[n].kind, tp_size, tp_rank)]
        else:
            raise TypeError(
                "LLaVA rollout engine: load_weights takes GenerationWeights or a mapping of "
                f"LLaVAModel names to tensors, got {type(weights).__name__}"
            )
        decoder = {n[len(DECODER) :]: p for n, p in pieces.items() if n.startswith(DECODER)}
        if not decoder:
            raise ValueError("LLaVA rollout engine: no language_model.* parameters in the weights")
        self.vision = VisionWeights.from_llava(self.llava, pieces)
        if self.dtype is not None:
            self.vision = VisionWeights(
                self.llava, {n: [p.to(self.dtype) for p in ps] for n, ps in self.vision.pieces.items()}
            )
        super().load_weights(ShardedWeights(self.spec, tp_size, tp_rank, decoder))

    def release_memory(self) -> None:
        super().release_memory()
        self.vision = None

    def generate(
        self,
        prompts_token_ids: Sequence[Sequence[int]],
        params: SamplingParams,
        images: Sequence[torch.Tensor | None] | None = None,
    ) -> RolloutBatch:
        """`prompts_token_ids` with one image token per image; `images[i]` prompt i's pixels."""
        if self.vision is None:
            raise RuntimeError("LLaVA rollout engine has no weights: call load_weights() first")
        prompts = [list(map(int, p)) for p in prompts_token_ids]
        images = list(images) if images is not None else [None] * len(prompts)
        if len(images) != len(prompts):
            raise ValueError(f"generate: {len(prompts)} prompts but {len(images)} entries in images")
        spec, widened = self.llava, []
        for i, (prompt, pixels) in enumerate(zip(prompts, images)):
            count = 0 if pixels is None else len(pixels)
            tokens = sum(t == spec.image_token_id for t in prompt)
            if tokens != count:
                raise ValueError(
                    f"generate: prompt {i} holds {tokens} image token(s) (id {spec.image_token_id}) "
                    f"but images[{i}] has {count} image(s)"
                )
            if count and tuple(pixels.shape[1:]) != (3, spec.image_size, spec.image_size):
                raise ValueError(
                    f"generate: images[{i}] has shape {tuple(pixels.shape)}, expected "
                    f"[n, 3, {spec.image_size}, {spec.image_size}] (llava_pixel_values)"
                )
            widened.append(_widen(prompt, spec))
        digest = zlib.crc32(b"".join(_image_bytes(p) for p in images))
        if not self.tp.agree(digest):
            raise ValueError(
                f"generate: the ranks of the generation-TP group {self.tp.ranks} passed different images"
            )
        self._chunk_images, self.images_encoded = images, 0
        try:
            batch = super().generate(widened, params)
        finally:
            self._chunk_images = []
        batch.metrics["rollout/images_encoded"] = float(self.images_encoded)
        return batch

    def _prefill_embeds(self, tokens: torch.Tensor, first_prompt: int, embed: Any) -> torch.Tensor:
        """The prefill's input [B, T, hidden]: token embeddings, image positions replaced."""
        x = embed(tokens)
        chunk = self._chunk_images[first_prompt : first_prompt + len(tokens)]
        pixels = [p for p in chunk if p is not None and len(p)]
        if not pixels:
            return x
        w = self.vision
        batch = torch.cat(pixels).to(device=x.device, dtype=w.one(TOWER + "conv1.weight").dtype)
        features = encode_images(w, batch, self.tp).to(x.dtype)
        self.images_encoded += len(batch)
        where = tokens == self.llava.image_token_id
        assert int(where.sum()) == features.shape[0] * features.shape[1], "checked in generate"
        return x.masked_scatter(where.unsqueeze(-1), features)


def _widen(prompt: list[int], spec: Any) -> list[int]:
    from rl3d.models.llava import hf_input_ids

    return hf_input_ids(prompt, spec)


def _image_bytes(pixels: torch.Tensor | None) -> bytes:
    if pixels is None or not len(pixels):
        return b"-"
    return repr(tuple(pixels.shape)).encode() + pixels.detach().cpu().contiguous().numpy().tobytes()
