#!/usr/bin/env bash
# One GPU-box session: build in place, the conformance suite on cuda (area by area, each with its report), then
# every benchmark. Each part is time-boxed so that one slow part cannot starve the rest of a lease; the figures in
# docs/benchmarks.md come from this script. Usage: benchmarks/run_gpu.sh OUT_DIR (from the repository root).
# PARTS="name1 name2 ..." runs only the named parts (names as printed after "=="; default: all of them).
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
out=$(realpath -m "${1:?usage: benchmarks/run_gpu.sh OUT_DIR}"); mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HOSTOFFLOAD_SOURCE_ROOT=$root
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# SKIP_BUILD=1: another run_gpu.sh of the same call already built the copy (parts may run side by side).
if [ -z "${SKIP_BUILD:-}" ]; then
  python3 -m pip install --no-build-isolation --no-deps -e . >"$out/build.log" 2>&1 || { tail -40 "$out/build.log"; exit 1; }
fi
# The device tool's copy may carry a stale .git, so the sources are also fingerprinted by content.
{ date -u +%FT%TZ; echo "git HEAD of this copy: $(git -C "$root" rev-parse --short HEAD 2>/dev/null)"
  echo "sources sha256: $(cd "$root" && find reference optimized csrc conformance benchmarks -type f \
    \( -name '*.py' -o -name '*.cpp' -o -name '*.h' -o -name '*.sh' -o -name 'CMakeLists.txt' \) | sort \
    | xargs sha256sum | sha256sum | cut -c1-16)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max --format=csv,noheader
  lscpu | grep -E 'Model name|^CPU\(s\)'; grep -E 'MemTotal|MemAvailable' /proc/meminfo; echo "memlock: $(ulimit -l)"; python3 -c 'import torch; print("torch", torch.__version__)'; } >"$out/hardware.txt" 2>&1
cat "$out/hardware.txt"
wanted() { [ -z "${PARTS:-}" ] || [[ " $PARTS " == *" $1 "* ]]; }
part() {  # part NAME SECONDS COMMAND...: run, keep the log, print its tail
  local name=$1 secs=$2; shift 2; wanted "$name" || return 0; echo "== $name (${secs}s): $*"
  timeout "$secs" "$@" >"$out/$name.log" 2>&1; echo "   exit $?"
  grep -E '^(FAILED|ERROR)|passed|failed|^\|' "$out/$name.log" | tail -30
}
suite() {  # suite NAME SECONDS PYTEST-TARGETS...
  local name=$1 secs=$2; shift 2
  part "suite-$name" "$secs" bash -c 'cd /tmp && exec python3 -m pytest --pyargs -p no:cacheprovider -W ignore::DeprecationWarning \
    --conformance-accelerator cuda --conformance-profile gpu --conformance-report "$0" -q "$@"' "$out/report-$name" "$@"
}
suite pinning "${T_PIN:-190}" conformance.suite.test_pinning_api conformance.suite.test_pinning_cuda \
  conformance.suite.test_pinning_threads conformance.suite.test_pinning_memlock conformance.suite.test_ranges_state_machine \
  conformance.suite.test_ranges_agreement conformance.suite.test_accelerators_contract conformance.suite.test_pinning_lifetime \
  conformance.suite.test_ranges_cost_growth conformance.suite.test_readme_usage
# The CUDA-only pinning module and the API module (is_pinned's agreement with torch, its misses' cache), for a
# call without time for the whole pinning part above.
suite pinning-cuda "${T_PINC:-120}" conformance.suite.test_pinning_cuda conformance.suite.test_pinning_api
# What asking CUDA "is this host pointer pinned?" costs per way of asking, and what each answers (issue 19).
part probe-pointer-query "${T_PPQ:-90}" bash -c 'nvcc -O2 -std=c++17 -o /tmp/probe_pointer_query \
  benchmarks/probe_pointer_query.cpp -lcuda && /tmp/probe_pointer_query'
wanted probe-pointer-query && cat "$out/probe-pointer-query.log"
# The offload modules by name: "-k offload" also selected every accumulation test parametrized "offload"/"no-offload"
# (64 ZeRO scenarios on gloo among them), which the accumulation parts run, and which starved this part's time box.
suite offload "${T_OFF:-240}" conformance.suite.test_offload_checkpoint conformance.suite.test_offload_config \
  conformance.suite.test_offload_cuda conformance.suite.test_offload_docs conformance.suite.test_offload_equivalence \
  conformance.suite.test_offload_hf conformance.suite.test_offload_semantics conformance.suite.test_offload_streams
