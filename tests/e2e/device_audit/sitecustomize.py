"""Device audit for the e2e test `test_device_audit.py`, installed in every rank process through
PYTHONPATH when RL3D_DEVICE_AUDIT names an output folder. Inert otherwise.

On CPU every tensor is on the same device, so the audit tracks where each tensor was *meant* to
live, and what a GPU run would make of it:
- host tensors: made by the controller, or made in a worker without `device=`; an op in a worker
  on a host tensor gives a host tensor;
- `.to(...)`/`.cuda()` makes a tensor the rank's own; `.cpu()` makes it host again;
- device tensors: everything else a worker makes.
Violations: a host tensor reaching a model's embedding lookup (a forward) or a tensor collective,
and a device tensor crossing from a worker back to the controller. Each is written with the rl3d
frame that caused it to RL3D_DEVICE_AUDIT/rank<N>.json at exit.
"""

import os

if os.environ.get("RL3D_DEVICE_AUDIT"):
    import atexit
    import json
    import threading
    import traceback

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    _state = threading.local()
    _violations: list = []

    def _place(t) -> str | None:
        """ "host" or "device", a tag on the tensor object itself. Parameters are the model's,
        on the rank's device (`model.to(device)` swaps their data, not the objects)."""
        return "device" if isinstance(t, torch.nn.Parameter) else getattr(t, "_rl3d_place", None)

    def _mark(t, place: str, origin: str = "") -> None:
        try:
            t._rl3d_place = place
            t._rl3d_origin = origin
        except (AttributeError, RuntimeError):  # a few internal tensor types take no attributes
            pass

    def _origin(tensors) -> str:
        return next((getattr(t, "_rl3d_origin", "") for t in tensors if _place(t) == "host"), "")

    _FACTORIES = {
        torch.tensor,
        torch.zeros,
        torch.ones,
        torch.empty,
        torch.full,
        torch.arange,
        torch.as_tensor,
    }
    _TO_DEVICE = {torch.Tensor.to, torch.Tensor.cuda}

    def _in_worker() -> bool:
        return getattr(_state, "depth", 0) > 0

    def _tensors(obj):
        if isinstance(obj, torch.Tensor):
            yield obj
        elif isinstance(obj, dict):
            for v in obj.values():
                yield from _tensors(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                yield from _tensors(v)
        elif hasattr(obj, "tensors") and isinstance(obj.tensors, dict):  # DataBatch
            yield from _tensors(obj.tensors)

    def _where() -> str:
        frames = [
            f
            for f in traceback.extract_stack()[:-2]
            if "/rl3d/" in f.filename and "sitecustomize" not in f.filename
        ]
        return f"{frames[-1].filename.split('/rl3d/')[-1]}:{frames[-1].lineno}" if frames else "?"

    def _flag(kind: str, what: str) -> None:
        _violations.append({"kind": kind, "what": what, "where": _where()})

    class _Audit(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            inputs = list(_tensors((args, kwargs)))
            outputs = list(_tensors(out))
            if func in _TO_DEVICE:
                for t in outputs:
                    _mark(t, "device")
                return out
            if func is torch.Tensor.cpu:
                for t in outputs:
                    _mark(t, "host")
                return out
            if not _in_worker():
                for t in outputs:
                    if _place(t) is None:
                        _mark(t, "host", f"made by the controller at {_where()}")
                return out
            origin = _origin(inputs)
            if not origin and func in _FACTORIES and "device" not in kwargs:
                origin = f"{getattr(func, '__name__', func)} without device= at {_where()}"
            if func is F.embedding and _place(inputs[0]) == "host":
                _flag("host tensor in a model forward", f"embedding indices ({_origin(inputs[:1])})")
            for t in outputs:
                if not any(t is i for i in inputs):  # in-place results keep their place
                    _mark(t, "host" if origin else "device", origin)
            return out

    _Audit().__enter__()  # for the whole process

    def _checked_collective(name):
        real = getattr(dist, name)

        def collective(tensor, *args, **kwargs):
            if _in_worker():
                for t in _tensors(tensor):
                    if _place(t) == "host":
                        _flag("host tensor in a collective", f"{name} ({_origin([t])})")
            return real(tensor, *args, **kwargs)

        return collective

    for _name in ("all_reduce", "broadcast", "all_gather", "reduce_scatter"):
        setattr(dist, _name, _checked_collective(_name))

    def _as_worker(fn):
        """`fn` running as the rank's worker: what it makes is the rank's own."""

        def in_worker(*args, **kwargs):
            _state.depth = getattr(_state, "depth", 0) + 1
            try:
                return fn(*args, **kwargs)
            finally:
                _state.depth -= 1

        return in_worker

    def _install_worker_build(rank):
        rank.build_worker = _as_worker(rank.build_worker)

    def _install_worker_boundary(spmd):
        real_method = spmd.SPMDWorkerGroup._method

        def _method(self, method_name):
            method = real_method(self, method_name)
            in_worker = _as_worker(method)

            for attr in ("__rl3d_dispatch__", "__rl3d_metrics__"):
                if hasattr(method, attr):
                    setattr(in_worker, attr, getattr(method, attr))
            return in_worker

        spmd.SPMDWorkerGroup._method = _method
        real_gather = dist.all_gather_object

        def all_gather_object(out, obj, *args, **kwargs):
            if any(_place(t) == "device" for t in _tensors(obj)):
                _flag("device tensor returned to the controller", "all_gather_object")
            return real_gather(out, obj, *args, **kwargs)

        dist.all_gather_object = all_gather_object

    import importlib.abc
    import sys

    _PATCHES = {
        "rl3d.single_controller.spmd": _install_worker_boundary,  # worker method calls
        "rl3d.controller.rank": _install_worker_build,  # building a rank's workers and models
    }

    class _Hook(importlib.abc.MetaPathFinder):  # patch rl3d's modules as they are imported
        def find_spec(self, name, path, target=None):
            if name not in _PATCHES:
                return None
            patch = _PATCHES.pop(name)
            sys.meta_path.remove(self)
            try:
                spec = importlib.util.find_spec(name)
            finally:
                if _PATCHES:
                    sys.meta_path.insert(0, self)
            real_exec = spec.loader.exec_module

            def exec_module(module):
                real_exec(module)
                patch(module)

            spec.loader.exec_module = exec_module
            return spec

    import importlib.util

    sys.meta_path.insert(0, _Hook())

    def _dump() -> None:
        out = os.path.join(os.environ["RL3D_DEVICE_AUDIT"], f"rank{os.environ['RANK']}.json")
        with open(out, "w") as f:
            json.dump(_violations, f)

    if "RANK" in os.environ and "TORCHELASTIC_RUN_ID" in os.environ:  # a rank, not the launchers
        atexit.register(_dump)
