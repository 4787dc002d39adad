"""The batch sweep: prefill, decode and closed-loop workload points over batch settings.

    from deepinfer.profiling.sweep import SweepSpec, run_sweep
    res = run_sweep(spec=SweepSpec(decode_batch_sizes=(1, 4)), engine_kwargs={"dtype": "float32"},
                    name="tiny-cpu", out_dir="profiling/results")
    res.df; res.paths; res.figures["prefill"]

CLI: ``python benchmarks/sweep.py --help``. Three kinds of points, all timed with host
clocks from ``llm.metrics`` with the torch profiler off:

* ``prefill`` (per ``max_num_batched_tokens``): workload prompts with ``max_tokens=1``;
  steady state = prefill-only steps after ``warmup_steps``, the last (partial) step
  dropped. Reports ms per prefill step and non-cached input tokens/s per device.
* ``decode`` (per batch size B = ``max_num_seqs``): B requests generating together;
  steady state = steps where all B decode and nothing prefills, after ``warmup_steps``.
  Reports tokens/s per user and per device, using the measured effective tokens per step
  (REFERENCE.md section 4): tokens emitted per request per step, i.e. accepted drafts + 1
  with speculative decoding (whose acceptance, mean accepted length and verify rows per
  step sit beside them in ``spec_*`` columns), 1 without.
* ``workload`` (per concurrency C = ``max_num_seqs``): the workload's requests with their
  own prompt/output lengths, all submitted at once so at most C run (a closed loop);
  reports TTFT / TPOT / ITL percentiles and throughput.

One engine serves every point: limits change in place (:func:`set_batch_limits`), so the
engine is built with the largest ``max_num_seqs`` of the sweep.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm.auto import tqdm

from deepinfer.profiling.workload import (DEFAULT_WORKLOAD, WorkloadRequest, load_workload, scale_workload,
                                          synth_prompts)

if TYPE_CHECKING:
    import pandas as pd

    from deepinfer.llm import LLM

__all__ = ["SweepSpec", "SweepResult", "run_sweep", "set_batch_limits", "measure_prefill", "measure_decode",
           "measure_workload"]


@dataclass
class SweepSpec:
    """What to sweep. Empty tuples skip that kind of point."""

    workload: str = DEFAULT_WORKLOAD
    prefill_budgets: tuple[int, ...] = (64, 128, 256, 512)
    decode_batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    concurrency: tuple[int, ...] = (1, 4)
    num_workload_requests: int = 16
    warmup_steps: int = 2
    measure_steps: int = 6
    seed: int = 0


@dataclass
class SweepResult:
    """Rows (one per point), the run's metadata, written files and the two charts."""

    df: pd.DataFrame
    meta: dict[str, Any]
    paths: dict[str, str] = field(default_factory=dict)
    figures: dict[str, Any] = field(default_factory=dict)


def set_batch_limits(llm: LLM, max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None) -> None:
    """Change the scheduler's per-step limits in place (the engine must be idle).

    ``max_num_seqs`` may not exceed the state slots the KV cache was built with."""
    if llm.scheduler.has_unfinished():
        raise RuntimeError("set_batch_limits needs an idle engine (requests are in flight)")
    sched = llm.scheduler.config
    seqs = sched.max_num_seqs if max_num_seqs is None else int(max_num_seqs)
    tokens = sched.max_num_batched_tokens if max_num_batched_tokens is None else int(max_num_batched_tokens)
    if not 1 <= seqs <= llm.kv_manager.max_num_seqs:
        raise ValueError(f"max_num_seqs={seqs} must be in [1, {llm.kv_manager.max_num_seqs}] "
                         "(the engine's state slots); build the LLM with a larger max_num_seqs")
    llm.config = dataclasses.replace(llm.config, max_num_seqs=seqs, max_num_batched_tokens=tokens)
    sched.max_num_seqs, sched.max_num_batched_tokens = seqs, tokens


def _run(llm: LLM, reqs: Sequence[WorkloadRequest], seed: int) -> pd.DataFrame:
    """Generate ``reqs`` (exact output lengths) on a fresh metrics window; return its steps."""
    from deepinfer.sampling_params import SamplingParams

    llm.metrics.reset()
    params = [SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0.0) for r in reqs]
    llm.generate(prompt_token_ids=synth_prompts(reqs, seed, llm.model_config.vocab_size), sampling_params=params, use_tqdm=False)
    return llm.metrics.steps_df()


def _window(steps: pd.DataFrame, mask: Any, spec: SweepSpec, drop_last: bool = False) -> pd.DataFrame:
    """Steady-state steps: rows matching ``mask`` after ``warmup_steps``, at most ``measure_steps``."""
    rows = steps[mask]
    if drop_last and len(rows) > 1:
        rows = rows.iloc[:-1]
    return rows.iloc[spec.warmup_steps: spec.warmup_steps + spec.measure_steps]


