"""Where the confidence-scheduled verify budget gets its step-time curve T(tokens).

In order (`curve_for_engine`, called by `deepinfer.spec.setup` when
``enable_mtp_varlen`` is on):

1. a measured curve given as configuration: ``DEEPINFER_SPEC_STEP_CURVE`` = a
   ``spec_step_curve_*.json`` file or a directory of them (``benchmarks/spec_step_curve.py``
   writes them), used when its ``hardware`` and ``model_signature`` match this engine. The
   engine never looks in ``profiling/results`` by itself: results are records of past runs
   (another commit, another machine), not inputs, so an engine's behaviour does not change
   when someone commits a result file;
2. else (unset, ``profile``, or no match) a curve profiled at start-up: a few verify-shaped
   steps of the model (forward + logits + sampler) at total sizes 1, 2, 4, ... up to the
   largest step the engine can plan, timed with host clocks after a device sync, made
   non-decreasing (a point below a smaller size's is timing noise: no bigger step costs
   less, and an inverted curve would make the scheduler buy rows for nothing);
   the profile is cached (`load_cached_curve` / `save_cached_curve`) as a small JSON under
   ``<DEEPINFER_CACHE_DIR>/step_curves/``, keyed by the device's name, a hash of the model's
   whole config, the dtype and what shapes the profile (draft length, largest step, the
   executor), not by commit: the next engine of the same model on the same hardware
   reloads it instead of profiling (unset ``DEEPINFER_SPEC_STEP_CURVE``; ``profile`` always
   profiles and refreshes the cache; ``DEEPINFER_SPEC_STEP_CURVE_CACHE=0`` neither reads
   nor writes it);
3. either way wrapped in `OnlineStepTimeCurve`, which replaces a size's value by the
   running median of the verify steps the engine actually ran at that size, and scales
   sizes not seen yet by the median ratio observed / predicted (REFERENCE.md section 8).

The profile writes KV rows of blocks 0.. and resets state slots 0..: it runs before any
request exists (nothing is cached or running yet), and every row is rewritten before a
later request reads it.
"""

from __future__ import annotations

import bisect
import dataclasses
import glob
import hashlib
import json
import os
import statistics
import time
from collections import deque
from pathlib import Path

import torch

from deepinfer import batch_invariant, envs

from .scheduling import StepTimeCurve

ENV_CURVE = "DEEPINFER_SPEC_STEP_CURVE"  # declared in deepinfer/envs.py
CACHE_ENV = "DEEPINFER_SPEC_STEP_CURVE_CACHE"  # declared in deepinfer/envs.py: 0 = no start-up curve cache
CACHE_VERSION = 2  # bump when the profile's method changes: older cached curves are then ignored
SIGNATURE_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                  "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "vocab_size")


def hardware_key(device: torch.device) -> str:
    """What a measured curve must have been recorded on: the GPU's name, or the CPU model."""
    from deepinfer.profiling.records import device_name, hardware_name

    return device_name(device) if device.type != "cpu" else hardware_name()


def model_signature(cfg, dtype: torch.dtype) -> dict:
    """The model shape a step time depends on (a curve of another model does not apply)."""
    sig = {k: getattr(cfg, k) for k in SIGNATURE_KEYS if hasattr(cfg, k)}
    sig["dtype"] = str(dtype).split(".")[-1]
    return sig


def curve_record(llm, rows: list[dict]) -> dict:
    """The keys a curve file needs to be found again for this engine (`find_measured_curve`):
    ``hardware``, ``model_signature`` and ``rows`` of ``{batch, verify_per_request, step_ms}``."""
    return {"hardware": hardware_key(llm.device), "model_signature": model_signature(llm.model_config, llm.model.dtype),
            "rows": rows}


def find_measured_curve(hardware: str, signature: dict, where: str | os.PathLike
                        ) -> tuple[StepTimeCurve, str] | None:
    """The newest matching ``spec_step_curve_*.json`` under ``where`` (a file or directory),
    as (curve, path); None when none matches."""
    where = Path(where)
    paths = [where] if where.is_file() else sorted(map(Path, glob.glob(str(where / "spec_step_curve_*.json"))),
                                                   key=lambda p: p.stat().st_mtime, reverse=True)
    for path in paths:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if data.get("hardware") == hardware and data.get("model_signature") == signature and data.get("rows"):
            return StepTimeCurve.from_profile(data), str(path)
    return None


