"""Shared fixtures: the repository's fixture files, small routers and a NATS server."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import kvroute

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "fixtures"

#: Two decode endpoints with fresh metrics at NOW.
NOW = 1_000
EP1 = "10.0.0.1:8000"
EP2 = "10.0.0.2:8000"


@pytest.fixture
def router() -> kvroute.Router:
    r = kvroute.Router()
    for ep in (EP1, EP2):
        r.upsert_endpoint(ep, "decode")
        r.update_metrics(ep, waiting=0, running=0, kv_usage=0.1, now=NOW)
    return r


def chat(system: str, user: str = "hi", max_tokens: int = 64) -> dict[str, object]:
    """An OpenAI chat body."""
    return {
        "model": "llama",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": max_tokens,
    }


# ----------------------------------------------------------------------------------------------
# NATS (router replicas)
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Nats:
    """A running nats-server: its client URL and the token it requires."""

    url: str
    token: str


def free_port() -> int:
    """A loopback TCP port free now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture(scope="session")
def nats(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Nats]:
    """Debian's nats-server on a free loopback port: JetStream on, its storage in a temporary
    directory, token authentication; killed (and its storage removed) at teardown."""
    binary = shutil.which("nats-server") or shutil.which("nats-server", path="/usr/sbin:/usr/bin:/usr/local/bin")
    if binary is None:
        pytest.fail("nats-server is not installed: apt-get install nats-server (scripts/test.sh installs it)")
    store = tmp_path_factory.mktemp("nats")
    port = free_port()
    token = f"py-test-{port}"
    cmd = [binary, "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(store), "--auth", token]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"nats-server did not listen on 127.0.0.1:{port} within 20 s (exit code {proc.poll()})")
                time.sleep(0.02)
        yield Nats(url=f"nats://127.0.0.1:{port}", token=token)
    finally:
        proc.kill()
        proc.wait(timeout=10)
        shutil.rmtree(store, ignore_errors=True)
