"""rl3d.checkpoint: atomic per-step checkpoint directories and RNG state.

manager = CheckpointManager(run_dir / "checkpoints", keep_last=cfg.checkpoint.keep_last)
manager.save(step, write_fn, rank=rank, world_size=world, barrier=torch.distributed.barrier)
found = manager.resume_point()  # (step, path) of the newest whole checkpoint, or None
"""

from rl3d.checkpoint.manager import DAMAGED_SUFFIX, META_FILE, CheckpointManager, load_meta
from rl3d.checkpoint.manifest import (
    MANIFEST_FILE,
    CheckpointMismatch,
    checkpoint_identity,
    identity_problem,
    verify,
    write_manifest,
)
from rl3d.checkpoint.rng import (
    capture_rng_state,
    generator_state,
    load_rng_state,
    read_rng_state,
    restore_generator,
    restore_rng_state,
    save_rng_state,
)

__all__ = [
    "DAMAGED_SUFFIX",
    "MANIFEST_FILE",
    "META_FILE",
    "CheckpointManager",
    "CheckpointMismatch",
    "checkpoint_identity",
    "identity_problem",
    "verify",
    "write_manifest",
    "capture_rng_state",
    "generator_state",
    "load_meta",
    "load_rng_state",
    "read_rng_state",
    "restore_generator",
    "restore_rng_state",
    "save_rng_state",
]
