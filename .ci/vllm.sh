#!/usr/bin/env bash
# CI: aiokv's vLLM plug-in tests, in a fresh venv of their own (vLLM 0.33 pins its own
# torch, which the main suite's torch must not be replaced by). aiokv goes in without its
# dependencies so vLLM's torch stays. pytest exit code 5 (nothing collected) fails here.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${AIOKV_VLLM_VENV:-${TMPDIR:-/tmp}/aiokv-ci-venv-vllm}"
rm -rf "$VENV"
python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q 'vllm>=0.33,<0.34'
"$VENV/bin/python" -m pip install -q --no-deps -e .
"$VENV/bin/python" -m pip install -q 'pytest>=8' 'pytest-asyncio>=0.24' 'pytest-timeout>=2.3'
set +e
"$VENV/bin/python" -m pytest -q tests/vllm
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "CI: the vLLM suite collected no tests; failing" >&2
  exit 1
fi
exit "$rc"