suite io "${T_IO:-30}" conformance -k "test_io"
suite accumulation-nccl "${T_ACC:-90}" conformance -k "accumulation and (nccl or nvme or cpu_adam or optimizer)"
suite accumulation-engine "${T_ACE:-300}" conformance.suite.test_accumulation_engine_resume \
  conformance.suite.test_accumulation_engine_surface conformance.suite.test_accumulation_engine_examples \
  conformance.suite.test_accumulation_engine_faults conformance.suite.test_accumulation_engine_scenarios \
  conformance.suite.test_accumulation_engine_overlap conformance.suite.test_accumulation_delayed_update \
  conformance.suite.test_accumulation_split_update conformance.suite.test_accumulation_engine_device_adam
# The update paths on cuda after the streamed update's carve into stages and R29 (issue 40 items 1-2): the split,
# the delayed update, the overlap, the fused device Adam (bf16 moments included) and the R29 matrix, for a call
# without time for the whole accumulation-engine part above.
suite accumulation-stages "${T_ASG:-180}" conformance.suite.test_accumulation_split_update \
  conformance.suite.test_accumulation_delayed_update conformance.suite.test_accumulation_engine_overlap \
  conformance.suite.test_accumulation_engine_device_adam conformance.suite.test_accumulation_state_precision
# examples/train_zero_resume.py on NCCL, world size 1: 3 steps, save, resume to 6; then 6 uninterrupted steps.
# The two "final checksum" lines must be equal.
zero_resume() {
  local r=(torchrun --standalone --nproc_per_node 1 examples/train_zero_resume.py --backend nccl --stage 3 --bf16
           --total-steps 6 --save-every 3)
  rm -rf /tmp/zA /tmp/zB
  "${r[@]}" --steps 3 --ckpt-dir /tmp/zA && "${r[@]}" --steps 6 --ckpt-dir /tmp/zA --resume \
    && "${r[@]}" --steps 6 --ckpt-dir /tmp/zB
}
export -f zero_resume
part zero-resume-nccl "${T_ZRN:-120}" bash -c zero_resume
wanted zero-resume-nccl && grep -i "checksum" "$out/zero-resume-nccl.log"
# The same with the delayed update (R27, stage 2, cpu offload): the checkpoint keeps the lagging weights.
zero_resume_dpu() {
  local r=(torchrun --standalone --nproc_per_node 1 examples/train_zero_resume.py --backend nccl --stage 2 --bf16
           --delayed-update --total-steps 6 --save-every 3)
  rm -rf /tmp/zC /tmp/zD
  "${r[@]}" --steps 3 --ckpt-dir /tmp/zC && "${r[@]}" --steps 6 --ckpt-dir /tmp/zC --resume \
    && "${r[@]}" --steps 6 --ckpt-dir /tmp/zD
}
export -f zero_resume_dpu
part zero-resume-nccl-dpu "${T_ZRD:-120}" bash -c zero_resume_dpu
wanted zero-resume-nccl-dpu && grep -i "checksum" "$out/zero-resume-nccl-dpu.log"
part zero-scenarios-nccl "${T_ZSC:-70}" python3 benchmarks/bench_zero.py scenarios --backend nccl --world 1 --out "$out/zero"
part diag-offload-prefetch "${T_DOP:-60}" python3 benchmarks/diag_offload_prefetch.py --blocks 6 --steps 2
part bench-pinning "${T_BPIN:-70}" python3 benchmarks/bench_pinning.py --only "${PIN_GROUPS:-alloc,phases,is_pinned,bandwidth}" \
  --out "$out/bench_pinning.json"
part bench-offload "${T_BOFF:-140}" python3 benchmarks/bench_offload.py \
  --arms no_ckpt,ckpt,save_on_cpu,reference,optimized,optimized_p2,optimized_p0 --out "$out/bench_offload.json"
