"""Shared fixtures: the repository's fixture files and small routers."""

from __future__ import annotations

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
