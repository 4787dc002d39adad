"""Per-step structured-output overhead at a given batch size, on the engine's own path.

Each of B requests holds a JSON-Schema matcher walking a valid instance (requests
start at different offsets, so their states differ: inside keys, strings, numbers).
One step = what the engine does for B constrained rows: ``StructuredOutputBatch``
fills the host bitmask (xgrammar's batched fill) and applies it in place to a
``[B, vocab]`` float32 logits tensor on ``device``; then every matcher accepts its
next token. Reported per step (median over steps, milliseconds): fill, apply,
accept and their total. On a GPU, apply is measured to completion (synchronised),
which the engine itself never does.

Used by ``benchmarks/structured_mask_overhead.py`` and notebook 07.
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

import torch

from deepinfer.structured.batch import BitmaskBuffers, MaskStats, StructuredOutputBatch
from deepinfer.structured.matcher import RequestGrammar
from deepinfer.structured.spec import StructuredOutputSpec

__all__ = ["BENCH_SCHEMA", "mask_overhead"]

BENCH_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 10**6},
        "name": {"type": "string", "maxLength": 40},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"enum": ["alpha", "beta", "gamma"]}, "maxItems": 5},
        "score": {"type": "number", "minimum": 0, "maximum": 100},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string",
                                                                                           "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"]},
        "active": {"type": "boolean"},
    },
    "required": ["id", "name", "tags", "address", "active"],
}
_INSTANCES = [
    {"id": 17, "name": "Ada Lovelace", "email": "ada@example.com", "tags": ["alpha", "gamma"], "score": 99.5,
     "address": {"city": "London", "zip": "12345"}, "active": True},
    {"id": 904211, "name": "Grace Hopper of the U.S. Navy", "tags": [], "address": {"city": "Arlington, VA",
                                                                                    "zip": "22201"}, "active": False},
]


def _tokens(manager: Any) -> list[list[int]]:
    """Tokenizations of the instances in the grammar's layout (json.dumps separators)."""
    return [manager.tokenizer.encode(json.dumps(x, ensure_ascii=False), add_bos=False) for x in _INSTANCES]


def mask_overhead(manager: Any, batch_sizes: tuple[int, ...] = (1, 16, 64), steps: int = 40,
                  device: str = "cpu", spec: StructuredOutputSpec | None = None) -> list[dict[str, float]]:
    """Measure per-step ms at each batch size with ``manager`` (a StructuredOutputManager)."""
    spec = spec or StructuredOutputSpec("json", BENCH_SCHEMA)
    manager.pool.check(spec)
    t0 = time.perf_counter()
    compiled = manager.pool.submit(spec).result()
    compile_ms = 1e3 * (time.perf_counter() - t0)
    paths = _tokens(manager)
    dev = torch.device(device)
    rows: list[dict[str, float]] = []
    for b in batch_sizes:
        grammars = {f"r{i}": RequestGrammar(compiled) for i in range(b)}
        walks = [(paths[i % len(paths)], i % (len(paths[i % len(paths)]) - 1)) for i in range(b)]
        for g, (path, start) in zip(grammars.values(), walks):
            g.advance(path[:start])
        batch = StructuredOutputBatch(grammars, BitmaskBuffers(manager.vocab_size, dev, b), MaskStats())
        logits = torch.randn(b, manager.vocab_size, device=dev)
        ids = list(grammars)
        fills, applies, accepts = [], [], []
        for step in range(steps + 3):  # 3 warm-up steps
            for g, (path, _) in zip(grammars.values(), walks):
                if g.num_seen >= len(path):
                    g.rollback(g.num_seen)  # restart the walk (not timed)
            t0 = time.perf_counter()
            host, constrained = batch.fill(ids)
            t1 = time.perf_counter()
            batch.apply_mask(logits, host, constrained)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            t2 = time.perf_counter()
            for g, (path, _) in zip(grammars.values(), walks):
                g.accept(path[g.num_seen])
            t3 = time.perf_counter()
            if step >= 3:
                fills.append(t1 - t0)
                applies.append(t2 - t1)
                accepts.append(t3 - t2)
        med = {k: 1e3 * statistics.median(v) for k, v in (("fill_ms", fills), ("apply_ms", applies),
                                                           ("accept_ms", accepts))}
        rows.append({"batch": b, **med, "total_ms": sum(med.values()), "compile_ms": compile_ms,
                     "device": str(dev), "vocab": manager.vocab_size})
    return rows