part bench-zero-adam "${T_BZA:-150}" python3 benchmarks/bench_zero.py cpu-adam --sizes "${ADAM_SIZES:-1e7,1e8,1e9}" --iters 5 --out "$out/zero"
part bench-zero-engine "${T_BZE:-50}" python3 benchmarks/bench_zero.py engine --device cuda --dtype bf16 --layers 12 \
  --hidden 1024 --heads 16 --seq 1024 --vocab 32000 --batch 8 --gas 4 --iters 5 --out "$out/zero"
# Adam on device masters (no offload, the split's device side): the fused Triton kernel against the torch-op
# sequence it replaces (same bits, checked) and torch's fused AdamW (the user's alternative), 1e6 to 8.9e8 elements.
part bench-device-adam "${T_BDA:-120}" python3 benchmarks/bench_device_adam.py --device cuda \
  --sizes "${DA_SIZES:-1e6,1e7,1e8,6.4e8,8.9e8}" --iters 10 --out "$out/device_adam.json"
wanted bench-device-adam && cat "$out/bench-device-adam.log"
# The host's memory bandwidth, the floor under the CPU Adam's time (30 bytes of optimizer traffic per parameter).
part host-bandwidth "${T_HBW:-60}" python3 benchmarks/host_memory_bandwidth.py --gib 4 --params 886e6
# Issue 49 item 3: the CPU Adam kernel alone, then under each condition the engine adds (buckets, pinned buffers,
# one thread fewer, the H2D beside it, a D2H stream, a bf16 gradient, R30's backup), on the 886M partition.
part host-update "${T_HU:-150}" python3 benchmarks/bench_host_update.py --device cuda --params 886e6 --bucket 25e6 \
  --out "$out/host_update"
wanted host-update && grep -E "GB/s|host update" "$out/host-update.log"
wanted host-bandwidth && cat "$out/host-bandwidth.log"
# Issue 16: ours vs DeepSpeed ZeRO-Offload vs FSDP2 on the 886M Llama (about 70 s per arm on the H200, so the arms
# are split to fit one 600 s device call each; the JSON is rewritten after every arm). The DeepSpeed arms need its
# wheels carried in .whl/ and installed first: `python3 -m pip install -q --no-index --no-deps --no-compile
# --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site DS_ACCELERATOR=cuda`
# (docs/benchmarks.md, 2026-12-03); without them they print "not installed".
# Issue 52: a config's scheduler section against DeepSpeed's own scheduler classes (lr and betas of every boundary,
# compared exactly; prints one line per section) and the suite's test of the same, which runs wherever DeepSpeed
# imports. Both need DeepSpeed's wheel installed as said above; without it the script prints SKIPPED.
part ds-schedules "${T_DSS:-120}" python3 benchmarks/compare_deepspeed_schedules.py --boundaries 60 --random 40
wanted ds-schedules && tail -3 "$out/ds-schedules.log"
suite ds-schedules "${T_DSST:-120}" conformance.suite.test_accumulation_lr_schedules \
  conformance.suite.test_accumulation_deepspeed_configs_train
zo=(python3 benchmarks/bench_zero_offload.py --device cuda --steps 5 --warmup 2 --timeout 150)
# Stage 2 first (no offload, offload, offload + delayed update R27, DeepSpeed), then stage 3 in a part of its own:
# seven arms at ~70 s do not fit one 600 s call.
part bench-zero-offload "${T_BZO:-330}" "${zo[@]}" --model 886m --out "$out/zero_offload" \
  --arms "${S2_ARMS:-ours-s2,ours-s2-offload,ours-s2-offload-dpu,ds-z2-offload}"
