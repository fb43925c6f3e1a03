#!/usr/bin/env bash
# One device call for the GPU work: build the fused kernels, run their tests, benchmark them,
# and the ZeRO benchmarks (stages, offload, the largest model) and the CPU Adam benchmark.
# Everything lands under $OUT: the tables (*.md) and the logs packed in logs.tgz.
# Run from the repository root on the GPU machine, with the wheels of
# ../shared/tools/gpu-wheels carried in .whl (WHEELS: another folder):
#     bash benchmarks/gpu_check.sh [firststep|pycache|recipes|epilogues|attention|deepspeed|offloadprofile|muon|delayed124m|delayedrule|speculation|build|tests|bench|gallery|e2e|e2e1.5b|tune|inspect|ncu|profile|profile1.5b|zero124m|zero1.5b|ladder|scaling|cpu_adam|autotune|grid|calibrate|infinity|infinity-train|treeab|addnorm ...]
#                                                       (default: build tests bench)
# Every stage runs in a subshell with `set -e` and pipefail, so a failing command ends its stage
# with its status even behind `| tee`; the call ends with one line per stage (ok / FAILED rc N /
# skipped: why) and exits with the first failing stage's status (0 when every stage is ok or skipped).
set -uo pipefail
OUT=${OUT:-/tmp/gpu_check}
WHEELS=${WHEELS:-.whl}
SITE=/tmp/site
mkdir -p "$OUT"
marks=$(mktemp -d)  # a stage that skips itself leaves its reason here (the subshell cannot set a variable)
trap 'rm -rf "$marks"' EXIT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TOOLKIT_KERNELS_CACHE=/tmp/toolkit-kernels
stages=${*:-build tests bench}
start=$SECONDS
names=() results=() status=0

record() {  # record NAME RC: the stage's summary line, and the call's status from the first failure
  local reason
  names+=("$1")
  if [[ $2 != 0 ]]; then
    results+=("FAILED rc $2")
    (( status )) || status=$2
  elif reason=$(cat "$marks/$1" 2> /dev/null); then
    results+=("skipped: $reason")
  else
    results+=("ok")
  fi
}

skip() {  # inside a stage: say why it does nothing (the summary shows it as skipped, not ok)
  echo "$stage skipped: $*"
  echo "$*" > "$marks/$stage"
}

