"""Pre-queue admission: one validation pass over a whole ``generate`` call.

``admit_generate`` checks every prompt and every ``SamplingParams`` of a call against the
engine that will run it, and returns the normalised inputs; it queues nothing. A call is
admitted whole or not at all, so a bad 3rd prompt can never leave the first two behind
in the scheduler (where they would run inside the next call and their outputs be lost).

What is checked, per request, in this order:

* prompt types: ``str`` (not ``bytes``, not a lone surrogate), or token ids as lists /
  tuples of ints, numpy integer arrays, numpy integer scalars, torch integer tensors
  (1-D for one prompt, 2-D for a batch); floats, ``None``, bools, a bare int and dicts
  are refused with the offending element named;
* token ids in ``[0, vocab_size)`` and the prompt shorter than ``max_model_len``;
* sampling values in the dtype the sampler computes in (float32 temperature / top_p
  must stay finite and non-zero; see :func:`check_sampling_values`), stop token ids
  inside the vocabulary;
* KV fit: the blocks the request can reach (prompt + max_tokens, capped at the context)
  must exist in every KV group, else it could never be scheduled;
* structured output: the schema rules, then the grammar itself compiled (shared with the
  compile the engine does later) and its first step must allow at least one token. The
  call's grammars compile in parallel and admission waits for them up to
  ``DEEPINFER_GRAMMAR_COMPILE_TIMEOUT_S`` (30 s by default; typical grammars take
  milliseconds) in all; a grammar still compiling then is refused naming the field and the
  limit. No request is ever queued with a grammar that was not compiled and checked, so no
  grammar error can surface after queueing.

``max_tokens`` past the context is allowed (the request stops at ``max_model_len`` with
finish reason ``"length"``), and logged once per call as a warning, as vLLM reports it.
"""

from __future__ import annotations

import logging
import math
import numbers
import time
from array import array
from concurrent.futures import TimeoutError as FuturesTimeout
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

import numpy as np
import torch

from deepinfer.engine.inputs import expand_sampling_params
from deepinfer.engine.kv_cache_manager import KVFit
from deepinfer.errors import InvalidRequestError
from deepinfer.sampling_params import FLOAT32_MAX, SamplingParams
from deepinfer.structured.spec import StructuredOutputSpec

__all__ = ["admit_generate", "prompt_items", "token_id_lists", "check_sampling_values", "kv_fit_of"]

logger = logging.getLogger(__name__)


Prompt = tuple[str | None, array]  # (text or None, int64 token ids)
INT64_MAX = 2**63 - 1


# ---- prompts -----------------------------------------------------------------------------
def _text_list(prompts: Any) -> list[str]:
    """``prompts`` as a list of non-empty, UTF-8-encodable strings."""
    if isinstance(prompts, str):
        prompts = [prompts]
    elif isinstance(prompts, (bytes, bytearray, memoryview)):
        raise InvalidRequestError("prompts must be a str or a list of str, got bytes; decode them first "
                                  "(e.g. data.decode('utf-8'))", field="prompts")
    elif isinstance(prompts, Mapping) or not isinstance(prompts, Sequence):
        raise InvalidRequestError(f"prompts must be a str or a list of str, got {type(prompts).__name__}",
                                  field="prompts")
    items = list(prompts)
    for i, p in enumerate(items):
        if not isinstance(p, str):
            raise InvalidRequestError(f"prompts[{i}] must be a str, got {type(p).__name__}", field="prompts")
        if p == "":
            raise InvalidRequestError(f"prompts[{i}] is empty; a prompt needs at least one character",
                                      field="prompts")
        try:
            p.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidRequestError(
                f"prompts[{i}] is not valid Unicode text: {p[exc.start:exc.end]!r} at index {exc.start} is a "
                f"lone surrogate (no UTF-8 encoding)", field="prompts") from None
    return items


