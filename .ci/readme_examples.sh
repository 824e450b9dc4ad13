#!/usr/bin/env bash
# Start the README's server and run, against it: examples/curl.sh, examples/openai_client.py,
# and the README's own curl and openai-client blocks (the offline Python blocks run in pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
# a free loopback port; the README's blocks say 8000 and are pointed at this one
PORT="${PREFIXKV_EXAMPLE_PORT:-$(python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}"
export PREFIXKV_BASE_URL="http://127.0.0.1:${PORT}"
LOG="$(mktemp)"
prefixkv serve --host 127.0.0.1 --port "$PORT" > "$LOG" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 1 180); do
  curl -sf "$PREFIXKV_BASE_URL/health" > /dev/null && break
  kill -0 $SERVER 2>/dev/null || { cat "$LOG"; exit 1; }
  sleep 1
done
curl -sf "$PREFIXKV_BASE_URL/health" > /dev/null || { echo "server did not start"; cat "$LOG"; exit 1; }
bash examples/curl.sh > /dev/null
python examples/openai_client.py
PORT="$PORT" python - <<'PY'
import os, re, subprocess
text = open("README.md").read().replace("127.0.0.1:8000", "127.0.0.1:" + os.environ["PORT"])
for lang, code in re.findall(r"```(bash|python)\n(.*?)```", text, flags=re.S):
    if lang == "bash" and "curl" in code:
        subprocess.run(["bash", "-euo", "pipefail", "-c", code], check=True, stdout=subprocess.DEVNULL)
    elif lang == "python" and "openai" in code:
        exec(compile(code, "README.md", "exec"), {"__name__": "readme"})
print("README server examples: ok")
PY
echo "readme examples: ok"
