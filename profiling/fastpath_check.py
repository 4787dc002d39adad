"""Correctness phases of benchmarks/fastpath_bench.py: the engine's reference path vs its
fast path (eager and CUDA graphs) on a mixed batch, and the teacher-forced per-layer study
of profiling/fastpath_layers.py."""

from __future__ import annotations

from deepinfer import SamplingParams


def token_ids(seed: int, n: int, vocab: int) -> list[int]:
    """A deterministic prompt of n ids inside the vocabulary (away from special ids 0-9)."""
    return [(seed * 7919 + 31 * j) % (vocab - 20) + 10 for j in range(n)]


def set_mode(llm, mode: str) -> None:
    """reference: both fast paths off; eager / graphs: the fast paths on."""
    runner = llm.runner
    runner.fast, runner.fast_prefill = (None, None) if mode == "reference" else llm._fast_paths
    if runner.fast is not None:
        runner.fast.graphs_enabled = mode == "graphs"


def generate_recording(llm, prompts, sp) -> tuple[list, list]:
    steps: list = []
    sample = llm.runner.sampler.sample

    def wrapped(logits, params, *args):
        steps.append(logits.float().cpu())
        return sample(logits, params, *args)

    llm.runner.sampler.sample, llm.runner.greedy_lane = wrapped, False  # every step through the sampler
    try:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
    finally:
        llm.runner.sampler.sample, llm.runner.greedy_lane = sample, True
    return [o.token_ids for o in outs], steps


def compare(ra, rb) -> dict:
    """Per-row logits rel err on rows whose tokens so far agree, and greedy agreement."""
    (ta, la), (tb, lb) = ra, rb
    errs = []
    for step, (a, b) in enumerate(zip(la, lb)):
        if a.shape != b.shape:
            break
        errs += [float((a[r] - b[r]).norm() / a[r].norm()) for r in range(a.shape[0]) if ta[r][:step] == tb[r][:step]]
    agree = sum(x == y for s, t in zip(ta, tb) for x, y in zip(s, t))
    return {"greedy_token_agreement": f"{agree}/{sum(len(s) for s in ta)}",
            "row_logits_rel_err_max": max(errs) if errs else None,
            "row_logits_rel_err_mean": sum(errs) / len(errs) if errs else None, "rows_compared": len(errs)}


def check_engine(llm, new: int, lens: tuple) -> dict:
    prompts = [token_ids(i, n, llm.model_config.vocab_size) for i, n in enumerate(lens)]
    sp = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    runs = {}
    for mode in ("reference", "eager", "graphs"):
        set_mode(llm, mode)
        runs[mode] = generate_recording(llm, prompts, sp)
    return {"prompt_lens": list(lens), "new_tokens": new,
            "reference_vs_eager": compare(runs["reference"], runs["eager"]),
            "reference_vs_graphs": compare(runs["reference"], runs["graphs"]),
            "eager_vs_graphs": compare(runs["eager"], runs["graphs"])}


def check_layers(model, steps: int, lens: tuple) -> dict:
    from fastpath_layers import teacher_forced, verdict

    prompts = [token_ids(100 + i, n, model.cfg.vocab_size) for i, n in enumerate(lens)]
    kind = "triton" if next(model.parameters()).is_cuda else "ref"
    study = teacher_forced(model, prompts, steps, kind)
    study["verdict"] = verdict(study)
    return study


def check_prefill(model, lens: tuple) -> dict:
    """The batched prefill path (deepinfer/models/v4/fast/prefill.py) vs the reference path on one
    prefill step of fresh requests, each over its own cache: per request the rel err of the
    final streams (all rows, and the worst row with its position) and of the last row's logits.
    Lengths past a compressed window (e.g. 129 > 128) put rows behind a closed HCA entry."""
    import torch

    from deepinfer.models.fast.prefill import prefill_ops
    from deepinfer.models.v4.fast.prefill import PrefillPath
    from deepinfer.models.paged_batch import ForwardBatch, SeqMeta
    from deepinfer.models.standalone import StandaloneRunner

    dev = next(model.parameters()).device
    prompts = [token_ids(200 + i, n, model.cfg.vocab_size) for i, n in enumerate(lens)]
    runs = [StandaloneRunner(model, len(lens), max(lens) + 8) for _ in range(2)]

    def batch_of(run) -> ForwardBatch:
        seqs, ids, pos, off = [], [], [], 0
        for i, p in enumerate(prompts):
            seqs.append(SeqMeta(0, len(p), off, run._table(i), i, is_new=True, prompt_len=len(p)))
            ids += p
            pos += range(len(p))
            off += len(p)
        return ForwardBatch(torch.tensor(ids, device=dev), torch.tensor(pos, device=dev), seqs)

    with torch.no_grad():
        ref_batch = batch_of(runs[0])
        ref = model(ref_batch, runs[0].cache)
        path = PrefillPath(model, runs[1].cache, prefill_ops("triton" if dev.type == "cuda" else "ref"))
        batch = batch_of(runs[1])
        fast = path.forward(batch, path.prepare(batch))
        last = [s.offset + s.length - 1 for s in ref_batch.seqs]
        l_ref, l_fast = model.compute_logits(ref[last]), model.compute_logits(fast[last])
    out = {}
    for i, s in enumerate(ref_batch.seqs):
        rows = slice(s.offset, s.offset + s.length)
        a, b = fast[rows].float().flatten(1), ref[rows].float().flatten(1)
        per_row = (a - b).norm(dim=1) / b.norm(dim=1).clamp_min(1e-30)
        out[f"len{s.length}"] = {"streams_rel_err_mean": round(float(per_row.mean()), 5),
                                 "worst_row_rel_err": round(float(per_row.max()), 5),
                                 "worst_row_position": int(per_row.argmax()),
                                 "last_logits_rel_err": round(float((l_fast[i] - l_ref[i]).norm() / l_ref[i].norm()), 5)}
    return out
