"""A CPU stand-in for `sglang` 0.5.23 whose behaviour follows the pinned wheel's source (read by
`sglang_wheel`), installed into `sys.modules` for one test:

- `Engine(**kwargs)` takes only ServerArgs fields; it writes into the launching process's
  environment what `_set_envs_and_config` writes, sets the start method to spawn, installs its
  SIGQUIT handler (which would kill the process tree), and records the environment its scheduler
  "processes" inherit. With `load_format="dummy"` it reads the checkpoint's tensor names and
  shapes only and starts from random values. A scheduler that inherits
  TORCHELASTIC_USE_AGENT_STORE=True hangs in torch's tcp:// rendezvous, and one that inherits
  MASTER_ADDR/MASTER_PORT uses the trainer's (`setdefault` in sglang's bootstrap): both raise.
- Memory tags: release adds to `offload_tags` (released weights lose their values unless the
  engine was launched with `enable_weights_cpu_backup`, which keeps a host copy); resume
  removes and raises KeyError for a tag that was not released
  (`self.offload_tags.remove(tag)`); generation and weight writes refuse while a tag they need is
  released.
- Weight updates fail (success False) outside begin/end_weight_update; payloads are decoded as
  SGLang decodes them: base64 -> `SafeUnpickler` with the wheel's ALLOWED_GLOBALS -> each rank's
  own payload -> `flat[start:end].view(dtype).reshape(shape)`, and must name a tensor of the
  checkpoint with its shape.
- Sampling dicts take only SamplingParams fields; `ignore_eos` turns off stop ids and EOS alike;
  `sampling_seed` holds only with deterministic inference; log-probs are those of logits / T
  unless the scheduler inherited SGLANG_RETURN_ORIGINAL_LOGPROB.

Its "model" is a deterministic function of the prompt, the weights' checksum, the seed and the
step, so a test can tell which weights and seed produced a row.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
import types
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file

# `_set_envs_and_config` writes these only under conditions a colocated rl3d engine never meets
CONDITIONAL_WRITES = {"NCCL_GRAPH_MIXING_SUPPORT"}  # dcp_size > 1
SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def raw_logprob(token: int) -> float:
    """The stand-in model's plain-softmax log-prob of `token`."""
    return -(1 + token % 5) / 10


class StandIn:
    """The wheel's facts, the engines launched, and the calls they saw."""

    def __init__(self, wheel: Any):
        self.version = wheel.version()
        self.server_fields = wheel.server_args_fields()
        self.sampling_fields = wheel.sampling_param_fields()
        self.memory_types = wheel.memory_types()
        self.allowed = wheel.safe_unpickler_globals()
        self.env_writes = {k: v for k, v in wheel.env_writes().items() if k not in CONDITIONAL_WRITES}
        self.meta_fields = wheel.dataclass_fields(
            "sglang/srt/weight_sync/tensor_bucket.py", "FlattenedTensorMetadata"
        )
        self.engines: list[Engine] = []
        self.patched_reductions = 0
        self.launch_seconds = 0.0  # how long Engine(...) takes (loading, CUDA graphs, ...)
        self.generate_seconds = 0.0

    def modules(self) -> dict[str, types.ModuleType]:
        standin = self

        def module(name: str, **attrs: Any) -> types.ModuleType:
            m = types.ModuleType(name)
            m.__dict__.update(attrs)
            return m

        meta = dataclasses.make_dataclass("FlattenedTensorMetadata", self.meta_fields)
        meta.__module__ = "sglang.srt.weight_sync.tensor_bucket"

        class BoundEngine(Engine):
            def __init__(self, **kwargs: Any):
                super().__init__(standin, **kwargs)

        def patch() -> None:
            standin.patched_reductions += 1

        return {
            "sglang": module("sglang", __version__=self.version, Engine=BoundEngine),
            "sglang.srt": module("sglang.srt"),
            "sglang.srt.utils": module("sglang.srt.utils", MultiprocessingSerializer=Serializer),
            "sglang.srt.utils.patch_torch": module(
                "sglang.srt.utils.patch_torch", monkey_patch_torch_reductions=patch
            ),
            "sglang.srt.constants": module(
                "sglang.srt.constants", GPU_MEMORY_ALL_TYPES=list(self.memory_types)
            ),
            "sglang.srt.weight_sync": module("sglang.srt.weight_sync"),
            "sglang.srt.weight_sync.tensor_bucket": module(
                "sglang.srt.weight_sync.tensor_bucket", FlattenedTensorMetadata=meta
            ),
        }


def install(monkeypatch: Any, wheel: Any) -> StandIn:
    standin = StandIn(wheel)
    for name, mod in standin.modules().items():
        monkeypatch.setitem(sys.modules, name, mod)
    return standin


class Serializer:
    """sglang.srt.utils.common.MultiprocessingSerializer."""

    @staticmethod
    def serialize(obj: Any, output_str: bool = False) -> bytes | str:
        buf = io.BytesIO()
        ForkingPickler(buf).dump(obj)
        out = buf.getvalue()
        return base64.b64encode(out).decode("utf-8") if output_str else out