def _ids_of(seq: Any, where: str, vocab: int | None = None) -> array:
    """One prompt's token ids as an int64 ``array`` (types checked; ranges later). An array,
    not a list: the garbage collector never walks it, so long prompts cost no GC time while
    they are served (see :class:`deepinfer.engine.request.Request`)."""
    if isinstance(seq, torch.Tensor):
        if seq.dim() != 1 or seq.dtype == torch.bool or seq.dtype.is_floating_point or seq.dtype.is_complex:
            raise InvalidRequestError(f"{where} must be a 1-D integer tensor, got {seq.dim()}-D {seq.dtype}",
                                      field="prompt_token_ids")
        return _int64_ids(seq.detach().cpu().numpy(), where, vocab)
    if isinstance(seq, np.ndarray):
        if seq.ndim != 1 or seq.dtype.kind not in "iu":
            raise InvalidRequestError(f"{where} must be a 1-D integer array, got {seq.ndim}-D {seq.dtype}",
                                      field="prompt_token_ids")
        return _int64_ids(seq, where, vocab)
    if isinstance(seq, (str, bytes, bytearray, Mapping)) or not isinstance(seq, Sequence):
        raise InvalidRequestError(f"{where} must be a list of int token ids, got {type(seq).__name__}",
                                  field="prompt_token_ids")
    if set(map(type, seq)) <= {int}:  # the common case (JSON ids, lists): far cheaper than the checks below
        try:
            return array("q", seq)
        except OverflowError:
            _out_of_range(where, [t for t in seq if not -INT64_MAX - 1 <= t <= INT64_MAX], vocab)
    out = array("q")
    for j, t in enumerate(seq):
        if isinstance(t, (torch.Tensor, np.ndarray)) and t.ndim == 0:
            t = t.item()
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, numbers.Integral):
            raise InvalidRequestError(f"{where}[{j}] must be an int token id, got {t!r} ({type(t).__name__})",
                                      field="prompt_token_ids")
        if not -INT64_MAX - 1 <= int(t) <= INT64_MAX:
            _out_of_range(where, [int(t)], vocab)
        out.append(int(t))
    return out


def _int64_ids(a: np.ndarray, where: str, vocab: int | None) -> array:
    """A 1-D integer ndarray as an int64 ``array``; values int64 cannot hold are refused
    (a uint64 id past 2**63 - 1 would otherwise wrap to a negative one)."""
    if a.dtype == np.uint64 and a.size and int(a.max()) > INT64_MAX:
        _out_of_range(where, [int(t) for t in a[a > INT64_MAX][:5]], vocab)
    out = array("q")
    out.frombytes(np.ascontiguousarray(a, dtype=np.int64).tobytes())
    return out


def _out_of_range(where: str, bad: list[int], vocab: int | None = None) -> NoReturn:
    bound = f"[0, {vocab})" if vocab is not None else "int64's range"
    raise InvalidRequestError(f"{where} has token ids outside {bound}: {bad[:5]}", field="prompt_token_ids")


def token_id_lists(prompt_token_ids: Any, vocab: int | None = None) -> list[array]:
    """``prompt_token_ids`` (one prompt or a batch, in any accepted container) as int64 arrays
    (``vocab``: the range errors name ``[0, vocab)``)."""
    x = prompt_token_ids
    if isinstance(x, (torch.Tensor, np.ndarray)):
        ndim = x.dim() if isinstance(x, torch.Tensor) else x.ndim
        if ndim == 1:
            return [_ids_of(x, "prompt_token_ids", vocab)]
        if ndim == 2:
            return [_ids_of(row, f"prompt_token_ids[{i}]", vocab) for i, row in enumerate(x)]
        raise InvalidRequestError(f"prompt_token_ids must be 1-D (one prompt) or 2-D (a batch), got {ndim}-D",
                                  field="prompt_token_ids")
    if isinstance(x, (bool, numbers.Number)):
        raise InvalidRequestError(f"prompt_token_ids must be a list of token ids or a list of such lists, got the "
                                  f"bare {type(x).__name__} {x!r} (one prompt of one token is [{x!r}])",
                                  field="prompt_token_ids")
    if isinstance(x, (str, bytes, bytearray, Mapping)) or not isinstance(x, Sequence):
        raise InvalidRequestError(f"prompt_token_ids must be a list of token ids or a list of such lists, got "
                                  f"{type(x).__name__}", field="prompt_token_ids")
    items = list(x)
    scalar = lambda t: isinstance(t, numbers.Number) or (isinstance(t, (torch.Tensor, np.ndarray)) and t.ndim == 0)
    if items and all(scalar(t) for t in items):
        return [_ids_of(items, "prompt_token_ids", vocab)]
    return [_ids_of(seq, f"prompt_token_ids[{i}]", vocab) for i, seq in enumerate(items)]


