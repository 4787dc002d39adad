"""Batched, batch-invariant token sampler.

Pipeline for one step (all rows at once, no per-row Python loop):

1. ``logits`` are cast to float32. Raw log-probs ``log_softmax(logits)`` are
   what :class:`SamplerOutput` reports (like vLLM: model log-probs, *before*
   temperature / top-k / top-p / min-p), also for greedy rows.
2. Greedy rows (``temperature < 1e-5``): ``argmax`` of the raw logits, ties go
   to the lowest token id.
3. Random rows: ``z = logits / temperature``; then, in this order, top-k (per
   row k, one stable descending sort shared with top-p), top-p (keep the
   smallest prefix of the sorted distribution whose mass reaches ``top_p``;
   the top token is always kept), min-p (drop tokens with
   ``p < min_p * p_max``, i.e. ``exp(z - z_max) < min_p``; ratio-based, so it
   is unaffected by the earlier masks). Filtered tokens get ``-inf``.
4. Draw with the exponential (Gumbel-max) trick using the counter-based RNG:
   ``token = argmax(z - log(E))``, ``E = -log(U)``,
   ``U = rng.uniform(seed, position, SAMPLE, V)``.

Every operation is elementwise or a reduction *within* a row, so a row's
token and log-prob are bitwise identical whether it is sampled alone or in any
batch, in any order; the noise depends only on ``(seq_seed, position)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from deepinfer.engine import rng
from deepinfer.engine.transfer import to_device
from deepinfer.models.invariant_ops import row_cumsum
from deepinfer.sampling_params import SamplingParams

__all__ = ["SamplingTensors", "SamplerOutput", "Sampler", "pack_greedy", "unpack_greedy"]


def pack_greedy(tok: torch.Tensor, lp: torch.Tensor) -> torch.Tensor:
    """Sampled tokens and their log-probs as one [R, 2] int64 tensor (token, the log-prob's
    float32 bits): one device -> host copy for a step's results."""
    return torch.stack([tok, lp.float().view(torch.int32).to(torch.int64)], dim=1)


def unpack_greedy(packed: torch.Tensor) -> tuple[list[int], list[float]]:
    """Host lists (tokens, log-probs) of a :func:`pack_greedy` tensor (on the host; numpy
    views: a torch op per field costs more host time than the whole conversion here)."""
    a = packed.numpy()
    return a[:, 0].tolist(), a[:, 1].astype(np.int32).view(np.float32).tolist()


