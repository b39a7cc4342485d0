#!/usr/bin/env bash
# Every GPU-box benchmark in one go (the figures in docs/benchmarks.md come from this script).
# Usage: benchmarks/run_gpu.sh OUT_DIR   (repository root; builds in place first, no network needed)
set -uo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${1:?usage: benchmarks/run_gpu.sh OUT_DIR}"); mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python3 -m pip install --no-build-isolation --no-deps -e . >"$out/build.log" 2>&1 || { tail -40 "$out/build.log"; exit 1; }
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max --format=csv,noheader
  lscpu | grep -E 'Model name|^CPU\(s\)'; python3 -c 'import torch; print("torch", torch.__version__)'; } >"$out/hardware.txt" 2>&1
cat "$out/hardware.txt"
run() { local name=$1; shift; echo "== $name: $*"; timeout "${BENCH_TIMEOUT:-240}" "$@" >"$out/$name.log" 2>&1; echo "   exit $?"; tail -25 "$out/$name.log"; }
run pinning python3 benchmarks/bench_pinning.py --out "$out/bench_pinning.json"
run offload python3 benchmarks/bench_offload.py --arms no_ckpt,ckpt,save_on_cpu,reference,optimized,optimized_p2,optimized_p0 --out "$out/bench_offload.json"
run io python3 benchmarks/bench_io.py --sizes 64M,256M,1G,4G --dir /tmp/hostoffload-io --out "$out/bench_io.json"
run zero python3 benchmarks/bench_zero.py all --out "$out/zero"
