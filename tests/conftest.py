"""Shared fixtures: fresh seeds (printed on failure), the repo on sys.path, and a
deterministic tie order for transformers' indexer top-k (see stable_topk)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Tiny models: one intra-op thread is far faster than two fighting over small ops.
torch.set_num_threads(1)


@pytest.fixture
def fresh_seed(request: pytest.FixtureRequest) -> int:
    """A new seed every run (override with DEEPINFER_TEST_SEED to replay a failure)."""
    seed = int(os.environ.get("DEEPINFER_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
    request.node.user_properties.append(("seed", seed))
    print(f"[seed] {request.node.name}: DEEPINFER_TEST_SEED={seed}")
    return seed


@pytest.fixture
def stable_topk(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers' indexer calls Tensor.topk, whose order among EXACTLY equal scores is
    unspecified (and differs between prefill shapes, so its own chunked and full prefill
    disagree). deepinfer breaks ties lowest-entry-first; pin the oracle to the same order.
    Only the order among equal values changes."""

    def topk(self: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True):
        values, indices = torch.sort(self, dim=dim, descending=largest, stable=True)
        return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))

    monkeypatch.setattr(torch.Tensor, "topk", topk)
