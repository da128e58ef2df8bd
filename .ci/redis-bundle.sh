#!/usr/bin/env bash
# Bundle this machine's redis-server, with the shared libraries it needs beyond glibc, into
# one folder that runs on a host without Redis installed (the lent GPU machine):
#   bash .ci/redis-bundle.sh .redis      # then carry .redis; run .redis/redis-server
# `aiokv bench serve --redis-server .redis/redis-server` starts and stops it itself.
# The binary needs the glibc it was built against or newer (Debian 12's: 2.34).
set -euo pipefail
dest="${1:?usage: bash .ci/redis-bundle.sh DEST}"
src="$(command -v redis-server || true)"
if [ -z "$src" ]; then
  echo "redis-server is not installed here (bash .ci/redis.sh installs it)" >&2
  exit 1
fi
real="$(readlink -f "$src")"
mkdir -p "$dest/bin" "$dest/lib"
# Debian's redis-server is a link to redis-check-rdb, which acts by the name it is run as.
cp "$real" "$dest/bin/redis-server"
ldd "$real" | awk '/=> \// {print $3}' | while read -r lib; do
  case "$(basename "$lib")" in
    libc.so.*|libm.so.*|libpthread.so.*|libdl.so.*|librt.so.*|ld-linux*) ;;  # the host's own
    *) cp -L "$lib" "$dest/lib/" ;;
  esac
done
cat > "$dest/redis-server" <<'SH'
#!/bin/sh
here="$(cd "$(dirname "$0")" && pwd)"
LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$here/bin/redis-server" "$@"
SH
chmod +x "$dest/redis-server" "$dest/bin/redis-server"
"$dest/redis-server" --version
