#!/usr/bin/env bash
# One device call for the GPU work: build the fused kernels, run their tests, benchmark them,
# and the ZeRO benchmarks (stages, offload, the largest model) and the CPU Adam benchmark.
# Everything lands under $OUT: the tables (*.md) and the logs packed in logs.tgz.
# Run from the repository root on the GPU machine, with the wheels of
# ../shared/tools/gpu-wheels carried in .whl:
#     bash benchmarks/gpu_check.sh [build|tests|bench|e2e|e2e1.5b|tune|inspect|ncu|profile|profile1.5b|zero124m|zero1.5b|ladder|scaling|cpu_adam ...]
#                                                       (default: build tests bench)
set -uo pipefail
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 TOOLKIT_KERNELS_CACHE=/tmp/toolkit-kernels
stages=${*:-build tests bench}
start=$SECONDS
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv
  echo "TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST-unset}; nvcc: $(nvcc --version | tail -1)"
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
} 2>&1 | tee "$OUT/machine.txt"
for stage in $stages; do
  echo "=== $stage (t=$((SECONDS - start))s)"
  case $stage in
    build)
      { time timeout 180 python3 -m toolkit build-kernels; python3 -m toolkit doctor; } 2>&1 | tee "$OUT/build.txt"
      cat /tmp/toolkit-kernels/*/build.log > "$OUT/build-logs.txt" 2>/dev/null ;;
    tests)
      timeout 200 python3 -m pytest -q -p no:cacheprovider -rfE --durations=10 tests/test_kernels_cuda.py \
        tests/test_zero_cuda.py tests/test_cuda_training.py::test_the_engine_never_waits_for_the_gpu_in_a_bf16_step \
        2>&1 | tee "$OUT/tests.txt" | tail -60 ;;
    bench)
      timeout 100 python3 benchmarks/kernels.py --markdown "$OUT/bench.md" 2>&1 | tee "$OUT/bench.txt" ;;
    e2e|e2e1.5b)  # GPT-2 end to end, only while the call is young (E2E_BY: seconds into the call;
                  # E2E_ROUNDS: interleave the configurations, benchmarks/end_to_end.py --rounds)
      size=124m; [[ $stage == e2e1.5b ]] && size=1.5b
      left=$(( ${E2E_BY:-260} - (SECONDS - start) ))
      if (( left > 40 )); then
        timeout $left python3 benchmarks/end_to_end.py --size $size \
          --only "${E2E_ONLY:-toolkit fused,toolkit fallbacks,plain eager}" --rounds "${E2E_ROUNDS:-0}" \
          --markdown "$OUT/e2e-$size.md" 2>&1 | tee "$OUT/e2e-$size.txt"
      else
        echo "$stage skipped: $left s left"
      fi ;;
    tune)  # shapes of the norm kernels side by side (benchmarks/norm_tune.py; TUNE_SHAPES, TUNE_ROUNDS, TUNE_COLD_L2)
      timeout 300 python3 benchmarks/norm_tune.py ${TUNE_SHAPES:+--shapes "$TUNE_SHAPES"} --rounds "${TUNE_ROUNDS:-1}" ${TUNE_COLD_L2:+--cold-l2} \
        --markdown "$OUT/tune-norm.md" \
        2>&1 | tee "$OUT/tune-norm.txt" ;;
    inspect)  # how torch.compile and the shipped kernels launch the norms, and Inductor's code for them
      timeout 200 python3 benchmarks/norm_inspect.py --markdown "$OUT/inspect-norm.md" --code-dir "$OUT/inductor" \
        2>&1 | tee "$OUT/inspect-norm.txt" ;;
    ncu)  # Nsight Compute's view of RMSNorm's kernels, torch.compile's and ours (benchmarks/norm_ncu.py)
      if command -v ncu > /dev/null; then
        timeout 150 ncu --profile-from-start off --section SpeedOfLight --section LaunchStats --section Occupancy \
          --section WarpStateStats --section MemoryWorkloadAnalysis --section SchedulerStats \
          python3 benchmarks/norm_ncu.py > "$OUT/ncu-norm.txt" 2>&1; tail -5 "$OUT/ncu-norm.txt"
      else
        echo "ncu skipped: not installed"
      fi ;;
    profile|profile1.5b)  # where each configuration's GPU time goes (benchmarks/profile_e2e.py)
      size=124m; [[ $stage == profile1.5b ]] && size=1.5b
      timeout 400 python3 benchmarks/profile_e2e.py --size $size \
        --only "${PROFILE_ONLY:-toolkit fused compiled,plain compiled}" --markdown "$OUT/profile-$size.md" \
        2>&1 | tee "$OUT/profile-$size.txt" ;;
    zero124m)  # ZeRO stages and offload against plain PyTorch (benchmarks/zero_gpu.py)
      timeout 240 python3 -m benchmarks.zero_gpu --size 124m --micro 16 \
        --configs plain,stage0,stage1,stage2,stage3,stage2-offload --markdown "$OUT/zero.md" 2>&1 | tee "$OUT/zero124m.txt" ;;
    zero1.5b)
      timeout 330 python3 -m benchmarks.zero_gpu --size 1.5b --micro 16 --steps 6 \
        --configs plain,stage0,stage1,stage2,stage3,stage2-offload --markdown "$OUT/zero.md" 2>&1 | tee "$OUT/zero1.5b.txt" ;;
    ladder)  # the largest GPT-2 shape with offload + activation checkpointing, micro batch 4
              # (LADDER: layer counts; OFFLOAD_RATIO: zero.offload_ratio)
      for layers in ${LADDER:-24 39}; do
        timeout 200 python3 -m benchmarks.zero_gpu --layers "$layers" --width 4096 --heads 32 --micro 4 --ckpt \
          --steps 4 --warmup 2 --timeout 190 --configs stage2-offload --offload-ratio "${OFFLOAD_RATIO:-1}" \
          --markdown "$OUT/zero.md" 2>&1 | tee -a "$OUT/ladder.txt"
      done ;;
    scaling)  # several GPUs (issue #7): every stage, DDP and FSDP2 on 1 and on all GPUs, 124M then 1.5B
      gpus=$(nvidia-smi --list-gpus | wc -l)
      for size in 124m 1.5b; do
        timeout 900 python3 -m benchmarks.zero_gpu --size $size --micro 16 --steps 5 --warmup 2 --gpus "$gpus" \
          --scaling --configs plain,stage0,stage1,stage2,stage3,stage2-offload,fsdp2 --markdown "$OUT/zero.md" \
          2>&1 | tee -a "$OUT/scaling.txt"
      done ;;
    cpu_adam)  # the toolkit's CPU Adam against torch's CPU AdamW on this host's cores
      timeout 120 python3 benchmarks/cpu_adam.py --steps 10 2>&1 | tee "$OUT/cpu_adam.txt" ;;
  esac
done
echo "=== done (t=$((SECONDS - start))s)"
# NOTE: the device tool brings back at most 8 files: the tables stay as they are, the logs travel packed.
(cd "$OUT" && tar czf logs.tgz ./*.txt && rm -f ./*.txt)
