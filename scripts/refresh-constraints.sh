#!/usr/bin/env bash
# Refresh constraints.txt on purpose: resolve the README's test install in a fresh venv with no
# lock (today's newest releases), run the canary tests that caught past breakages (the
# schemathesis plugin against pytest, the real-client and README checks), and only if they
# pass write the new lock. Review `git diff constraints.txt` before committing it.
#   bash scripts/refresh-constraints.sh [VENV_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-$(mktemp -d)/venv}"
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
# -c /dev/null: ignore any constraint file pip's own configuration names
"$VENV/bin/pip" install -q -c /dev/null torch==2.13.0 -e ".[test]"
"$VENV/bin/python" -m pytest -o addopts="" -q -x \
  tests/server/test_server_fuzz.py tests/test_readme.py tests/test_constraints.py
{
  sed -n '/^#/p' constraints.txt
  "$VENV/bin/pip" freeze --exclude-editable | grep -viE '^(torch|nvidia-|triton|pip|setuptools|wheel)==' | grep -v '^#'
} > constraints.txt.new
mv constraints.txt.new constraints.txt
echo "constraints.txt refreshed from $VENV; review: git diff constraints.txt"
