"""Run megatron-core on CPU (gloo): the one place that remaps its CUDA-only calls.

megatron-core assumes CUDA in a handful of places that are not behind a config switch. This
module remaps exactly those to the CPU, and nothing else:

1. The CUDA RNG tracker (`tensor_parallel.random`): TP weight init and dropout fork a CUDA
   generator; on CPU the tracker forks the CPU generator instead, and activation recompute's
   CUDA state save/restore is left to the CPU generator's.
2. `GlobalMemoryBuffer` allocates on `torch.cuda.current_device()` (sequence-parallel gathers,
   the local attention's baddbmm buffer).
3. `device="cuda"` literals and `torch.cuda.current_device()` in the pipeline schedules and
   p2p communication, the grad buffers of DDP, the optimizers (loss scale, found-inf and
   norm tensors), RoPE (which moves its inverse frequencies to the current device), the
   local attention's default causal mask, dist-checkpointing's writers and exchange, and the
   torch fallback of the grad-norm kernel used without apex/TE. Each patched module sees a
   `torch` whose factories map "cuda" to "cpu" and whose `torch.cuda.current_device()` is the
   CPU; the global `torch` is untouched.
4. Tensor-method calls: grad clipping asserts `torch.cuda.FloatTensor`, the optimizers sort
   params by `torch.cuda.*Tensor` type names, tied-embedding setup and the distributed
   optimizer's checkpoint gather call `.cuda()`, and so does the CLIP ViT's constructor (LLaVA's
   vision tower); inside exactly those calls a CPU tensor reports its CUDA type name and
   `.cuda()` is a no-op.
5. In 0.19, the grad buffer reads `torch.cuda.current_stream` (covered by the module `torch`
   of item 3: on CPU there is one stream and nothing to wait on). The mixture-of-experts
   all-to-all token dispatcher makes a side `torch.cuda.Stream` for its device-to-host copies
   and records an event on it: on CPU both are the one stream, with nothing to record. Its
   router moves its weight to `torch.cuda.current_device()` and, with the router's aux-loss
   tracker, allocates on "cuda" (item 3's remap), as do the gathers of the tensor-parallel
   mappings the expert-parallel dispatcher calls. Its split sizes reach `all_to_all_single` as
   numpy arrays from a GPU, but stay tensors on CPU, which gloo's binding refuses: on CPU they
   become numpy arrays too.
6. Uneven all-gathers: under sequence parallelism the dispatcher gathers each TP rank's
   routed tokens, whose counts differ, by `all_gather` into unequal parts, which NCCL runs and
   gloo refuses. On CPU the parts are padded to the largest, gathered, and cut back. The
   linear layers' backward under sequence parallelism gathers its input into a buffer on
   `torch.cuda.current_device()` (item 3's remap).

`activate()` is a no-op that returns False for a CUDA run, so a GPU run never sees a
remap (tests/gpu asserts it). The rl3d test suite exercises these remaps on 0.16.1; the same
call sites were seen on 0.13.1 and 0.19.2 (`KNOWN_GOOD_VERSIONS`). Another version raises
unless `RL3D_ALLOW_UNTESTED_MEGATRON=1`, since a moved call site would fail deep inside megatron.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import logging
import os
from typing import Any

import torch

logger = logging.getLogger(__name__)

KNOWN_GOOD_VERSIONS = ("0.13.", "0.16.", "0.19.")
_ALLOW_ENV = "RL3D_ALLOW_UNTESTED_MEGATRON"

# Modules whose `torch` global is replaced by `_CpuTorch` (item 3); absent ones are skipped,
# since the set of modules differs a little between the known versions.
_DEVICE_LITERAL_MODULES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.models.common.embeddings.rope_utils",
    "megatron.core.transformer.utils",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.strategies.fully_parallel",
    "megatron.core.dist_checkpointing.strategies.async_utils",
    "megatron.core.dist_checkpointing.exchange_utils",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.experts",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.layers",
)

_active = False


def is_active() -> bool:
    return _active


def check_version(version: str | None = None) -> str:
    """The installed megatron-core version, if it is one the remaps were checked against."""
    if version is None:
        import megatron.core

        version = megatron.core.__version__
    if not version.startswith(KNOWN_GOOD_VERSIONS):
        message = (
            f"megatron-core {version} is not one the rl3d CPU shim was checked against "
            f"({', '.join(v + 'x' for v in KNOWN_GOOD_VERSIONS)}); set {_ALLOW_ENV}=1 to try anyway"
        )
        if os.environ.get(_ALLOW_ENV) != "1":
            raise RuntimeError(message)
        logger.warning(message)
    return version


def define_missing_te_gemm() -> None:
    """megatron-core 0.16's router reads `moe_utils.te_general_gemm`, which it binds only when
    Transformer Engine imports; without TE that is a NameError. None is what it tests for, and
    selects its torch matmul. Needed without TE on any device, so called by the builder."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def define_clip_vit_norm_without_te() -> None:
    """megatron-core's CLIP ViT takes its pre-norm class as a default argument, Transformer
    Engine's `TENorm` or, without TE, `torch.nn.LayerNorm`, which it then builds with a
    `config=` keyword that torch's norm refuses (LLaVA passes no norm of its own). Without TE the
    default becomes megatron's `WrappedTorchNorm`, the local layer spec's LayerNorm (the same
    torch LayerNorm behind megatron's constructor signature). Needed without TE on any device,
    so called by the LLaVA builder."""
    from megatron.core.models.vision import clip_vit_model
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    init = inspect.unwrap(clip_vit_model.CLIPViTModel.__init__)  # under the CPU shim's wrapper
    defaults = init.__defaults__
    assert defaults is not None
    init.__defaults__ = tuple(WrappedTorchNorm if d is torch.nn.LayerNorm else d for d in defaults)