def prompt_items(engine: Any, prompts: Any, prompt_token_ids: Any) -> list[Prompt]:
    """(text, ids) per prompt, every type and id range checked."""
    if (prompts is None) == (prompt_token_ids is None):
        raise InvalidRequestError("generate() needs exactly one of prompts or prompt_token_ids")
    vocab = engine.model_config.vocab_size
    if prompts is not None:
        out: list[Prompt] = [(p, array("q", engine.tokenizer.encode(p))) for p in _text_list(prompts)]
        for i, (_, ids) in enumerate(out):
            if max(ids) >= vocab:
                raise InvalidRequestError(
                    f"prompts[{i}] tokenizes to ids >= the model's vocab_size {vocab}; the tokenizer "
                    f"({engine.tokenizer.vocab_size} tokens) does not match this checkpoint", field="tokenizer")
        return out
    out = []
    for i, ids in enumerate(token_id_lists(prompt_token_ids, vocab)):
        if not ids:
            raise InvalidRequestError(f"prompt_token_ids[{i}] is empty; a prompt needs at least one token",
                                      field="prompt_token_ids")
        view = np.frombuffer(ids, dtype=np.int64)  # no copy
        if view.min() < 0 or view.max() >= vocab:
            _out_of_range(f"prompt_token_ids[{i}]", view[(view < 0) | (view >= vocab)][:5].tolist(), vocab)
        out.append((None, ids))
    return out


# ---- sampling values ---------------------------------------------------------------------
def check_sampling_values(sp: SamplingParams, i: int, vocab_size: int) -> None:
    """The values the sampler computes with, re-checked here because a SamplingParams is a
    mutable dataclass (a field set after construction skipped its validation)."""
    where = f"sampling_params[{i}]: SamplingParams"
    t = sp.temperature
    if isinstance(t, bool) or not isinstance(t, numbers.Real) or not math.isfinite(t) or not 0 <= t <= FLOAT32_MAX:
        raise InvalidRequestError(f"{where}.temperature must be a number in [0, {FLOAT32_MAX:.7g}] (finite in "
                                  f"float32, the sampler's dtype), got {t!r}", field="temperature")
    for name, lo_open in (("top_p", True), ("min_p", False)):
        v = getattr(sp, name)
        f32 = float(np.float32(v)) if isinstance(v, numbers.Real) and not isinstance(v, bool) else math.nan
        if not (0 < f32 <= 1 if lo_open else 0 <= f32 <= 1):
            raise InvalidRequestError(f"{where}.{name} must be in {'(0, 1]' if lo_open else '[0, 1]'} as a float32, "
                                      f"got {v!r}", field=name)
    k = sp.top_k
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or not (k == -1 or 1 <= k <= 2**63 - 1):
        raise InvalidRequestError(f"{where}.top_k must be -1 (disabled) or an int in [1, 2**63 - 1] (int64; values "
                                  f"above vocab_size={vocab_size} keep every token), got {k!r}", field="top_k")
    for name, lo in (("max_tokens", 1), ("min_tokens", 0), ("top_logprobs", 0)):
        v = getattr(sp, name)
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < lo:
            raise InvalidRequestError(f"{where}.{name} must be an int >= {lo}, got {v!r}", field=name)
    stop = sp.stop
    if not isinstance(stop, list) or not all(isinstance(x, str) and x for x in stop):
        raise InvalidRequestError(f"{where}.stop must be a list of non-empty str, got {stop!r}", field="stop")
    ids = sp.stop_token_ids
    if not isinstance(ids, list):
        raise InvalidRequestError(f"{where}.stop_token_ids must be a list of token ids, got {ids!r}",
                                  field="stop_token_ids")
    bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"{where}.stop_token_ids must be token ids in [0, {vocab_size}), got {bad[:5]}",
                                  field="stop_token_ids")
    if sp.structured_output is not None and not isinstance(sp.structured_output, StructuredOutputSpec):
        raise InvalidRequestError(f"{where}.structured_output must be set through SamplingParams(...) (a "
                                  f"StructuredOutputSpec), got {type(sp.structured_output).__name__}",
                                  field="structured_output")


# ---- KV fit and context ------------------------------------------------------------------
def kv_fit_of(engine: Any) -> KVFit:
    """The KV cache admission checks against: an `AdmissionView`'s snapshot, else the engine's own."""
    fit = getattr(engine, "kv_fit", None)
    return fit if isinstance(fit, KVFit) else engine.scheduler.kv.fit


