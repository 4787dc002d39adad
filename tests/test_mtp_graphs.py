"""The MTP drafter's graphed passes (deepinfer/spec/mtp_graphs.py) on CPU, graphs emulated
on the host buffers (the fast path's kernel references): on the trained default, whose MTP
stage drafts real tokens, the graphed drafter proposes what the eager one does (same greedy
output, same accepted drafts at every position), every pass replays a captured shape, and
steps it cannot take (sampling) stay on the eager drafter."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any deepinfer_kernels module is imported

import pytest  # noqa: E402

from deepinfer import LLM, SamplingParams  # noqa: E402
from deepinfer.models.default_model import trained_model_dir  # noqa: E402

from spec_common import assert_same_drafts, run_recording_drafts  # noqa: E402

PROMPTS = ["The quick brown fox jumps over the lazy dog. " * 3, "Once upon a time, there was a", "def fibonacci(n):"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _run(monkeypatch, graphs: str, k: int, params=GREEDY, async_scheduling: bool = False):
    """(The synchronous loop by default: a plan made ahead caps drafts near max_tokens by the
    optimistic in-flight count, so its per-position counts differ from the eager drafter's.)"""
    monkeypatch.setenv("DEEPINFER_FASTPATH", "ref")
    monkeypatch.setenv("DEEPINFER_CUDA_GRAPHS", graphs)
    monkeypatch.setenv("DEEPINFER_CUDA_GRAPH_WARMUP", "1")  # the start-up capture, emulated on the host
    llm = LLM(trained_model_dir(), dtype="float32", max_model_len=256, max_num_seqs=4, num_speculative_tokens=k,
              max_num_batched_tokens=64, async_scheduling=async_scheduling)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    m = llm.runner.spec.metrics
    return llm.runner.spec.drafter, [o.token_ids for o in outs], list(m.accepted), list(m.proposed)


@pytest.mark.parametrize("k", [1, 3])
def test_graphed_mtp_drafts_what_the_eager_drafter_drafts(monkeypatch, k):
    graphed, tokens, accepted, proposed = _run(monkeypatch, "1", k)
    eager, tokens0, accepted0, proposed0 = _run(monkeypatch, "0", k)
    assert graphed.graphs is not None and eager.graphs is None
    # (k = 1: every greedy-lane step's catch-up runs inside its verify graph, spec/mtp_verify_tail.py,
    # so the stage's own graphs have no pass left to run)
    assert (graphed.graphs.stats["graph_passes"] > 0 or k == 1) and graphed.graphs.stats["eager_passes"] == 0
    assert graphed.graphs.graphs.stats["uncaptured_steps"] == 0  # every pass replayed a captured shape
    assert tokens == tokens0 and accepted == accepted0 and proposed == proposed0
    assert sum(accepted) > 0  # the trained stage's drafts are accepted: the drafts themselves were compared
    # greedy-lane steps draft behind the verify graph, from the verify's own argmax (k = 3: the
    # later passes at positions shifted by the accepted count on the device)
    assert graphed.graphs.stats["after_verify_passes"] > 0


def test_sampling_steps_draft_eagerly(monkeypatch):
    sampled = SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True, seq_seed=1)
    drafter, tokens, _, proposed = _run(monkeypatch, "1", 2, params=sampled)
    assert drafter.graphs is not None and drafter.graphs.stats["graph_passes"] == 0
    assert all(len(t) == 12 for t in tokens) and sum(proposed) > 0  # the eager drafter drafted


def test_drafts_behind_the_verify_graph_equal_host_drafts(monkeypatch):
    """k = 3: every step's drafts and their confidences (the stage's log-probs, which see
    positions and the stage's window cache) equal the host path's, the same output."""
    spec, tokens, steps = run_recording_drafts(monkeypatch, trained_model_dir(), 3, PROMPTS, after_verify=True)
    spec0, tokens0, steps0 = run_recording_drafts(monkeypatch, trained_model_dir(), 3, PROMPTS, after_verify=False)
    assert spec.drafter.graphs.stats["after_verify_passes"] > 0 == spec0.drafter.graphs.stats["after_verify_passes"]
    assert tokens == tokens0 and list(spec.metrics.accepted) == list(spec0.metrics.accepted)
    assert_same_drafts(steps, steps0)