class OnlineStepTimeCurve:
    """A base curve corrected by running medians of measured verify steps.

    ``observe(tokens, seconds)`` files a measured step under its grid size (the smallest
    base size >= tokens, i.e. the captured graph it would pad to). A size with at least
    ``min_obs`` observations answers with their median (the last ``window``); other sizes
    answer base(tokens) x the median of observed / predicted over all recent steps."""

    def __init__(self, base: StepTimeCurve, window: int = 32, min_obs: int = 3) -> None:
        self.base, self.min_obs = base, min_obs
        self.obs: dict[int, deque[float]] = {}
        self.ratios: deque[float] = deque(maxlen=4 * window)
        self.window = window

    def _grid(self, tokens: int) -> int:
        i = bisect.bisect_left(self.base.tokens, tokens)
        return self.base.tokens[i] if i < len(self.base.tokens) else tokens

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens < 1 or not seconds > 0:
            return
        g = self._grid(tokens)
        self.obs.setdefault(g, deque(maxlen=self.window)).append(seconds)
        self.ratios.append(seconds / self.base(tokens))

    def __call__(self, tokens: int) -> float:
        seen = self.obs.get(self._grid(tokens))
        if seen is not None and len(seen) >= self.min_obs:
            return statistics.median(seen)
        scale = statistics.median(self.ratios) if len(self.ratios) >= self.min_obs else 1.0
        return self.base(tokens) * scale


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _verify_logits(llm, so, batch) -> torch.Tensor:
    """Every row's logits through the path a verify step of ``so``'s shape takes: the spec
    runner's (verify graphs, compiled prefill or reference), the model's without one."""
    spec = llm.runner.spec
    if spec is None:
        return llm.model.compute_logits(llm.model(batch, llm.kv_cache))
    (_, _, logits_of), _ = spec._forward(llm.runner, so, batch)
    return logits_of(torch.arange(batch.num_tokens, device=llm.device))


@torch.no_grad()
def profile_step_curve(llm, max_tokens: int, repeats: int = 2, budget_s: float = 20.0) -> StepTimeCurve:
    """Time verify-shaped steps of ``llm``'s model at total sizes 1, 2, 4, ... <= max_tokens
    (and max_tokens): R requests of at most k + 1 rows each, forward + logits + sampler.
    Median of ``repeats`` after one warm-up; stops early past ``budget_s`` (the curve
    extrapolates linearly beyond its largest size)."""
    from deepinfer.engine.outputs import SchedulerOutput, ScheduledRequest
    from deepinfer.engine.sampler import SamplingTensors
    from deepinfer.sampling_params import SamplingParams

    runner, k = llm.runner, llm.config.num_speculative_tokens
    per_req = k + 1
    pools = llm.kv_manager.pools
    n_blocks = min(p.num_blocks for p in pools.values())
    slots = llm.kv_manager.max_num_seqs
    sizes = sorted({min(1 << i, max_tokens) for i in range(max(1, max_tokens).bit_length() + 1)})
    greedy = SamplingParams(temperature=0.0)
    tokens, seconds, start = [], [], time.perf_counter()
    for n in sizes:
        reqs, left = [], n
        while left:
            r, v = len(reqs), min(per_req, left)
            ids = [(7 * r + j) % llm.model_config.vocab_size for j in range(v)]
            # continuing requests (not new): the step verification runs, decode-like
            reqs.append(ScheduledRequest(f"profile-{r}", ids, 0, {g: [r % n_blocks] for g in pools}, r % slots,
                                         False, True, greedy, 0, v, num_draft_tokens=v - 1))
            left -= v
        so = SchedulerOutput(reqs, n)
        times = []
        for rep in range(repeats + 1):
            _sync(llm.device)
            t0 = time.perf_counter()
            batch = runner.build_batch(so)
            logits = _verify_logits(llm, so, batch)
            params = SamplingTensors.from_params([greedy] * n, list(range(n)), llm.device)
            runner.sampler.sample(logits, params).token_ids.tolist()
            _sync(llm.device)
            if rep:
                times.append(time.perf_counter() - t0)
        tokens.append(n)
        seconds.append(statistics.median(times))
        if time.perf_counter() - start > budget_s:
            break
    return StepTimeCurve(tokens, seconds)


