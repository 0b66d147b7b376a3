"""LoRA adapters on a megatron GPTModel's linears (this rank's PP stage and TP shard), over a
frozen base.

    adapters = attach_lora(model, spec, groups, rank=8, alpha=16, targets=("q_proj", "v_proj"))
    with adapters.disabled():      # the base model: the reference policy
        ...
    adapters.merged_deltas()       # scale * B @ A per adapted weight, in its local layout
    adapters.state_dict()          # full PEFT-keyed tensors, gathered over TP and PP

Each adapted megatron linear gets one `LoraAdapter` (a child of its attention or MLP block)
holding a pair of fp32 factors per HF projection fused in it, and a forward hook that adds
`scale * B @ A @ x` to the linear's output. Under TP each factor is split the way its base is:
column-parallel linears (qkv, fc1) keep A whole and split B's rows as the base splits its own
(each rank's query groups, its share of gate and up); row-parallel ones (proj, fc2) split A's
columns and keep B whole, the rank-r partial products summed over TP before B. The adapted output
then equals the unsharded computation, and A's (column) or B's (row) gradient is the full one on
every TP rank. Names of the projections and of PEFT's keys are `rl3d.models.lora_names`'.

With `lm_head` the last stage's vocab-parallel output layer gets an adapter too, split like a
column-parallel linear (A whole, B's vocabulary rows split). Its B holds megatron's padded
vocabulary rows; PEFT's tensor has the HF vocabulary's (the padding is cut out and put back).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist

from rl3d.models.bootstrap import MegatronGroups
from rl3d.models.lora_names import FUSED, LM_HEAD, TARGETS, peft_key
from rl3d.models.params import global_layer_index
from rl3d.models.spec import ModelSpec
from rl3d.ops.layouts import qkv_hf_to_megatron

ADAPTER_SUFFIX = "_lora"  # linear_qkv's adapter is the block's child linear_qkv_lora
OUTPUT_LINEAR = "output_layer"  # the model's child output_layer_lora adapts it (lm_head)


class LoraAdapter(torch.nn.Module):
    """The low-rank update of one megatron linear's TP shard. `sections` lists the HF projections
    fused in the linear with their local output sizes, in the fused order; `fuse(*parts)` joins
    per-projection tensors (dim 0: output rows) into the linear's local layout."""

    def __init__(
        self,
        sections: tuple[tuple[str, int], ...],
        in_features: int,
        *,
        adapted: tuple[str, ...],
        row_parallel: bool,
        rank: int,
        scaling: float,
        dropout: float,
        tp_group,
        fuse: Callable[..., torch.Tensor],
        switch: _Switch,
    ):
        super().__init__()
        self.sections, self.rank, self.scaling = sections, rank, scaling
        self.row_parallel, self.tp_group, self.fuse, self.switch = row_parallel, tp_group, fuse, switch
        self.dropout = torch.nn.Dropout(dropout) if dropout > 0 else torch.nn.Identity()
        out = dict(sections)
        self.A = torch.nn.ParameterDict(
            {n: torch.nn.Parameter(torch.zeros(rank, in_features)) for n in adapted}
        )
        self.B = torch.nn.ParameterDict({n: torch.nn.Parameter(torch.zeros(out[n], rank)) for n in adapted})
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        split = self.A if row_parallel else self.B  # the factor split over TP, like its base
        for p in split.values():
            set_tensor_model_parallel_attributes(p, is_parallel=True, dim=1 if row_parallel else 0, stride=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The update of the linear's output for its input `x` [..., in] (fp32)."""
        from megatron.core.tensor_parallel.mappings import (
            copy_to_tensor_model_parallel_region,
            reduce_from_tensor_model_parallel_region,
        )

        x = self.dropout(x.float())
        names = list(self.A)
        h = x @ torch.cat([self.A[n] for n in names]).T  # [..., len(names) * r]
        if self.row_parallel:  # partial sums over the input shards; then B, replicated
            h = reduce_from_tensor_model_parallel_region(h, group=self.tp_group)
        else:  # A replicated: its gradient sums every rank's rows of B
            h = copy_to_tensor_model_parallel_region(h, group=self.tp_group)
        parts = {n: h_n @ self.B[n].T for n, h_n in zip(names, h.split(self.rank, dim=-1))}
        return self.scaling * self._fused(parts, x.shape[:-1]).movedim(0, -1)

    def delta_weight(self) -> torch.Tensor:
        """scale * B @ A in the base weight's local layout [out, in] (fp32)."""
        parts = {n: (self.B[n] @ self.A[n]).T for n in self.A}  # output last, as forward's
        in_features = next(iter(self.A.values())).shape[1]
        return self.scaling * self._fused(parts, (in_features,))

    def _fused(self, parts: dict[str, torch.Tensor], rest: tuple[int, ...]) -> torch.Tensor:
        """Per-projection [.., out_n] (output last) -> the fused [out, ...] with zeros where a
        projection has no adapter."""
        some = next(iter(parts.values()))
        rows = [
            parts[n].movedim(-1, 0) if n in parts else some.new_zeros(size, *rest)
            for n, size in self.sections
        ]
        return self.fuse(*rows)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """megatron dist-checkpointing's view: the split factor sharded over TP like its base."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        factor, dim = ("A", 1) if self.row_parallel else ("B", 0)
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True),
            prefix,
            {f"{factor}.{n}": dim for n in self.A},
            sharded_offsets,
            tp_group=self.tp_group,
            dp_cp_group=(metadata or {}).get("dp_cp_group"),
        )


def _base_name(layer: int, linear: str) -> str:
    """The global name of the base weight an adapter on (layer, megatron linear) updates."""
    return f"{linear}.weight" if linear == OUTPUT_LINEAR else f"decoder.layers.{layer}.{linear}.weight"


class _Switch:
    """Shared by a model's adapters: off, the model is its base."""

    enabled = True


class LoraAdapters:
    """The adapters attached to one model chunk, by (global layer, megatron linear)."""

    def __init__(self, spec: ModelSpec, groups: MegatronGroups, targets: tuple[str, ...], switch: _Switch):
        self.spec, self.groups, self.targets, self.switch = spec, groups, targets, switch
        self.by_linear: dict[tuple[int, str], LoraAdapter] = {}

    @contextlib.contextmanager
    def disabled(self):
        """While open the model computes its base alone (the reference policy)."""
        self.switch.enabled = False
        try:
            yield
        finally:
            self.switch.enabled = True

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for a in self.by_linear.values() for p in a.parameters()]

    def merged_deltas(self) -> dict[str, torch.Tensor]:
        """Global base parameter name -> scale * B @ A in that parameter's local shard layout."""
        with torch.no_grad():
            return {_base_name(g, linear): a.delta_weight() for (g, linear), a in self.by_linear.items()}

    def local_factors(self) -> dict[str, tuple[torch.Tensor, int | None]]:
        """PEFT key -> (this rank's tensor, the dim it is split along over TP, or None)."""
        out = {}
        for (layer, _), a in self.by_linear.items():
            for n in a.A:
                out[peft_key(layer, n, "A")] = (a.A[n], 1 if a.row_parallel else None)
                out[peft_key(layer, n, "B")] = (a.B[n], None if a.row_parallel else 0)
        return out

    def state_dict(
        self, of: Callable[[torch.Tensor], torch.Tensor] = torch.Tensor.detach
    ) -> dict[str, torch.Tensor]:
        """Every adapter factor (`of(param)`: e.g. its `main_grad` instead), full (t=1) on the host,
        under PEFT's keys; collective over the model's TP and PP groups (every rank gets it all)."""
        t, local = self.groups.layout.t, {}
        for key, (param, dim) in self.local_factors().items():
            tensor = of(param)
            if dim is not None and t > 1:
                parts = [torch.empty_like(tensor) for _ in range(t)]
                dist.all_gather(parts, tensor.contiguous(), group=self.groups.tp_group)
                tensor = torch.cat(parts, dim=dim)
            if key == peft_key(None, LM_HEAD, "B"):
                tensor = tensor[: self.spec.vocab_size]  # megatron's vocabulary padding out
            local[key] = tensor.float().cpu().clone()  # a copy, never the live tensor
        if self.groups.layout.p == 1:
            return local
        stages: list[dict] = [{} for _ in range(self.groups.layout.p)]
        dist.all_gather_object(stages, local, group=self.groups.pp_group)
        return {k: v for stage in stages for k, v in stage.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor], *, source: str = "adapter") -> None:
        """Set this rank's factors from full PEFT-keyed tensors (every key this stage adapts must
        be there, in its full shape)."""
        t, tp_rank = self.groups.layout.t, self.groups.tp_rank
        with torch.no_grad():
            for key, (param, dim) in self.local_factors().items():
                if key not in state:
                    raise KeyError(f"{source}: no tensor {key}")
                full = state[key]
                want = list(param.shape)
                if dim is not None:
                    want[dim] *= t
                if key == peft_key(None, LM_HEAD, "B") and full.shape[0] == self.spec.vocab_size:
                    full = torch.cat([full, full.new_zeros(want[0] - full.shape[0], *full.shape[1:])])
                if list(full.shape) != want:
                    raise ValueError(f"{source}: {key} has shape {list(full.shape)}, the model needs {want}")
                param.copy_(full if dim is None else full.chunk(t, dim=dim)[tp_rank])


