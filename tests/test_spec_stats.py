"""Speculative sampling preserves the target distribution (chi-square, p > 0.01), and the
same test rejects a deliberately broken acceptance rule (accept with p(d), ignoring q)."""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.engine.sampler import SamplingTensors
from deepinfer.models.tiny import tiny_config, write_tiny_checkpoint
from deepinfer.spec.verify import drafts_to_verify, rejection_sample, sample_draft

V = 16


def _chi2_p(tokens: list[int], probs: torch.Tensor) -> float:
    n = len(tokens)
    counts = torch.bincount(torch.tensor(tokens), minlength=V).double()
    exp = probs.double() * n
    keep = exp >= 5  # pool rare cells so the chi-square approximation holds
    obs_c = torch.cat([counts[keep], counts[~keep].sum().view(1)])
    exp_c = torch.cat([exp[keep], exp[~keep].sum().view(1)])
    if exp_c[-1] < 5:
        obs_c, exp_c = obs_c[:-1], exp_c[:-1]
        exp_c = exp_c * obs_c.sum() / exp_c.sum()
    chi2 = float(((obs_c - exp_c) ** 2 / exp_c).sum())
    df = len(obs_c) - 1  # chi-square survival function = regularised upper incomplete gamma
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(chi2 / 2, dtype=torch.float64)))


def _first_tokens(rule: str, n: int = 20000, k: int = 2, temperature: float = 1.0) -> tuple[list[int], torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    target = torch.randn(V, generator=g) * 1.5
    draft = torch.randn(V, generator=g) * 1.5
    sp = [SamplingParams(temperature=temperature, seq_seed=s) for s in range(n)]
    # drafts for positions 10..10+k-1 from q, the DRAFT stream
    draft_ids = []
    qs = []
    for j in range(k):
        st = SamplingTensors.from_params(sp, [10 + j] * n)
        tok, q = sample_draft(draft.expand(n, V), st)
        draft_ids.append(tok)
        qs.append(q)
    rows_logits, rows_params, rows_pos, rows_draft, rows_q = [], [], [], [], []
    ids = torch.stack(draft_ids, 1)  # [n, k]
    q = torch.stack(qs, 1)  # [n, k, V]
    logits = target.expand(n, k + 1, V).reshape(-1, V)
    positions = [10 + j for _ in range(n) for j in range(k + 1)]
    params = SamplingTensors.from_params([p for p in sp for _ in range(k + 1)], positions)
    d = torch.cat([ids, torch.full((n, 1), -1)], 1).reshape(-1)
    qq = torch.cat([q, torch.zeros(n, 1, V)], 1).reshape(-1, V)
    res = rejection_sample(logits, params, [k] * n, d, qq, rule=rule)
    p = torch.softmax(target / temperature, -1)
    return [t[0] for t in res.tokens], p, res


def test_rejection_sampling_preserves_target_distribution():
    first, p, res = _first_tokens("standard")
    assert _chi2_p(first, p) > 0.01
    # the token after an accepted first draft is again distributed as p (same logits here)
    second = [t[1] for t in res.tokens if len(t) > 1]
    assert len(second) > 1000 and _chi2_p(second, p) > 0.01
    assert 0.2 < sum(res.num_accepted) / (2 * len(res.num_accepted)) < 0.95


def test_broken_acceptance_rule_is_detected():
    first, p, _ = _first_tokens("ignore_q")
    assert _chi2_p(first, p) < 0.01


def test_greedy_is_the_special_case():
    target = torch.randn(3, V)
    sp = [SamplingParams(temperature=0, seq_seed=1)] * 3
    params = SamplingTensors.from_params(sp, [4, 5, 6])
    best = target.argmax(-1)
    d = torch.tensor([int(best[0]), (int(best[1]) + 1) % V, -1])
    res = rejection_sample(target, params, [2], d)
    assert res.tokens == [[int(best[0]), int(best[1])]] and res.num_accepted == [1]


@pytest.fixture(scope="module")
def small_vocab_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_v16")
    write_tiny_checkpoint(str(path), seed=5, cfg=tiny_config(vocab_size=V, sliding_window=32))
    return str(path)


def test_engine_sampling_with_mtp_matches_target_distribution(small_vocab_ckpt):
    """Second generated token (the first one verified against an MTP draft) over many seeds,
    against its exact marginal sum_t1 p(t1) p(t2 | t1) computed with speculation off."""
    prompt = [3, 1, 4, 1, 5]
    off = LLM(small_vocab_ckpt, dtype="float32", max_model_len=64, max_num_seqs=16)
    lp = lambda ids: torch.tensor([dict(t)[i] for t in [off.generate(  # noqa: E731
        prompt_token_ids=[ids], use_tqdm=False,
        sampling_params=SamplingParams(temperature=1.0, max_tokens=1, top_logprobs=V, seq_seed=0))[0]
        .top_logprobs[0]] for i in range(V)]).exp()
    p1 = lp(prompt)
    p2 = sum(p1[t] * lp(prompt + [t]) for t in range(V))
    on = LLM(small_vocab_ckpt, dtype="float32", max_model_len=64, max_num_seqs=256, num_speculative_tokens=2)
    n = 1200
    outs = on.generate(prompt_token_ids=[prompt] * n, use_tqdm=False,
                       sampling_params=[SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, seq_seed=s)
                                        for s in range(n)])
    assert on.runner.spec.metrics.steps > 0 and on.runner.spec.metrics.proposed[0] > 0
    assert _chi2_p([o.token_ids[1] for o in outs], p2) > 0.01


