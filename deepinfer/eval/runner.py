"""`generate`: run a benchmark through `LLM.chat` into a resumable JSONL of raw outputs.

Each line is one item::

    benchmark, id, prompt, reference, answer_type, choices, skipped,
    output_text (raw), content / reasoning_content / tool_calls (recipe-parsed),
    num_prompt_tokens, num_output_tokens, finish_reason (engine), chat_finish_reason, latency_s,
    seed (the item's seq_seed), eval_seed, thinking, sampling_params,
    model, engine_config, commit, timestamp, data_note

Per-item seeds derive from (benchmark, eval seed, item id), so a resumed run samples
exactly what an uninterrupted one would have. Scoring lives in ``deepinfer.eval.report``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from deepinfer.chat.outputs import ChatOutput
from deepinfer.chat.runner import replace_sampling_params
from deepinfer.eval.loaders import EvalItem, load_benchmark
from deepinfer.eval.records import append_record, exclusive, git_commit, jsonable, read_records
from deepinfer.sampling_params import SamplingParams

__all__ = ["GenerateResult", "generate_eval", "item_seed", "ResumeMismatchError", "DEFAULT_EVAL_PARAMS"]

#: Sampling used when none is given: DeepSeek's thinking-mode settings, a long answer budget.
DEFAULT_EVAL_PARAMS = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=32768)
# settings that must agree between an existing file and a resumed run (else records mix)
_RUN_KEYS = ("benchmark", "eval_seed", "thinking", "sampling_params", "model")


class ResumeMismatchError(ValueError):
    """The output file holds records made with different settings than this run."""


@dataclass
class GenerateResult:
    """What one `generate_eval` call did (throughput counts only this call's generation)."""

    out_path: str
    n_items: int
    n_existing: int
    n_generated: int
    n_skipped: int
    prompt_tokens: int
    output_tokens: int
    wall_s: float

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def items_per_s(self) -> float:
        return self.n_generated / self.wall_s if self.wall_s > 0 else 0.0


def item_seed(benchmark: str, eval_seed: int, item_id: str) -> int:
    """The uint64 sampling seed of one item (stable across runs and resumes)."""
    digest = hashlib.sha256(f"{benchmark}:{eval_seed}:{item_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def _sampling_dict(params: SamplingParams) -> dict[str, Any]:
    d = dataclasses.asdict(params)
    d.pop("seq_seed", None)  # per item; recorded as "seed"
    d.pop("structured_output", None)
    return jsonable(d)


def _check_resume(existing: list[dict[str, Any]], run: dict[str, Any], out_path: Path) -> None:
    for rec in existing:
        diff = [k for k in (*_RUN_KEYS, "engine_config") if k in rec and k in run and rec[k] != run[k]]
        if diff:
            theirs, ours = {k: rec[k] for k in diff}, {k: run[k] for k in diff}
            if "engine_config" in diff:  # name the engine fields, not two whole configs
                keys = sorted(k for k in {*rec["engine_config"], *run["engine_config"]}
                              if rec["engine_config"].get(k) != run["engine_config"].get(k))
                theirs["engine_config"] = {k: rec["engine_config"].get(k) for k in keys}
                ours["engine_config"] = {k: run["engine_config"].get(k) for k in keys}
            raise ResumeMismatchError(
                f"{out_path} holds record {rec.get('id')!r} made with different {diff} "
                f"(file: {theirs}, this run: {ours}); write to a new file or delete it to start over")


def _base_record(item: EvalItem, run: dict[str, Any]) -> dict[str, Any]:
    return {"benchmark": item.benchmark, "id": item.id, "prompt": item.prompt, "reference": item.reference,
            "answer_type": item.answer_type, "choices": item.choices, "skipped": item.skip_reason,
            **run, "data_note": item.meta.get("sample_note")}


def generate_eval(llm: Any, benchmark: str, data_path: str | Path, out_path: str | Path,
                  sampling_params: SamplingParams | None = None, *, seed: int = 0, thinking: bool = True,
                  batch_size: int = 16, limit: int | None = None, use_tqdm: bool = True) -> GenerateResult:
    """Generate one record per item of ``data_path`` into ``out_path``, resuming if it exists.

    Args:
        llm: a ``deepinfer.LLM`` (anything with ``chat``, ``config`` and ``model_dir``).
        benchmark: ``"aime"`` | ``"gpqa"`` | ``"hle"``.
        sampling_params: the template for every item (``seq_seed`` is replaced per item);
            default :data:`DEFAULT_EVAL_PARAMS`.
        seed: the eval seed: per-item sampling seeds and GPQA option order derive from it.
        thinking: chat in thinking mode (the answer is graded from the text after ``</think>``).
        batch_size: items per ``llm.chat`` call; a crash loses at most one batch of work.
        limit: only the first ``limit`` items (quick looks).

    Raises:
        ResumeMismatchError: ``out_path`` already holds records made with other settings.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    out_path = Path(out_path)
    if out_path.is_dir():
        raise ValueError(f"--out {out_path} is a directory; give the generation file to write, e.g. "
                         f"{out_path / (benchmark + '.jsonl')}")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with exclusive(out_path):  # one writer per file: a concurrent run fails here, duplicates nothing
        return _generate_locked(llm, benchmark, data_path, out_path, sampling_params, seed=seed, thinking=thinking,
                                batch_size=batch_size, limit=limit, use_tqdm=use_tqdm)


def _generate_locked(llm: Any, benchmark: str, data_path: str | Path, out_path: Path,
                     sampling_params: SamplingParams | None, *, seed: int, thinking: bool, batch_size: int,
                     limit: int | None, use_tqdm: bool) -> GenerateResult:
    items = load_benchmark(benchmark, data_path, seed)[:limit]
    base = sampling_params if sampling_params is not None else DEFAULT_EVAL_PARAMS
    run = {"benchmark": benchmark, "eval_seed": seed, "thinking": thinking,
           "sampling_params": _sampling_dict(base), "model": str(getattr(llm, "model_dir", None))}
    provenance = {"engine_config": jsonable({k: v for k, v in dataclasses.asdict(llm.config).items()
                                             if k != "sources"}), "commit": git_commit()}
    existing = read_records(out_path)
    # the engine config is recorded per record and must agree on resume (no mixed dtypes)
    _check_resume(existing, {**run, "engine_config": provenance["engine_config"]}, out_path)
    done = {str(r["id"]) for r in existing}
    pending = [it for it in items if it.id not in done]
    result = GenerateResult(str(out_path), len(items), len(items) - len(pending), 0, 0, 0, 0, 0.0)
    bar = tqdm(total=len(items), initial=result.n_existing, desc=f"eval {benchmark}", disable=not use_tqdm)
    with bar, open(out_path, "a", encoding="utf-8") as f:
        for item in [it for it in pending if it.skip_reason]:
            append_record(f, {**_base_record(item, run), **provenance, "output_text": None,
                              "timestamp": datetime.now(timezone.utc).isoformat()})
            result.n_skipped += 1
            bar.update(1)
        todo = [it for it in pending if not it.skip_reason]
        for start in range(0, len(todo), batch_size):
            batch = todo[start:start + batch_size]
            params = [replace_sampling_params(base, seq_seed=item_seed(benchmark, seed, it.id)) for it in batch]
            t0 = time.perf_counter()
            outs = llm.chat([[{"role": "user", "content": it.prompt}] for it in batch], params,
                            thinking=thinking, use_tqdm=False)
            result.wall_s += time.perf_counter() - t0
            for item, sp, out in zip(batch, params, outs):
                rec = {**_base_record(item, run), **provenance, **_output_fields(out), "seed": sp.seq_seed}
                append_record(f, rec)
                result.n_generated += 1
                result.prompt_tokens += rec["num_prompt_tokens"] or 0
                result.output_tokens += rec["num_output_tokens"] or 0
                bar.update(1)
    return result


def _output_fields(out: ChatOutput) -> dict[str, Any]:
    """The generated part of a record: raw text, the recipe's parse, token counts, timing."""
    raw = out.output
    m = raw.metrics if raw is not None else None
    return {"output_text": raw.text if raw is not None else out.content,
            "content": out.content, "reasoning_content": out.reasoning_content,
            "tool_calls": [c.to_openai() for c in out.tool_calls],
            "finish_reason": raw.finish_reason if raw is not None else out.finish_reason,  # engine's
            "chat_finish_reason": out.finish_reason,  # the recipe's: stop | length | tool_calls
            "num_prompt_tokens": len(raw.prompt_token_ids) if raw is not None else None,
            "num_output_tokens": len(raw.token_ids) if raw is not None else None,
            "latency_s": (m.finished_time - m.arrival_time) if m and m.finished_time else None,
            "timestamp": datetime.now(timezone.utc).isoformat()}
