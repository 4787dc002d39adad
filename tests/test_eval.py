"""Eval workflow: loaders on the sample files, scorers, resumable generation, score, CLI."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from deepinfer import SamplingParams
from deepinfer.chat import ChatOutput
from deepinfer.eval import (ResumeMismatchError, generate_eval, load_benchmark, read_records, score_file,
                            score_record, score_records)
from deepinfer.eval.runner import item_seed

SAMPLES = Path(__file__).resolve().parent.parent / "datasets" / "eval_samples"
DATA = {"aime": SAMPLES / "aime_sample.jsonl", "gpqa": SAMPLES / "gpqa_diamond_sample.csv",
        "hle": SAMPLES / "hle_sample.jsonl"}


def rec(answer_type: str, reference: str, content: str, **extra) -> dict:
    return {"id": "x", "answer_type": answer_type, "reference": reference, "content": content, **extra}


@pytest.mark.parametrize("content, verdict", [
    ("2^10 + 81 = 1105, so the remainder is \\boxed{105}.", "correct"),
    ("\\boxed{\\text{105}}", "correct"),
    ("The final answer is 105.", "correct"),
    ("Answer: 104", "wrong"),
    ("\\boxed{105} was a typo, it is \\boxed{106}", "wrong"),  # the last boxed answer counts
    ("It is a big number, around 1105 maybe", "unparseable"),
    ("\\boxed{x + 1}", "unparseable"),
    ("", "unparseable"),
])
def test_aime_scoring(content: str, verdict: str) -> None:
    assert score_record(rec("integer", "105", content)).verdict == verdict


def test_aime_leading_zeros_and_reasoning_is_not_graded() -> None:
    assert score_record(rec("integer", "42", "\\boxed{042}")).verdict == "correct"
    # the boxed answer sits in the unfinished thinking: no answer was given
    r = rec("integer", "105", "", reasoning_content="so \\boxed{105}", output_text="so \\boxed{105}")
    assert score_record(r).verdict == "unparseable"


@pytest.mark.parametrize("content, verdict", [
    ("Photons carry it.\nAnswer: B", "correct"),
    ("**Answer:** (B)", "correct"),
    ("\\boxed{B}", "correct"),
    ("Answer: C", "wrong"),
    ("\\boxed{\\text{D}}", "wrong"),
    ("the answer is a photon", "unparseable"),  # the article "a" is not option A
    ("Answer: E", "unparseable"),  # only four options
])
def test_gpqa_scoring(content: str, verdict: str) -> None:
    r = rec("multipleChoice", "B", content, choices=["W boson", "Photon", "Gluon", "Graviton"])
    assert score_record(r).verdict == verdict


@pytest.mark.parametrize("reference, content, verdict", [
    ("W", "Tungsten is W.\nAnswer: W", "correct"),
    ("30", "Answer: 30.", "correct"),
    ("0.5", "Answer: $\\frac12$ is 1/2\nAnswer: 1/2", "correct"),
    ("1969", "so \\boxed{1969}", "correct"),
    ("W", "Answer: Tungsten", "wrong"),
    ("30", "I am not sure.", "unparseable"),
])
def test_hle_exact_match_scoring(reference: str, content: str, verdict: str) -> None:
    assert score_record(rec("exactMatch", reference, content)).verdict == verdict


def test_hle_multiple_choice_skip_and_judge_hook() -> None:
    assert score_record(rec("multipleChoice", "B", "Answer: B")).verdict == "correct"
    assert score_record(rec("multipleChoice", "B", "no idea")).verdict == "unparseable"
    assert score_record({"id": "img", "skipped": "image", "reference": "circle"}).verdict == "skipped"
    free = rec("exactMatch", "W", "Answer: Tungsten")
    seen = []

    def judge(req):  # a stand-in for an LLM judge: knows tungsten is W
        seen.append(req)
        return req.extracted.lower() in ("w", "tungsten")

    v = score_record(free, judge)
    assert v.verdict == "correct" and v.method == "judge" and seen[0].reference == "W"
    assert score_record(free).verdict == "wrong"  # judge off by default: plain exact match


def test_summary_counts_and_accuracy() -> None:
    recs = [rec("integer", "1", "\\boxed{1}"), rec("integer", "2", "\\boxed{3}"), rec("integer", "2", "??"),
            {"id": "s", "skipped": "image", "reference": "x"}]
    s = score_records(recs).summary
    assert (s["n_items"], s["n_scored"], s["correct"], s["wrong"], s["unparseable"], s["skipped"]) == (4, 3, 1, 1, 1, 1)
    assert s["accuracy"] == pytest.approx(1 / 3)


def test_loaders_read_public_formats() -> None:
    aime = load_benchmark("aime", DATA["aime"])
    assert len(aime) == 6 and aime[0].reference == "105" and "\\boxed{}" in aime[0].prompt
    assert all(it.meta["sample_note"] == "SAMPLE - not the benchmark" for it in aime)
    g0, g1 = load_benchmark("gpqa", DATA["gpqa"], seed=0), load_benchmark("gpqa", DATA["gpqa"], seed=1)
    assert [it.choices for it in g0] == [it.choices for it in load_benchmark("gpqa", DATA["gpqa"], seed=0)]
    assert [it.choices for it in g0] != [it.choices for it in g1]  # the seed reshuffles
    for it in g0 + g1:  # the gold letter always points at the correct answer
        assert it.choices["ABCD".index(it.reference)] in ("Photon", "sp", "Mitochondrion", "2.5 eV", "Uracil", "+7")
        assert f"{it.reference}) {it.choices['ABCD'.index(it.reference)]}" in it.prompt
    hle = load_benchmark("hle", DATA["hle"])
    assert [it.id for it in hle if it.skip_reason == "image"] == ["sample-hle-06"]
    assert {it.answer_type for it in hle} == {"exactMatch", "multipleChoice"}


def test_loader_errors_name_what_is_missing(tmp_path: Path) -> None:
    bad = tmp_path / "gpqa.csv"
    bad.write_text("Question,Correct Answer\nq,a\n")
    with pytest.raises(ValueError, match="Incorrect Answer 1"):
        load_benchmark("gpqa", bad)
    with pytest.raises(FileNotFoundError, match="never downloaded"):
        load_benchmark("aime", tmp_path / "missing.jsonl")


@dataclass
class _Config:
    max_num_seqs: int = 4


class StubLLM:
    """Answers every prompt with a boxed number; can crash on a chosen chat() call."""

    model_dir = "/stub/model"

    def __init__(self, crash_on_call: int | None = None) -> None:
        self.config, self.calls, self.crash_on_call, self.prompts = _Config(), 0, crash_on_call, []

    def chat(self, convs, params, thinking=None, use_tqdm=True):
        self.calls += 1
        if self.calls == self.crash_on_call:
            raise KeyboardInterrupt("simulated crash")
        self.prompts += [c[0]["content"] for c in convs]
        return [ChatOutput("\\boxed{105}", None, [], "stop") for _ in convs]


def test_generation_interrupted_and_resumed_has_one_record_per_item(tmp_path: Path) -> None:
    out = tmp_path / "aime.jsonl"
    params = SamplingParams(max_tokens=8, temperature=0.0)
    with pytest.raises(KeyboardInterrupt):
        generate_eval(StubLLM(crash_on_call=2), "aime", DATA["aime"], out, params, batch_size=2, use_tqdm=False)
    first = read_records(out)
    assert len(first) == 2
    with open(out, "a") as f:  # a crash mid-write leaves half a line behind
        f.write('{"benchmark": "aime", "id": "sample-aime-0')
    resumed = StubLLM()
    res = generate_eval(resumed, "aime", DATA["aime"], out, params, batch_size=2, use_tqdm=False)
    assert (res.n_existing, res.n_generated) == (2, 4) and len(resumed.prompts) == 4
    records = read_records(out)
    ids = [r["id"] for r in records]
    assert sorted(ids) == sorted(it.id for it in load_benchmark("aime", DATA["aime"])) and len(set(ids)) == 6
    assert records[:2] == first  # nothing rewritten or lost
    assert all(json.loads(line) for line in out.read_text().splitlines())  # the torn line is gone
    for r in records:
        assert r["seed"] == item_seed("aime", 0, r["id"]) and r["model"] == "/stub/model"
        assert r["sampling_params"]["max_tokens"] == 8 and r["commit"] and r["timestamp"]
    # a finished file resumes to a no-op; other settings are refused instead of mixed in
    assert generate_eval(StubLLM(), "aime", DATA["aime"], out, params, use_tqdm=False).n_generated == 0
    with pytest.raises(ResumeMismatchError, match="sampling_params"):
        generate_eval(StubLLM(), "aime", DATA["aime"], out, SamplingParams(max_tokens=9), use_tqdm=False)


def test_corruption_before_the_last_line_is_an_error(tmp_path: Path) -> None:
    out = tmp_path / "g.jsonl"
    out.write_text('{"id": "a"}\nnot json\n{"id": "b"}\n')
    with pytest.raises(ValueError, match=":2 is not valid JSON"):
        read_records(out)


@pytest.fixture(scope="module")
def llm():
    from deepinfer import LLM
    return LLM()


def test_tiny_model_generate_score_and_cli(llm, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    from deepinfer import cli

    made = []

    def fake_llm(model=None, **kwargs):  # the CLI builds its engine; reuse the loaded one
        made.append((model, kwargs))
        return llm

    monkeypatch.setattr("deepinfer.LLM", fake_llm)
    out = tmp_path / "hle.jsonl"
    rc = cli.main(["eval", "generate", "--benchmark", "hle", "--data", str(DATA["hle"]), "--out", str(out),
                   "--max-tokens", "3", "--no-thinking", "--quiet", "--engine", "max_num_seqs=8"])
    assert rc == 0 and made == [(None, {"max_num_seqs": 8})]
    records = read_records(out)
    assert len(records) == 6 and sum(bool(r["skipped"]) for r in records) == 1
    for r in (r for r in records if not r["skipped"]):
        assert 1 <= r["num_output_tokens"] <= 3 and r["finish_reason"] in ("stop", "length")
        assert r["engine_config"]["accelerator"] == "cpu" and r["thinking"] is False
        assert r["data_note"] == "SAMPLE - not the benchmark" and isinstance(r["output_text"], str)
    assert cli.main(["eval", "score", str(out)]) == 0
    scores = json.loads(out.with_name("hle.scores.json").read_text())
    assert len(scores["items"]) == 6 and scores["summary"]["skipped"] == 1
    assert 0.0 <= scores["summary"]["accuracy"] <= 1.0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["n_items"] == 6
    assert score_file(out).summary["n_scored"] == 5
