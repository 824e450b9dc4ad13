#!/usr/bin/env bash
# Talk to a running `prefixkv serve` with curl: a completion sent twice (the second one reports
# cached prompt tokens), a streamed chat, the cache stats and the prefix-cache metrics.
#
#   prefixkv serve &                  # the built-in demo model (its text is meaningless)
#   examples/curl.sh                  # PREFIXKV_BASE_URL, PREFIXKV_MODEL, PREFIXKV_API_KEY optional
#
# Exits non-zero if the server is unreachable or answers with an error.
set -euo pipefail

URL="${PREFIXKV_BASE_URL:-http://127.0.0.1:8000}"
MODEL="${PREFIXKV_MODEL:-prefixkv-demo}"
AUTH=()
if [[ -n "${PREFIXKV_API_KEY:-}" ]]; then
  AUTH=(-H "Authorization: Bearer ${PREFIXKV_API_KEY}")
fi
post() { curl -sSf "${AUTH[@]}" -H 'Content-Type: application/json' "$URL$1" -d "$2"; }

SYSTEM="You are a helpful assistant. Answer in one short sentence. $(printf 'Rule %d: be brief. ' $(seq 1 20))"

echo "== models"
curl -sSf "${AUTH[@]}" "$URL/v1/models"
echo

echo "== completion (cold), then the same prompt again (warm: usage.prompt_tokens_details.cached_tokens > 0)"
BODY="{\"model\": \"$MODEL\", \"prompt\": \"$SYSTEM Question: what is 2+2?\", \"max_tokens\": 8, \"temperature\": 0}"
post /v1/completions "$BODY"
echo
WARM=$(post /v1/completions "$BODY")
echo "$WARM"
echo "$WARM" | grep -Eq '"cached_tokens":[1-9]' || { echo "expected cached_tokens > 0" >&2; exit 1; }

echo "== streamed chat completion (server-sent events), usage in the last chunk"
STREAM=$(post /v1/chat/completions "{
  \"model\": \"$MODEL\",
  \"messages\": [{\"role\": \"system\", \"content\": \"$SYSTEM\"},
                 {\"role\": \"user\", \"content\": \"Say hello.\"}],
  \"max_tokens\": 8, \"stream\": true, \"stream_options\": {\"include_usage\": true}
}")
echo "$STREAM"
echo "$STREAM" | grep -q '^data: \[DONE\]$' || { echo "stream did not end with [DONE]" >&2; exit 1; }

echo "== cache stats"
curl -sSf "${AUTH[@]}" "$URL/v1/cache/stats"
echo

echo "== prefix-cache metrics (tokens)"
curl -sSf "$URL/metrics" | grep -E '^prefixkv:prefix_cache_(queries|hits)_total'