# Issue 40's comparison in one 600 s device call: the 886M model at sequence 1024, batch 4, 2 micro-batches (the
# issue's table) with our engine without offload, with every update on the host (share 0), and at DeepSpeed's peak
# GPU memory (-matched: "auto" with the gpu_memory_budget that DeepSpeed's peak leaves above share 0's, so those two
# run first), DeepSpeed ZeRO-2 + offload, torchao's CPUOffloadOptimizer and Megatron-Core's HybridDeviceOptimizer
# (offload_fraction 1.0), each arm 2 warm-up + I40_STEPS timed steps. All peers need their wheels installed first as
# said above (torchao and megatron_core are in .whl/ beside DeepSpeed's); a missing one prints "not installed".
# Estimate: ours ~50 s per arm with setup, DeepSpeed ~90 s (its CPU Adam's JIT build), the peers ~40-60 s each
# (pinning 7 GB of host copies, Megatron's import): ~350 s, plus the build. I40_GAS="2,8" runs the accumulation
# sweep (each arm at 2 and at 8 micro-batches: about twice the time, so a call of its own; I40_ARMS splits the arms
# over calls, keeping ours-s2-offload and ds-z2-offload before the matched arm or giving I40_EXTRA="--match-memory-gib
# X"). The "matched:" lines say the peak matched, the base and the budget.
part bench-zero-offload-i40 "${T_I40:-520}" python3 benchmarks/bench_zero_offload.py --device cuda --model 886m \
  --seq 1024 --batch 4 --gas "${I40_GAS:-2}" --steps "${I40_STEPS:-5}" --warmup 2 --timeout 180 \
  --arms "${I40_ARMS:-ours-s2,ours-s2-offload,ds-z2-offload,ours-s2-offload-matched,torchao-offload,megatron-offload}" \
  ${I40_EXTRA:-} --out "$out/zero_offload_i40${I40_TAG:-}"
wanted bench-zero-offload-i40 && grep -E "matched:|per boundary|split:" "$out/bench-zero-offload-i40.log"
# Issue 49 item 1-2, the honest baseline: DeepSpeed in its default configuration (bf16 accumulation, buckets 5e8),
# with 5e7 buckets, and with fp32 accumulation (the same numerics as ours; what the issue-40 rows matched), beside
# our engine without offload and at share 0 with fp32 and with bf16 (DeepSpeed's default numerics) accumulation.
# --memory-breakdown prints what each peak is made of (peak_breakdown.py). ~60 s per arm, DeepSpeed's first ~90 s.
part bench-zero-offload-i49 "${T_I49:-540}" python3 benchmarks/bench_zero_offload.py --device cuda --model 886m \
  --seq 1024 --batch 4 --gas "${I49_GAS:-2}" --steps "${I49_STEPS:-5}" --warmup 2 --timeout 170 --memory-breakdown \
  --arms "${I49_ARMS:-ours-s2,ours-s2-offload,ours-s2-offload-bf16acc,ds-z2-offload,ds-z2-offload-b5e7,ds-z2-offload-fp32acc}" \
  ${I49_EXTRA:-} --out "$out/zero_offload_i49${I49_TAG:-}"
wanted bench-zero-offload-i49 && sed -n '/^| arm/,$p' "$out/bench-zero-offload-i49.log"
# The same comparison at 8 micro-batches for our engine without offload and share 0 with bf16 moments (issue 40's
# "<= 1.15x at 8 micro-batches" target), a part of its own so that it fits one call beside the part above.
part bench-zero-offload-i40-gas8 "${T_I40G8:-70}" python3 benchmarks/bench_zero_offload.py --device cuda --model 886m \
  --seq 1024 --batch 4 --gas 8 --steps "${I40_STEPS:-5}" --warmup 2 --timeout 60 \
  --arms "${I40G8_ARMS:-ours-s2,ours-s2-offload-bf16state}" ${I40G8_EXTRA:-} --out "$out/zero_offload_i40_gas8"
# R30 where it stands (issue 40 item 3): share 0 with bf16 moments without and with the host update under the last
# backward, at the i40 shape with --clip 1e9 so that no boundary clips (with clip 1.0 on random data every boundary
# clips, and R30's policy then runs the step path: bench-zero-offload-overlap shows that case).
part bench-zero-offload-overlap-noclip "${T_BZON:-60}" python3 benchmarks/bench_zero_offload.py --device cuda \
  --model 886m --seq 1024 --batch 4 --gas 2 --steps "${I40_STEPS:-5}" --warmup 2 --timeout 50 --clip 1e9 \
  --arms ours-s2-offload-bf16state,ours-s2-offload-bf16state-overlap --out "$out/zero_offload_overlap_noclip"
