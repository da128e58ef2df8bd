"""Real redis-server processes for the Redis tier tests: one server, or a three-node cluster,
on free loopback ports, started by fixtures and stopped afterwards.

Tests skip with a reason when ``redis-server`` or the ``redis`` package is missing; CI
installs both (.ci/redis.sh, the ``test`` extra).
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

SERVER = shutil.which("redis-server")
CLI = shutil.which("redis-cli")
MISSING = (
    "redis-server/redis-cli are not installed (apt-get install redis-server redis-tools, "
    "or run .ci/redis.sh)" if SERVER is None or CLI is None else None
)


def need_redis() -> None:
    """Skip the calling test or fixture unless a real server and the client can run."""
    if MISSING:
        pytest.skip(MISSING)
    pytest.importorskip("redis", reason="the redis package is not installed: pip install -e '.[redis]'")


def free_port(*, bus: bool = False) -> int:
    """A loopback port free now (and, for cluster nodes, its bus port +10000 too)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not bus:
            return port
        if port + 10000 < 65536 and _free(port + 10000):
            return port
    raise RuntimeError("no free loopback port pair found")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class PortTaken(RuntimeError):
    """redis-server found its port bound by another process."""


class RedisServer:
    """One redis-server on 127.0.0.1:port, no persistence; ``kill`` and ``start`` again on
    the same port to test a lost and a returning server."""

    def __init__(self, workdir: Path, *, port: int | None = None, password: str | None = None,
                 tls: dict[str, Path] | None = None, args: tuple[str, ...] = ()) -> None:
        self.workdir = workdir
        self.bus = "--cluster-enabled" in args
        self.chosen = port is None  # a port taken meanwhile is chosen again at start
        self.port = port or free_port(bus=self.bus)
        self.password = password
        self.tls = tls
        self.args = args
        self.process: subprocess.Popen[bytes] | None = None
        workdir.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        if self.tls:
            return (f"rediss://{auth}127.0.0.1:{self.port}/0?ssl_ca_certs={self.tls['ca']}"
                    "&ssl_cert_reqs=required")
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        """Start it; a port of ours that another process bound since it was found free
        (the race every free-port pick has) is picked again, a few times."""
        for _ in range(4):
            try:
                self._start_once()
                break
            except PortTaken:
                if not self.chosen:
                    raise
                self.port = free_port(bus=self.bus)
        else:
            self._start_once()
        self.chosen = False  # clients know its URL now: a restart keeps the port
        return self

    def _start_once(self) -> None:
        cmd = [str(SERVER), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
               "--dir", str(self.workdir), "--logfile", str(self.workdir / "redis.log")]
        if self.tls:
            cmd += ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(self.tls["cert"]),
                    "--tls-key-file", str(self.tls["key"]), "--tls-ca-cert-file", str(self.tls["ca"]),
                    "--tls-auth-clients", "no"]
        else:
            cmd += ["--port", str(self.port)]
        if self.password:
            cmd += ["--requirepass", self.password]
        self.process = subprocess.Popen(cmd + list(self.args), stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while self.cli("PING") != "PONG":
            if self.process.poll() is not None or time.monotonic() > deadline:
                log = (self.workdir / "redis.log").read_text(errors="replace")[-2000:]
                self.stop()
                error = PortTaken if "Address already in use" in log else RuntimeError
                raise error(f"redis-server on port {self.port} did not start:\n{log}")
            time.sleep(0.02)

    def cli(self, *command: str) -> str:
        """Run one redis-cli command against this server; its output, stripped."""
        cmd = [str(CLI), "-h", "127.0.0.1", "-p", str(self.port)]
        if self.password:
            cmd += ["--no-auth-warning", "-a", self.password]
        if self.tls:
            cmd += ["--tls", "--cacert", str(self.tls["ca"])]
        done = subprocess.run(cmd + list(command), capture_output=True, timeout=10)
        return done.stdout.decode(errors="replace").strip()

    def kill(self) -> None:
        """SIGKILL, as a crash would; the port is free again once this returns."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
        self.process = None

    stop = kill


class RedisCluster:
    """Three masters on loopback, no replicas, every slot assigned."""

    def __init__(self, workdir: Path) -> None:
        self.nodes = [
            RedisServer(workdir / f"node{i}",
                        args=("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                              "--cluster-node-timeout", "2000"))
            for i in range(3)
        ]

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def start(self) -> RedisCluster:
        for node in self.nodes:
            node.start()
        addresses = [f"127.0.0.1:{n.port}" for n in self.nodes]
        done = subprocess.run([str(CLI), "--cluster", "create", *addresses, "--cluster-replicas", "0",
                               "--cluster-yes"], capture_output=True, timeout=30)
        if done.returncode != 0:
            self.stop()
            raise RuntimeError(f"redis-cli --cluster create failed: {done.stdout!r} {done.stderr!r}")
        deadline = time.monotonic() + 20
        while not all("cluster_state:ok" in n.cli("CLUSTER", "INFO") for n in self.nodes):
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the cluster never reached cluster_state:ok")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


def make_tls_files(workdir: Path) -> dict[str, Path] | None:
    """A self-signed CA and a server certificate for 127.0.0.1 (None without openssl)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        return None
    workdir.mkdir(parents=True, exist_ok=True)
    ca, ca_key = workdir / "ca.crt", workdir / "ca.key"
    cert, key, csr = workdir / "server.crt", workdir / "server.key", workdir / "server.csr"
    ext = workdir / "ext.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1\n")
    steps = [
        [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
         "/CN=aiokv-test-ca", "-keyout", str(ca_key), "-out", str(ca)],
        [openssl, "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
         "-keyout", str(key), "-out", str(csr)],
        [openssl, "x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key),
         "-CAcreateserial", "-days", "2", "-extfile", str(ext), "-out", str(cert)],
    ]
    for step in steps:
        if subprocess.run(step, capture_output=True, timeout=60).returncode != 0:
            return None
    return {"ca": ca, "cert": cert, "key": key}


@contextlib.contextmanager
def running(server: RedisServer | RedisCluster) -> Iterator[RedisServer | RedisCluster]:
    """Start, yield, always stop."""
    server.start()
    try:
        yield server
    finally:
        server.stop()