def _first_tokens_under_grammar(cut) -> tuple[list[int], torch.Tensor]:
    """First token over many seeds when a grammar allows half the vocabulary: the target is
    masked, the draft distribution q is not (so ~half the drafts are grammar-invalid), and
    ``cut(num_drafts, num_valid, deterministic)`` decides how many drafts are verified."""
    n = 20000
    g = torch.Generator().manual_seed(1)
    target, draft = torch.randn(V, generator=g) * 1.5, torch.randn(V, generator=g) * 1.5
    allowed = torch.zeros(V, dtype=torch.bool)
    allowed[torch.randperm(V, generator=g)[: V // 2]] = True
    masked = target.masked_fill(~allowed, float("-inf"))
    sp = [SamplingParams(temperature=1.0, seq_seed=s) for s in range(n)]
    tok, q = sample_draft(draft.expand(n, V), SamplingTensors.from_params(sp, [10] * n))
    nd = [cut(1, int(allowed[t]), False) for t in tok.tolist()]
    rows_sp, positions, ids, probs = [], [], [], []
    for i, k in enumerate(nd):
        rows_sp += [sp[i]] * (k + 1)
        positions += list(range(10, 11 + k))
        ids += [int(tok[i])] * k + [-1]
        probs += [q[i]] * k + [torch.zeros(V)]
    res = rejection_sample(masked.expand(len(ids), V).clone(), SamplingTensors.from_params(rows_sp, positions), nd,
                           torch.tensor(ids), torch.stack(probs))
    assert 0.2 < float(allowed[tok].float().mean()) < 0.8  # many drafts are grammar-invalid
    return [t[0] for t in res.tokens], torch.softmax(masked, -1)


def test_grammar_truncated_drafts_preserve_the_masked_target_distribution():
    """The engine's rule (deepinfer.spec.verify.drafts_to_verify): a sampled draft the grammar
    rejects is still verified (and rejected by the mask, so the residual is drawn)."""
    first, p = _first_tokens_under_grammar(drafts_to_verify)
    assert _chi2_p(first, p) > 0.01


def test_dropping_grammar_rejected_sampled_drafts_is_detected():
    """Dropping the rejected draft (a fresh sample instead of the residual) biases the output."""
    first, p = _first_tokens_under_grammar(lambda n, valid, deterministic: valid)
    assert _chi2_p(first, p) < 0.01