def activate(device: str | None = None) -> bool:
    """Remap megatron-core's CUDA-only calls to CPU; True if the remaps are (now) in place.

    Idempotent. `device` is where this run computes (the configured one: a CPU run on a GPU
    host is remapped too); None means "cuda if this host has it". Returns False, changing
    nothing, for a CUDA run.
    """
    global _active
    if (device or ("cuda" if torch.cuda.is_available() else "cpu")) != "cpu":
        return False
    if _active:
        return True
    check_version()
    _patch_rng_tracker()
    _patch_memory_buffer()
    for name in _DEVICE_LITERAL_MODULES:
        _patch_module_torch(name)
    _patch_l2_norm()
    _patch_split_sizes()
    _patch_uneven_gather()
    _patch_tensor_method_calls()
    _active = True
    logger.info("megatron-core CPU shim active")
    return True


# --- 1. RNG tracker -------------------------------------------------------------------------


def _patch_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """The CUDA tracker's bookkeeping over the CPU default generator."""

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    original_init = mrandom.initialize_rng_tracker

    @functools.wraps(original_init)
    def initialize_rng_tracker(*args: Any, **kwargs: Any) -> None:
        original_init(*args, **kwargs)
        # The TE tracker and the inference tracker are never chosen on CPU; swap the class of the
        # plain one so that `get_cuda_rng_tracker()` callers get the CPU fork.
        tracker = mrandom._CUDA_RNG_STATE_TRACKER
        if type(tracker) is mrandom.CudaRNGStatesTracker:
            tracker.__class__ = CpuRNGStatesTracker

    mrandom.initialize_rng_tracker = initialize_rng_tracker
    # Activation recompute (`CheckpointFunction`) saves and restores the CPU, the CUDA and the
    # tracker's states around a recomputed forward; without CUDA the CPU generator is the only
    # default generator, which it already restores.
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda *args, **kwargs: None
    # model_parallel_cuda_manual_seed seeds the CUDA default generator; it is lazy (queued)
    # without CUDA, and the CPU generator is seeded by the caller.


# --- 2. Global memory buffer ----------------------------------------------------------------


def _patch_memory_buffer() -> None:
    from megatron.core import parallel_state, utils

    original = utils.GlobalMemoryBuffer

    class CpuGlobalMemoryBuffer(original):
        def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
            required = 1
            for size in tensor_shape:
                required *= size
            buf = self.buffer.get((name, dtype))
            if buf is None or buf.numel() < required:
                buf = self.buffer[(name, dtype)] = torch.empty(required, dtype=dtype, device="cpu")
            return buf[:required].view(*tensor_shape)

    utils.GlobalMemoryBuffer = CpuGlobalMemoryBuffer
    # parallel_state imported the class by name before we ran.
    parallel_state.GlobalMemoryBuffer = CpuGlobalMemoryBuffer