def _check_fit(engine: Any, items: list[Prompt], params: list[SamplingParams]) -> None:
    cfg = engine.config
    limit = cfg.max_model_len
    kv = kv_fit_of(engine)
    capped = []
    for i, ((_, ids), sp) in enumerate(zip(items, params)):
        n = len(ids)
        if n >= limit:
            raise InvalidRequestError(
                f"prompt {i} has {n} tokens; the model's context (max_model_len) is {limit}, "
                f"so prompts must have at most {limit - 1} tokens", field="max_model_len")
        total = min(n + sp.max_tokens, limit)
        if total < n + sp.max_tokens:
            capped.append(i)
        if not cfg.chunked_prefill and total > cfg.max_num_batched_tokens:
            raise InvalidRequestError(
                f"prompt {i} may reach {total} tokens but chunked prefill is off and "
                f"max_num_batched_tokens={cfg.max_num_batched_tokens}", field="max_num_batched_tokens")
        for group, need in kv.max_blocks_needed(total, cfg.max_num_batched_tokens).items():
            have = kv.num_blocks[group]
            if need > have:
                raise InvalidRequestError(
                    f"prompt {i} ({n} prompt + up to {total - n} new tokens) needs {need} KV blocks of "
                    f"{cfg.block_size} tokens in group {group!r}, but the whole cache has {have} "
                    f"(num_kv_blocks / kv_cache_memory_bytes): it could never be scheduled; nothing was queued",
                    field="num_kv_blocks")
    if capped:
        logger.warning("%d request(s) of this call (first: prompt %d) ask for more tokens than the context "
                       "max_model_len=%d leaves; they stop at the context with finish_reason 'length'",
                       len(capped), capped[0], limit)


# ---- structured output -------------------------------------------------------------------
def _check_grammars(engine: Any, params: list[SamplingParams]) -> None:
    """Compile every grammar of the call now (the engine's later compile reuses the result)
    and refuse one whose first step allows no token at all (an empty language)."""
    structured = engine.structured
    if structured is None:  # an AdmissionView: the engine's own admission checks grammars
        if any(sp.structured_output is not None for sp in params):
            raise ValueError("structured output is admitted by the engine (it compiles the grammar), "
                             "not through an AdmissionView")
        return
    structured.check(params)
    futures = {i: structured.pool.submit(sp.structured_output) for i, sp in enumerate(params)
               if sp.structured_output is not None}
    from deepinfer import envs

    limit = envs.DEEPINFER_GRAMMAR_COMPILE_TIMEOUT_S
    deadline = time.monotonic() + limit
    for i, fut in futures.items():
        spec = params[i].structured_output
        try:
            compiled = fut.result(timeout=max(0.0, deadline - time.monotonic()))
        except FuturesTimeout:
            # never admitted unchecked; the compile goes on in its worker and is cached, so
            # a retry of the same spec finds it (sooner) done
            raise InvalidRequestError(
                f"sampling_params[{i}]: SamplingParams.structured_output: the grammar did not finish compiling "
                f"within DEEPINFER_GRAMMAR_COMPILE_TIMEOUT_S={limit:g} s; nothing was queued (simplify the "
                f"schema, or raise the limit)", field="structured_output") from None
        except Exception as exc:  # noqa: BLE001 - any backend failure is the request's fault here
            raise InvalidRequestError(f"sampling_params[{i}]: SamplingParams.structured_output: grammar "
                                      f"compilation failed: {exc}", field="structured_output") from None
        if structured.trigger_ids(spec) is not None:
            continue  # a triggered grammar starts later; its start state is checked when it does
        from deepinfer.structured.matcher import new_matcher

        mask = torch.zeros((1, (structured.vocab_size + 31) // 32), dtype=torch.int32)
        new_matcher(compiled).fill_next_token_bitmask(mask, 0)
        if not bool(mask.any()):
            raise InvalidRequestError(f"sampling_params[{i}]: SamplingParams.structured_output: the grammar "
                                      f"accepts no output at all (not even EOS): its language is empty",
                                      field="structured_output")


def admit_generate(engine: Any, prompts: Any, sampling_params: Any,
                   prompt_token_ids: Any) -> tuple[list[Prompt], list[SamplingParams]]:
    """Validate a whole ``generate`` call against ``engine`` (an EngineCore or LLM) and
    return ``(items, params)``: (text, ids) per prompt and each request's resolved
    SamplingParams (``for_request()``: a fresh seed where none was given). Raises
    InvalidRequestError naming the prompt and field; nothing is queued either way."""
    items = prompt_items(engine, prompts, prompt_token_ids)
    params = expand_sampling_params(sampling_params, len(items))
    vocab = engine.model_config.vocab_size
    for i, sp in enumerate(params):
        check_sampling_values(sp, i, vocab)
    _check_fit(engine, items, params)
    _check_grammars(engine, params)
    return items, [p.for_request() for p in params]