def _base_row(llm: LLM, kind: str) -> dict[str, Any]:
    cfg = llm.config
    return {"kind": kind, "max_num_seqs": cfg.max_num_seqs, "max_num_batched_tokens": cfg.max_num_batched_tokens,
            "engine_config": json.dumps(cfg.to_dict(), sort_keys=True, default=str)}


def measure_prefill(llm: LLM, workload: Sequence[WorkloadRequest], budget: int, spec: SweepSpec,
                    seed: int = 0) -> dict[str, Any]:
    """One prefill point at ``max_num_batched_tokens=budget``."""
    set_batch_limits(llm, max_num_batched_tokens=budget)
    need = (spec.warmup_steps + spec.measure_steps + 2) * budget
    reqs, total, i = [], 0, 0
    for r in scale_workload(workload, len(workload), max_len=llm.config.max_model_len):
        if total >= need or i >= 4 * len(workload):
            break
        reqs.append(WorkloadRequest(r.prompt_len, 1))
        total, i = total + r.prompt_len, i + 1
    steps = _run(llm, reqs, seed)
    win = _window(steps, (steps["decode_tokens"] == 0) & (steps["prefill_tokens"] > 0), spec, drop_last=True)
    row = _base_row(llm, "prefill")
    secs = win["step_ms"].sum() / 1e3
    row.update(batch_size=len(reqs), prompt_len=float(np.mean([r.prompt_len for r in reqs])),
               context_len=float(np.mean([r.prompt_len for r in reqs])), steps_measured=len(win),
               prefill_ms_per_step=float(win["step_ms"].median()) if len(win) else float("nan"),
               prefill_tokens_per_step=float(win["prefill_tokens"].mean()) if len(win) else float("nan"),
               prefill_tok_s_per_device=float(win["prefill_tokens"].sum() / secs) if secs > 0 else float("nan"))
    return row


