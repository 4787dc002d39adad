"""The pinned schema-corpus benchmark on its committed 30-schema sample (JSONSchemaBench).

The sample's files match their sha256 pins; the pin of the whole corpus is checked against
its own listing; and the benchmark's property holds on the sample through the engine:
no output that finishes "stop" fails its schema.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from deepinfer.structured.corpus import blob_id, load_corpus, manifest_digest
from deepinfer.structured.corpus_bench import admission_only, run_corpus

SAMPLE = Path(__file__).parent / "data" / "jsonschemabench_sample"
pytest.importorskip("llguidance")


def test_sample_matches_its_pins() -> None:
    meta = json.loads((SAMPLE / "SAMPLE.json").read_text())
    files = {str(p.relative_to(SAMPLE)): p.read_bytes() for p in SAMPLE.glob("data/*/*.json")}
    assert len(files) == 30 and set(files) == set(meta["sha256"])
    for path, data in files.items():
        assert hashlib.sha256(data).hexdigest() == meta["sha256"][path], path
    assert "MIT" in meta["licence"] and len(meta["commit"]) == 40
    # the digest is over (path, git blob id): changing one byte changes it
    ids = {p: blob_id(b) for p, b in files.items()}
    changed = dict(ids, **{next(iter(ids)): blob_id(b"{}")})
    assert manifest_digest(ids) != manifest_digest(changed)


def test_no_stop_output_fails_its_schema_on_the_sample() -> None:
    from deepinfer import LLM

    corpus = load_corpus(SAMPLE)
    items = [(c, n, t) for c in sorted(corpus) for n, t in sorted(corpus[c].items())]
    admission = admission_only(items)
    assert admission["schemas"] == 30 and admission["rejected"] <= 10
    llm = LLM(dtype="float32", max_model_len=4096, max_num_seqs=32)
    result = run_corpus(llm, items, max_tokens=48, seed=0)
    assert result["invalid"] == 0, [r for r in result["rows"] if r["outcome"] == "invalid"]
    assert result["rejected"] == admission["rejected"]
    assert result["valid"] + result["length"] + result["rejected"] == 30 and result["valid"] >= 1
