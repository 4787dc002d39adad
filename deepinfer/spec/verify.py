"""Lossless verification of draft tokens (speculative rejection sampling).

Layout: request ``i`` owns ``k_i + 1`` consecutive rows of ``logits``: row ``j < k_i`` is
the target's distribution for the slot of draft ``j`` (``draft_ids[row]``), row ``k_i``
the one after the last draft (bonus). Per request, in order:

* draft ``j`` is accepted iff ``U < min(1, p(d) / q(d))`` with ``U`` drawn from the
  counter RNG keyed ``(seq_seed, position, ACCEPT)``; ``p`` is the target distribution
  after temperature / top-k / top-p / min-p (``Sampler.process_logits``), ``q`` the
  draft's (one-hot when the drafter is deterministic, ``draft_probs=None``);
* at the first rejected row the token is drawn from ``max(p - q, 0)`` renormalised with
  ``(seq_seed, position, RESIDUAL)`` noise;
* when every draft is accepted the bonus row draws a fresh target sample exactly as
  the regular sampler does (``(seq_seed, position, SAMPLE)``), so a step with 0 drafts
  is bit-for-bit the non-speculative step.

Greedy rows are the special case: accept iff ``d == argmax(logits)``, and the token
emitted at the first mismatch is that argmax. Every draw is a pure function of
``(seed, position, case)``: results do not depend on the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from deepinfer.engine import rng
from deepinfer.engine.sampler import Sampler, SamplingTensors, unpack_greedy

#: Acceptance rule. "standard" is the lossless one; "ignore_q" (accept with p(d)) is a
#: deliberately BROKEN rule that the statistical test must reject (see tests/test_spec_stats.py).
ACCEPT_RULES = ("standard", "ignore_q")


@dataclass
class VerifyResult:
    """Per request: emitted tokens (accepted drafts + one target token), how many drafts
    were accepted, and the raw-model logprob of each emitted token."""

    tokens: list[list[int]]
    num_accepted: list[int]
    logprobs: list[list[float]]
    rows: list[list[int]]  # the logits row each emitted token came from


def rejection_sample(logits: torch.Tensor, params: SamplingTensors, num_drafts: list[int],
                     draft_ids: torch.Tensor, draft_probs: torch.Tensor | None = None,
                     sampler: Sampler | None = None, rule: str = "standard") -> VerifyResult:
    """Verify drafts of several requests in one batched pass (see module docstring).

    Args:
        logits: float [M, V], M = sum(k_i + 1).
        params: per-row sampling tensors; ``position[row]`` = index the row's token occupies.
        num_drafts: k_i per request.
        draft_ids: int64 [M]; the draft in each draft row (anything, e.g. -1, in bonus rows).
        draft_probs: float [M, V] draft distributions q per row (bonus rows ignored), or
            None when drafts are deterministic (q = one-hot at the draft).
        rule: "standard" or a deliberately broken rule for tests.
    """
    if rule not in ACCEPT_RULES:
        raise ValueError(f"rule must be one of {ACCEPT_RULES}, got {rule!r}")
    sampler = sampler or Sampler()
    M, V = logits.shape
    if sum(k + 1 for k in num_drafts) != M:
        raise ValueError(f"logits has {M} rows, num_drafts {num_drafts} needs {sum(k + 1 for k in num_drafts)}")
    raw = logits.float()
    fresh = sampler.sample(raw, params)  # bonus rows: the regular target sample
    greedy_tok = raw.argmax(dim=-1)
    d = draft_ids.clamp(0, V - 1).unsqueeze(1)
    accept = d.squeeze(1) == greedy_tok
    residual_tok = greedy_tok
    if not params.all_greedy:
        p = torch.softmax(sampler.process_logits(raw, params), dim=-1)
        pd = p.gather(1, d).squeeze(1)
        if draft_probs is None:
            qd = torch.ones_like(pd)
            resid = p.scatter(1, d, 0.0)
        else:
            q = torch.nan_to_num(draft_probs.float(), nan=0.0)
            qd = q.gather(1, d).squeeze(1)
            resid = (p - q).clamp(min=0.0)
        ratio = torch.where(qd > 0, pd / qd.clamp(min=1e-30), (pd > 0).float())
        if rule == "ignore_q":
            ratio = pd
        u = rng.uniform(params.seed, params.position, rng.ACCEPT, 1)[:, 0]
        accept_rand = u < ratio  # U in [0, 1): ratio >= 1 always accepts
        mass = resid.sum(dim=-1, keepdim=True)
        resid = torch.where(mass > 0, resid / mass.clamp(min=1e-30), p)  # p == q exactly: never rejects
        ur = rng.uniform(params.seed, params.position, rng.RESIDUAL, V)
        res = (torch.log(resid) - torch.log(-torch.log(ur))).argmax(dim=-1)
        accept = torch.where(params.greedy, accept, accept_rand)
        residual_tok = torch.where(params.greedy, greedy_tok, res)
    raw_lp = torch.log_softmax(raw, dim=-1)
    acc, res_l, fresh_l = accept.tolist(), residual_tok.tolist(), fresh.token_ids.tolist()
    drafts = draft_ids.tolist()
    out = VerifyResult([], [], [], [])
    base = 0
    lp_rows, lp_toks = [], []
    for k in num_drafts:
        a = 0
        while a < k and acc[base + a]:
            a += 1
        toks = drafts[base: base + a] + [res_l[base + a] if a < k else fresh_l[base + k]]
        rows = list(range(base, base + a + 1))
        out.tokens.append(toks)
        out.num_accepted.append(a)
        out.rows.append(rows)
        lp_rows += rows
        lp_toks += toks
        base += k + 1
    lps = raw_lp[torch.tensor(lp_rows, device=raw.device), torch.tensor(lp_toks, device=raw.device)].tolist()
    i = 0
    for toks in out.tokens:
        out.logprobs.append(lps[i: i + len(toks)])
        i += len(toks)
    return out


@dataclass
class DeviceVerify:
    """The verify step's results on the device, padded per request to ``K + 1`` slots
    (K = the step's largest draft count): ``packed`` int64 [B, 2 (K + 1) + 1] holds, per
    request, the accepted count, the emitted tokens (-1 past the last) and the float32
    bits of their raw-model log-probs, so the host needs one small copy per step.
    ``rows`` [B, K + 1]: the logits row of each slot (the last valid row repeated past the
    emitted ones); ``tokens`` / ``num_accepted``: views of ``packed``."""

    packed: torch.Tensor
    rows: torch.Tensor
    num_drafts: list[int]

    @property
    def width(self) -> int:
        return (self.packed.shape[1] - 1) // 2

    @property
    def num_accepted(self) -> torch.Tensor:
        return self.packed[:, 0]

    @property
    def tokens(self) -> torch.Tensor:
        return self.packed[:, 1:1 + self.width]

    def to_result(self, host_packed: torch.Tensor | None = None) -> VerifyResult:
        """Host lists of ``packed`` (already copied: ``host_packed``; else copied here)."""
        h = (self.packed if host_packed is None else host_packed).cpu()
        w = self.width
        acc = h[:, 0].tolist()
        toks = h[:, 1:1 + w].tolist()
        lps = h[:, 1 + w:].to(torch.int32).view(torch.float32).tolist()
        out = VerifyResult([], [], [], [])
        base = 0
        for b, k in enumerate(self.num_drafts):
            a = acc[b]
            out.tokens.append(toks[b][:a + 1])
            out.num_accepted.append(a)
            out.logprobs.append(lps[b][:a + 1])
            out.rows.append(list(range(base, base + a + 1)))
            base += k + 1
        return out


def verify_layout(num_drafts: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Device index tensors of the padded layout: ``slot_row`` [B, K + 1] (row of slot j
    of request b: base_b + min(j, k_b)) and ``is_draft`` [B, K + 1] (j < k_b), built from
    the host list in one host -> device copy."""
    ks = np.asarray(num_drafts, dtype=np.int64)
    width = int(ks.max(initial=0)) + 1
    base = np.concatenate([[0], np.cumsum(ks + 1)[:-1]]).astype(np.int64)
    j = np.arange(width, dtype=np.int64)[None, :]
    slot_row = base[:, None] + np.minimum(j, ks[:, None])
    is_draft = (j < ks[:, None]).astype(np.int64)
    both = torch.from_numpy(np.stack([slot_row, is_draft]))
    both = both.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else both.to(device)
    return both[0], both[1].bool()


def rejection_sample_device(logits: torch.Tensor, params: SamplingTensors, num_drafts: list[int],
                            draft_ids: torch.Tensor, draft_probs: torch.Tensor | None = None,
                            sampler: Sampler | None = None, rule: str = "standard",
                            raw_logprobs: torch.Tensor | None = None) -> DeviceVerify:
    """:func:`rejection_sample` without leaving the device: the same draws (so the same
    tokens and counts, bit for bit), the accepted run per request found with a cumulative
    product over its padded slots instead of a host loop. Arguments as there;
    ``raw_logprobs``: ``log_softmax(logits)`` when the caller has it (top log-probs).
    Where the sampler reduces rows with its fused kernel (CUDA), the argmax and the
    log-probs come from it, as in a non-speculative decode step (the host reference's
    ``argmax`` / ``log_softmax`` may then differ by a tie / float32 rounding)."""
    if rule not in ACCEPT_RULES:
        raise ValueError(f"rule must be one of {ACCEPT_RULES}, got {rule!r}")
    sampler = sampler or Sampler()
    M, V = logits.shape
    if sum(k + 1 for k in num_drafts) != M:
        raise ValueError(f"logits has {M} rows, num_drafts {num_drafts} needs {sum(k + 1 for k in num_drafts)}")
    raw = logits.float()
    # on CUDA the sampler's fused argmax / log-sum-exp: the kernel a decode step's greedy
    # lane reduces with, so ties break and log-probs round as they do without speculation
    reduce = sampler._row_reduce(raw) if raw_logprobs is None else None
    lse = None
    if reduce is not None:
        greedy_tok, lse, _ = reduce(raw.contiguous())
    else:
        greedy_tok = raw.argmax(dim=-1)
    d = draft_ids.clamp(0, V - 1)
    accept = d == greedy_tok
    slot_row, is_draft = verify_layout(num_drafts, raw.device)
    # the token a slot emits when it is the request's first unaccepted one: a draft slot's
    # residual sample, the bonus slot's fresh target sample
    final = greedy_tok[slot_row]
    if not params.all_greedy:
        fresh = sampler.sample(raw, params).token_ids
        p = torch.softmax(sampler.process_logits(raw, params), dim=-1)
        pd = p.gather(1, d.unsqueeze(1)).squeeze(1)
        if draft_probs is None:
            qd = torch.ones_like(pd)
            resid = p.scatter(1, d.unsqueeze(1), 0.0)
        else:
            q = torch.nan_to_num(draft_probs.float(), nan=0.0)
            qd = q.gather(1, d.unsqueeze(1)).squeeze(1)
            resid = (p - q).clamp(min=0.0)
        ratio = torch.where(qd > 0, pd / qd.clamp(min=1e-30), (pd > 0).float())
        if rule == "ignore_q":
            ratio = pd
        u = rng.uniform(params.seed, params.position, rng.ACCEPT, 1)[:, 0]
        mass = resid.sum(dim=-1, keepdim=True)
        resid = torch.where(mass > 0, resid / mass.clamp(min=1e-30), p)
        ur = rng.uniform(params.seed, params.position, rng.RESIDUAL, V)
        res = (torch.log(resid) - torch.log(-torch.log(ur))).argmax(dim=-1)
        accept = torch.where(params.greedy, accept, u < ratio)
        residual_tok = torch.where(params.greedy, greedy_tok, res)
        final = torch.where(is_draft, residual_tok[slot_row], fresh[slot_row])
    acc = accept[slot_row] & is_draft  # [B, K + 1]; the bonus slot never "accepts"
    n_acc = acc.long().cumprod(dim=1).sum(dim=1)  # the leading run of accepted drafts
    j = torch.arange(slot_row.shape[1], device=raw.device).unsqueeze(0)
    a = n_acc.unsqueeze(1)
    tok = torch.where(j < a, d[slot_row], final)
    tok = torch.where(j <= a, tok, torch.full_like(tok, -1))
    if lse is not None:
        lp = raw[slot_row, tok.clamp(min=0)] - lse[slot_row]
    else:
        lp_all = torch.log_softmax(raw, dim=-1) if raw_logprobs is None else raw_logprobs
        lp = lp_all[slot_row, tok.clamp(min=0)]
    packed = torch.cat([n_acc.unsqueeze(1), tok, lp.float().view(torch.int32).to(torch.int64)], dim=1)
    rows = torch.where(j <= a, slot_row, slot_row.gather(1, a))
    return DeviceVerify(packed, rows, list(num_drafts))


def drafts_to_verify(num_drafts: int, num_valid: int, deterministic: bool) -> int:
    """How many of a request's ``num_drafts`` drafts to verify when only the first
    ``num_valid`` are allowed by its grammar (structured output).

    The first rejected draft is dropped when the proposal is deterministic (q one-hot:
    the mask gives it p = 0, so the residual max(p - q, 0) is p itself and the fresh
    target sample at that position has the residual's distribution) and verified
    otherwise: the mask makes its p zero, so it is rejected and the token is drawn from
    max(p - q, 0), exactly as in standard rejection sampling. Dropping a sampled draft
    instead would bias the output, because the cut would depend on the draft itself
    (tests/test_spec_stats.py checks both)."""
    if not 0 <= num_valid <= num_drafts:
        raise ValueError(f"num_valid={num_valid} must be in [0, num_drafts={num_drafts}]")
    if num_valid == num_drafts or deterministic:
        return num_valid
    return num_valid + 1


def sample_draft(logits: torch.Tensor, params: SamplingTensors, sampler: Sampler | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draw draft tokens from drafter logits [R, V] with the request's sampling settings and
    the DRAFT stream (seed + DRAFT_SEED_OFFSET, position, SAMPLE). Returns (tokens [R],
    q [R, V] or None when every row is greedy). Greedy rows take the argmax, q = one-hot."""
    sampler = sampler or Sampler()
    raw = torch.nan_to_num(logits.float(), nan=0.0, posinf=0.0, neginf=-1e30)
    tokens = raw.argmax(dim=-1)
    if params.all_greedy:
        return tokens, None
    z = sampler.process_logits(raw, params)
    q = torch.softmax(z, dim=-1)
    u = rng.uniform(rng.draft_seed(params.seed), params.position, rng.SAMPLE, raw.shape[1])
    sampled = (z - torch.log(-torch.log(u))).argmax(dim=-1)
    tokens = torch.where(params.greedy, tokens, sampled)
    onehot = torch.nn.functional.one_hot(tokens, raw.shape[1]).to(q.dtype)
    q = torch.where(params.greedy.unsqueeze(1), onehot, q)
    return tokens, q


def greedy_verify_result(host: torch.Tensor, offsets: list[int], num_drafts: list[int], rows: int) -> VerifyResult:
    """Host lists of ``deepinfer_kernels.spec_lane.greedy_verify``'s copy (the verify
    graphs' greedy lane; its accepted runs are :func:`rejection_sample`'s for greedy rows)
    for the requests whose groups start at ``offsets`` with ``num_drafts`` drafts each
    (``rows``: the step's padded row count R)."""
    toks, lps = unpack_greedy(host[:2 * rows].view(rows, 2))
    first = host[2 * rows:].numpy().tolist()
    out = VerifyResult([], [], [], [])
    for g, (start, k) in enumerate(zip(offsets, num_drafts)):
        a = min(first[g] - start, k)
        out.tokens.append(toks[start:start + a + 1])
        out.num_accepted.append(a)
        out.logprobs.append(lps[start:start + a + 1])
        out.rows.append(list(range(start, start + a + 1)))
    return out
