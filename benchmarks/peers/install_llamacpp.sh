#!/usr/bin/env bash
# Build llama.cpp's llama-bench, llama-server and llama-perplexity from the copy vendored in the
# llama-cpp-python sdist (pinned in common.sh), fetched from the package registry with pip.
# Native CPU build (GGML_NATIVE: the host's AVX2/AVX-512/AMX), no web UI (its prebuilt assets
# would be downloaded from a hub), no HTTPS, no tests/examples. Output: .work/llama.cpp-build/bin.
# Usage: benchmarks/peers/install_llamacpp.sh   (idempotent; ~5-15 min on 2 cores)
# Idempotent and cached: with the three tools built it exits at once; an interrupted run resumes
# (the unpacked sdist is kept, ninja rebuilds only what is missing). Runs one at a time per
# $PEERS_WORK (a lock), so two checkouts sharing the work directory never build into it together.
set -euo pipefail
source "$(dirname "$0")/common.sh"
exec 9>"$PEERS_WORK/.llama.cpp-build.lock"
flock 9
tools=(llama-bench llama-server llama-perplexity)
have=1; for t in "${tools[@]}"; do [ -x "$LLAMA_BIN/$t" ] || have=0; done
if [ $have = 1 ]; then echo "install_llamacpp: already built in $LLAMA_BIN"; exit 0; fi
started=$SECONDS
sdist=$PEERS_WORK/sdist
if [ ! -d "$LLAMA_SRC/vendor/llama.cpp" ]; then
  mkdir -p "$sdist"
  tarball=$sdist/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz
  # --no-binary for this package only: pip still prepares the sdist's metadata in an isolated
  # build environment, whose build backend (scikit-build-core) must come as a wheel; ":all:"
  # would build every build dependency from source as well
  [ -f "$tarball" ] || "$PKGD_PY" -m pip download --disable-pip-version-check --quiet --no-deps \
    --no-binary llama-cpp-python "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" -d "$sdist" \
    2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2)
  # unpacked beside, then moved into place: a half-unpacked tree never looks complete
  rm -rf "$LLAMA_SRC.partial" && mkdir -p "$LLAMA_SRC.partial"
  tar xzf "$tarball" -C "$LLAMA_SRC.partial" --strip-components=1
  rm -rf "$LLAMA_SRC" && mv "$LLAMA_SRC.partial" "$LLAMA_SRC"
fi
build=$PEERS_WORK/llama.cpp-build
cmake -S "$LLAMA_SRC/vendor/llama.cpp" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
  -DLLAMA_OPENSSL=OFF -DLLAMA_LLGUIDANCE=OFF >"$build.cmake.log" 2>&1 \
  || { tail -30 "$build.cmake.log" >&2; exit 1; }
cmake --build "$build" -j "$(nproc)" --target "${tools[@]}" >"$build.log" 2>&1 \
  || { tail -40 "$build.log" >&2; exit 1; }
for t in "${tools[@]}"; do [ -x "$LLAMA_BIN/$t" ] || { echo "install_llamacpp: $t missing" >&2; exit 1; }; done
echo "install_llamacpp: built ${tools[*]} in $((SECONDS - started)) s ($LLAMA_BIN)"
