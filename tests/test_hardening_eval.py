"""Eval outputs under careless use: one writer per --out (a second concurrent run fails at
once, no duplicate records), the engine config recorded per record and checked on resume
(no mixed dtypes in one file), and ``--out <directory>`` a clear error before any engine loads."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.eval import ResumeMismatchError, generate_eval, read_records
from deepinfer.eval.records import OutputLockedError

DATA = Path(__file__).resolve().parent.parent / "datasets" / "eval_samples" / "aime_sample.jsonl"
PARAMS = SamplingParams(temperature=0, max_tokens=3)


@pytest.fixture(scope="module")
def f32() -> LLM:
    return LLM(dtype="float32", max_model_len=512, max_num_seqs=4)


def test_concurrent_run_on_one_out_fails_and_duplicates_nothing(f32, tmp_path) -> None:
    out = tmp_path / "aime.jsonl"
    holder = subprocess.Popen(  # another run, mid-way: it holds the file's lock
        [sys.executable, "-c", "import sys, time\nfrom deepinfer.eval.records import exclusive\n"
         "with exclusive(sys.argv[1]):\n    print('held', flush=True)\n    time.sleep(60)\n", str(out)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        start = time.monotonic()
        with pytest.raises(OutputLockedError, match="being written by another run"):
            generate_eval(f32, "aime", DATA, out, PARAMS, limit=2, use_tqdm=False, thinking=False)
        assert time.monotonic() - start < 5 and read_records(out) == []
    finally:
        holder.kill()
        holder.wait()
    res = generate_eval(f32, "aime", DATA, out, PARAMS, limit=2, use_tqdm=False, thinking=False)
    assert res.n_generated == 2 and len(read_records(out)) == 2  # the lock went with its holder


def test_resume_with_another_engine_config_is_refused(f32, tmp_path) -> None:
    out = tmp_path / "aime.jsonl"
    generate_eval(f32, "aime", DATA, out, PARAMS, limit=1, use_tqdm=False, thinking=False)
    assert read_records(out)[0]["engine_config"]["dtype"] == "float32"
    bf16 = LLM(dtype="bfloat16", max_model_len=512, max_num_seqs=4)
    with pytest.raises(ResumeMismatchError, match=r"engine_config.*'dtype': 'float32'.*'dtype': 'bfloat16'"):
        generate_eval(bf16, "aime", DATA, out, PARAMS, limit=2, use_tqdm=False, thinking=False)
    assert len(read_records(out)) == 1
    assert generate_eval(f32, "aime", DATA, out, PARAMS, limit=2, use_tqdm=False, thinking=False).n_generated == 1


def test_out_directory_is_a_clear_error(tmp_path, capsys) -> None:
    from deepinfer import cli

    rc = cli.main(["eval", "generate", "--benchmark", "aime", "--data", str(DATA), "--out", str(tmp_path),
                   "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and "is a directory; give the generation file to write" in err and "Traceback" not in err
    with pytest.raises(ValueError, match="is a directory"):
        generate_eval(object(), "aime", DATA, tmp_path, PARAMS)
