#!/usr/bin/env bash
# The GPU run (issue 17) as one bounded script, for a machine with one CUDA GPU whose python3 has
# torch and this project's dependencies (the package need not be installed: it runs from here).
#
#   OUT=gpu_out benchmarks/gpu_check.sh          # steps 1-3: 196 s on one H200 (benchmarks/RESULTS.md)
#
# 1. smoke: benchmarks/gpu_check.py on the tiny shape, every CUDA path in seconds (and the compiled
#    kernels into the cache the next steps use);
# 2. the check: gpu_check.py at Qwen3-30B-A3B layer shapes, 4 layers (see its docstring), calibrated
#    with the full grids, every cycle and the 4-layer profile kept;
# 3. `specfit calibrate --shape qwen3-30b-a3b --layers 4` with the full probe grids, timed: the
#    profile of the whole 48-layer model on this machine (costs scaled to the full depth);
# 4. `specfit decode` of the bundled tiny model and its trained drafter in bfloat16, as a user runs
#    it (a quick calibration of its own): accepted drafts, lossless greedy output on the GPU.
# Each step is bounded and runs whatever the one before it did; what they print lands in $OUT.
set -u -o pipefail
out=${OUT:-gpu_out}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export NUMBA_CACHE_DIR=${NUMBA_CACHE_DIR:-/tmp/specfit-numba}

elapsed() { echo "$1: $(( ($(date +%s%N) - $2) / 1000000 )) ms" | tee -a "$out/steps.txt"; }

{ nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max --format=csv
  $py -c 'import torch, numba, numpy; print("torch", torch.__version__, "cuda", torch.version.cuda, "numba",
numba.__version__, "numpy", numpy.__version__, torch.cuda.get_device_name())'
  nproc; } 2>&1 | tee "$out/steps.txt"

t=$(date +%s%N)
timeout "${SMOKE_S:-150}" $py benchmarks/gpu_check.py --shape tiny --layers 2 --prompts 1 --new-tokens 8 \
    2>&1 | tee "$out/smoke.log"
elapsed "smoke (rc $?)" "$t"

t=$(date +%s%N)
timeout "${CHECK_S:-200}" $py benchmarks/gpu_check.py --full-calibration --out "$out/gpu_check.json" \
    --profile-out "$out/profile-4layers.json" 2>&1 | tee "$out/gpu_check.log"
elapsed "gpu_check qwen3-30b-a3b (rc $?)" "$t"

t=$(date +%s%N)
timeout "${CALIBRATE_S:-120}" $py -m specfit calibrate --shape qwen3-30b-a3b --layers 4 --device cuda \
    --out "$out/profile.json" 2>&1 | tee "$out/calibrate.log"
elapsed "specfit calibrate qwen3-30b-a3b (rc $?)" "$t"

t=$(date +%s%N)
prompts=$(mktemp)
head -4 specfit/assets/prompts.jsonl > "$prompts"
timeout "${DECODE_S:-150}" $py -m specfit decode --model specfit/assets/tiny-moe \
    --drafter specfit/assets/tiny-moe-eagle3 --prompts "$prompts" --cache-experts 8 \
    --policies ar,eagle3,specfit --max-new-tokens 32 --device cuda 2>&1 | tee "$out/decode.log"
elapsed "specfit decode tiny-moe bfloat16 (rc $?)" "$t"
rm -f "$prompts"
