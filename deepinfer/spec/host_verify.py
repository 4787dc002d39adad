"""A speculative step's verification on the host path: rejection sampling over the
logits rows of the sampled requests' drafts (any sampling settings, grammar masks, top
log-probs), one device -> host copy. The verify graphs' greedy lane
(`SpecDecoder._launch_lane`) covers greedy steps without these; this path covers the rest.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from deepinfer.engine.outputs import SchedulerOutput
from deepinfer.engine.sampler import SamplingTensors
from deepinfer.engine.transfer import to_device
from deepinfer.profiling.markers import LOGITS, SAMPLE, phase

from .verify import rejection_sample_device

__all__ = ["StepTokens", "verify_on_host"]


@dataclass
class StepTokens:
    """Per scheduled request of a step: the tokens it emits (``sampled``; ``emitted`` what
    the drafter sees), their log-probs, top log-probs, and its rows with valid KV."""

    sampled: list[list[int]]
    emitted: list[list[int] | None]
    logprobs: list[list[float]]
    tops: list
    valid: list[int]


def verify_on_host(spec: Any, runner: Any, so: SchedulerOutput, batch: Any, logits_of: Callable, picks: list[int],
                   grammar: Any, any_top: bool, out: StepTokens) -> None:
    """Verify the drafts of requests ``picks`` (indices into ``so.scheduled``) from the rows
    ``logits_of`` scores, recording the result in ``spec``'s metrics; fills ``out`` for them."""
    rows, params, positions, draft_ids, nd, qs = [], [], [], [], [], []
    layout = []  # (req_id, drafts) per sampled request, in row order (grammar masks)
    for i in picks:
        r, seq = so.scheduled[i], batch.seqs[i]
        k, n_real = r.num_draft_tokens, out.valid[i]
        first = seq.offset + n_real - 1
        layout.append((r.req_id, list(r.token_ids[n_real:])))
        rows += range(first, first + k + 1)
        params += [r.sampling_params] * (k + 1)
        positions += [r.start_pos + n_real + j for j in range(k + 1)]
        draft_ids += list(r.token_ids[n_real:]) + [-1]
        nd.append(k)
        q = spec.probs.pop(r.req_id, None)
        qs.append(q[:k] if q is not None and k and q.shape[0] >= k and not r.sampling_params.is_greedy
                  else None)
    for i in range(len(so.scheduled)):
        if i not in picks:
            spec.probs.pop(so.scheduled[i].req_id, None)
    dev = runner.device
    with phase(LOGITS):
        logits = logits_of(to_device(rows, torch.long, dev))
    if grammar is not None:  # row j of a request: its grammar after drafts[:j]
        grammar.apply_verify(logits, layout)
    st = SamplingTensors.from_params(params, positions, dev)
    draft_t = to_device(draft_ids, torch.long, dev)
    probs = None
    if any(q is not None for q in qs):
        V = logits.shape[1]
        parts = []
        for q, k in zip(qs, nd):
            parts.append(q.to(dev).float() if q is not None else torch.zeros(k, V, device=dev))
            parts.append(torch.zeros(1, V, device=dev))
        probs = torch.cat(parts)
        onehot = torch.nn.functional.one_hot(draft_t.clamp(min=0), V).float()
        none_rows = to_device(sum(([q is None] * (k + 1) for q, k in zip(qs, nd)), []), torch.bool, dev)
        probs = torch.where(none_rows.unsqueeze(1), onehot, probs)
    with phase(SAMPLE):
        raw_lp = torch.log_softmax(logits.float(), dim=-1) if any_top else None
        dv = rejection_sample_device(logits, st, nd, draft_t, probs, runner.sampler, rule=spec.rule,
                                     raw_logprobs=raw_lp)
        tensors = [dv.packed]
        kt_max = max((so.scheduled[i].sampling_params.top_logprobs for i in picks), default=0)
        if any_top:  # every emitted slot's top log-probs, in the same copy
            v, ids = torch.topk(raw_lp[dv.rows], min(kt_max, raw_lp.shape[1]), dim=-1)
            tensors += [ids, v]
        # the step's one device -> host copy (pinned, on the copy stream): the drafter
        # needs the accepted counts and tokens on the host
        host = runner.copier.start(tensors).wait()
        res = dv.to_result(host[0])
    spec._record(so, picks, nd, res)
    top_ids = host[1].tolist() if any_top else None
    top_vals = host[2].tolist() if any_top else None
    for j, i in enumerate(picks):
        out.sampled[i] = out.emitted[i] = res.tokens[j]
        out.logprobs[i] = res.logprobs[j]
        out.valid[i] += res.num_accepted[j]
        kt = so.scheduled[i].sampling_params.top_logprobs
        n_out = len(res.tokens[j])
        if kt and top_ids is not None:
            out.tops[i] = [list(zip(a[:kt], b[:kt])) for a, b in zip(top_ids[j][:n_out], top_vals[j][:n_out])]
        else:
            out.tops[i] = [[] for _ in res.tokens[j]]
