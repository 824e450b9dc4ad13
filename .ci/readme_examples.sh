#!/usr/bin/env bash
# Start the README's server, run the README's curl and openai-client examples against it.
set -euo pipefail
cd "$(dirname "$0")/.."
PORT="${PREFIXKV_EXAMPLE_PORT:-18931}"
export PREFIXKV_BASE_URL="http://127.0.0.1:${PORT}"
if [ ! -f examples/curl.sh ]; then
  echo "readme examples: examples/ not present yet, skipped"; exit 0
fi
prefixkv serve --host 127.0.0.1 --port "$PORT" > /tmp/prefixkv-example-server.log 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 1 120); do
  curl -sf "$PREFIXKV_BASE_URL/health" > /dev/null && break
  kill -0 $SERVER 2>/dev/null || { cat /tmp/prefixkv-example-server.log; exit 1; }
  sleep 1
done
bash examples/curl.sh
python examples/openai_client.py
echo "readme examples: ok"