@dataclass
class SamplingTensors:
    """Per-row sampling parameters of one batch, as device tensors.

    Attributes:
        temperature: float32 ``[R]``; 1.0 on greedy rows (never divides by ~0).
        top_k: int64 ``[R]``; -1 means disabled.
        top_p: float32 ``[R]``; 1.0 means disabled.
        min_p: float32 ``[R]``; 0.0 means disabled.
        seed: int64 ``[R]``; the ``seq_seed`` bits (uint64 stored as int64).
        position: int64 ``[R]``; position of the token being sampled (the index
            it will occupy in its sequence).
        greedy: bool ``[R]``; rows decoded with argmax.
        max_top_logprobs: host int, largest ``top_logprobs`` in the batch.
        all_greedy, any_top_k, any_top_p, any_min_p: host flags used to skip
            work that no row needs (skipping never changes any row's result).
        state_slots: int64 ``[R]`` the rows' state slots when asked for (the async
            token buffer's scatter index, carried in the same host -> device copy).
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    seed: torch.Tensor
    position: torch.Tensor
    greedy: torch.Tensor
    max_top_logprobs: int
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    state_slots: torch.Tensor | None = None

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], positions: Sequence[int],
                    device: torch.device | str | None = None,
                    state_slots: Sequence[int] | None = None) -> SamplingTensors:
        """Build the batch tensors from one ``SamplingParams`` and position per row
        (``state_slots``: one per row, returned as :attr:`state_slots`)."""
        if len(params) != len(positions):
            raise ValueError(f"params and positions must have equal length, got "
                             f"{len(params)} and {len(positions)}")
        if any(isinstance(p, bool) or not isinstance(p, int) or p < 0 for p in positions):
            raise ValueError(f"positions must be ints >= 0, got {list(positions)!r}")
        greedy = [p.is_greedy for p in params]
        assert all(p.seq_seed is not None for p in params)

        # ONE host -> device copy per step (not one per field): the float32 fields travel as
        # their int32 bit patterns in rows of the int64 tensor and are reinterpreted on the
        # device (one conversion kernel), views everywhere else (no host sync on CUDA)
        floats = np.array([[1.0 if g else p.temperature for p, g in zip(params, greedy)],
                           [p.top_p for p in params], [p.min_p for p in params]], dtype=np.float32)
        int_rows = [[p.top_k for p in params], [rng.seed_to_int64(p.seq_seed) for p in params],  # type: ignore[arg-type]
                    list(positions), greedy, *floats.view(np.int32).tolist()]
        if state_slots is not None:
            if len(state_slots) != len(params):
                raise ValueError(f"state_slots must have one entry per row, got {len(state_slots)} for {len(params)}")
            int_rows.append(list(state_slots))
        ints = to_device(int_rows, torch.int64, device)
        as_float = ints[4:7].to(torch.int32).view(torch.float32)
        return cls(
            temperature=as_float[0], top_k=ints[0], top_p=as_float[1], min_p=as_float[2], seed=ints[1],
            position=ints[2], greedy=ints[3] != 0,
            max_top_logprobs=max((p.top_logprobs for p in params), default=0),
            all_greedy=all(greedy),
            any_top_k=any(p.top_k != -1 and not g for p, g in zip(params, greedy)),
            any_top_p=any(p.top_p < 1.0 and not g for p, g in zip(params, greedy)),
            any_min_p=any(p.min_p > 0.0 and not g for p, g in zip(params, greedy)),
            state_slots=ints[7] if state_slots is not None else None,
        )

    @property
    def num_rows(self) -> int:
        """Number of rows R in the batch."""
        return int(self.temperature.shape[0])


@dataclass
class SamplerOutput:
    """Result of :meth:`Sampler.sample`.

    Attributes:
        token_ids: int64 ``[R]`` sampled tokens.
        logprobs: float32 ``[R]`` log-prob of each sampled token under the raw
            model distribution ``log_softmax(logits)`` (vLLM semantics).
        top_logprobs: ``(ids int64 [R, K], values float32 [R, K])`` of the K raw
            log-probs per row, K = ``max_top_logprobs`` of the batch, sorted
            descending (rows asking for fewer slice ``[:, :k]``); ``None`` when
            no row asks for any.
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    top_logprobs: tuple[torch.Tensor, torch.Tensor] | None


