"""The `sglang` RolloutEngine: SGLang's offline `Engine`, colocated with the actor.

One SGLang engine serves one generation-TP group: group rank 0 launches it with
`tp_size = t_g` on the group's GPUs (`base_gpu_id` = rank 0's GPU, `gpu_id_step` = the stride of
the group's ranks), so SGLang's TP rank a runs on the GPU of generation-TP rank a. Every rank
of the group calls every method (they are collective over the group); results are broadcast.
It generates with p_g = 1 only (`rl3d.rollout.factory` refuses more before launch), and
`load_weights` checks that every HF tensor of the model was pushed.

Launch: SGLang's processes start without the torchrun variables (`sglang_launch_env`) and with
`SGLANG_RETURN_ORIGINAL_LOGPROB=1`, so its log-probs are the plain softmax's, as the torch
engine's `raw_logprobs`. SGLang writes process-wide settings into rank 0's environment
(NCCL_CUMEM_ENABLE, CUDA_DEVICE_MAX_CONNECTIONS, ...), the multiprocessing start method and
signal handlers; rank 0 gets its own back after the launch, so it runs what its peers run, and
`launch_env` records what SGLang set. SGLang's children signal a failure with SIGQUIT: in the
trainer that raises `SGLangSchedulerError` (rl3d's error path: logged, the run stopped cleanly),
where SGLang's own handler would kill the process tree (`rl3d.rollout.sglang_launch`). The
engine loads no checkpoint (`load_format="dummy"`): every tensor is pushed before the first
generation.

Weights (`load_weights`), in the buckets its transition planned (`push_plan`, the hybrid
engine's `EnginePush`: the push is the transition's last step, checked and counted with it),
inside SGLang's begin/end_weight_update session:
- "tensor" (colocated, default): each rank all-gathers the generation-TP shards of the bucket's
  parameters, converts them to whole HF tensors with the resharding kernels, flattens them into
  one buffer on its own GPU, and sends a CUDA-IPC handle (device named by UUID, SGLang's
  `monkey_patch_torch_reductions`) to group rank 0, which hands SGLang one payload per SGLang
  TP rank (`update_weights_from_tensor(load_format="flattened_bucket")`);
- "distributed" (rollout on separate GPUs): group rank 0 broadcasts each bucket's HF tensors
  over an NCCL group it shares with the engine (`update_weights_from_distributed`).

Memory (with `enable_memory_saver`): `release_memory()` releases every tag SGLang has
(kv_cache, weights, cuda_graph); the engine is launched once every colocated role exists and
starts released. SGLang resumes a tag on every GPU of the group at once, so before each resume
every rank of the group empties its allocator's cache and they meet at a barrier. `load_weights`
resumes "weights" that way and pushes; the caller then frees what it no longer needs (its
resharded copy, offloaded training state) and `resume_memory` resumes the KV cache and CUDA
graphs; `pause` releases those two again and keeps the weights.
`generate` refuses while any tag is released.

Control messages (barriers, the gather of IPC handles, the broadcast of results) wait on SGLang
for as long as it launches or generates; they go over `control_group`, a gloo twin of the
generation-TP group with the world's timeout, so no NCCL kernel spins meanwhile.

SGLang needs CUDA; this module imports it only inside methods. Its pure parts live in
`rl3d.rollout.sglang_weights` and are tested on CPU, against the pinned wheel's source and a
stand-in engine that follows it; the rest is tested in tests/gpu.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist

from rl3d.models.spec import ModelSpec
from rl3d.rollout.base import RolloutBatch, SamplingParams, check_prompts
from rl3d.rollout.model import TPComm
from rl3d.rollout.sglang_launch import scoped_environ, trainer_signal_handlers
from rl3d.rollout.sglang_lora import (
    check_lora_update,
    peft_config_dict,
    sglang_lora_server_args,
    whole_adapters,
)
from rl3d.rollout.sglang_outputs import parse_output, top_tensors
from rl3d.rollout.sglang_weights import (
    Pushed,
    check_sglang,
    env_changes,
    flatten_bucket,
    hf_names,
    is_torchrun_var,
    planned_buckets,
    sglang_launch_env,
    sglang_server_args,
    to_sglang_sampling,
)
from rl3d.rollout.stops import model_eos_token_ids
from rl3d.utils.device import current_gpu, empty_cache

logger = logging.getLogger(__name__)
UPDATE_MODES = ("tensor", "distributed")
WEIGHTS, KV_CACHE = "weights", "kv_cache"


def _import_sglang() -> Any:
    try:
        import sglang
    except ImportError as err:
        raise ImportError(
            "the sglang rollout engine needs SGLang (CUDA only): pip install 'rl3d[gpu]'"
        ) from err
    check_sglang(sglang)
    return sglang


def _current_gpu() -> int:
    return current_gpu()


def _empty_allocator_cache() -> None:
    """Hand the blocks training freed back to the driver, so SGLang can map them on resume."""
    empty_cache()


class SGLangRolloutEngine:
    name = "sglang"
    holds_weights = True  # its own copy: the caller may free what it pushed from
    # copies the trainer's process holds beyond what it pushed: none (SGLang's are its own)
    weight_copy_bytes = lora_copy_bytes = 0

    def __init__(
        self,
        spec: ModelSpec,
        *,
        model_path: str,
        group: Any = None,
        push_plan: Any = None,
        control_group: Any = None,
        pad_token_id: int = 0,
        update_mode: str = "tensor",
        mem_fraction_static: float = 0.5,
        enable_memory_saver: bool = True,
        deterministic: bool = False,
        max_total_tokens: int | None = None,
        base_gpu_id: int | None = None,
        gpu_id_step: int | None = None,
        dtype: str = "bfloat16",
        seed: int | None = None,
        engine_kwargs: dict[str, Any] | None = None,
        lora: Any = None,
    ):
        if update_mode not in UPDATE_MODES:
            raise ValueError(f"rollout.sglang.update_mode={update_mode!r}; known: {', '.join(UPDATE_MODES)}")
        sglang = _import_sglang()  # first: without SGLang, say how to install it
        if not getattr(push_plan, "buckets", None):
            raise ValueError(
                "the SGLang engine pushes the buckets its transition planned: give push_plan "
                "(`Resharder.push_plan`, or `rl3d.hybrid_engine.engine_push.plan_engine_push`)"
            )
        self.spec, self.update_mode, self.pad_token_id = spec, update_mode, pad_token_id
        self.push_plan = push_plan
        self.memory_saver = enable_memory_saver
        self.eos_token_ids = model_eos_token_ids(model_path)
        self.tp = TPComm(group)
        # barriers, gathers and broadcasts of Python objects wait on SGLang: a gloo group (the
        # generation-TP group's twin) where one is given
        self.control = self.tp.handle if control_group is None else control_group.handle
        self._released: list[str] = []
        self._update_group: Any = None
        self._update_group_name = ""
        self.lora_config = lora  # the adapters' config it was launched for (None: no LoRA)
        self._lora_name: str | None = None  # the adapter requests use (None: the base alone)
        self._lora_version = 0
        self.engine = None
        self.launch_env: dict[str, Any] = {}
        if not deterministic:
            logger.warning("SGLang without deterministic inference ignores the sampling seed")
        if self.tp.rank == 0:
            ranks = self.tp.ranks
            step = gpu_id_step if gpu_id_step is not None else (ranks[1] - ranks[0] if len(ranks) > 1 else 1)
            kwargs = sglang_server_args(
                model_path=model_path,
                tp_size=self.tp.size,
                base_gpu_id=base_gpu_id if base_gpu_id is not None else _current_gpu(),
                gpu_id_step=step,
                mem_fraction_static=mem_fraction_static,
                enable_memory_saver=enable_memory_saver,
                deterministic=deterministic,
                max_total_tokens=max_total_tokens,
                dtype=dtype,
                seed=seed,
            )
            if lora is not None:  # adapters of this rank and these targets can be loaded later
                kwargs.update(sglang_lora_server_args(lora))
            kwargs.update(engine_kwargs or {})
            logger.info("launching SGLang %s engine: %s", sglang.__version__, kwargs)
            self.engine = self._launch(sglang, kwargs)
        self._barrier()
        self.release_memory()  # hold nothing until the first load_weights

    def _launch(self, sglang: Any, kwargs: dict[str, Any]) -> Any:
        """sglang.Engine(**kwargs) in `sglang_launch_env`; this process's environment and start
        method are restored afterwards, and what SGLang changed is recorded in `launch_env`."""
        parent = dict(os.environ)
        start_method = multiprocessing.get_start_method(allow_none=True)
        launch = sglang_launch_env(parent)
        with trainer_signal_handlers() as signals, scoped_environ(launch):
            engine = sglang.Engine(**kwargs)
            child = dict(os.environ)
        if multiprocessing.get_start_method(allow_none=True) != start_method:
            multiprocessing.set_start_method(start_method, force=True)
        self.launch_env = {
            "scrubbed": sorted(k for k in parent if is_torchrun_var(k)),
            "set_by_rl3d": env_changes(parent, launch),
            "set_by_sglang": env_changes(launch, child),
            "signal_handlers_restored": sorted(signals),
        }
        logger.info(
            "SGLang's processes started with %s; rank 0's environment and signal handlers restored",
            self.launch_env,
        )
        return engine

    # -- helpers -------------------------------------------------------------------------------
    def _barrier(self) -> None:
        if self.tp.size > 1:
            dist.barrier(group=self.control)

    def _from_rank0(self, obj: Any) -> Any:
        if self.tp.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.control, 0), group=self.control)
        return box[0]

    # -- RolloutEngine -------------------------------------------------------------------------
    def load_weights(self, weights: Any) -> Pushed:
        """Push `GenerationWeights` into SGLang in the planned buckets (`push_plan`), its weights
        memory resumed first if released; returns what was pushed, which the hybrid engine checks
        against the plan. The KV cache stays as it was: `resume_memory` brings it back."""
        if WEIGHTS in self._released:
            self._resume_after_empty_caches([WEIGHTS])
        if self.engine is not None:
            _check_ok(self.engine.begin_weight_update(), "begin_weight_update")
        pushed = Pushed()
        for bucket in planned_buckets(self.spec, weights, self.push_plan.buckets, self.tp, pushed):
            if self.update_mode == "tensor":
                self._push_ipc(bucket)
            else:
                self._push_distributed(bucket)
            pushed.add(bucket)
        if self.engine is not None:
            _check_ok(self.engine.end_weight_update(), "end_weight_update")
        sent = {n for bucket, _ in pushed.buckets for n in bucket}
        missing = sorted({n for names in hf_names(self.spec).values() for n in names} - sent)
        if missing:
            raise RuntimeError(
                f"SGLang got no new values for {len(missing)} tensors ({', '.join(missing[:3])}, ...): "
                "its engine holds the whole model, so every tensor must be pushed (rollout.p_g = 1)"
            )
        if self.engine is not None:
            self._flush_cache()  # the prefix cache holds the old weights' keys and values
        self._barrier()
        logger.info("pushed weights to SGLang in %d buckets", len(pushed.buckets))
        return pushed

    def _resume_after_empty_caches(self, tags: list[str]) -> None:
        """SGLang resumes `tags` on every GPU of the group at once: every rank first hands its
        allocator's free blocks back to the driver, and all wait for the slowest before rank 0
        asks SGLang to map memory on their GPUs."""
        _empty_allocator_cache()
        self._barrier()
        self._resume(tags)

    def _resume(self, tags: list[str]) -> None:
        if not tags:
            return
        if self.engine is not None:
            self.engine.resume_memory_occupation(tags=tags)
        self._released = [t for t in self._released if t not in tags]

    def _push_ipc(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        from sglang.srt.utils import MultiprocessingSerializer
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata

        flat, entries = flatten_bucket(bucket)
        monkey_patch_torch_reductions()  # CUDA-IPC handles name the GPU by UUID, not index
        payload = MultiprocessingSerializer.serialize(
            {"flattened_tensor": flat, "metadata": [FlattenedTensorMetadata(**asdict(e)) for e in entries]},
            output_str=True,
        )
        gathered = [None] * self.tp.size if self.tp.rank == 0 else None
        if self.tp.size > 1:
            root = dist.get_global_rank(self.control, 0)
            dist.gather_object(payload, gathered, dst=root, group=self.control)
        else:
            gathered = [payload]
        if self.engine is not None:
            ret = self.engine.update_weights_from_tensor(
                named_tensors=gathered, load_format="flattened_bucket", flush_cache=False
            )
            _check_ok(ret, "update_weights_from_tensor")
        self._barrier()  # `flat` must outlive SGLang's copy out of it

    def connect_update_group(self, master_address: str, master_port: int, group_name: str = "rl3d") -> None:
        """For update_mode="distributed": make the NCCL group {group rank 0} + the engine's ranks."""
        if self.engine is None:
            return
        from sglang.srt.utils import init_custom_process_group

        world = 1 + self.engine.server_args.tp_size
        thread = threading.Thread(
            target=self.engine.init_weights_update_group,
            kwargs=dict(master_address=master_address, master_port=master_port, rank_offset=1,
                        world_size=world, group_name=group_name, backend="nccl"),
        )  # fmt: skip
        # torchrun's agent-store variable would make this tcp:// rendezvous a client-only store
        with scoped_environ({k: v for k, v in os.environ.items() if not is_torchrun_var(k)}):
            thread.start()
            self._update_group = init_custom_process_group(
                backend="nccl", init_method=f"tcp://{master_address}:{master_port}",
                world_size=world, rank=0, group_name=group_name,
            )  # fmt: skip
            thread.join()
        self._update_group_name = group_name

    def _push_distributed(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        if self.engine is None:
            return
        if self._update_group is None:
            raise RuntimeError("update_mode='distributed' needs connect_update_group() first")
        outcome: dict[str, Any] = {}

        def receive() -> None:  # SGLang's side: blocks until the broadcasts below arrive
            try:
                outcome["ret"] = self.engine.update_weights_from_distributed(
                    names=[n for n, _ in bucket],
                    dtypes=[str(t.dtype).removeprefix("torch.") for _, t in bucket],
                    shapes=[list(t.shape) for _, t in bucket],
                    group_name=self._update_group_name,
                    flush_cache=False,
                )
            except BaseException as err:  # re-raised in the caller's thread
                outcome["err"] = err

        thread = threading.Thread(target=receive)
        thread.start()
        for _, t in bucket:
            dist.broadcast(t.contiguous(), src=0, group=self._update_group)
        thread.join()
        if "err" in outcome:
            raise outcome["err"]
        _check_ok(outcome.get("ret"), "update_weights_from_distributed")

    def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """Release `tags` (default: every tag SGLang has: kv_cache, weights, cuda_graph) that are
        not released yet; a no-op without the memory saver."""
        if not self.memory_saver:
            return
        from sglang.srt.constants import GPU_MEMORY_ALL_TYPES

        tags = [t for t in (tags or GPU_MEMORY_ALL_TYPES) if t not in self._released]
        if tags and self.engine is not None:
            self.engine.release_memory_occupation(tags=tags)
        self._released += tags
        self._barrier()

    def pause(self) -> None:
        """Release everything but the weights (the KV cache and CUDA graphs)."""
        from sglang.srt.constants import GPU_MEMORY_ALL_TYPES

        self.release_memory([t for t in GPU_MEMORY_ALL_TYPES if t != WEIGHTS])

    def resume_memory(self) -> None:
        """Resume what is released but the weights, which `load_weights` resumes and fills
        (each after every rank of the group emptied its allocator's cache)."""
        if WEIGHTS in self._released:
            raise RuntimeError("SGLang's weights are released: load_weights() first")
        resumed = list(self._released)
        self._resume_after_empty_caches(resumed)
        if self.engine is not None and KV_CACHE in resumed:
            self.engine.flush_cache()
        self._barrier()

    def resume_weights(self) -> None:
        """Bring back the weights SGLang was pushed before, as they were: the adapter transition
        pushes the base once and resumes it every step. Needs the engine built with `lora=`,
        whose released weights SGLang keeps in host memory (`enable_weights_cpu_backup`)."""
        if WEIGHTS not in self._released:
            return
        if self.lora_config is None:
            raise RuntimeError("SGLang's released weights lost their values (no CPU backup): load_weights()")
        self._resume_after_empty_caches([WEIGHTS])

    def load_lora(self, tensors: Any, config: Any) -> None:
        """Use these LoRA adapters over the base weights SGLang holds; the previous adapters are
        unloaded. `tensors`: PEFT's names -> whole tensors (rank 0's are used), or the
        `GenerationWeights` the adapter transition gave this rank, gathered whole over the group
        (collective). The engine must have been built with `lora=` (`rl3d.rollout.sglang_lora`)."""
        if self.lora_config is None:
            raise RuntimeError("the SGLang engine was launched without LoRA: build it with lora=")
        whole = whole_adapters(tensors, self.tp)
        if self.engine is not None:
            self._unload_lora()
            self._lora_version += 1
            name = f"rl3d-lora-{self._lora_version}"
            ret = self.engine.load_lora_adapter_from_tensors(
                lora_name=name, tensors=whole, config_dict=peft_config_dict(config)
            )
            check_lora_update(ret, "load_lora_adapter_from_tensors")
            self._lora_name = name
            self._flush_cache()  # cached prefixes were computed without these adapters
        self._barrier()

    def clear_lora(self) -> None:
        """Generate with the base weights alone again."""
        if self.engine is not None:
            self._unload_lora()
            self._flush_cache()
        self._barrier()

    def _flush_cache(self) -> None:
        """Drop cached prefixes; a released KV cache holds none (`resume_memory` flushes)."""
        if KV_CACHE not in self._released:
            self.engine.flush_cache()

    def _unload_lora(self) -> None:
        if self._lora_name is not None:
            ret = self.engine.unload_lora_adapter(lora_name=self._lora_name)
            check_lora_update(ret, "unload_lora_adapter")
            self._lora_name = None

    def generate(self, prompts_token_ids: Sequence[Sequence[int]], params: SamplingParams) -> RolloutBatch:
        """`logprobs` and `raw_logprobs` both hold SGLang's log-probs of the plain softmax
        (SGLANG_RETURN_ORIGINAL_LOGPROB): it returns one kind only."""
        if self._released:
            raise RuntimeError(
                f"SGLang's memory ({', '.join(self._released)}) is released: "
                "load_weights() and resume_memory() first"
            )
        prompts = check_prompts(prompts_token_ids, self.spec.vocab_size)
        rows = None
        if self.engine is not None:
            ids = [p for p in prompts for _ in range(params.n)]
            sampling = [to_sglang_sampling(params, i, self.eos_token_ids) for i in range(len(ids))]
            lora = None if self._lora_name is None else [self._lora_name] * len(ids)
            # the alternatives come from the same (original) log-probs as the sampled token's
            outputs = self.engine.generate(
                input_ids=ids, sampling_params=sampling, return_logprob=True,
                top_logprobs_num=params.top_logprobs or None,  # None: SGLang's default, none
                lora_path=lora,
            )  # fmt: skip
            rows = [parse_output(o, params.top_logprobs) for o in outputs]
        rows = self._from_rank0(rows)
        logprobs = [r[1] for r in rows]
        batch = RolloutBatch.from_lists(
            [r[0] for r in rows], logprobs, [r[2] for r in rows], [i // params.n for i in range(len(rows))],
            raw_logprobs=logprobs, pad_token_id=self.pad_token_id,
        )  # fmt: skip
        if params.top_logprobs:
            batch.top_ids, batch.top_logprobs = top_tensors([r[3] for r in rows], params.top_logprobs)
        return batch

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None


def _check_ok(ret: Any, what: str) -> None:
    """SGLang's weight updates answer (success, message); a failure must not pass silently."""
    if isinstance(ret, tuple) and ret and ret[0] is False:
        raise RuntimeError(f"SGLang {what} failed: {ret[1] if len(ret) > 1 else ret}")
