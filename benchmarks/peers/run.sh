#!/usr/bin/env bash
# One command for the whole comparison: install the peers if they are not there yet (vLLM's CPU
# build in its own venv, llama.cpp built from the llama-cpp-python sdist; both under .work/),
# then run every figure of every system and print the table and the pkgd / peer ratios.
# Usage: benchmarks/peers/run.sh [summary.py options]   e.g. --quick, --port-base 18100, --repeats 2, --only serve
# Needs pkgd's .venv (./scripts/bootstrap). Not part of the test command.
set -euo pipefail
here=$(dirname "$0")
source "$here/common.sh"
"$here/install_vllm.sh" || echo "run.sh: vLLM could not be installed; its rows are skipped" >&2
"$here/install_llamacpp.sh" || echo "run.sh: llama.cpp could not be built; its rows are skipped" >&2
exec "$PKGD_PY" "$here/summary.py" "$@"