# NOTE: --no-deps: the carried wheels are what the device lacks (nbval among them, without nbformat);
# the tests stage runs pytest with -p no:nbval so such a plugin cannot stop pytest from starting.
wheels=("$WHEELS"/*.whl)
if [[ -e ${wheels[0]} ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}"
  record wheels $?
  PYTHONPATH=$PYTHONPATH:$SITE
  SITE_PATH=$SITE
fi

{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv
  echo "TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST-unset}; nvcc: $(nvcc --version | tail -1)"
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
} 2>&1 | tee "$OUT/machine.txt"  # informational: the stages that need the GPU fail on their own

stage_body() {
  case $stage in
    build)  # doctor runs after a failed build too: it says why
      local build_rc=0
      { time timeout 180 python3 -m toolkit build-kernels; } 2>&1 | tee "$OUT/build.txt" || build_rc=$?
      { time python3 -m toolkit doctor; } 2>&1 | tee -a "$OUT/build.txt"  # timed: under 5 s once cached (issue 33)
      cat /tmp/toolkit-kernels/*/build.log > "$OUT/build-logs.txt" 2> /dev/null || true
      return "$build_rc" ;;
    firststep)  # issue 33: seconds from `toolkit run` to its first optimizer step, GPT-2 124M (benchmarks/first_step.py):
                # with the kernel cache as this machine has it (empty on a fresh machine: put this stage first), then
                # cached; `toolkit doctor` timed; the kernel builds' ninja logs (each compile's start and end, ms)
      local cache=cold run=(python3 -m toolkit run recipes/gpt2-124m.json training.log_interval=1 checkpoint.save_final=false)
      [[ -n $(ls -A /tmp/toolkit-kernels 2> /dev/null) ]] && cache="cache not empty"
      timeout 240 python3 -m benchmarks.first_step --label "$cache, 40 steps" --markdown "$OUT/first_step.md" -- \
        "${run[@]}" training.max_steps=40 2>&1 | tee "$OUT/firststep.txt"
      timeout 120 python3 -m benchmarks.first_step --label "cached, 20 steps" --markdown "$OUT/first_step.md" -- \
        "${run[@]}" training.max_steps=20 2>&1 | tee -a "$OUT/firststep.txt"
      # the same without the toolkit's bytecode folder (toolkit/cli/bytecode_cache.py): what the image's start costs
      TOOLKIT_BYTECODE_CACHE=off timeout 120 python3 -m benchmarks.first_step --markdown "$OUT/first_step.md" \
        --label "cached, bytecode folder off, 20 steps" -- "${run[@]}" training.max_steps=20 2>&1 | tee -a "$OUT/firststep.txt"
      { time python3 -m toolkit doctor; } 2>&1 | tee -a "$OUT/firststep.txt"
      # where a cached start's seconds go: cProfile of a 2-step run, its top entries by cumulative time
      timeout 120 python3 -m cProfile -o "$OUT/startup.prof" -m toolkit run recipes/gpt2-124m.json \
        training.max_steps=2 training.log_interval=1 checkpoint.save_final=false > /dev/null 2>&1
      python3 -c "import pstats, sys; pstats.Stats(sys.argv[1]).sort_stats('cumulative').print_stats(60)" \
        "$OUT/startup.prof" > "$OUT/startup_profile.txt" 2>&1
      find /tmp/toolkit-kernels -name .ninja_log -exec sh -c 'echo "== $1"; cat "$1"' _ {} \; >> "$OUT/firststep.txt" ;;
    pycache)  # a cached start where Python may keep bytecode: this image sets PYTHONDONTWRITEBYTECODE=1, so every
              # process compiles ~1,900 modules (6.1 s of the cProfile'd start); these runs unset it and keep the
              # bytecode under PYTHONPYCACHEPREFIX (the image's packages are read-only): the first fills it, the
              # second is timed
      local i run=(python3 -m toolkit run recipes/gpt2-124m.json training.log_interval=1 checkpoint.save_final=false
                   training.max_steps=20)
      { env | grep '^PYTHON' || true
        python3 -c "import sys, os, torch; d = os.path.join(os.path.dirname(torch.__file__), '__pycache__')
print('dont_write_bytecode', sys.dont_write_bytecode, 'pycache_prefix', sys.pycache_prefix, d, 'exists',
      os.path.isdir(d), 'writable', os.access(os.path.dirname(d), os.W_OK))"; } 2>&1 | tee -a "$OUT/pycache.txt"
      for i in 1 2; do
        env -u PYTHONDONTWRITEBYTECODE PYTHONPYCACHEPREFIX=/tmp/pycache timeout 120 python3 -m benchmarks.first_step \
          --label "cached, bytecode kept (run $i)" --markdown "$OUT/first_step.md" -- "${run[@]}" 2>&1 \
          | tee -a "$OUT/pycache.txt"
      done ;;
    offloadprofile)  # issue 36 item 1: where GPT-2 1.5B's ZeRO-2 + CPU offload step goes (benchmarks/offload_profile.py;
                     # PROFILE_ARGS: more of its arguments, e.g. "--modes exact,overlapped training.grad_clip=0")
      timeout ${PROFILE_S:-240} python3 -m benchmarks.offload_profile --markdown "$OUT/offload_profile.md" \
        ${PROFILE_ARGS:-} 2>&1 \
        | tee "$OUT/offload_profile.txt" ;;
    muon)  # issue 35: Muon against AdamW on gpt2-124m (benchmarks/muon_vs_adamw.py): optimizer steps to AdamW's final
           # held-out loss and ms per step, the engines stepping in turn (MUON_ARGS: its arguments)
      timeout ${MUON_S:-280} python3 -m benchmarks.muon_vs_adamw ${MUON_ARGS:-gpt2-124m scheduler.warmup_num_steps=30 \
        --steps 300 --eval-every 20} 2>&1 | tee "$OUT/muon.txt" ;;
    delayed124m)  # issue 36: exact against the delayed offload updates over 300 steps of gpt2-124m, every mode but the
                  # first exact run resumed from its step-100 checkpoint, "exact, resumed" the noise floor
                  # (benchmarks/offload_update.py; DELAYED_ARGS: its arguments)
      timeout ${DELAYED_S:-300} python3 -m benchmarks.offload_update ${DELAYED_ARGS:-gpt2-124m \
        scheduler.warmup_num_steps=30 batch.micro_batch_per_rank=16 batch.grad_accum_steps=2 --steps 300 \
        --warmup 100 --fork-at 100 --modes delayed delayed_extrapolated} 2>&1 | tee "$OUT/delayed124m.txt" ;;
    delayedrule)  # issue 36: is delayed's gap to exact on gpt2-124m the rule's own? The hand-written rule, delayed and
                  # exact stepping in turn (benchmarks/delayed_rule.py; RULE_ARGS: its arguments)
      timeout ${RULE_S:-300} python3 -m benchmarks.delayed_rule ${RULE_ARGS:-gpt2-124m scheduler.warmup_num_steps=30 \
        batch.grad_accum_steps=2 training.max_steps=300 --steps 160 --warmup 100 --eval-every 10} 2>&1 \
        | tee "$OUT/delayedrule.txt" ;;
    speculation)  # issue 36: the overlapped step with clipping against exact mode, run twice, on tutorial 18's GPU
                  # recipe (benchmarks/speculation_exactness.py: every loss and norm printed)
      timeout 200 python3 -m benchmarks.speculation_exactness --device cuda 2>&1 | tee "$OUT/speculation.txt" ;;
    recipes)  # the shipped recipes' tokens/s as `toolkit run` reports them (issue 33's goals). RECIPES: words
              # name:steps[:override,override...], e.g. gpt2-1.5b-h200:20:zero.stage=2,zero.offload_optimizer=cpu;
              # RECIPES_ALLOC: words, each a PYTORCH_CUDA_ALLOC_CONF a run takes in turn ("default": unset, so the
              # toolkit command's own, expandable segments; torch's default is expandable_segments:False), and
              # RECIPES_ROUNDS alternations of them per recipe (an A/B of the allocator's settings)
      local item name steps extra round alloc
      for item in ${RECIPES:-gpt2-124m:60 gpt2-1.5b-h200:40}; do
        IFS=: read -r name steps extra <<< "$item"
        for round in $(seq "${RECIPES_ROUNDS:-1}"); do
          for alloc in ${RECIPES_ALLOC:-default}; do
            [[ $alloc == default ]] && alloc=
            env ${alloc:+PYTORCH_CUDA_ALLOC_CONF=$alloc} timeout 300 python3 -m benchmarks.first_step \
              --label "$name, $steps steps${extra:+, ${extra//,/ }}${alloc:+, $alloc}" --markdown "$OUT/recipes.md" \
              -- python3 -m toolkit run "recipes/$name.json" "training.max_steps=$steps" checkpoint.save_final=false \
              ${extra//,/ } 2>&1 | tee -a "$OUT/recipes.txt"
          done
        done
      done ;;
    epilogues)  # issue 33: GPT-2's dense layers with cuBLASLt's GEMM epilogues against the toolkit's ops
                # (benchmarks/gemm_epilogues.py)
      timeout 300 python3 -m benchmarks.gemm_epilogues --markdown "$OUT/epilogues.md" 2>&1 | tee "$OUT/epilogues.txt" ;;
    attention)  # issue 33: torch's attention backends (flash, cuDNN, memory-efficient) at the recipes' shapes
      timeout 200 python3 -m benchmarks.attention_backends --markdown "$OUT/attention.md" 2>&1 | tee "$OUT/attention.txt" ;;
    deepspeed)  # issue 36's peer: DeepSpeed's ZeRO-2 + CPU offload on GPT-2 1.5B (benchmarks/deepspeed_offload.py; its wheel
                # and deps carried in .whl: built with DS_BUILD_OPS=0, its CPU Adam JIT-built here first; DS_ARGS: its arguments)
      timeout ${DS_S:-300} python3 -m benchmarks.deepspeed_offload --markdown "$OUT/deepspeed.md" ${DS_ARGS:-} 2>&1 \
        | tee "$OUT/deepspeed.txt" ;;
    tests)  # TEST_TARGETS: other pytest targets (TESTS_S: their time limit); a run where no test passed (all skipped: no GPU) fails
      # shellcheck disable=SC2086  # the targets are words
      timeout "${TESTS_S:-200}" python3 -m pytest -q -p no:nbval -p no:cacheprovider -rfE --durations=10 \
        ${TEST_TARGETS:-tests/ops/test_kernels_cuda.py tests/runtime/test_zero_cuda.py \
          tests/train/test_cuda_training.py::test_the_engine_never_waits_for_the_gpu_in_a_bf16_step} \
        2>&1 | tee "$OUT/tests.txt" | tail -60
      grep -Eq '[0-9]+ passed' "$OUT/tests.txt" || { echo "tests: no test passed"; return 1; } ;;
    grid)  # issue 31: every point of `toolkit tune`'s space for GRID_RECIPES (default gpt2-124m), measured once
           # (benchmarks/tune_grid.py; GRID_MICROS, GRID_STAGES, GRID_OFFLOADS default none; GRID_SKIP: a label regex
           # left out; GRID_MISSING: a grid file, only its unmeasured points run; GRID_S: no point starts after)
      # shellcheck disable=SC2086  # the recipes are words
      python3 -m benchmarks.tune_grid ${GRID_RECIPES:-gpt2-124m} --micros "${GRID_MICROS:-}" \
        --stages "${GRID_STAGES:-0,1,2,3}" --offloads "${GRID_OFFLOADS:-none}" --seconds "${GRID_S:-420}" \
        ${GRID_SKIP:+--skip "$GRID_SKIP"} ${GRID_MISSING:+--missing "$GRID_MISSING"} --out "$OUT/grid.jsonl" --md "$OUT/grid.md" 2>&1 | tee "$OUT/grid.txt" ;;
    calibrate)  # issue 31: a memory calibration matrix measured here (CALIB_MATRIX, default stage0ckpt; CALIB_GIB: how many
                # GiB of predicted peaks run at once; CALIB_ONLY: comma-separated substrings of the row ids to run),
                # rows and the predicted / measured table (benchmarks/memory_calibration.py)
      python3 -m benchmarks.memory_calibration --matrix "${CALIB_MATRIX:-stage0ckpt}" --parallel-gib "${CALIB_GIB:-70}" \
        --only "${CALIB_ONLY:-}" --out "$OUT/calib.jsonl" 2>&1 | tee "$OUT/calib.txt"
      python3 -m benchmarks.memory_calibration --report "$OUT/calib.jsonl" | tee "$OUT/calib.md" ;;
    gallery)  # the tutorials' GPU variants executed here, saved with their outputs (GALLERY: some names, run in that order;
              # the carried wheels must include jupyter's: nbformat, nbclient, ipykernel and theirs; GALLERY_S
              # below the call's own limit, so the executed notebooks are copied out before it ends)
      local gallery_rc=0
      # shellcheck disable=SC2086  # the names are words
      timeout "${GALLERY_S:-540}" python3 -m toolkit tutorials build --execute --gpu ${GALLERY:-} 2>&1 \
        | tee "$OUT/gallery.txt" || gallery_rc=$?
      # the executed ones, even after a failure, with their wall times (run_times.json), in one file (a device
      # call returns at most 8 files): unpack it in tutorials/
      tar czf "$OUT/gallery.tgz" -C tutorials gpu run_times.json
      return "$gallery_rc" ;;
    bench)
      timeout 100 python3 -m benchmarks.kernels --markdown "$OUT/bench.md" 2>&1 | tee "$OUT/bench.txt" ;;
    e2e|e2e1.5b)  # GPT-2 end to end, only while the call is young (E2E_BY: seconds into the call;
                  # E2E_ROUNDS: interleave the configurations, benchmarks/end_to_end.py --rounds; E2E_MICRO: its --micro)
      local size=124m left
      [[ $stage == e2e1.5b ]] && size=1.5b
      left=$(( ${E2E_BY:-260} - (SECONDS - start) ))
      if (( left <= 40 )); then
        skip "$left s left (E2E_BY=${E2E_BY:-260})"
        return 0
      fi
      timeout $left python3 -m benchmarks.end_to_end --size $size \
        --only "${E2E_ONLY:-toolkit fused,toolkit fallbacks,plain eager}" --rounds "${E2E_ROUNDS:-0}" \
        --micro "${E2E_MICRO:-16}" \
        --markdown "$OUT/e2e-$size.md" 2>&1 | tee "$OUT/e2e-$size.txt" ;;
    tune)  # shapes of the norm kernels side by side (benchmarks/norm_tune.py; TUNE_SHAPES, TUNE_ROUNDS, TUNE_COLD_L2)
      timeout 300 python3 -m benchmarks.norm_tune ${TUNE_SHAPES:+--shapes "$TUNE_SHAPES"} --rounds "${TUNE_ROUNDS:-1}" \
        ${TUNE_COLD_L2:+--cold-l2} --markdown "$OUT/tune-norm.md" 2>&1 | tee "$OUT/tune-norm.txt" ;;
    inspect)  # how torch.compile and the shipped kernels launch the norms, and Inductor's code for them
      timeout 200 python3 -m benchmarks.norm_inspect --markdown "$OUT/inspect-norm.md" --code-dir "$OUT/inductor" \
        2>&1 | tee "$OUT/inspect-norm.txt" ;;
    ncu)  # Nsight Compute's view of RMSNorm's kernels, torch.compile's and ours (benchmarks/norm_ncu.py)
      if ! command -v ncu > /dev/null; then
        skip "ncu not installed"
        return 0
      fi
      local ncu_rc=0
      timeout 150 ncu --profile-from-start off --section SpeedOfLight --section LaunchStats --section Occupancy \
        --section WarpStateStats --section MemoryWorkloadAnalysis --section SchedulerStats \
        python3 -m benchmarks.norm_ncu > "$OUT/ncu-norm.txt" 2>&1 || ncu_rc=$?
      tail -5 "$OUT/ncu-norm.txt"
      return "$ncu_rc" ;;
    profile|profile1.5b)  # where each configuration's GPU time goes (benchmarks/profile_e2e.py)
      local size=124m
      [[ $stage == profile1.5b ]] && size=1.5b
      timeout 400 python3 -m benchmarks.profile_e2e --size $size \
        --only "${PROFILE_ONLY:-toolkit fused compiled,plain compiled}" --markdown "$OUT/profile-$size.md" \
        2>&1 | tee "$OUT/profile-$size.txt" ;;
    zero124m)  # ZeRO stages and offload against plain PyTorch (benchmarks/zero_gpu.py)
      timeout 240 python3 -m benchmarks.zero_gpu --size 124m --micro 16 \
        --configs plain,stage0,stage1,stage2,stage3,stage2-offload --markdown "$OUT/zero.md" 2>&1 | tee "$OUT/zero124m.txt" ;;
    zero1.5b)
      timeout 330 python3 -m benchmarks.zero_gpu --size 1.5b --micro 16 --steps 6 \
        --configs plain,stage0,stage1,stage2,stage3,stage2-offload --markdown "$OUT/zero.md" 2>&1 | tee "$OUT/zero1.5b.txt" ;;
    ladder)  # the largest GPT-2 shape with offload + activation checkpointing, micro batch 4
             # (LADDER: layer counts, each tried even after one fails; OFFLOAD_RATIO: zero.offload_ratio;
             # STATE_DTYPE: optimizer.state_dtype, e.g. bf16 for issue 35's 15B goal)
      local ladder_rc=0 layers
      for layers in ${LADDER:-24 39}; do
        timeout 200 python3 -m benchmarks.zero_gpu --layers "$layers" --width 4096 --heads 32 --micro 4 --ckpt \
          --steps 4 --warmup 2 --timeout 190 --configs stage2-offload --offload-ratio "${OFFLOAD_RATIO:-1}" \
          --state-dtype "${STATE_DTYPE:-fp32}" \
          --markdown "$OUT/zero.md" 2>&1 | tee -a "$OUT/ladder.txt" || ladder_rc=$?
      done
      return "$ladder_rc" ;;
    scaling)  # several GPUs (issue #7): every stage, DDP and FSDP2 on 1 and on all GPUs, 124M then 1.5B
      local scaling_rc=0 gpus size
      gpus=$(nvidia-smi --list-gpus | wc -l)
      for size in 124m 1.5b; do
        timeout 900 python3 -m benchmarks.zero_gpu --size $size --micro 16 --steps 5 --warmup 2 --gpus "$gpus" \
          --scaling --configs plain,stage0,stage1,stage2,stage3,stage2-offload,fsdp2 --markdown "$OUT/zero.md" \
          2>&1 | tee -a "$OUT/scaling.txt" || scaling_rc=$?
      done
      return "$scaling_rc" ;;
    cpu_adam)  # the toolkit's CPU Adam against torch's CPU AdamW on this host's cores
      timeout 120 python3 -m benchmarks.cpu_adam --steps 10 2>&1 | tee "$OUT/cpu_adam.txt" ;;
    autotune)  # issues 22 and 31: `toolkit tune` of each AUTOTUNE_RECIPES recipe (default gpt2-1.5b-zero3) for this one
               # GPU, AUTOTUNE_MINUTES of trials each (default 5, the issue's budget; each a fresh `toolkit run`), the
               # A/B/A/B reruns after; AUTOTUNE_MICRO: --micro (default: the tuner's whole space)
      local name
      mkdir -p "$OUT/autotune"
      for name in ${AUTOTUNE_RECIPES:-gpt2-1.5b-zero3}; do
        echo "=== toolkit tune $name" | tee -a "$OUT/autotune.txt" "$OUT/autotune.md"
        timeout "${AUTOTUNE_S:-530}" python3 -m toolkit tune "recipes/$name.json" --budget-minutes "${AUTOTUNE_MINUTES:-5}" \
          ${AUTOTUNE_MICRO:+--micro "$AUTOTUNE_MICRO"} --out "$OUT/autotune/$name.tuned.json" 2>&1 | tee -a "$OUT/autotune.txt"
        cat "$OUT/autotune/$name.tuned.trials.md" >> "$OUT/autotune.md"
      done ;;
    infinity)  # ZeRO-Infinity's swap I/O on this host's disk (issue #21): thread pool vs one thread, block
               # sizes, 1 GiB file, page cache dropped before reads; ~1-2 minutes. SWAP_DIR: the disk to measure
      timeout 300 python3 -m benchmarks.swap_io --dir "${SWAP_DIR:-/tmp}" --mib 1024 --rounds 3 \
        --out "$OUT/swap_io.md" 2>&1 | tee "$OUT/infinity.txt" ;;
    infinity-train)  # ZeRO-Infinity training (issue #21, benchmarks/infinity_gpu.py): width 4096, micro 4,
                     # checkpointing; the largest that fits with NVMe, then 8B and 5B with the optimizer on NVMe vs
                     # CPU (offload_ratio 0.3); rows written as runs end, runs skipped past the INF_BUDGET_S budget
                     # (INF_RUNS: infinity_gpu.py's --runs, to split the runs over two calls; STATE_DTYPE:
                     # optimizer.state_dtype, bf16 for issue 35's 25B goal; GRAD_DTYPE: zero.grad_dtype, bf16 too)
      df -h "${SWAP_DIR:-/tmp}" | tee "$OUT/infinity-train.txt"
      timeout $(( ${INF_BUDGET_S:-520} + 40 )) python3 -m benchmarks.infinity_gpu \
        --swap-dir "${SWAP_DIR:-/tmp}/toolkit-swap-bench" ${INF_RUNS:+--runs "$INF_RUNS"} \
        --budget-s "${INF_BUDGET_S:-520}" --state-dtype "${STATE_DTYPE:-fp32}" --grad-dtype "${GRAD_DTYPE:-fp32}" \
        --markdown "$OUT/infinity_train.md" \
        2>&1 | tee -a "$OUT/infinity-train.txt"
      rm -rf "${SWAP_DIR:-/tmp}/toolkit-swap-bench" ;;
    addnorm)  # issue 33: the residual add fused into the norm against its parts, kernel time (benchmarks/add_norm.py)
      timeout 120 python3 -m benchmarks.add_norm --markdown "$OUT/add_norm.md" 2>&1 | tee "$OUT/add_norm.txt" ;;
    treeab)  # today's tree against BASELINE_TREE (a `git archive` of an earlier commit, with pyproject.toml): AB_N
             # alternations of benchmarks/end_to_end.py (AB_ROUNDS rounds of 20 steps at micro AB_MICRO, default 3 and
             # 32), each of today's AB_ONLY configurations and the baseline's BASELINE_ONLY alone in its process (a
             # process holding two engines runs slower); AB_TOGETHER=1: today's AB_ONLY interleaved in one process
             # (issue 24's tensor = pipeline = 1 check: AB_ONLY="toolkit fused,toolkit fused parallel 1x1" AB_MICRO=16
             # AB_ROUNDS=5 AB_TOGETHER=1 BASELINE_ONLY="toolkit fused", the `tp1pp1` stage before 2026-12-07)
      local i config table
      local -a groups
      table=$(mktemp)
      for i in $(seq "${AB_N:-3}"); do
        if [[ -n ${AB_TOGETHER:-} ]]; then
          groups=("${AB_ONLY:-toolkit fused stage 1}")
        else
          IFS=, read -ra groups <<< "${AB_ONLY:-toolkit fused stage 1}"
        fi
        for config in "${groups[@]}"; do
          timeout 200 python3 -m benchmarks.end_to_end --steps 20 --rounds "${AB_ROUNDS:-3}" --micro "${AB_MICRO:-32}" \
            --only "$config" --markdown "$table" 2>&1 | tee -a "$OUT/treeab.txt"
          { echo "alternation $i, today's tree"; cat "$table"; } >> "$OUT/treeab.md"
        done
        [[ -n ${BASELINE_TREE:-} ]] || continue
        (cd "$BASELINE_TREE" && PYTHONPATH=$PWD${SITE_PATH:+:$SITE_PATH} timeout 200 python3 -m benchmarks.end_to_end \
          --steps 20 --rounds "${AB_ROUNDS:-3}" --micro "${AB_MICRO:-32}" --only "${BASELINE_ONLY:-toolkit fused stage 1}" \
          --markdown "$table") 2>&1 | tee -a "$OUT/treeab.txt"
        { echo "alternation $i, $BASELINE_TREE"; cat "$table"; } >> "$OUT/treeab.md"
      done ;;
    *)
      echo "unknown stage '$stage'; see the stages at the top of benchmarks/gpu_check.sh" >&2
      return 2 ;;
  esac
}

for stage in $stages; do
  echo "=== $stage (t=$((SECONDS - start))s)"
  ( set -e; stage_body )
  record "$stage" $?
done
echo "=== done (t=$((SECONDS - start))s)"
# NOTE: the device tool brings back at most 8 files: the tables stay as they are, the logs travel packed.
(cd "$OUT" && tar czf logs.tgz ./*.txt && rm -f ./*.txt)
record logs.tgz $?
echo "=== summary"
width=0
for name in "${names[@]}"; do (( ${#name} > width )) && width=${#name}; done
for i in "${!names[@]}"; do
  printf '%-*s  %s\n' "$width" "${names[$i]}" "${results[$i]}"
done
exit "$status"