# --- 3. device literals ---------------------------------------------------------------------


def _cpu_device(device: Any) -> Any:
    if device is None:
        return None
    if isinstance(device, int):  # a CUDA ordinal from current_device()
        return torch.device("cpu")
    if torch.device(device).type == "cuda":
        return torch.device("cpu")
    return device


def _remap_factory(fn: Any) -> Any:
    @functools.wraps(fn)
    def factory(*args: Any, device: Any = None, pin_memory: bool = False, **kwargs: Any) -> Any:
        # pinning is staging for a copy to the GPU; on CPU torch refuses it and it means nothing
        return fn(*args, device=_cpu_device(device), **kwargs)

    return factory


class _NullStream:
    """The CPU's one stream: waiting on or recording into it has nothing to do. A recorded event
    is a null stream too, so that synchronising on it does nothing."""

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: self


class _CpuCuda:
    """`torch.cuda` as a patched module sees it: the current device is the CPU, one stream."""

    @staticmethod
    def current_device() -> torch.device:
        return torch.device("cpu")

    @staticmethod
    def synchronize(*args: Any, **kwargs: Any) -> None:
        return None

    @staticmethod
    def current_stream(*args: Any, **kwargs: Any) -> _NullStream:
        return _NullStream()

    @staticmethod
    def Stream(*args: Any, **kwargs: Any) -> _NullStream:  # noqa: N802 - torch.cuda.Stream's name
        return _NullStream()

    @staticmethod
    def stream(*args: Any, **kwargs: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class _CpuTorch:
    """`torch` as a patched module sees it: "cuda" tensors are made on the CPU."""

    cuda = _CpuCuda()
    zeros = staticmethod(_remap_factory(torch.zeros))
    ones = staticmethod(_remap_factory(torch.ones))
    empty = staticmethod(_remap_factory(torch.empty))
    full = staticmethod(_remap_factory(torch.full))
    tensor = staticmethod(_remap_factory(torch.tensor))
    arange = staticmethod(_remap_factory(torch.arange))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


_CPU_TORCH = _CpuTorch()


def _patch_module_torch(name: str) -> None:
    try:
        module = importlib.import_module(name)
    except ImportError:
        logger.debug("CPU shim: %s not present in this megatron-core", name)
        return
    assert module.torch is torch, f"{name}.torch is already replaced"
    module.torch = _CPU_TORCH


NORM_CHUNK = 1 << 16  # elements per fp64 temporary of the grad norm: 512 KiB, cache-sized


def _l2_norm_fp64(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """The CPU stand-in for apex/TE's `multi_tensor_l2norm`: the norm of all tensors, summed in
    fp64. megatron adds this rank's squared norm to the other ranks' (stages, TP/DP shards), so
    in fp32 the clip coefficient depended on how the layout split the sum. In fp64 it does not
    (measured: norms within 2e-16, fp32 clip factors equal), and PP/DP runs with clipping equal
    a one-process run bit for bit. Each square is exact in fp64; the fp64 copies cover
    `NORM_CHUNK` elements at a time, not a whole gradient (SmolLM2-135M's 134.5M: 0.63 -> 0.17 s
    and 317k -> 0 page faults, the same norm bit for bit)."""
    first = tensor_lists[0][0] if tensor_lists and tensor_lists[0] else None
    total = torch.zeros((), dtype=torch.float64, device=first.device if first is not None else "cpu")
    for tensor in tensor_lists[0]:
        for chunk in tensor.detach().reshape(-1).split(NORM_CHUNK):
            total += chunk.double().square().sum()
    return total.sqrt().reshape(1), None


def _patch_split_sizes() -> None:
    """The all-to-all dispatcher's split sizes: its `maybe_move_tensor_to_cpu(as_numpy=True)`
    returns a GPU tensor's copy as a numpy array, which `all_to_all_single` takes as a list of
    sizes, but leaves a CPU tensor a tensor, which it refuses; on CPU, numpy too."""
    from megatron.core.transformer.moe import token_dispatcher

    moved = token_dispatcher.maybe_move_tensor_to_cpu

    def to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return moved(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = to_cpu


def _patch_uneven_gather() -> None:
    """The sequence-parallel gather into parts of unequal sizes (item 6), as equal parts."""
    import torch.distributed as dist
    from megatron.core.tensor_parallel import mappings

    gather = mappings._gather_along_first_dim

    def padded_gather(input_, group, output_split_sizes=None, use_global_buffer=False):
        sizes = output_split_sizes
        if sizes is None or group.size() == 1 or len(set(sizes)) == 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        longest = max(sizes)
        padded = input_.new_zeros((longest, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded, group=group)
        return torch.cat([part[:size] for part, size in zip(parts, sizes)])

    mappings._gather_along_first_dim = padded_gather


def _patch_l2_norm() -> None:
    # Without apex/TE, grad clipping uses megatron.core.utils.local_multi_tensor_l2_norm, which
    # returns its norm on "cuda". Only the clip_grads binding is replaced: utils stays as is.
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    if clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = _l2_norm_fp64


# --- 4. tensor-method calls: type-name asserts and .cuda() -----------------------------------

_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}
_tensor_type = torch.Tensor.type
_tensor_cuda = torch.Tensor.cuda


def _type_as_cuda(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    result = _tensor_type(self, *args, **kwargs)
    if args or kwargs:  # a conversion, not a type-name query
        return result
    return _CUDA_TYPE_NAMES.get(result, result)


def _cuda_stays_on_cpu(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return self


@contextlib.contextmanager
def _cuda_tensor_methods() -> Any:
    """Inside one megatron call: CPU tensors report CUDA type names and `.cuda()` is a no-op.

    Scoped to the wrapped call; megatron makes these calls on the main thread at setup time.
    Calls nest (LLaVA's constructor builds a GPTModel, whose embedding setup is wrapped too): each
    exit restores what its entry found.
    """
    found = torch.Tensor.type, torch.Tensor.cuda
    torch.Tensor.type = _type_as_cuda
    torch.Tensor.cuda = _cuda_stays_on_cpu
    try:
        yield
    finally:
        torch.Tensor.type, torch.Tensor.cuda = found


def _with_cuda_tensor_methods(fn: Any) -> Any:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _cuda_tensor_methods():
            return fn(*args, **kwargs)

    return wrapper


def _patch_tensor_method_calls() -> None:
    from megatron.core.models.common.language_module import language_module
    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer

    # Grad clipping asserts `param.grad.type() == "torch.cuda.FloatTensor"`.
    clipped = _with_cuda_tensor_methods(clip_grads.clip_grad_by_total_norm_fp32)
    clip_grads.clip_grad_by_total_norm_fp32 = clipped
    optimizer.clip_grad_by_total_norm_fp32 = clipped  # imported by name
    # The optimizers sort parameters into fp32 / fp16 / bf16 groups by CUDA type name.
    for cls in (distrib_optimizer.DistributedOptimizer, optimizer.Float16OptimizerWithFloat16Params):
        cls.__init__ = _with_cuda_tensor_methods(cls.__init__)
    # The reshardable distributed-optimizer checkpoint moves DP shards `.cuda()` to gather them.
    dist_opt = distrib_optimizer.DistributedOptimizer
    dist_opt.get_parameter_state_dp_zero = _with_cuda_tensor_methods(dist_opt.get_parameter_state_dp_zero)
    # With tied embeddings and p > 1, the last stage's copy is moved `.cuda()` before the
    # all-reduce that initialises it from the first stage.
    module_cls = language_module.LanguageModule
    module_cls.setup_embeddings_and_output_layer = _with_cuda_tensor_methods(
        module_cls.setup_embeddings_and_output_layer
    )
    # Under context parallelism RoPE's table is cut per CP rank with an index moved `.cuda()`.
    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding

    cut = _with_cuda_tensor_methods(rope_utils.get_pos_emb_on_this_cp_rank)
    rope_utils.get_pos_emb_on_this_cp_rank = cut
    rotary_pos_embedding.get_pos_emb_on_this_cp_rank = cut  # imported by name
    # The CLIP ViT (LLaVA's vision tower) moves its position ids `.cuda()` when it is built.
    from megatron.core.models.vision import clip_vit_model

    vit = clip_vit_model.CLIPViTModel
    vit.__init__ = _with_cuda_tensor_methods(vit.__init__)