def safe_loads(data: bytes, allowed: set[tuple[str, str]]) -> Any:
    class SafeUnpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            if (module, name) in allowed:
                return super().find_class(module, name)
            raise RuntimeError(f"Blocked unsafe global ({module}.{name}) during pickle deserialization")

    return SafeUnpickler(io.BytesIO(data)).load()


def launch_phase_sigquit_handler(signum: int, frame: Any) -> None:
    raise AssertionError("SGLang's own SIGQUIT handler ran in the trainer (it kills the process tree)")


class Engine:
    def __init__(self, standin: StandIn, **kwargs: Any):
        unknown = sorted(set(kwargs) - standin.server_fields)
        if unknown:
            raise TypeError(f"ServerArgs has no field(s) {unknown}")
        self.standin, self.args = standin, kwargs
        self.server_args = types.SimpleNamespace(**kwargs)
        self.tp_size = kwargs.get("tp_size", 1)
        self.deterministic = bool(kwargs.get("enable_deterministic_inference", False))
        self.events: list[tuple] = []
        # _set_envs_and_config, then the scheduler processes are spawned with this environment
        for name, value in standin.env_writes.items():
            if name.startswith("NCCL_") and name in os.environ:
                continue
            os.environ[name] = value if value is not None else ("0" if name.startswith("NCCL_") else "run-1")
        multiprocessing.set_start_method("spawn", force=True)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGQUIT, launch_phase_sigquit_handler)
        time.sleep(standin.launch_seconds)
        self.child_env = dict(os.environ)
        if self.child_env.get("TORCHELASTIC_USE_AGENT_STORE") == str(True):
            raise TimeoutError("scheduler start-up hangs: its tcp:// rendezvous made a client-only store")
        inherited = sorted({"MASTER_ADDR", "MASTER_PORT"} & set(self.child_env))
        if inherited:
            raise RuntimeError(f"the scheduler would rendezvous at the trainer's {inherited}")
        flag = self.child_env.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "false").lower()
        self.original_logprob = flag in ("1", "true", "yes")
        path = Path(kwargs["model_path"])
        config = json.loads((path / "config.json").read_text())
        self.vocab_size = config["vocab_size"]
        self.eos = set()
        for name in ("config.json", "generation_config.json"):
            if (path / name).is_file():
                eos = json.loads((path / name).read_text()).get("eos_token_id")
                self.eos |= set() if eos is None else {eos} if isinstance(eos, int) else set(eos)
        self.weights = {}
        self.read_checkpoint = kwargs.get("load_format", "auto") != "dummy"
        for file in sorted(path.glob("*.safetensors")):
            if self.read_checkpoint:
                self.weights.update(load_file(str(file)))
                continue
            with safe_open(str(file), "pt") as f:  # the header: names, shapes and dtypes
                for name in f.keys():
                    piece = f.get_slice(name)
                    dtype = SAFETENSORS_DTYPES[piece.get_dtype()]
                    self.weights[name] = torch.rand(piece.get_shape(), dtype=dtype)
        self.offload_tags: set[str] = set()
        self.session = False
        self.pushed: list[tuple[tuple[str, ...], int]] = []  # each update's tensor names and bytes
        self.loras: dict[str, float] = {}  # adapter name -> its tensors' checksum
        standin.engines.append(self)

    # -- memory -------------------------------------------------------------------------------
    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        tags = tags or list(self.standin.memory_types)
        self.events.append(("release", tuple(tags)))
        for tag in tags:
            assert tag in self.standin.memory_types, tag
            if tag in self.offload_tags:
                raise RuntimeError(f"{tag} is already released")
            self.offload_tags.add(tag)
        if "weights" in tags and not self.args.get("enable_weights_cpu_backup"):
            for t in self.weights.values():
                t.fill_(float("nan"))  # the memory saver drops what it pauses

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        tags = tags or list(self.standin.memory_types)
        self.events.append(("resume", tuple(tags)))
        for tag in tags:
            self.offload_tags.remove(tag)

    def flush_cache(self) -> bool:
        self.events.append(("flush",))
        if "kv_cache" in self.offload_tags:
            raise RuntimeError("flush_cache on a released KV cache")
        return True

    # -- weights ------------------------------------------------------------------------------
    def begin_weight_update(self, selector: str = "all") -> tuple[bool, str]:
        self.events.append(("begin",))
        if self.session:
            return False, "a weight-update session is already open; call end_weight_update() first"
        if "weights" in self.offload_tags:
            raise RuntimeError("begin_weight_update on released weights")
        self.session = True
        return True, "Success"

    def end_weight_update(self) -> tuple[bool, str]:
        self.events.append(("end",))
        if not self.session:
            return False, "no weight-update session is open; call begin_weight_update() first"
        self.session = False
        return True, "Success"

    def update_weights_from_tensor(
        self, named_tensors: list, load_format: str | None = None, flush_cache: bool = True
    ) -> tuple[bool, str]:
        self.events.append(("update", load_format))
        if not self.session:
            return (
                False,
                "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()",
            )
        if "weights" in self.offload_tags:
            raise RuntimeError("weights written into released memory")
        if load_format != "flattened_bucket" or len(named_tensors) != self.tp_size:
            raise ValueError(
                f"load_format={load_format!r}, {len(named_tensors)} payloads for tp {self.tp_size}"
            )
        payloads = [
            base64.b64decode(p, validate=True) if isinstance(p, str) else bytes(p) for p in named_tensors
        ]
        own = safe_loads(payloads[0], self.standin.allowed)  # TP rank 0's payload
        flat = own["flattened_tensor"]
        self.pushed.append((tuple(m.name for m in own["metadata"]), flat.numel() * flat.element_size()))
        for meta in own["metadata"]:
            tensor = flat[meta.start_idx : meta.end_idx].view(meta.dtype).reshape(meta.shape)
            if meta.name not in self.weights or self.weights[meta.name].shape != tensor.shape:
                raise ValueError(f"the model has no tensor {meta.name} of shape {tuple(tensor.shape)}")
            self.weights[meta.name].copy_(tensor)
        if flush_cache:
            self.flush_cache()
        return True, "Success"

    def init_weights_update_group(self, master_address, master_port, rank_offset, world_size, group_name,
                                  backend="nccl"):  # fmt: skip
        raise NotImplementedError("the CPU stand-in has no NCCL")

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name="weight_update_group",
                                        flush_cache=True, load_format=None):  # fmt: skip
        raise NotImplementedError("the CPU stand-in has no NCCL")

    # -- LoRA ---------------------------------------------------------------------------------
    def load_lora_adapter_from_tensors(self, lora_name, tensors, config_dict, load_format=None):
        """As the wheel's: LoRA must be enabled at launch, the name new, the rank within max_lora_rank."""
        self.events.append(("load_lora", lora_name))
        if not self.args.get("enable_lora"):
            return types.SimpleNamespace(success=False, error_message="LoRA is not enabled")
        if lora_name in self.loras:
            return types.SimpleNamespace(success=False, error_message=f"{lora_name} is already loaded")
        if config_dict["r"] > self.args.get("max_lora_rank", 0):
            return types.SimpleNamespace(success=False, error_message="rank above max_lora_rank")
        assert all(".lora_A." in n or ".lora_B." in n for n in tensors), sorted(tensors)[:2]
        self.loras[lora_name] = float(sum(t.double().sum() for t in tensors.values()))
        return types.SimpleNamespace(success=True, error_message=None, loaded_adapters=dict(self.loras))

    def unload_lora_adapter(self, lora_name):
        self.events.append(("unload_lora", lora_name))
        if self.loras.pop(lora_name, None) is None:
            return types.SimpleNamespace(success=False, error_message=f"{lora_name} is not loaded")
        return types.SimpleNamespace(success=True, error_message=None, loaded_adapters=dict(self.loras))

    # -- generation ---------------------------------------------------------------------------
    def checksum(self) -> float:
        return float(sum(t.double().sum() for t in self.weights.values()))

    def generate(
        self, input_ids=None, sampling_params=None, return_logprob=False, lora_path=None, **_: Any
    ) -> list[dict]:
        self.events.append(("generate", len(input_ids)))
        time.sleep(self.standin.generate_seconds)
        if self.offload_tags:
            raise RuntimeError(f"generate on released memory {sorted(self.offload_tags)}")
        assert len(sampling_params) == len(input_ids)
        weights = self.checksum()
        if weights != weights:
            raise RuntimeError("generate on weights that were released and never written")
        if lora_path is not None:  # the adapter's tensors change the "model" too
            assert len(lora_path) == len(input_ids)
            (name,) = set(lora_path)
            weights += self.loras[name]
        return [self._one(ids, sp, weights, i) for i, (ids, sp) in enumerate(zip(input_ids, sampling_params))]

    def _one(self, ids: list[int], sp: dict, weights: float, row: int) -> dict:
        unknown = sorted(set(sp) - self.standin.sampling_fields)
        if unknown:
            raise TypeError(f"SamplingParams has no field(s) {unknown}")
        seed = sp.get("sampling_seed") if self.deterministic else None
        seed = seed if seed is not None else torch.randint(0, 2**31, ()).item()
        stops = set(sp.get("stop_token_ids") or ()) | self.eos
        temperature = sp.get("temperature", 1.0)
        out, logprobs, finish = [], [], None
        for step in range(sp["max_new_tokens"]):
            token = hash((tuple(ids), round(weights, 3), seed, step)) % self.vocab_size
            if step == 1 and sum(ids) % 2 == 0:
                token = min(self.eos) if self.eos else token  # an EOS the model "samples"
            lp = raw_logprob(token)
            if not self.original_logprob and temperature not in (0.0, 1.0):
                lp = lp / temperature
            out.append(token)
            logprobs.append((lp, token, None))
            if not sp.get("ignore_eos") and token in stops:
                finish = {"type": "stop", "matched": token}
                break
        finish = finish or {"type": "length", "length": len(out)}
        return {"output_ids": out, "meta_info": {"finish_reason": finish, "output_token_logprobs": logprobs}}

    def shutdown(self) -> None:
        self.events.append(("shutdown",))
