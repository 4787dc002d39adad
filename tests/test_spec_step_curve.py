"""The confidence scheduler's step-time curve: a measured curve file is used when its
hardware and model match, else the curve is profiled at start-up; running medians of the
verify steps the engine runs then correct it."""

from __future__ import annotations

import json

import pytest

from deepinfer.models.tiny import tiny_config, write_tiny_checkpoint
from deepinfer.spec.scheduling import StepTimeCurve
from deepinfer.spec.step_curve import ENV_CURVE, OnlineStepTimeCurve, curve_record, find_measured_curve

from spec_common import PARAMS, VOCAB, make_llm, mixed_prompts

ROWS = [{"batch": b, "verify_per_request": v, "step_ms": 10.0 + b * v} for b in (1, 4) for v in (1, 2, 3)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_curve")
    write_tiny_checkpoint(str(path), seed=3, cfg=tiny_config(vocab_size=VOCAB, sliding_window=32))
    return str(path)


@pytest.fixture(scope="module")
def profiled(ckpt):
    """An engine whose curve was profiled at start-up (no matching file on this machine)."""
    mp = pytest.MonkeyPatch()
    mp.setenv(ENV_CURVE, "profile")
    try:
        yield make_llm(ckpt, num_speculative_tokens=3, enable_mtp_varlen=True, max_num_seqs=4)
    finally:
        mp.undo()


def test_startup_profile_covers_every_plannable_size(profiled):
    spec = profiled.runner.spec
    assert spec.curve_source == "profiled" and isinstance(spec.curve, OnlineStepTimeCurve)
    base = spec.curve.base
    assert base.tokens == [1, 2, 4, 8, 16]  # up to max_num_seqs * (k + 1) = 16 verify rows
    assert all(s > 0 for s in base.seconds)


def test_measured_curve_of_this_hardware_and_model_is_loaded(ckpt, profiled, tmp_path, monkeypatch):
    good = curve_record(profiled, ROWS)
    other_model = dict(good, model_signature={**good["model_signature"], "hidden_size": 4096})
    other_hw = dict(good, hardware="NVIDIA H200")
    for name, rec in (("a_model", other_model), ("b_hw", other_hw), ("c_match", good)):
        (tmp_path / f"spec_step_curve_{name}.json").write_text(json.dumps(rec))
    found = find_measured_curve(good["hardware"], good["model_signature"], tmp_path)
    assert found is not None and found[1].endswith("spec_step_curve_c_match.json")
    assert found[0].tokens == [1, 2, 3, 4, 8, 12] and found[0](5) == pytest.approx(0.018)
    assert find_measured_curve("NVIDIA H200", good["model_signature"], tmp_path / "spec_step_curve_a_model.json") is None
    monkeypatch.setenv(ENV_CURVE, str(tmp_path))
    llm = make_llm(ckpt, num_speculative_tokens=3, enable_mtp_varlen=True, max_num_seqs=4)
    spec = llm.runner.spec
    assert spec.curve_source.startswith("measured:") and spec.curve_source.endswith("c_match.json")
    assert spec.curve.base.tokens == found[0].tokens and spec.curve.base.seconds == found[0].seconds


def test_running_medians_correct_the_curve():
    c = OnlineStepTimeCurve(StepTimeCurve([1, 2, 4, 8], [1.0, 1.0, 2.0, 4.0]), window=5, min_obs=3)
    assert c(3) == 2.0 and c(8) == 4.0
    c.observe(3, 6.0)
    c.observe(4, 5.0)
    assert c(3) == 2.0  # two observations of size 4 are not enough for its own median
    c.observe(3, 1.0)  # ratios observed / predicted: 3, 2.5, 0.5
    assert c(4) == 5.0 and c(3) == 5.0  # median of the three size-4 steps
    assert c(8) == pytest.approx(4.0 * 2.5)  # unseen size: base x median ratio
    for _ in range(5):  # the window keeps the last 5
        c.observe(4, 9.0)
    assert c(4) == 9.0


def test_engine_verify_steps_feed_the_running_medians(profiled):
    outs = profiled.generate(prompt_token_ids=mixed_prompts()[:4], sampling_params=PARAMS[:4], use_tqdm=False)
    assert all(len(o.token_ids) == p.max_tokens for o, p in zip(outs, PARAMS))
    curve = profiled.runner.spec.curve
    seen = {g: len(v) for g, v in curve.obs.items()}
    assert sum(seen.values()) >= 5 and set(seen) <= set(curve.base.tokens)
    assert len(curve.ratios) == sum(seen.values())


def test_profiling_script_writes_a_curve_this_engine_finds(tmp_path):
    """benchmarks/spec_step_curve.py (CPU smoke mode) -> JSON -> found again by hardware and model."""
    import importlib.util
    from pathlib import Path

    import torch

    from deepinfer.spec.step_curve import hardware_key, model_signature

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "spec_step_curve.py"
    spec = importlib.util.spec_from_file_location("spec_step_curve_script", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = Path(mod.main(["--smoke", "--batches", "1,2", "--max-verify", "2", "--steps", "1", "--out", str(tmp_path)]))
    data = json.loads(out.read_text())
    assert data["complete"] and data["greedy_spec_equals_off"] == data["greedy_spec_equals_off_v41_dspark"] == "4/4"
    assert [(r["batch"], r["verify_per_request"], r["rows"]) for r in data["rows"]] == [(1, 1, 1), (1, 2, 2),
                                                                                        (2, 1, 2), (2, 2, 4)]
    assert all(r["step_ms"] > 0 and 0 <= r["hbm_frac"] < 1 for r in data["rows"])
    sig = model_signature(tiny_config(vocab_size=VOCAB, sliding_window=32), torch.float32)
    assert find_measured_curve(hardware_key(torch.device("cpu")), sig, tmp_path) is None  # smoke files are skipped
    out.rename(tmp_path / "spec_step_curve_cpu_tiny.json")
    found = find_measured_curve(hardware_key(torch.device("cpu")), sig, tmp_path)
    assert found is not None and found[0].tokens == [1, 2, 4]


def test_engine_never_reads_result_files_unless_configured(ckpt, monkeypatch, tmp_path):
    """Without DEEPINFER_SPEC_STEP_CURVE the curve is measured at start-up: the engine does not
    look for files (profiling/results holds records of past runs, not inputs)."""
    import deepinfer.spec.step_curve as step_curve

    def tripwire(*args, **kwargs):
        raise AssertionError(f"the engine looked for a curve file: {args}")

    monkeypatch.delenv(ENV_CURVE, raising=False)
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path))  # no cached start-up curve from another test
    monkeypatch.setattr(step_curve, "find_measured_curve", tripwire)
    llm = make_llm(ckpt, num_speculative_tokens=3, enable_mtp_varlen=True, max_num_seqs=4)
    assert llm.runner.spec.curve_source == "profiled"


