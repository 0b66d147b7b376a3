"""Model shapes, megatron-core builders, converters and the CPU shim.

- spec: ModelSpec shapes (pure Python)
- params: the parameter inventory (names, shapes, shard kinds, stages; pure Python), which the
  builder, the 3D-HybridEngine planner and the rollout engine all read
- bootstrap: init_megatron(layout) -> MegatronGroups; the only reader of megatron's process-group globals
- cpu_shim: remaps megatron-core's CUDA-only calls on CPU (version-checked, inactive with CUDA)
- builder: build_gpt(spec, groups, role=actor|critic|reference)
- logprobs: vocab_parallel_logprobs_entropy (logp_BT, entropy_BT without gathering the vocab)
- training: wrap_ddp, build_optimizer, build_scheduler, forward_backward, train_step
- hf_mapping / convert / weights: HF <-> Megatron per tensor, load_weights / save_weights
- dist_checkpoint: save_checkpoint / load_checkpoint (model, optimizer, scheduler, RNG)

Importing this package does not import megatron-core; the builders do, lazily.
"""

from rl3d.models.spec import MODEL_SPECS, ModelSpec, get_model_spec

__all__ = ["MODEL_SPECS", "ModelSpec", "get_model_spec"]
