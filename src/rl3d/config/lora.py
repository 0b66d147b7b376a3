"""`actor.lora`: low-rank adapters on the megatron actor, over a frozen base.

    actor:
      lora:
        rank: 8
        alpha: 16               # scaling = alpha / rank (rsLoRA: alpha / sqrt(rank))
        dropout: 0.0            # on the adapters' input, in training forwards only
        target_modules: [q_proj, k_proj, v_proj, o_proj]   # or all-linear; lm_head: the output layer
        init: null              # a PEFT adapter directory to start from (else A random, B zero)
        use_rslora: false
        transition: auto        # adapters | merged | auto
        engine_mode: merge      # merge | apply: how the torch engine uses the adapters it receives

The base weights stay frozen (no gradients, no optimizer state); only the adapters train, in
fp32 whatever `model.dtype`. `lm_head` (named beside the others; `all-linear` leaves it out, as in
PEFT) adapts the untied output layer: a frozen output layer bounds the logits the adapters below it
can reach (docs/lora.md). With a reference enabled, the reference log-probs come from the
actor with its adapters switched off: no reference model is built. Off by default (`null`).

`transition`: `adapters` resharding the base into the engine once and then moving only the
adapters each step (the 3D-HybridEngine plans and moves them as parameters of their own; the torch
engine merges them into its own copy of the base, or applies them beside it: `engine_mode`;
SGLang keeps the base it was pushed once and loads the adapters through its LoRA API); `merged`
moving base + scale * B @ A every step, as for a full model (what a separate rollout pool gets);
`auto` takes `adapters` on the colocated torch engine and `merged` elsewhere. See docs/lora.md.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from rl3d.config.errors import FieldError
from rl3d.models.lora_names import ALL_LINEAR, LM_HEAD, LORA_TARGETS, resolve_targets, scaling_of


@dataclass(frozen=True, kw_only=True)
class LoraConfig:
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: [ALL_LINEAR])
    init: str | None = None  # a PEFT adapter directory (adapter_config.json + adapter_model.safetensors)
    use_rslora: bool = False
    transition: Literal["auto", "adapters", "merged"] = "auto"
    engine_mode: Literal["merge", "apply"] = "merge"

    def __post_init__(self) -> None:
        if self.rank <= 0:
            raise FieldError("rank", f"must be > 0, got {self.rank}")
        if self.alpha <= 0:
            raise FieldError("alpha", f"must be > 0, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise FieldError("dropout", f"must be in [0, 1), got {self.dropout}")
        if not self.target_modules:
            raise FieldError(
                "target_modules", f"name at least one of {', '.join(LORA_TARGETS)}, {LM_HEAD} or {ALL_LINEAR}"
            )
        known = [*LORA_TARGETS, LM_HEAD, ALL_LINEAR]
        for name in self.target_modules:
            if name not in known:
                close = difflib.get_close_matches(name, known, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise FieldError(
                    "target_modules", f"unknown module {name!r}{hint}; known: {', '.join(known)}"
                )
        if self.init is not None and not Path(self.init).is_dir():
            raise FieldError("init", f"no such PEFT adapter directory: {self.init!r}")

    @property
    def targets(self) -> tuple[str, ...]:
        """The decoder layers' HF projection names adapted, in forward order (not lm_head)."""
        return resolve_targets(self.target_modules)

    @property
    def lm_head(self) -> bool:
        """Whether the output layer is adapted too."""
        return LM_HEAD in self.target_modules

    @property
    def peft_targets(self) -> tuple[str, ...]:
        """adapter_config.json's target_modules: the projections, then lm_head if adapted."""
        return (*self.targets, LM_HEAD) if self.lm_head else self.targets

    @property
    def scaling(self) -> float:
        return scaling_of(self.rank, self.alpha, self.use_rslora)


def adapter_transition(cfg: Any) -> bool:
    """Whether a run with `actor.lora` moves only the adapters to its rollout engine (see the
    module's docstring for `transition`). `auto` keeps SGLang on merged weights: it decodes
    through its LoRA kernels beside the base, slower than on merged weights, and asks for
    `adapters` by name."""
    lora = cfg.actor.lora
    if lora is None or lora.transition == "merged":
        return False
    if lora.transition == "auto" and cfg.rollout.engine != "torch":
        return False
    return not _adapters_refused(cfg)


def _adapters_refused(cfg: Any) -> str | None:
    """Why this run's engine cannot keep the base and take only adapters (None: it can)."""
    if cfg.actor.lora.lm_head:
        return "an adapted lm_head reaches the engine merged into the output layer"
    if cfg.rollout.placement != "colocated":
        return "a separate rollout pool gets merged weights (rollout.placement: separate)"
    if cfg.rollout.engine == "sglang" and not cfg.rollout.sglang.enable_memory_saver:
        return (
            "SGLang keeps the base in its memory saver's CPU backup (set rollout.sglang.enable_memory_saver)"
        )
    return None


def check_lora(cfg: Any, fail) -> None:
    """Cross-section checks of `actor.lora`."""
    lora = cfg.actor.lora
    if lora is None:
        return
    if lora.transition == "adapters" and (why := _adapters_refused(cfg)):
        raise fail("actor.lora.transition", f"'adapters' does not run here: {why}; use auto or merged")
    if lora.dropout > 0 and cfg.actor.parallel.tp > 1:
        # the column-parallel adapters' A is replicated over TP: each rank would draw its own mask
        raise fail(
            "actor.lora.dropout", f"{lora.dropout} needs actor.parallel.tp: 1 (got {cfg.actor.parallel.tp})"
        )
    if cfg.model.dtype == "float16":
        # the fp32 adapters train under megatron's fp32 optimizer, which has no loss scaler
        raise fail("actor.lora", "needs model.dtype bfloat16 or float32 (float16 needs a loss scale)")
    if cfg.actor.packing and cfg.launch.device != "cpu":
        # packing picks Transformer Engine's layer spec on CUDA, whose linears fuse the norm
        raise fail("actor.lora", "does not run on Transformer Engine's layer spec: set actor.packing: false")
    if cfg.actor.warm_start is not None:
        raise fail("actor.lora", "does not combine with actor.warm_start (SFT trains the full model)")
    if cfg.reference_enabled and not cfg.reference.colocate:
        raise fail(
            "reference.colocate",
            "false builds a reference model in its own pool; with actor.lora the reference is the "
            "actor's base (adapters off): set reference.colocate: true",
        )