wanted bench-zero-offload-overlap-noclip && grep -E "per boundary|last backward" "$out/bench-zero-offload-overlap-noclip.log"
# The largest model with bf16 moments (R29: 14 bytes of host memory per parameter): the 9b preset (9.2B), two
# steps, the host memory predicted before construction (estimate_host_memory) beside the measured peak RSS; 8b if 9b
# fails. Micro-batch 1 (of 2048 tokens): at the preset's 4 the 9b model's activations ran the H100's 80 GB out (run
# AB); the host's memory, not the GPU's, is what this part measures.
part bench-zero-offload-largest "${T_BZL:-320}" python3 benchmarks/bench_zero_offload.py --device cuda \
  --model "${LARGEST_MODEL:-9b,8b}" --sweep down --batch "${LARGEST_BATCH:-1}" --steps 2 --warmup 1 --timeout 150 \
  --arms ours-s2-offload-bf16state --out "$out/zero_offload_largest"
wanted bench-zero-offload-largest && grep -E "host memory|^\|" "$out/bench-zero-offload-largest.log"
# estimate_host_memory against the locked memory of the engine then built, on cuda (every buffer but R30's backup
# is pinned there, so the whole estimate is checked).
suite host-memory-estimate "${T_HME:-30}" conformance.suite.test_accumulation_engine_host_memory -k estimate
# Issue 27's ~3B shape (3b preset: hidden 3200, 24 layers, sequence 2048, batch 4, 2 micro-batches), step mode.
part bench-zero-offload-3b "${T_BZ3B:-330}" "${zo[@]}" --model 3b --out "$out/zero_offload_3b" \
  --arms "${S2_ARMS:-ours-s2,ours-s2-offload,ours-s2-offload-split,ds-z2-offload}"
# Time to loss (issue 27 item 6): each arm trains the 886M model on the bigram chain (1,024 ids, 4 successors each,
# floor ln 4 = 1.39; sequence 1024, batch 4, 2 micro-batches, AdamW lr 3e-4, clip 1.0) for 120 boundaries and
# reports the median step, the loss after them and the wall time to loss 2.0, with our offloaded arms' per-phase
# timeline. Estimated from run J's setup times and issue 27's step times at this shape (ours: 14-28 s setup, 194-433
# ms steps; DeepSpeed: 75 s setup with its CPU Adam's JIT build, ~600 ms steps): about 450 s for the six arms, DS
# last so a cut keeps ours (the JSON is rewritten after every arm). Needs DeepSpeed's wheels as for the parts
# below. CONV_ARMS / CONV_STEPS / CONV_MODEL change the arms, boundaries and shape (3b: about 3.4x the step time,
# so split its arms over calls). The -split arm needs R28 (gpu_share) and reports itself absent without it.
# CONV_EXTRA adds arguments (e.g. "--gpu-memory-budget-gib 7" for the split arm) and CONV_TAG suffixes the output
# folder, so that a second invocation of the part (SKIP_BUILD=1) keeps the first one's files.
part bench-zero-converge "${T_BZC:-470}" python3 benchmarks/bench_zero_offload.py --mode converge --device cuda \
  --model "${CONV_MODEL:-886m}" --seq 1024 --steps "${CONV_STEPS:-120}" --target 2.0 --lr 3e-4 --arm-seconds 80 \
  --timeout 200 --arms "${CONV_ARMS:-ours-s2,ours-s2-offload,ours-s2-offload-split,ours-s2-offload-dpu-warmup,ours-s2-offload-dpu,ds-z2-offload}" \
  ${CONV_EXTRA:-} --out "$out/zero_converge${CONV_TAG:-}"
wanted bench-zero-converge && grep -E "per boundary|split:|warm-up:" "$out/bench-zero-converge.log"
# R29 (issue 40 item 2): share 0 with each state precision side by side with no offload, step mode on the 886M
# model (three arms at ~70 s), then time to loss for the two offloaded ones (the bf16 moments' loss curve against
# the fp32 moments'). The host kernel's bytes per parameter and its fraction of the host's bandwidth per precision
# are the bench-zero-adam part's "native+bf16" and "native+bf16 state=bf16" rows.
part bench-zero-offload-state "${T_BZST:-300}" "${zo[@]}" --model 886m --out "$out/zero_offload_state" \
  --arms "${STATE_ARMS:-ours-s2,ours-s2-offload,ours-s2-offload-bf16state}"
