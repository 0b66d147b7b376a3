"""The `sglang` RolloutEngine: SGLang's offline `Engine`, colocated with the actor.

One SGLang engine serves one generation-TP group: group rank 0 launches it with
`tp_size = t_g` on the group's GPUs (`base_gpu_id` = rank 0's GPU, `gpu_id_step` = the stride of
the group's ranks), so SGLang's TP rank a runs on the GPU of generation-TP rank a. Every rank
of the group calls every method (they are collective over the group); results are broadcast.

Weights (`load_weights`), bucket by bucket:
- "tensor" (colocated, default): each rank all-gathers the generation-TP shards of the bucket's
  parameters, converts them to whole HF tensors with the resharding kernels, flattens them into
  one buffer on its own GPU, and sends a CUDA-IPC handle to group rank 0, which hands SGLang one
  payload per SGLang TP rank (`update_weights_from_tensor(load_format="flattened_bucket")`);
- "distributed" (rollout on separate GPUs): group rank 0 broadcasts each bucket's HF tensors
  over an NCCL group it shares with the engine (`update_weights_from_distributed`).
The cache is flushed once after the last bucket. `release_memory()` / `resume_memory()` wrap
SGLang's `release/resume_memory_occupation` (the engine runs with `enable_memory_saver`);
weights memory is resumed before new weights are written into it.

SGLang needs CUDA; this module imports it only inside methods. Its pure parts live in
`rl3d.rollout.sglang_weights` and are tested on CPU; the rest is tested in tests/gpu.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist

from rl3d.models.spec import ModelSpec
from rl3d.rollout.base import FINISH_LENGTH, FINISH_STOP, RolloutBatch, SamplingParams, check_prompts
from rl3d.rollout.model import TPComm
from rl3d.rollout.sglang_weights import (
    check_sglang,
    flatten_bucket,
    hf_tensors,
    plan_buckets,
    to_sglang_sampling,
)

logger = logging.getLogger(__name__)
UPDATE_MODES = ("tensor", "distributed")


def _import_sglang() -> Any:
    try:
        import sglang
    except ImportError as err:
        raise ImportError(
            "the sglang rollout engine needs SGLang (CUDA only): pip install 'rl3d[gpu]'"
        ) from err
    check_sglang(sglang)
    return sglang


class SGLangRolloutEngine:
    name = "sglang"

    def __init__(
        self,
        spec: ModelSpec,
        *,
        model_path: str,
        group: Any = None,
        weights: Any = None,
        update_mode: str = "tensor",
        bucket_mb: float = 512.0,
        mem_fraction_static: float = 0.5,
        base_gpu_id: int | None = None,
        gpu_id_step: int | None = None,
        dtype: str = "bfloat16",
        engine_kwargs: dict[str, Any] | None = None,
    ):
        if update_mode not in UPDATE_MODES:
            raise ValueError(f"rollout.sglang.update_mode={update_mode!r}; known: {', '.join(UPDATE_MODES)}")
        sglang = _import_sglang()
        self.spec, self.update_mode = spec, update_mode
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.tp = TPComm(group)
        self._released: set[str] = set()
        self._update_group: Any = None
        self._update_group_name = ""
        self.engine = None
        if self.tp.rank == 0:
            ranks = self.tp.ranks
            step = gpu_id_step if gpu_id_step is not None else (ranks[1] - ranks[0] if len(ranks) > 1 else 1)
            kwargs = dict(
                model_path=model_path,
                tp_size=self.tp.size,
                enable_memory_saver=True,
                skip_tokenizer_init=True,
                mem_fraction_static=mem_fraction_static,
                base_gpu_id=base_gpu_id if base_gpu_id is not None else torch.cuda.current_device(),
                gpu_id_step=step,
                dtype=dtype,
            )
            kwargs.update(engine_kwargs or {})
            logger.info("launching SGLang %s engine: %s", sglang.__version__, kwargs)
            self.engine = sglang.Engine(**kwargs)
        self._barrier()
        if weights is not None:
            self.load_weights(weights)

    # -- helpers -------------------------------------------------------------------------------
    def _barrier(self) -> None:
        if self.tp.size > 1:
            dist.barrier(group=self.tp.handle)

    def _from_rank0(self, obj: Any) -> Any:
        if self.tp.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.tp.handle, 0), group=self.tp.handle)
        return box[0]

    # -- RolloutEngine -------------------------------------------------------------------------
    def load_weights(self, weights: Any) -> None:
        """Push `GenerationWeights` into SGLang, bucket by bucket, then flush its cache."""
        if self.engine is not None and "weights" in self._released:
            self.engine.resume_memory_occupation(tags=["weights"])
        self._released.discard("weights")
        count = 0
        for bucket in plan_buckets(hf_tensors(self.spec, weights, self.tp), self.bucket_bytes):
            if self.update_mode == "tensor":
                self._push_ipc(bucket)
            else:
                self._push_distributed(bucket)
            count += 1
        if self.engine is not None:
            self.engine.flush_cache()
        self._barrier()
        logger.info("pushed weights to SGLang in %d buckets", count)

    def _push_ipc(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        from sglang.srt.utils import MultiprocessingSerializer
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata

        flat, entries = flatten_bucket(bucket)
        payload = MultiprocessingSerializer.serialize(
            {"flattened_tensor": flat, "metadata": [FlattenedTensorMetadata(**asdict(e)) for e in entries]},
            output_str=True,
        )
        gathered = [None] * self.tp.size if self.tp.rank == 0 else None
        if self.tp.size > 1:
            dist.gather_object(
                payload, gathered, dst=dist.get_global_rank(self.tp.handle, 0), group=self.tp.handle
            )
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

    def release_memory(self) -> None:
        if self.engine is not None:
            self.engine.release_memory_occupation()
        self._released = {"weights", "kv_cache"}
        self._barrier()

    def resume_memory(self) -> None:
        if self.engine is not None and self._released:
            from sglang.srt.constants import GPU_MEMORY_ALL_TYPES

            still = [t for t in GPU_MEMORY_ALL_TYPES if t != "weights" or "weights" in self._released]
            self.engine.resume_memory_occupation(tags=still)
        self._released = set()
        self._barrier()

    def generate(self, prompts_token_ids: Sequence[Sequence[int]], params: SamplingParams) -> RolloutBatch:
        prompts = check_prompts(prompts_token_ids, self.spec.vocab_size)
        rows = None
        if self.engine is not None:
            ids = [p for p in prompts for _ in range(params.n)]
            sampling = [to_sglang_sampling(params, i) for i in range(len(ids))]
            outputs = self.engine.generate(input_ids=ids, sampling_params=sampling, return_logprob=True)
            rows = [_parse_output(o) for o in outputs]
        rows = self._from_rank0(rows)
        return RolloutBatch.from_lists(
            [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows],
            [i // params.n for i in range(len(rows))],
        )  # fmt: skip

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None


def _check_ok(ret: Any, what: str) -> None:
    """SGLang's weight updates answer (success, message); a failure must not pass silently."""
    if isinstance(ret, tuple) and ret and ret[0] is False:
        raise RuntimeError(f"SGLang {what} failed: {ret[1] if len(ret) > 1 else ret}")


def _parse_output(output: dict[str, Any]) -> tuple[list[int], list[float], str]:
    """(token ids, log-probs, finish reason) of one SGLang generate output."""
    meta = output["meta_info"]
    reason = (meta.get("finish_reason") or {}).get("type")
    if reason not in (FINISH_STOP, FINISH_LENGTH):
        raise RuntimeError(f"SGLang request ended with finish_reason={meta.get('finish_reason')!r}")
    ids = list(output["output_ids"])
    logprobs = [float(entry[0]) for entry in meta["output_token_logprobs"]]
    if len(logprobs) != len(ids):
        raise RuntimeError(f"SGLang returned {len(ids)} tokens but {len(logprobs)} log-probs")
    return ids, logprobs, reason