def attach_lora(
    model: torch.nn.Module,
    spec: ModelSpec,
    groups: MegatronGroups,
    *,
    rank: int,
    alpha: float,
    targets: tuple[str, ...],
    dropout: float = 0.0,
    use_rslora: bool = False,
    lm_head: bool = False,
    seed: int = 0,
) -> LoraAdapters:
    """Freeze `model` (this rank's GPTModel) and give each decoder layer adapters on `targets`
    (and the last stage's output layer one, with `lm_head`). A starts as PEFT's
    (Kaiming-uniform), B as zero, drawn per (layer, projection) from `seed` in the full shape and
    then sliced, so every layout starts from the same adapters."""
    from rl3d.models.lora_names import scaling_of

    model.requires_grad_(False)
    t, tp_rank = groups.layout.t, groups.tp_rank
    nh, ng, hd = spec.num_attention_heads, spec.num_query_groups, spec.head_dim
    h, f = spec.hidden_size, spec.ffn_hidden_size
    q, kv = nh * hd, ng * hd
    # (output sizes of the fused projections, full input size, fuse) per megatron linear
    shapes = {
        "self_attention.linear_qkv": (
            (q, kv, kv),
            h,
            lambda *p: qkv_hf_to_megatron(*p, num_heads=nh // t, num_query_groups=ng // t),
        ),
        "self_attention.linear_proj": ((h,), q, lambda p: p),
        "mlp.linear_fc1": ((f, f), h, lambda *p: torch.cat(p)),
        "mlp.linear_fc2": ((h,), f, lambda p: p),
    }
    switch = _Switch()
    adapters = LoraAdapters(spec, groups, targets, switch)
    scaling = scaling_of(rank, alpha, use_rslora)
    for local, layer in enumerate(model.decoder.layers):
        g = global_layer_index(spec, groups.layout.p, groups.pp_rank, local)
        for linear, fused in FUSED.items():
            adapted = tuple(n for n in fused if n in targets)
            if not adapted:
                continue
            outs, in_full, fuse = shapes[linear]
            row = TARGETS[fused[0]].row_parallel
            sections = tuple((n, o if row else o // t) for n, o in zip(fused, outs))
            adapter = LoraAdapter(
                sections,
                in_full // t if row else in_full,
                adapted=adapted,
                row_parallel=row,
                rank=rank,
                scaling=scaling,
                dropout=dropout,
                tp_group=groups.tp_group,
                fuse=fuse,
                switch=switch,
            )
            _init_factors(
                adapter, g, seed=seed, t=t, tp_rank=tp_rank, outs=dict(zip(fused, outs)), in_full=in_full
            )
            block_name, linear_name = linear.split(".")
            block = getattr(layer, block_name)
            if "LayerNorm" in type(getattr(block, linear_name)).__name__:
                # Transformer Engine fuses the norm into the linear: its input is not what the
                # projection multiplies, so an adapter on it would see the wrong x
                raise ValueError(
                    f"LoRA does not run on {type(getattr(block, linear_name)).__name__} (no TE spec)"
                )
            block.add_module(linear_name + ADAPTER_SUFFIX, adapter.to(groups.device))
            getattr(block, linear_name).register_forward_hook(_hook(adapter), with_kwargs=True)
            adapters.by_linear[(g, linear)] = adapter
    if lm_head and groups.is_last_stage:
        _attach_output(model, adapters, spec, groups, rank=rank, scaling=scaling, dropout=dropout, seed=seed)
    return adapters


def _attach_output(model, adapters: LoraAdapters, spec: ModelSpec, groups, *, rank, scaling, dropout, seed):
    if spec.tied_embeddings:
        # the merged update would land in the embedding too, which shares the output layer's weight
        raise ValueError(
            f"actor.lora.target_modules: lm_head needs an untied output layer; {spec.name} ties it to "
            "the embedding"
        )
    t = groups.layout.t
    rows = model.output_layer.weight.shape[0]  # this rank's share of the padded vocabulary
    adapter = LoraAdapter(
        ((LM_HEAD, rows),),
        spec.hidden_size,
        adapted=(LM_HEAD,),
        row_parallel=False,
        rank=rank,
        scaling=scaling,
        dropout=dropout,
        tp_group=groups.tp_group,
        fuse=lambda p: p,
        switch=adapters.switch,
    )
    _init_factors(
        adapter, spec.num_layers, seed=seed, t=t, tp_rank=groups.tp_rank, outs={LM_HEAD: rows * t},
        in_full=spec.hidden_size,
    )  # fmt: skip
    model.add_module(OUTPUT_LINEAR + ADAPTER_SUFFIX, adapter.to(groups.device))
    model.output_layer.register_forward_hook(_hook(adapter), with_kwargs=True)
    adapters.by_linear[(spec.num_layers, OUTPUT_LINEAR)] = adapter


def _init_factors(
    adapter: LoraAdapter, layer: int, *, seed: int, t: int, tp_rank: int, outs, in_full
) -> None:
    with torch.no_grad():
        for n in adapter.A:
            index = list(TARGETS).index(n) if n in TARGETS else 0  # lm_head: "layer" num_layers
            gen = torch.Generator().manual_seed(seed * 1_000_003 + layer * 16 + index)
            bound = in_full**-0.5  # kaiming_uniform_(a=sqrt(5)), as PEFT and nn.Linear
            full = (torch.rand(adapter.rank, in_full, generator=gen) * 2 - 1) * bound
            adapter.A[n].copy_(full.chunk(t, dim=1)[tp_rank] if adapter.row_parallel else full)
            assert adapter.B[n].shape[0] == (outs[n] if adapter.row_parallel else outs[n] // t)


def _hook(adapter: LoraAdapter):
    def add_update(_module, args, kwargs, output):
        if not adapter.switch.enabled:
            return output
        x = args[0] if args else kwargs["input_"]
        out, bias = output
        return out + adapter(x).to(out.dtype), bias

    return add_update