def measure_decode(llm: LLM, workload: Sequence[WorkloadRequest], batch: int, spec: SweepSpec,
                   seed: int = 0) -> dict[str, Any]:
    """One decode point: ``batch`` requests decoding together (``max_num_seqs=batch``)."""
    drafts = llm.runner.spec
    per_step = 1 + (drafts.k if drafts is not None else 0)  # most tokens a request emits per step
    base = scale_workload(workload, batch, max_len=llm.config.max_model_len // 2)
    # a decode point needs all B requests (each a token + its drafts) in one step, and their
    # prompts prefilled before the first ones finish: with speculation, decoding requests eat
    # k + 1 tokens of the budget each and starve the later prefills (measured: B=64 never all
    # decoding at a 256-token budget). So the point's budget holds B x (k + 1) tokens and the
    # prompts (up to 8k); the sweep restores the engine's budget after the point.
    prompts = sum(r.prompt_len for r in base)
    set_batch_limits(llm, max_num_seqs=batch, max_num_batched_tokens=max(
        llm.config.max_num_batched_tokens, batch * per_step + min(prompts, 8192) if per_step > 1 else 0))
    budget = llm.config.max_num_batched_tokens
    stagger = -(-sum(r.prompt_len for r in base) // budget) + 2
    steps_needed = spec.warmup_steps + spec.measure_steps + stagger
    out_len = min(steps_needed * per_step, llm.config.max_model_len // 2)
    reqs = [WorkloadRequest(min(r.prompt_len, llm.config.max_model_len - out_len - 1), out_len) for r in base]
    if drafts is not None:
        drafts.metrics.reset()
    steps = _run(llm, reqs, seed)
    win = _window(steps, (steps["prefill_tokens"] == 0) & (steps["num_decode_reqs"] == batch), spec)
    row = _base_row(llm, "decode")
    step_s = float(win["step_ms"].median()) / 1e3 if len(win) else float("nan")
    eff = float(win["output_tokens"].sum() / win["num_decode_reqs"].sum()) if len(win) else float("nan")
    prompt = float(np.mean([r.prompt_len for r in reqs]))
    # why a window can come out empty: never all B decoding together (preempted, budget-bound)
    row.update(steps_total=len(steps), max_decode_reqs=int(steps["num_decode_reqs"].max()) if len(steps) else 0,
               preemptions=int(steps["preemptions"].sum()) if len(steps) else 0)
    row.update(batch_size=batch, prompt_len=prompt, steps_measured=len(win), decode_step_ms=step_s * 1e3,
               context_len=prompt + stagger + spec.warmup_steps + spec.measure_steps / 2,
               effective_tokens_per_step=eff, tok_s_per_user=eff / step_s, tok_s_per_device=batch * eff / step_s)
    if drafts is not None:  # over the whole point (warm-up included): acceptance is per draft, not per step
        m = drafts.metrics
        row.update(spec_method=type(drafts.drafter).__name__, spec_num_speculative_tokens=drafts.k,
                   spec_varlen=drafts.varlen, spec_mean_accepted_length=m.mean_accepted_length,
                   spec_verify_tokens_per_step=m.verify_tokens_per_step,
                   spec_acceptance_per_position=json.dumps([round(a, 4) for a in m.acceptance_per_position()]))
    return row


def measure_workload(llm: LLM, workload: Sequence[WorkloadRequest], concurrency: int, spec: SweepSpec,
                     seed: int = 0) -> dict[str, Any]:
    """One closed-loop point: the workload with at most ``concurrency`` requests running."""
    set_batch_limits(llm, max_num_seqs=concurrency)
    reqs = scale_workload(workload, spec.num_workload_requests, max_len=llm.config.max_model_len)
    _run(llm, reqs, seed)
    s = llm.metrics.summary()
    row = _base_row(llm, "workload")
    row.update(batch_size=concurrency, concurrency=concurrency, num_requests=s["num_requests"],
               num_finished=s["num_finished"], prompt_len=float(np.mean([r.prompt_len for r in reqs])),
               output_len=float(np.mean([r.output_len for r in reqs])), wall_s=s["wall_s"],
               output_tok_s=s["output_tok_per_s"], tok_s_per_device=s["output_tok_per_s"],
               requests_per_s=s["num_finished"] / s["wall_s"] if s["wall_s"] else float("nan"),
               **{k: s[k] for k in ("mean_ttft_ms", "p50_ttft_ms", "p90_ttft_ms", "mean_tpot_ms", "p50_tpot_ms",
                                    "p90_tpot_ms", "mean_itl_ms", "p99_itl_ms", "mean_batch_size", "preemptions")})
    return row


def run_sweep(llm: LLM | None = None, spec: SweepSpec | None = None, engine_kwargs: dict[str, Any] | None = None,
              name: str | None = None, out_dir: str | None = None, progress: bool = True,
              write_png: bool = False, time_budget_s: float | None = None) -> SweepResult:
    """Run every point of ``spec`` on ``llm`` (built from ``engine_kwargs`` when None) and,
    when ``out_dir`` is given, write ``<name>.csv``, ``<name>.json`` and the two charts.
    Points not started within ``time_budget_s`` are skipped (listed in ``meta["skipped"]``)."""
    import pandas as pd

    from deepinfer.profiling import records

    try:
        from deepinfer.profiling import charts
    except ImportError:
        charts = None

    spec = spec or SweepSpec()
    if llm is None:
        from deepinfer.llm import LLM

        kwargs = dict(engine_kwargs or {})
        kwargs.setdefault("max_num_seqs", max((*spec.decode_batch_sizes, *spec.concurrency, 1)))
        kwargs.setdefault("max_num_batched_tokens", max((*spec.prefill_budgets, 256)))
        llm = LLM(**kwargs)
    if records.torch_profiler_active():
        raise RuntimeError("run_sweep times with the torch profiler off; stop the active profiler first")
    workload = load_workload(spec.workload)
    limits = (llm.config.max_num_seqs, llm.config.max_num_batched_tokens)
    points = ([("prefill", b) for b in spec.prefill_budgets] + [("decode", b) for b in spec.decode_batch_sizes]
              + [("workload", c) for c in spec.concurrency])
    measure = {"prefill": measure_prefill, "decode": measure_decode, "workload": measure_workload}
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    start = time.perf_counter()
    try:
        _run(llm, scale_workload(workload, 2, output_len=4, max_len=llm.config.max_model_len), spec.seed)  # warm-up
        for i, (kind, value) in enumerate(tqdm(points, desc="sweep", disable=not progress)):
            if time_budget_s is not None and time.perf_counter() - start > time_budget_s:
                skipped.append(f"{kind}:{value}")
                continue
            set_batch_limits(llm, *limits)
            rows.append(measure[kind](llm, workload, value, spec, seed=spec.seed + 1 + i))
    finally:
        set_batch_limits(llm, *limits)
        llm.metrics.reset()
    meta = records.run_metadata(llm, spec=dataclasses.asdict(spec), skipped=skipped,
                                sweep_wall_s=round(time.perf_counter() - start, 2))
    df = pd.DataFrame(rows)
    for key in ("commit", "hardware", "device", "dtype", "max_model_len", "model"):
        df[key] = meta[key]
    figures = ({"prefill": charts.prefill_chart(df), "decode": charts.decode_chart(df)}
               if charts is not None else {})  # a machine without plotly still records the numbers
    res = SweepResult(df=df, meta=meta, figures=figures)
    if out_dir is not None:
        res.paths = records.write_results(df, meta, figures, out_dir, name or meta["default_name"], png=write_png)
    return res
