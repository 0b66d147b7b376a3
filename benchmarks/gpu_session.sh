#!/usr/bin/env bash
# rl3d's GPU check as one command: install what the machine lacks, then run the stages of
# benchmarks/device_check.py (its header: each stage's budget; benchmarks/README.md: the report).
# Installs into $SITE (default /tmp/site), put first on PYTHONPATH.
#
#   bash benchmarks/gpu_session.sh          # first: what fits 8 minutes on one H100, install included
#   bash benchmarks/gpu_session.sh rest     # optional second command: what is left (10 minutes)
#   bash benchmarks/gpu_session.sh multi    # a machine with several GPUs (multi_gpu_first_run.sh)
#
# On the library's lent machine (python3 3.12 with CUDA torch, offline), prepare here first:
#   make gpu-wheels     # megatron-core's wheel and SmolLM2's config and tokenizer into .whl/
#   device run: command "bash benchmarks/gpu_session.sh", carry [".whl"], timeout_s 480
# Elsewhere, with rl3d installed in the environment, call benchmarks/device_check.py directly.
#
# Writes $OUT/report.json (after every stage) and $OUT/device_check.log; the install's seconds
# and status go into the report, and a failed install skips every stage, saying so.
set -uo pipefail
SET=${1:-first}
started=$(date +%s.%N)
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 # compiled Triton kernels on the GPU
OUT=${OUT:-/tmp/rl3d-gpu-out}
mkdir -p "$OUT"
LOG="$OUT/device_check.log"
SITE=${SITE:-/tmp/site}

install() {
    shopt -s nullglob
    local wheels=(.whl/*.whl)
    if ((${#wheels[@]})); then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$SITE" "${wheels[@]}" || return 1
    fi
    # No GPU visible to setup.py: rl3d installs as Python only, and the kernels stage JIT-builds
    # the CUDA extension inside its own time limit.
    CUDA_VISIBLE_DEVICES= python3 -m pip install -q --no-index --no-deps --no-build-isolation \
        --no-compile --upgrade --target "$SITE" . || return 1
}

echo "===== install $(date -u +%FT%TZ)" >>"$LOG"
SECONDS=0
status=passed
SITE=$SITE timeout 120 bash -c "$(declare -f install); install" >>"$LOG" 2>&1 || status=failed
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >>"$LOG" 2>&1
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
exec python3 benchmarks/device_check.py --stages "$SET" --out "$OUT" --started-at "$started" \
    --install-seconds "$SECONDS" --install-status "$status"
