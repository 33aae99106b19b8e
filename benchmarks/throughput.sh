#!/usr/bin/env bash
# The engine figures of issue 3's "Done when", each one command, all in fp32 on this machine.
# Each run prints requests/s, output and total tokens/s, peak RSS, the torch.mm GEMM FLOP/s and
# roofline fraction, the single-stream decode rate against the bandwidth bound, and (with
# --baseline hf) Hugging Face generate() on the same prompts in static batches of 64 and the
# ratio -- all measured in the same run, so the ratios hold on a shared, noisy CPU.
# Usage: benchmarks/throughput.sh [uniform|mixed|all] [extra pkgd flags/overrides...]
set -euo pipefail
cd "$(dirname "$0")/.."
PKGD=${PKGD:-.venv/bin/pkgd}
which=${1:-all}; shift || true
results=${RESULTS_DIR:-/tmp/pkgd-bench}; mkdir -p "$results"
if [[ $which == uniform || $which == all ]]; then
  # 256 prompts, 128 in / 128 out, vs HF static batches of 64
  "$PKGD" bench throughput --num-prompts 256 --input-len 128 --output-len 128 --ignore-eos \
    --baseline hf --hf-batch-size 64 --output-json "$results"/uniform.json "$@"
fi
if [[ $which == mixed || $which == all ]]; then
  # mixed output lengths, uniform in 16-256, ignore_eos, vs HF static batches of 64
  "$PKGD" bench throughput --num-prompts 256 --input-len 128 --output-len-range 16 256 --ignore-eos \
    --baseline hf --hf-batch-size 64 --skip-single-stream --output-json "$results"/mixed.json "$@"
fi
