#!/usr/bin/env bash
# CI: aiokv's vLLM plug-in tests under every supported vLLM release, each in a fresh venv of
# its own (vLLM pins its own torch, which the main suite's torch must not be replaced by).
#
#   bash .ci/vllm.sh [VERSION ...]      default: 0.33.0 0.34.0
#
# vLLM goes in without its dependencies, then its requirements minus the pins this package
# index lacks (SUBSTITUTE below: GPU kernel libraries the CPU tests never load), then aiokv
# without its dependencies so vLLM's torch stays. pytest exit code 5 (nothing collected)
# fails here. AIOKV_VLLM_REUSE=1 keeps a venv that already holds the right vLLM.
set -euo pipefail
cd "$(dirname "$0")/.."
PREFIX="${AIOKV_VLLM_VENV:-${TMPDIR:-/tmp}/aiokv-ci-venv-vllm}"
if [ "$#" -eq 0 ]; then
  set -- 0.33.0 0.34.0
fi

# Requirements left out per release, with the reason (docs: CONTRIBUTING.md, "vLLM").
substitute() {
  case "$1" in
    0.34.*) echo "flashinfer-python" ;;  # pins 0.7.3, absent from the index; GPU kernels only
    *) echo "" ;;
  esac
}

build() {
  local version=$1 venv=$2 skip reqs
  if [ "${AIOKV_VLLM_REUSE:-0}" = 1 ] && [ -x "$venv/bin/python" ] &&
    [ "$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm"))' 2>/dev/null)" = "$version" ]; then
    "$venv/bin/python" -m pip install -q --no-deps -e .
    return
  fi
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --no-deps "vllm==$version"
  skip=$(substitute "$version")
  reqs="$venv/vllm-requirements.txt"
  # vLLM's own requirements (markers kept, extras dropped), minus the substituted ones.
  "$venv/bin/python" - "$skip" >"$reqs" <<'EOF'
import importlib.metadata as md
import re
import sys

skip = {s.lower() for s in sys.argv[1].split()}
for req in md.requires("vllm") or []:
    if "extra ==" in req:
        continue
    name = re.match(r"[A-Za-z0-9_.\-]+", req).group(0).lower().replace("_", "-")
    if name not in skip:
        print(req)
EOF
  if [ -n "$skip" ]; then
    echo "CI: vLLM $version installed without: $skip (pip's resolver may say it is missing)"
  fi
  "$venv/bin/python" -m pip install -q -r "$reqs"
  "$venv/bin/python" -m pip install -q --no-deps -e .
  # The test tools, and the redis extra: the tier tests run a Redis tier against a real
  # redis-server (they skip, saying why, where redis-server is missing).
  "$venv/bin/python" -m pip install -q 'pytest>=8' 'pytest-asyncio>=0.24' 'pytest-timeout>=2.3' \
    'redis[hiredis]>=6.0' 'isal>=1.6'
}

status=0
for version in "$@"; do
  venv="$PREFIX-$version"
  start=$SECONDS
  build "$version" "$venv"
  echo "CI: vLLM $version venv ready after $((SECONDS - start)) s ($venv)"
  start=$SECONDS
  set +e
  "$venv/bin/python" -m pytest -q tests/vllm
  rc=$?
  set -e
  echo "CI: vLLM $version tests took $((SECONDS - start)) s (exit $rc)"
  if [ "$rc" -eq 5 ]; then
    echo "CI: the vLLM $version suite collected no tests; failing" >&2
    rc=1
  fi
  if [ "$rc" -ne 0 ]; then
    status=$rc
  fi
done
exit "$status"
