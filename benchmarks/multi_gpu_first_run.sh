#!/usr/bin/env bash
# The first run on a machine with several GPUs: every check that needs more than one, in one
# command, each stage time-boxed and reported as benchmarks/gpu_session.sh does (the `multi`
# stages of benchmarks/device_check.py; budgets in its header):
#   batched_p2p_nccl  a reshard whose point-to-point phases trade expert parts both ways, on NCCL
#                     (benchmarks/batched_p2p_nccl.py: one batch per phase, weights bit for bit)
#   nccl_memory       device memory of NCCL's communicators (benchmarks/nccl_memory.py)
#   ppo_7b            recipes/gpu_llama2_7b_ppo.yaml for three steps, 64 prompts of 256 new tokens
#                     (8 GPUs, SGLang and Transformer Engine installed; set RL3D_LLAMA2_7B_HF to a
#                     Llama-2-7b HF directory and RL3D_GSM8K_TRAIN to a verl-layout parquet)
# A stage the machine cannot run is skipped with its reason. Dry run anywhere:
#   python benchmarks/device_check.py --stages multi --dry-run --out /tmp/multi
exec bash "$(dirname "$0")/gpu_session.sh" multi
