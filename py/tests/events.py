"""KV-event payloads as vLLM (>= 0.24, map-tagged events) publishes them, for the tests."""

from __future__ import annotations

from typing import Any

import msgpack

BLOCK = 16


def block_hashes(tokens: list[int], salt: int = 0) -> list[int]:
    """Engine block hashes for the full blocks of `tokens` (any consistent values do: the dual-key
    index learns engine key → request key from the events' token ids and parent hashes)."""
    out: list[int] = []
    h = 0x9E3779B97F4A7C15 ^ salt
    for i in range(len(tokens) // BLOCK):
        for t in tokens[i * BLOCK : (i + 1) * BLOCK]:
            h = (h * 0x100000001B3 ^ t) & 0x7FFF_FFFF_FFFF_FFFF
        out.append(h)
    return out


def stored(tokens: list[int], parent: int | None = None, salt: int = 0, medium: str = "GPU") -> dict[str, Any]:
    """One BlockStored event for the full blocks of `tokens`."""
    n = len(tokens) // BLOCK * BLOCK
    return {
        "type": "BlockStored",
        "block_hashes": block_hashes(tokens, salt),
        "parent_block_hash": parent,
        "token_ids": tokens[:n],
        "block_size": BLOCK,
        "lora_id": None,
        "medium": medium,
        "lora_name": None,
    }


def batch(*events: dict[str, Any], ts: float = 1.0, rank: int | None = 0) -> bytes:
    """A batch payload: `[ts, [events], data_parallel_rank]`."""
    payload = msgpack.packb([ts, list(events), rank])
    assert isinstance(payload, bytes)
    return payload


def token_body(tokens: list[int], max_tokens: int = 16) -> dict[str, Any]:
    """A completions body with a token-id prompt."""
    return {"model": "llama", "prompt": tokens, "max_tokens": max_tokens}
