#!/usr/bin/env bash
# The serving figures of issue 4, in one run (real engine-core and API-server processes):
#  1. frontend overhead: 1-token completions at concurrency 32 against the fake engine core
#     (no model compute), then against SmolLM2;
#  2. 64 concurrent streams of 128 -> 128 tokens against SmolLM2.
# Usage: benchmarks/serve_figures.sh   (from the repository root, after ./scripts/bootstrap)
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
echo "== frontend overhead, fake engine core (no model): 1-token completions, concurrency 32"
$py benchmarks/serve_local.py --fake-engine -- --no-stream --input-len 8 --output-len 1 --num-prompts 2000 --max-concurrency 32
echo "== same against SmolLM2 (engine compute included)"
$py benchmarks/serve_local.py --config model.max_model_len=2048 -- --no-stream --input-len 8 --output-len 1 --num-prompts 500 --max-concurrency 32
echo "== 64 concurrent streams, 128 -> 128 tokens, SmolLM2"
$py benchmarks/serve_local.py --config model.max_model_len=2048 -- --input-len 128 --output-len 128 --num-prompts 64 --max-concurrency 64
