#!/bin/bash
# Install the Rust routers prefixkv's router is compared with (docs/router.md, "Side by side with
# the Rust routers") into their own virtual environment, away from prefixkv's:
#   sglang-router 0.3.2 (SGLang Model Gateway) and vllm-router 0.1.17, prebuilt wheels from PyPI,
#   each a Python entry point around a Rust core.
# Usage: scripts/install-router-peers.sh [VENV]   (default /tmp/routerpeers/venv; also $ROUTER_PEERS_VENV)
# Then:  python -m prefixkv.bench.route.peers --routers prefixkv sglang vllm --peers-venv VENV
#        python -m prefixkv.bench.route.cost --peers sglang vllm --peers-venv VENV
set -euo pipefail
VENV=${1:-${ROUTER_PEERS_VENV:-/tmp/routerpeers/venv}}
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q sglang-router==0.3.2 vllm-router==0.1.17
"$VENV/bin/sglang-router" launch --help > /dev/null
"$VENV/bin/vllm-router" --help > /dev/null
echo "router peers installed in $VENV: $("$VENV/bin/pip" list 2>/dev/null | grep -Ei '^(sglang|vllm)-router' | tr -s ' ' | paste -sd, -)"
