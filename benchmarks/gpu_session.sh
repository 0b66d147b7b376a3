#!/usr/bin/env bash
# Everything rl3d checks on a GPU, as one call of the library's `device` tool (a lent H200:
# python3 3.12 with CUDA torch and triton, nothing fetchable). Prepare here, then run there:
#
#   make gpu-wheels                                   # megatron-core for Python 3.12 into .whl/
#   device run: command "bash benchmarks/gpu_session.sh", carry [".whl"], timeout_s 600
#
# The steps' limits add up to more than one device call may run (600 s): STEPS picks some, so
# a session runs it in two calls, e.g.
#   STEPS="test_gpu kernels rollout" bash benchmarks/gpu_session.sh          # limits 480 s
#   STEPS="grpo_cuda memory_plan memory_plan_7b offload" bash benchmarks/gpu_session.sh  # 540 s
#
# Steps, each under its own time limit so one hang cannot eat the lease; logs and CSVs land
# in $OUT (what the device tool brings back):
#   1. install the wheels and rl3d itself (with kernels/ as rl3d._kernels) into /tmp/site;
#   2. tests/gpu: kernels vs torch reference on CUDA, the CPU shim provably inactive, the
#      rollout engine on CUDA (the SGLang test skips: sglang is not on that machine);
#   3. benchmarks/kernel_bandwidth.py on one full-size llama2-70b layer: each form's bandwidth against
#      a device copy of the same bytes (goal: 80%);
#   4. the rollout benchmark on CUDA;
#   5. the whole GRPO loop on CUDA: the CPU quickstart on one GPU (world of 1, NCCL, local layer
#      spec: TE is not there, and rl3d refuses it with left padding anyway), 5 steps;
#   6. the memory plan beside torch.cuda.max_memory_allocated per phase (benchmarks/
#      memory_plan_gpu.py): the one-GPU quickstart, then llama2-7b in fp32 (random weights, no
#      reference; bf16 needs TE's norms, absent there), planned at 103 GiB;
#   7. offload around generation on CUDA (benchmarks/offload_cuda.py): a bf16 role's params,
#      grads and optimizer state leave the device (bytes freed per torch.cuda.memory_allocated,
#      against what rl3d reports, within 1%) and come back bit for bit; two more steps equal a
#      twin that never offloaded;
#   8. $OUT/report.md: one line per step with its exit status, and the loop's last metrics.
# Not in the default STEPS (run it by name, e.g. STEPS="lora_engine"):
#   lora_engine: LoRA in the torch engine on CUDA, apply vs merge (benchmarks/lora_engine.py):
#      decode tokens/s and per-step update time on tiny-llama and random llama2-7b weights (bf16)
#      at ranks 8 and 64, and the drift of an in-place merge/unmerge.
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0  # compiled Triton kernels on the GPU
OUT=${OUT:-/tmp/rl3d-gpu-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed: run 'make gpu-wheels' here and carry .whl"; exit 1; }
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/site . \
    || { echo "rl3d install failed"; exit 1; }
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"

status=0
STEPS=${STEPS:-test_gpu kernels rollout grpo_cuda memory_plan memory_plan_7b offload}
# step NAME LIMIT COMMAND...: run COMMAND (its output in $OUT/NAME.log) when STEPS names it
step() {
  local name=$1 limit=$2
  shift 2
  case " $STEPS " in *" $name "*) ;; *) return 0 ;; esac
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log" || status=1
}
step test_gpu 240 python3 -m pytest -q -p no:cacheprovider tests/gpu -rs
step kernels 150 python3 benchmarks/kernel_bandwidth.py --out "$OUT"
step rollout 90 python3 -m rl3d.cli bench rollout --out "$OUT"
step grpo_cuda 180 python3 -m rl3d.cli train recipes/quickstart_cpu_grpo.yaml launch.device=cuda \
    launch.nproc_per_node=1 actor.parallel.tp=1 trainer.total_steps=5 checkpoint.save_every=0 \
    logging.tensorboard=false trainer.run_dir="$OUT/grpo_cuda"
step memory_plan 90 python3 benchmarks/memory_plan_gpu.py --out "$OUT/memory_plan"
step memory_plan_7b 150 python3 benchmarks/memory_plan_gpu.py --out "$OUT/memory_plan_7b" model.name=llama2-7b \
    algorithm.kl.coef=0
step offload 120 python3 benchmarks/offload_cuda.py --out "$OUT/offload"
step lora_engine 240 python3 benchmarks/lora_engine.py --device cuda --dtype bfloat16 \
    --models tiny-llama,llama2-7b --ranks 8,64 --drift-steps 20 --json "$OUT/lora_engine.json"

{
  echo "# rl3d GPU session, $(date -u +%Y-%m-%d)"
  cat "$OUT/gpu.txt"
  for name in $STEPS; do
    echo "- $name: $(tail -n 1 "$OUT/$name.log" 2>/dev/null)"
  done
  echo "- grpo_cuda last step: $(tail -n 1 "$OUT/grpo_cuda/metrics.jsonl" 2>/dev/null | head -c 600)"
  grep -h "ratio" "$OUT/memory_plan.log" "$OUT/memory_plan_7b.log" 2>/dev/null | sed 's/^/- memory plan /'
  echo "overall status: $status"
} > "$OUT/report.md"
cat "$OUT/report.md"
exit $status
