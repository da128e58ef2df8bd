#!/usr/bin/env bash
# CI: the Redis tier tests start real redis-server processes (standalone, a three-node
# cluster, TLS); install Debian's redis-server and redis-cli when they are missing.
set -euo pipefail
if command -v redis-server >/dev/null 2>&1 && command -v redis-cli >/dev/null 2>&1; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends redis-server redis-tools openssl
# The package may start a system service; the tests run their own servers on free ports.
if command -v service >/dev/null 2>&1; then $SUDO service redis-server stop >/dev/null 2>&1 || true; fi
redis-server --version