def monotone(curve: StepTimeCurve) -> StepTimeCurve:
    """``curve`` with every point raised to the largest of the smaller sizes' (running max)."""
    out, top = [], 0.0
    for sec in curve.seconds:
        top = max(top, sec)
        out.append(top)
    return StepTimeCurve(list(curve.tokens), out, curve.sampler_seconds)


def config_hash(cfg) -> str:
    """sha256 of the model config's fields (paths left out: a moved checkpoint is the same model)."""
    fields = dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else dict(vars(cfg))
    kept = {k: v for k, v in fields.items() if not k.startswith("_") and "path" not in k and "dir" not in k}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()


def cache_key(llm, max_tokens: int) -> dict:
    """What a cached start-up curve must match (no commit: a rebuild does not re-profile)."""
    fast = getattr(llm.runner, "fast", None)
    executor = ("compiled" + ("+graphs" if fast.graphs_enabled else "")) if fast is not None else "reference"
    return {"version": CACHE_VERSION, "hardware": hardware_key(llm.device),
            "model_config_sha256": config_hash(llm.model_config), "dtype": str(llm.model.dtype).split(".")[-1],
            "num_speculative_tokens": int(llm.config.num_speculative_tokens), "max_tokens": int(max_tokens),
            "executor": executor + ("+invariant" if batch_invariant.enabled() else "")}


def cache_path(key: dict) -> Path:
    """The cache file of ``key`` under ``<DEEPINFER_CACHE_DIR>/step_curves``."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return Path(envs.get("DEEPINFER_CACHE_DIR")) / "step_curves" / f"step_curve_{digest}.json"


def load_cached_curve(key: dict) -> tuple[StepTimeCurve, str] | None:
    """The cached curve of ``key`` and its path; None when there is none, it is unreadable or
    it was written for another key (a digest collision or a hand-edited file)."""
    path = cache_path(key)
    try:
        data = json.loads(path.read_text())
        if data.get("key") != key:
            return None
        tokens, seconds = [int(t) for t in data["tokens"]], [float(x) for x in data["seconds"]]
        if not tokens or len(tokens) != len(seconds) or not all(x > 0 for x in seconds):
            return None
        return StepTimeCurve(tokens, seconds), str(path)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def save_cached_curve(key: dict, curve: StepTimeCurve, raw: StepTimeCurve) -> str | None:
    """Write the curve (and the raw profile it came from) atomically; None when the cache
    directory is not writable (the engine runs on with its profiled curve)."""
    path = cache_path(key)
    record = {"key": key, "tokens": curve.tokens, "seconds": curve.seconds, "raw_seconds": raw.seconds,
              "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record, indent=1))
        os.replace(tmp, path)
    except OSError:
        return None
    return str(path)


def curve_for_engine(llm) -> tuple[OnlineStepTimeCurve, str]:
    """(the curve the confidence scheduler uses, where its base came from: ``measured:<path>``,
    ``cached:<path>`` or ``profiled``); see the module docstring."""
    where = envs.get(ENV_CURVE)
    if where is not None and where != "profile":
        found = find_measured_curve(hardware_key(llm.device), model_signature(llm.model_config, llm.model.dtype),
                                    where)
        if found is not None:
            return OnlineStepTimeCurve(found[0]), f"measured:{found[1]}"
    cfg = llm.config
    most = min(cfg.max_num_seqs * (cfg.num_speculative_tokens + 1), cfg.max_num_batched_tokens)
    use_cache = envs.get(CACHE_ENV)
    key = cache_key(llm, most) if use_cache else None
    if key is not None and where != "profile":
        cached = load_cached_curve(key)
        if cached is not None:
            return OnlineStepTimeCurve(cached[0]), f"cached:{cached[1]}"
    raw = profile_step_curve(llm, most)
    curve = monotone(raw)
    if key is not None:
        save_cached_curve(key, curve, raw)
    return OnlineStepTimeCurve(curve), "profiled"
