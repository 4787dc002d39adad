"""Structured output on real-world schemas: rejected / valid / invalid / length, compile time.

For each schema of a corpus sample (``corpus.py``), through the engine's own path:

1. admission (``StructuredOutputManager.check``: deepinfer's rules, the backend choice,
   the backend's parser): a rejection is counted with its reason (the first clause);
2. compilation over the model's whole vocabulary, timed (``pool.submit(spec).result()``,
   admission included in the time, as a request sees it);
3. one ``LLM.generate`` over every admitted schema at once (temperature 1, ``max_tokens``),
   each output classified: ``valid`` (finished "stop" and validates with jsonschema, formats
   checked, ``multipleOf`` in decimal arithmetic: ``validator_for``), ``invalid`` (finished "stop" and does not: the number that must be 0), or
   ``length`` (ran out of tokens; incomplete output is never "stop").

``admission_only`` runs step 1 alone (no vocabulary work), fast enough for a whole corpus.
"""

from __future__ import annotations

import json
import statistics
import time
from collections import Counter
from decimal import Decimal
from typing import Any

from deepinfer.errors import InvalidRequestError

__all__ = ["admission_only", "run_corpus", "percentile", "validator_for"]

_PROMPT = "Produce one JSON value that follows this JSON schema.\nSchema: {schema}\nJSON: "


def percentile(values: list[float], q: float) -> float:
    """The ``q``-quantile (0..1) by linear interpolation; nan for no values."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (pos - lo)


def _reason(error: Exception) -> str:
    text = str(error).removeprefix("sampling_params[0]: ").removeprefix("SamplingParams.structured_output: ")
    return text.split(";")[0][:160]


def _exact_multiple_of(validator: Any, divisor: Any, instance: Any, schema: dict) -> Any:
    """``multipleOf`` in decimal arithmetic, as JSON Schema defines it on the JSON number: jsonschema
    divides binary floats, so e.g. 8518026.28 "is not a multiple of 0.01" there."""
    import jsonschema

    if not validator.is_type(instance, "number"):
        return
    quotient = Decimal(repr(instance)) / Decimal(repr(divisor))
    if quotient != quotient.to_integral_value():
        yield jsonschema.ValidationError(f"{instance!r} is not a multiple of {divisor!r}")


def validator_for(schema: dict) -> Any:
    """The jsonschema validator of the schema's draft (2020-12 by default), formats checked,
    ``multipleOf`` decimal-exact."""
    import jsonschema

    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    cls = jsonschema.validators.extend(cls, {"multipleOf": _exact_multiple_of})
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


_validator = validator_for


def admission_only(items: list[tuple[str, str, str]], mode: str | None = None) -> dict[str, Any]:
    """Admission (no vocabulary) of every ``(category, name, text)``: counts per backend and reason."""
    from deepinfer.structured.backends import plan_spec
    from deepinfer.structured.spec import StructuredOutputSpec

    backends, reasons, times = Counter(), Counter(), []
    for _, _, text in items:
        t0 = time.perf_counter()
        try:
            backends[plan_spec(StructuredOutputSpec("json", json.loads(text)), mode).backend] += 1
        except InvalidRequestError as e:
            backends["rejected"] += 1
            reasons[_reason(e)] += 1
        times.append(time.perf_counter() - t0)
    n = len(items)
    return {"schemas": n, "backends": dict(backends), "rejected": backends["rejected"],
            "rejected_frac": backends["rejected"] / max(n, 1), "top_reasons": reasons.most_common(15),
            "admission_s_p50": percentile(times, 0.5), "admission_s_p95": percentile(times, 0.95)}


def run_corpus(llm: Any, items: list[tuple[str, str, str]], max_tokens: int = 256, seed: int = 0) -> dict[str, Any]:
    """Admission, compile timing and generation for each item on ``llm`` (an ``LLM``)."""
    from deepinfer import SamplingParams

    manager = llm.structured
    rows: list[dict[str, Any]] = []
    admitted, params = [], []
    for i, (category, name, text) in enumerate(items):
        row: dict[str, Any] = {"category": category, "name": name}
        rows.append(row)
        schema = json.loads(text)
        try:
            sp = SamplingParams(temperature=1.0, max_tokens=max_tokens, seq_seed=seed + i,
                                structured_output={"json": schema})
            t0 = time.perf_counter()
            manager.check([sp])
            row["backend"] = manager.pool.plan(sp.structured_output).backend
            manager.pool.submit(sp.structured_output).result()
            row["compile_s"] = time.perf_counter() - t0
        except InvalidRequestError as e:
            row["outcome"], row["reason"] = "rejected", _reason(e)
            continue
        admitted.append((row, schema, text))
        params.append(sp)
    if params:
        prompts = [_PROMPT.format(schema=text[:400]) for _, _, text in admitted]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        gen_s = time.perf_counter() - t0
        for (row, schema, _), out in zip(admitted, outs):
            row["tokens"] = len(out.token_ids)
            if out.finish_reason != "stop":
                row["outcome"] = "length"
                continue
            try:
                ok = _validator(schema).is_valid(json.loads(out.text))
            except json.JSONDecodeError:
                ok = False
            row["outcome"] = "valid" if ok else "invalid"
            if not ok:
                row["text"] = out.text[:500]
    else:
        gen_s = 0.0
    counts = Counter(r["outcome"] for r in rows)
    compile_s = [r["compile_s"] for r in rows if "compile_s" in r]
    n = len(rows)
    return {"schemas": n, **{k: counts.get(k, 0) for k in ("rejected", "valid", "invalid", "length")},
            "rejected_frac": counts.get("rejected", 0) / max(n, 1),
            "backends": dict(Counter(r.get("backend", "rejected") for r in rows)),
            "compile_s_p50": percentile(compile_s, 0.5), "compile_s_p95": percentile(compile_s, 0.95),
            "compile_s_max": max(compile_s, default=float("nan")),
            "compile_s_mean": statistics.fmean(compile_s) if compile_s else float("nan"),
            "generate_s": gen_s, "max_tokens": max_tokens,
            "reasons": Counter(r["reason"] for r in rows if "reason" in r).most_common(15), "rows": rows}
