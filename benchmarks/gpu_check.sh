#!/usr/bin/env bash
# The GPU run (issue 17) as one bounded script, for a machine with one CUDA GPU whose python3 has
# torch and this project's dependencies (the package need not be installed: it runs from here).
#
#   OUT=gpu_out benchmarks/gpu_check.sh     # every step: about 5 min on one H200 (stop 38: kernels 52 s,
#                                           # check 53 s, check64 49 s, calibrate 39 s, decode 17 s,
#                                           # firstuse 37 + 27 s)
#   OUT=gpu_out STEPS="kernels check check64" benchmarks/gpu_check.sh     # some of them
#
# The steps added since stop 38 (smoke, attention, and eagle3+prefetch in check) have not run on a
# GPU, and the step timeouts add to 1,710 s: where one command may run 600 s at most (this project's
# device sessions, 15 min of device time in all), run it in two calls, the stop-38 steps first:
#   STEPS="kernels check check64 calibrate decode" (about 4 min), then STEPS="smoke firstuse attention".
# Each half's step timeouts add to more than 600 s (870 s and 840 s), so a step that runs to its
# timeout can take the call past the limit; to bound each half at 540 s, run the first with
# KERNELS_S=100 CHECK_S=120 CALIBRATE_S=100 DECODE_S=100 and the second with SMOKE_S=100
# FIRSTUSE_S=100 ATTENTION_S=80 (stop 38's times fit them).
#
# kernels   numba compiles the live decoder's kernels into the cache the next steps use (the
#           first run after an install; seconds after that);
# smoke     benchmarks/gpu_check.py on the tiny shape: every CUDA path in seconds;
# check     gpu_check.py at Qwen3-30B-A3B layer shapes, 4 layers (see its docstring), calibrated
#           with the full grids, 4 prompts x 32 tokens, a cache of 32 of 128 experts per layer, and
#           eagle3+prefetch beside its policies (copies on the copy stream while the drafter runs;
#           not yet run on a GPU): every cycle kept under $OUT/run-cache32 (for
#           benchmarks/bench_online.py) with the profile;
# check64   the same with another seed and 64 of 128 experts cached per layer ($OUT/run-cache64);
# calibrate `specfit calibrate --shape qwen3-30b-a3b --layers 4` with the full probe grids, timed:
#           the profile of the whole 48-layer model on this machine (costs scaled to the full depth);
# decode    `specfit decode` of the bundled tiny model and its trained drafter in bfloat16, as a
#           user runs it: accepted drafts, lossless greedy output on the GPU;
# firstuse  benchmarks/bench_first_use.py cold and after the proposer's warm-up: a target and a
#           drafter pass's first use per number of entries (about 65 s);
# attention benchmarks/bench_attention.py and bench_drafter_commit.py --device cuda: GQA attention
#           reading the KV cache in place vs repeated per query head (target and drafter), and a
#           drafter pass over committed entries with the newest row's logits alone, and a
#           DeepSeek-V2-Lite MLA layer with kv_b_proj absorbed vs every latent expanded
#           (bench_mla.py), in bfloat16 (not yet run on a GPU).
# Each step is bounded; what they print lands in $OUT, the elapsed times in $OUT/steps.txt.
set -u -o pipefail
out=${OUT:-gpu_out}
steps=" ${STEPS:-kernels smoke check check64 calibrate decode firstuse attention} "
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export NUMBA_CACHE_DIR=${NUMBA_CACHE_DIR:-/tmp/specfit-numba}

elapsed() { echo "$1: $(( ($(date +%s%N) - $2) / 1000000 )) ms" | tee -a "$out/steps.txt"; }
want() { [[ "$steps" == *" $1 "* ]]; }

{ nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max --format=csv
  $py -c 'import torch, numba, numpy; print("torch", torch.__version__, "cuda", torch.version.cuda, "numba",
numba.__version__, "numpy", numpy.__version__, torch.cuda.get_device_name())'
  nproc; } 2>&1 | tee "$out/steps.txt"

if want kernels; then
  t=$(date +%s%N)
  timeout "${KERNELS_S:-200}" $py -c 'from specfit.kernel_warmup import warm_up; print(f"kernels {warm_up():.1f} s")' \
      2>&1 | tee "$out/kernels.log"
  elapsed "kernels (rc $?)" "$t"
fi
if want smoke; then
  t=$(date +%s%N)
  timeout "${SMOKE_S:-150}" $py benchmarks/gpu_check.py --shape tiny --layers 2 --prompts 1 --new-tokens 8 \
      2>&1 | tee "$out/smoke.log"
  elapsed "smoke (rc $?)" "$t"
fi
if want check; then
  t=$(date +%s%N)
  timeout "${CHECK_S:-200}" $py benchmarks/gpu_check.py --full-calibration --prompts 4 --new-tokens 32 \
      --policies ar,eagle3,eagle3+prefetch,static:auto,specfit \
      --out "$out/gpu_check.json" --run-dir "$out/run-cache32" 2>&1 | tee "$out/gpu_check.log"
  elapsed "gpu_check qwen3-30b-a3b cache 32 (rc $?)" "$t"
fi
if want check64; then
  t=$(date +%s%N)
  timeout "${CHECK_S:-200}" $py benchmarks/gpu_check.py --full-calibration --prompts 4 --new-tokens 32 --seed 1 \
      --cache-experts 64 --out "$out/gpu_check64.json" --run-dir "$out/run-cache64" 2>&1 | tee "$out/gpu_check64.log"
  elapsed "gpu_check qwen3-30b-a3b cache 64 (rc $?)" "$t"
fi
if want calibrate; then
  t=$(date +%s%N)
  timeout "${CALIBRATE_S:-120}" $py -m specfit calibrate --shape qwen3-30b-a3b --layers 4 --device cuda \
      --out "$out/profile.json" 2>&1 | tee "$out/calibrate.log"
  elapsed "specfit calibrate qwen3-30b-a3b (rc $?)" "$t"
fi
if want decode; then
  t=$(date +%s%N)
  prompts=$(mktemp)
  head -4 specfit/assets/prompts.jsonl > "$prompts"
  timeout "${DECODE_S:-150}" $py -m specfit decode --model specfit/assets/tiny-moe \
      --drafter specfit/assets/tiny-moe-eagle3 --prompts "$prompts" --cache-experts 8 \
      --policies ar,eagle3,specfit --max-new-tokens 32 --device cuda 2>&1 | tee "$out/decode.log"
  elapsed "specfit decode tiny-moe bfloat16 (rc $?)" "$t"
  rm -f "$prompts"
fi
if want firstuse; then
  t=$(date +%s%N)
  { timeout "${FIRSTUSE_S:-120}" $py benchmarks/bench_first_use.py --max-n 40
    timeout "${FIRSTUSE_S:-120}" $py benchmarks/bench_first_use.py --max-n 40 --warm 40; } 2>&1 | tee "$out/firstuse.log"
  elapsed "bench_first_use cold and warmed (rc $?)" "$t"
fi
if want attention; then
  t=$(date +%s%N)
  { timeout "${ATTENTION_S:-150}" $py benchmarks/bench_attention.py --device cuda
    timeout "${ATTENTION_S:-150}" $py benchmarks/bench_drafter_commit.py --device cuda
    timeout "${ATTENTION_S:-150}" $py benchmarks/bench_mla.py --device cuda; } 2>&1 | tee "$out/attention.log"
  elapsed "bench_attention, bench_drafter_commit and bench_mla cuda (rc $?)" "$t"
fi