def test_monotone_raises_noise_dips_to_the_running_max():
    from deepinfer.spec.step_curve import monotone

    c = monotone(StepTimeCurve([1, 2, 4, 8], [3.0, 2.0, 5.0, 4.0]))
    assert c.tokens == [1, 2, 4, 8] and c.seconds == [3.0, 3.0, 5.0, 5.0]


def test_startup_curve_is_cached_per_hardware_and_model_and_reloaded(ckpt, monkeypatch, tmp_path):
    """The start-up profile lands in <DEEPINFER_CACHE_DIR>/step_curves keyed by hardware, the
    model config's hash, dtype, draft length, largest step and executor; the next engine of
    the same model reloads it; ``profile`` re-profiles; a corrupt file is re-profiled; another
    key (draft length, largest step) is another file; ``..._CACHE=0`` neither reads nor writes."""
    from deepinfer.spec import step_curve as sc

    monkeypatch.delenv(ENV_CURVE, raising=False)
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path))
    first = make_llm(ckpt, num_speculative_tokens=3, enable_mtp_varlen=True, max_num_seqs=4)
    assert first.runner.spec.curve_source == "profiled"
    files = list((tmp_path / "step_curves").glob("step_curve_*.json"))
    assert len(files) == 1
    data = json.loads(files[0].read_text())
    key = data["key"]
    assert key == sc.cache_key(first, 16) and key["hardware"] == sc.hardware_key(first.device)
    assert key["num_speculative_tokens"] == 3 and key["dtype"] == "float32" and "commit" not in json.dumps(key)
    base = first.runner.spec.curve.base
    assert data["tokens"] == base.tokens == [1, 2, 4, 8, 16] and data["seconds"] == base.seconds
    assert base.seconds == sorted(base.seconds)  # non-decreasing
    raw = data["raw_seconds"]
    assert all(x > 0 for x in raw) and raw[-1] >= 0.5 * raw[0]  # monotone-ish before the running max
    curve, source = sc.curve_for_engine(first)  # same engine, same key: the cached curve
    assert source == f"cached:{files[0]}" and curve.base.tokens == base.tokens and curve.base.seconds == base.seconds
    second = make_llm(ckpt, num_speculative_tokens=3, enable_mtp_varlen=True, max_num_seqs=4)  # a new engine
    assert second.runner.spec.curve_source == f"cached:{files[0]}"
    assert second.runner.spec.curve.base.seconds == base.seconds
    assert sc.cache_path(sc.cache_key(first, 8)) != files[0]  # another largest step: another file
    monkeypatch.setenv(ENV_CURVE, "profile")
    assert sc.curve_for_engine(first)[1] == "profiled"
    monkeypatch.delenv(ENV_CURVE)
    files[0].write_text("{not json")
    assert sc.curve_for_engine(first)[1] == "profiled"  # unreadable: profiled again and rewritten
    assert sc.curve_for_engine(first)[1] == f"cached:{files[0]}"
    monkeypatch.setenv(sc.CACHE_ENV, "0")
    files[0].unlink()
    assert sc.curve_for_engine(first)[1] == "profiled"
    assert not files[0].exists()


def test_startup_profile_times_the_verify_graphs(ckpt, monkeypatch, tmp_path):
    """The curve is profiled after the verify graphs are captured, through the spec runner's
    own forward: it times the graphed verify steps the scheduler plans for, not the eager
    reference forward (which it timed before, many times slower on a GPU)."""
    monkeypatch.setenv(ENV_CURVE, "profile")
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("DEEPINFER_FASTPATH", "ref")
    monkeypatch.setenv("DEEPINFER_CUDA_GRAPHS", "1")
    monkeypatch.setenv("DEEPINFER_CUDA_GRAPH_WARMUP", "1")  # the start-up capture, emulated on the host
    llm = make_llm(ckpt, num_speculative_tokens=3, enable_mtp_varlen=True, max_num_seqs=4)
    spec = llm.runner.spec
    assert spec.curve_source == "profiled" and llm.runner.fast.graphs.sealed
    verify = spec.verify_executor(llm.runner)
    assert verify.counts["graph_steps"] > 0 and verify.counts["eager_steps"] == 0  # the profile's steps
    replayed = {key[1] for key in llm.runner.fast.graphs.replays if key[0] == "verify"}
    assert max(replayed) >= 4  # a multi-request size of the curve replayed its verify graph
