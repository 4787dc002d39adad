"""router kernel vs the model's Gate math (interpreter on CPU)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from kernel_testutil import DEVICE, assert_close, gen  # noqa: E402

from deepinfer_kernels.router import router, router_ref  # noqa: E402


def _by_id(w: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots sorted by expert id (the reference's topk order is unspecified)."""
    order = ids.argsort(dim=-1)
    return w.gather(1, order), ids.gather(1, order)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n_experts,top_k", [(16, 2), (64, 6), (40, 8)])
@pytest.mark.parametrize("func", ["sqrtsoftplus", "sigmoid"])
def test_router_topk(fresh_seed: int, dtype: torch.dtype, n_experts: int, top_k: int, func: str) -> None:
    g = gen(fresh_seed)
    logits = (torch.randn(19, n_experts, generator=g) * 4).to(dtype).to(DEVICE)
    bias = (torch.randn(n_experts, generator=g) * 0.1).to(DEVICE)
    w, ids = router(logits, bias, top_k, route_scale=1.5, func=func)
    w_ref, ids_ref = router_ref(logits, bias, top_k, route_scale=1.5, func=func)
    assert w.dtype == dtype and ids.dtype == torch.int32
    w, ids = _by_id(w, ids)
    w_ref, ids_ref = _by_id(w_ref, ids_ref)
    assert torch.equal(ids, ids_ref)
    assert_close(w, w_ref, dtype)


def test_router_order_and_ties(fresh_seed: int) -> None:
    """Slots come in descending score order; exact ties go to the lowest expert id."""
    g = gen(fresh_seed)
    logits = torch.randn(8, 32, generator=g).to(DEVICE)
    logits[:, 5] = logits[:, 20] = logits[:, 9] = 10.0  # a three-way tie at the top
    w, ids = router(logits, None, 4, normalize=False)
    assert torch.equal(ids[:, :3].cpu(), torch.tensor([5, 9, 20], dtype=torch.int32).expand(8, 3))
    biased = torch.nn.functional.softplus(logits).sqrt()
    stable = torch.sort(biased.cpu(), dim=-1, descending=True, stable=True).indices[:, :4]
    assert torch.equal(ids.cpu().long(), stable)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_router_hash(fresh_seed: int, dtype: torch.dtype) -> None:
    g = gen(fresh_seed)
    vocab, n_experts, k = 50, 24, 6
    tid2eid = torch.stack([torch.randperm(n_experts, generator=g)[:k] for _ in range(vocab)]).to(DEVICE)
    input_ids = torch.randint(0, vocab, (13,), generator=g).to(DEVICE)
    logits = (torch.randn(13, n_experts, generator=g) * 3).to(dtype).to(DEVICE)
    w, ids = router(logits, None, k, 1.5, tid2eid=tid2eid, input_ids=input_ids)
    w_ref, ids_ref = router_ref(logits, None, k, 1.5, tid2eid=tid2eid, input_ids=input_ids)
    assert torch.equal(ids, ids_ref)  # table order is kept
    assert_close(w, w_ref, dtype)


@pytest.mark.parametrize("hashed", [False, True])
def test_router_extra_shared_slot(fresh_seed: int, hashed: bool) -> None:
    """extra_id appends the shared expert (weight 1) after the routed slots, which are unchanged."""
    g = gen(fresh_seed)
    vocab, n_experts, k, t = 30, 16, 4, 9
    logits = (torch.randn(t, n_experts, generator=g) * 3).to(torch.bfloat16).to(DEVICE)
    kw = {}
    if hashed:
        kw = dict(tid2eid=torch.stack([torch.randperm(n_experts, generator=g)[:k] for _ in range(vocab)]).to(DEVICE),
                  input_ids=torch.randint(0, vocab, (t,), generator=g).to(DEVICE))
    bias = None if hashed else (torch.randn(n_experts, generator=g) * 0.1).to(DEVICE)
    w, ids = router(logits, bias, k, 1.5, extra_id=n_experts, **kw)
    w0, ids0 = router(logits, bias, k, 1.5, **kw)
    w_ref, ids_ref = router_ref(logits, bias, k, 1.5, extra_id=n_experts, **kw)
    assert w.shape == ids.shape == (t, k + 1)
    assert torch.equal(ids[:, :k], ids0) and torch.equal(w[:, :k], w0)
    assert (ids[:, k] == n_experts).all() and (w[:, k] == 1).all()
    assert torch.equal(_by_id(w_ref, ids_ref)[1], _by_id(w, ids)[1])
