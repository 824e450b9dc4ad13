#!/bin/bash
# Install the serving-benchmark clients that count tokens with a Hugging Face tokenizer into their
# own virtual environment, away from prefixkv's (they pin their own torch, pytest, transformers):
#   guidellm 0.8.1 and aiperf 0.13.0, from PyPI (several GB: both pull a CUDA torch).
# Usage: scripts/install-bench-clients.sh [VENV]   (default /tmp/benchclients; also $PREFIXKV_BENCH_CLIENTS_VENV)
# Then:  PREFIXKV_BENCH_CLIENTS=VENV/bin python -m pytest -m slow tests/models/test_bench_clients.py
# and point either at a served catalog model with the tokenizer directory prefixkv printed:
#   VENV/bin/guidellm run --backend kind=openai_http,target=http://127.0.0.1:8000,model=smollm2-135m-instruct \
#     --tokenizer kind=huggingface_auto,model=TOKENIZER_DIR --profile kind=synchronous \
#     --constraint kind=max_requests,count=16 --data kind=synthetic_text,prompt_tokens=256,output_tokens=32
#   VENV/bin/aiperf profile --model smollm2-135m-instruct --url http://127.0.0.1:8000 \
#     --endpoint-type completions --tokenizer TOKENIZER_DIR --request-count 16 --isl 256 --osl 32
set -euo pipefail
VENV=${1:-${PREFIXKV_BENCH_CLIENTS_VENV:-/tmp/benchclients}}
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q guidellm==0.8.1 aiperf==0.13.0
"$VENV/bin/guidellm" --help > /dev/null
"$VENV/bin/aiperf" --help > /dev/null
echo "bench clients installed in $VENV: $("$VENV/bin/pip" list 2>/dev/null | grep -Ei '^(guidellm|aiperf) ' | tr -s ' ' | paste -sd, -)"
echo "export PREFIXKV_BENCH_CLIENTS=$VENV/bin"