class Sampler:
    """Stateless batched sampler; see the module docstring for the pipeline.

    ``fused_reduce``: compute each row's argmax and log-sum-exp with one fused kernel
    (``deepinfer_kernels.argmax_lse``) instead of materialising ``log_softmax`` over the
    vocabulary, when no row asks for top log-probs. ``None`` (default): on CUDA logits
    (also in batch-invariant mode), when the kernels import. The kernel's reduction is per
    row with a fixed split, so outputs stay batch-invariant; its log-probs differ from
    ``log_softmax``'s by float32 rounding.
    """

    def __init__(self, fused_reduce: bool | None = None) -> None:
        self.fused_reduce = fused_reduce
        self._kernel = None

    def _row_reduce(self, raw: torch.Tensor):
        """The fused argmax / log-sum-exp function when this step may use it, else None."""
        use = self.fused_reduce
        if use is None:
            # in batch-invariant mode too: its per-row fixed split is what the decode graphs'
            # greedy lane reduces with, so a token's log-prob has one value whichever step ran it
            use = raw.is_cuda
        if not use:
            return None
        if self._kernel is None:
            try:
                from deepinfer_kernels.argmax_lse import argmax_logsumexp
            except Exception:  # no triton: the torch reductions
                if self.fused_reduce:
                    raise
                self.fused_reduce = False
                return None
            self._kernel = argmax_logsumexp
        return self._kernel

    def process_logits(self, logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
        """Temperature-scaled float32 logits with filtered tokens set to ``-inf``.

        ``softmax`` of the result is the distribution random rows sample from
        (useful for speculative verification). Greedy rows are scaled by 1.
        """
        z = logits.float() / params.temperature.unsqueeze(1)
        neg_inf = float("-inf")
        vocab = z.shape[1]
        if params.any_top_k or params.any_top_p:
            sorted_z, order = torch.sort(z, dim=-1, descending=True, stable=True)
            rank = torch.arange(vocab, device=z.device).unsqueeze(0)
            keep_sorted = torch.ones_like(sorted_z, dtype=torch.bool)
            if params.any_top_k:
                k = torch.where(params.top_k < 0, vocab, params.top_k.clamp(max=vocab))
                keep_sorted = rank < k.unsqueeze(1)
                sorted_z = sorted_z.masked_fill(~keep_sorted, neg_inf)
            if params.any_top_p:
                probs = torch.softmax(sorted_z, dim=-1)
                mass_before = torch.nn.functional.pad(row_cumsum(probs)[:, :-1], (1, 0))  # fixed order in the mode
                top_p = params.top_p.unsqueeze(1)
                keep_sorted = keep_sorted & ((mass_before < top_p) | (top_p >= 1.0))
            keep = torch.empty_like(keep_sorted).scatter_(1, order, keep_sorted)
            z = z.masked_fill(~keep, neg_inf)
        if params.any_min_p:
            z_max = z.max(dim=-1, keepdim=True).values
            z = z.masked_fill(torch.exp(z - z_max) < params.min_p.unsqueeze(1), neg_inf)
        return z

    def sample(self, logits: torch.Tensor, params: SamplingTensors,
               reduced: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> SamplerOutput:
        """Sample one token per row of ``logits`` (float ``[R, V]``). ``reduced``: the rows'
        (argmax, log-sum-exp, argmax log-prob) already computed from these logits (a decode
        graph's), used instead of reducing again when no row asks for top log-probs."""
        if logits.dim() != 2 or logits.shape[0] != params.num_rows:
            raise ValueError(f"logits must be [R={params.num_rows}, V], got {tuple(logits.shape)}")
        raw = logits.float()
        k = min(params.max_top_logprobs, raw.shape[1])
        fused = k == 0  # argmax + log-sum-exp per row, no [R, V] log-probs
        if fused and reduced is not None:  # a graph's outputs, which its next replay rewrites
            tokens, lse, greedy_lp = reduced
        elif fused and (reduce := self._row_reduce(raw)) is not None:
            tokens, lse, greedy_lp = reduce(raw.contiguous())
        else:
            fused = False
            raw_logprobs = torch.log_softmax(raw, dim=-1)
            tokens = raw.argmax(dim=-1)
        if not params.all_greedy:
            z = self.process_logits(raw, params)
            u = rng.uniform(params.seed, params.position, rng.SAMPLE, raw.shape[1])
            # E = -log(U) ~ Exp(1); argmax(z - log E) ~ softmax(z). U == 0 gives
            # E = inf, i.e. a score of -inf (never chosen), never NaN.
            sampled = (z - torch.log(-torch.log(u))).argmax(dim=-1)
            tokens = torch.where(params.greedy, tokens, sampled)
        if not fused:
            logprobs = raw_logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
        elif params.all_greedy:
            logprobs = greedy_lp
            if reduced is not None:
                tokens, logprobs = tokens.clone(), logprobs.clone()
        else:
            logprobs = raw.gather(1, tokens.unsqueeze(1)).squeeze(1) - lse
        top = None
        if k > 0:
            values, ids = torch.topk(raw_logprobs, k, dim=-1, largest=True, sorted=True)
            top = (ids, values)
        return SamplerOutput(token_ids=tokens, logprobs=logprobs, top_logprobs=top)
