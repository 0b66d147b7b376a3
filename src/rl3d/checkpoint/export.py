"""A run's checkpointed actor as an HF directory: `rl3d export RUN_DIR --dst DIR [--step N]`.

A LoRA run (`actor.lora`) exports its adapters as a PEFT adapter directory
(`rl3d export RUN_DIR --lora DIR`) or the weights with the adapters merged (`--dst DIR --merge`).

The run's own record says what to build: `RUN_DIR/resolved_config.yaml` gives the model section
(`model.name`, or the HF directory whose config.json has the shapes, and whose config and
tokenizer files the export carries over), `RUN_DIR/checkpoints/step_N` the weights (the newest
complete checkpoint unless `--step`; its manifest's sizes are checked first). The conversion
itself is `rl3d.models.export.export_hf`: one process, any layout, written atomically.
"""

from __future__ import annotations

from pathlib import Path

from rl3d.checkpoint.manager import CheckpointManager
from rl3d.checkpoint.manifest import verify


def run_model_config(run_dir: Path):
    """The `model` section of the run's resolved config (`rl3d.config.ModelConfig`)."""
    from rl3d.config.run_dir import run_model_section

    return run_model_section(run_dir)


def run_lora_config(run_dir: Path):
    """The run's `actor.lora` (`rl3d.config.lora.LoraConfig`), None when it trained every weight."""
    from rl3d.config.loader import RESOLVED_NAME, yaml_load
    from rl3d.config.lora import LoraConfig
    from rl3d.config.typed import from_dict

    path = run_dir / RESOLVED_NAME
    lora = ((yaml_load(path.read_text()) or {}).get("actor") or {}).get("lora")
    if lora is None:
        return None
    lora = {k: v for k, v in lora.items() if k != "init"}  # where it started: not needed, maybe gone
    return from_dict(LoraConfig, lora, prefix="actor.lora", source_of=lambda _: str(path))


def export_run(
    run_dir: str | Path,
    dst: str | Path,
    *,
    step: int | None = None,
    max_shard_bytes: int = 5 * 2**30,
    lora: str | Path | None = None,
    merge: bool = False,
) -> tuple[int, Path]:
    """Export step `step` (default: the newest complete one) of the run in `run_dir` to `dst`;
    returns (step, the directory written). A LoRA run writes its adapters as a PEFT directory
    `lora`, or with `merge` the weights with the adapters merged to `dst`."""
    from rl3d.config.roles import ACTOR
    from rl3d.models.export import export_hf
    from rl3d.models.spec import spec_of

    run_dir = Path(run_dir)
    model = run_model_config(run_dir)
    adapters = run_lora_config(run_dir)
    if adapters is None and (lora is not None or merge):
        raise ValueError(f"{run_dir}: the run trained no LoRA adapters (no actor.lora): export it with --dst")
    if adapters is not None and lora is None and not merge:
        raise ValueError(
            f"{run_dir}: the run trained LoRA adapters over a frozen base: export them with --lora DIR "
            "(a PEFT adapter directory) or the merged weights with --dst DIR --merge"
        )
    found = dict(CheckpointManager(run_dir / "checkpoints", keep_last=1).checkpoints())
    if not found:
        raise FileNotFoundError(f"{run_dir / 'checkpoints'}: no complete checkpoint to export")
    step = max(found) if step is None else step
    if step not in found:
        raise ValueError(f"{run_dir}: no checkpoint of step {step}; there are steps {sorted(found)}")
    problem = verify(found[step])
    if problem:
        raise ValueError(f"checkpoint of step {step} is damaged: {problem}")
    if (found[step] / "reward_model").is_dir():  # a reward-model job's (rl3d.controller.rm_train)
        from rl3d.workers.reward_model import export_reward_model_hf

        return step, export_reward_model_hf(found[step] / "reward_model", dst)
    spec = spec_of(model)
    if adapters is not None:
        from rl3d.models.export import DistCheckpointReader
        from rl3d.models.lora_peft import checkpoint_adapters, save_peft_adapter

        reader = DistCheckpointReader(found[step] / ACTOR, spec)
        tensors = checkpoint_adapters(reader, spec, adapters.targets, lm_head=adapters.lm_head)
        if lora is not None:
            return step, save_peft_adapter(lora, tensors, adapters, base=model.hf_path or model.name)
        merged = {"adapters": tensors, "scaling": adapters.scaling}
    else:
        merged = None
    path = export_hf(
        found[step] / ACTOR,
        spec,
        dst,
        source=model.hf_path,
        max_shard_bytes=max_shard_bytes,
        merge_lora=merged,
    )
    return step, path