# R30 (issue 40 item 3): share 0 with the host update started under the last backward, beside share 0 and no
# offload (step mode, 886M); the timeline's "update under the last backward" line says how many boundaries were
# redone (the arms clip at 1.0: how many of their boundaries clip decides what the redo costs; unmeasured so far).
part bench-zero-offload-overlap "${T_BZOV:-300}" "${zo[@]}" --model 886m --out "$out/zero_offload_overlap" \
  --arms "${OVERLAP_ARMS:-ours-s2,ours-s2-offload,ours-s2-offload-overlap}"
wanted bench-zero-offload-overlap && grep -E "per boundary|last backward" "$out/bench-zero-offload-overlap.log"
part bench-zero-converge-state "${T_BZCS:-330}" python3 benchmarks/bench_zero_offload.py --mode converge \
  --device cuda --model "${CONV_MODEL:-886m}" --seq 1024 --steps "${CONV_STEPS:-120}" --target 2.0 --lr 3e-4 \
  --arm-seconds 80 --timeout 200 --arms "${STATE_CONV_ARMS:-ours-s2-offload,ours-s2-offload-bf16state}" \
  --out "$out/zero_converge_state"
# R27's remaining overhead (docs/benchmarks.md, run J: 89.5 ms over the no-offload step, 45 ms of it not
# attributed) looked like host-core contention between the CPU Adam and the training thread: the R27 arm with
# fewer Adam threads, side by side with the default count (one JSON per count).
dpu_threads() {
  for n in ${DPU_THREADS:-16 14 12}; do
    python3 benchmarks/bench_zero_offload.py --device cuda --steps 5 --warmup 2 --timeout 150 --model 886m \
      --arms ours-s2-offload-dpu --adam-threads "$n" --out "$1/zero_offload_dpu_threads_$n" || return
  done
}
export -f dpu_threads
part bench-zero-offload-dpu-threads "${T_BZT:-240}" bash -c 'dpu_threads "$0"' "$out"
part bench-zero-offload-s3 "${T_BZ3:-270}" "${zo[@]}" --model 886m --out "$out/zero_offload_s3" \
  --arms "${S3_ARMS:-ours-s3-offload,ours-s3-offload-dpu,ds-z3-offload}"
part bench-zero-offload-more "${T_BZM:-360}" "${zo[@]}" --model 886m --out "$out/zero_offload_more" \
  --arms ours-s3,fsdp2,fsdp2-offload
# Issue 52: a Lightning Trainer with our ZeroStrategy beside Lightning's DeepSpeedStrategy at the same config (ZeRO-2,
# optimizer offload, bf16-true, the 886M Llama). Needs lightning (or pytorch-lightning) and, for the DeepSpeed arm,
# DeepSpeed's wheels installed as above; a missing one prints "not installed".
part bench-lightning "${T_BL:-360}" python3 benchmarks/bench_lightning.py --device cuda --model 886m --steps 5 \
  --warmup 2 --timeout 170 --out "$out/lightning"
# The largest model that trains with offload (host memory bounds it), with default settings: the engine pins its own
# buffers at their exact size by default (HOSTOFFLOAD_ZERO_HOST_MEMORY=exact; docs/zero.md, "Host memory"), so no
# --pin-backend is given (under torch's allocator each engine buffer used to be rounded up to a power of two).
# Largest first, each arm stopping at the first model that trains (--sweep down); ours and DeepSpeed's in parts of
# their own, as the two do not fit one 600 s call.
sweep() {  # sweep ARM OUT
  python3 benchmarks/bench_zero_offload.py --device cuda --model "${SWEEP_MODELS:-7b,6b,5b}" --sweep down --steps 2 \
    --warmup 1 --timeout "${SWEEP_ARM_S:-190}" --arms "$1" --out "$2"
}
export -f sweep
part bench-zero-offload-sweep-ours "${T_BZS:-580}" bash -c 'sweep ours-s2-offload "$0"' "$out/zero_offload_sweep_ours"
part bench-zero-offload-sweep-ds "${T_BZS:-580}" bash -c 'sweep ds-z2-offload "$0"' "$out/zero_offload_sweep_ds"
mkdir -p /tmp/hostoffload-io
part bench-io "${T_BIO:-240}" python3 benchmarks/bench_io.py --sizes 64M,256M,1G,4G --repeats 2 --dir /tmp/hostoffload-io \
  --out "$out/bench_io.json"
