"""LLM(data_parallel_size=N, expert_parallel_size=N) over gloo ranks on CPU: greedy outputs
equal the single-process engine token for token on a mixed batch, before and after live
rebalances and a hand-made placement; idle ranks; clear errors for bad input and dead ranks."""

from __future__ import annotations

import random
import time

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.errors import ConfigError, InvalidRequestError
from deepinfer.models.tiny import tiny_config, write_tiny_checkpoint
from deepinfer.parallel.dp_engine import DataParallelEngine, RankFailedError
from deepinfer.parallel.placement import ExpertPlacement, PlacementError

VOCAB = 512
KW = dict(dtype="float32", max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny_dp")
    write_tiny_checkpoint(str(path), seed=7, cfg=tiny_config(vocab_size=VOCAB, sliding_window=32))
    return str(path)


@pytest.fixture(scope="module")
def batch() -> tuple[list[list[int]], list[SamplingParams]]:
    """Mixed: 1-token to 150-token prompts (chunked prefill at 64, past the 32-token window),
    3 to 14 new tokens."""
    rng = random.Random(2024)
    lengths = [1, 5, 150, 33, 70, 12, 101, 2]
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in lengths]
    params = [SamplingParams(temperature=0, max_tokens=rng.randrange(3, 15), ignore_eos=True) for _ in prompts]
    return prompts, params


@pytest.fixture(scope="module")
def reference(ckpt, batch) -> list[list[int]]:
    outs = LLM(ckpt, **KW).generate(prompt_token_ids=batch[0], sampling_params=batch[1], use_tqdm=False)
    return [o.token_ids for o in outs]


def tokens(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)]


def test_two_ranks_match_single_process_through_rebalances(ckpt, batch, reference) -> None:
    prompts, params = batch
    llm = LLM(ckpt, data_parallel_size=2, expert_parallel_size=2, num_redundant_experts=2,
              eplb_rebalance_interval=4, eplb_window_size=6, **KW)
    try:
        # LLM is a client of the multi-rank engine (no subclass returned by LLM.__new__)
        assert type(llm) is LLM and isinstance(llm.engine, DataParallelEngine) and llm.placement.num_slots == 10
        assert tokens(llm, prompts, params) == reference
        live = llm.rebalance_reports()
        assert len(live) >= 2 and any(r.experts_moved for r in live), "rebalanced during generate()"
        load = llm.expert_load()
        assert load["rank"].shape[1:] == (4, 2) and load["logical"].shape[1:] == (4, 8)
        report = llm.rebalance()
        assert report.imbalance_after <= report.imbalance_before + 1e-9
        # a hand-made placement: every rank swaps its expert set, with a redundant copy of 0 and 7
        manual = ExpertPlacement.from_rank_lists([[4, 5, 6, 7, 0], [0, 1, 2, 3, 7]], num_logical=8, num_layers=4)
        moved = llm.set_placement(manual)
        assert moved.manual and moved.experts_moved > 0 and llm.placement.phy2log.equal(manual.phy2log)
        assert tokens(llm, prompts, params) == reference
        with pytest.raises(InvalidRequestError, match="outside"):
            llm.generate(prompt_token_ids=[[1, 2], [3, VOCAB + 5]], use_tqdm=False)
        with pytest.raises(PlacementError, match="num_ranks=4"):
            llm.set_placement(ExpertPlacement.default(4, 8, 4))
        assert tokens(llm, prompts[:2], params[:2]) == reference[:2], "still serving after bad input"
        llm._procs[1].kill()
        start = time.monotonic()
        with pytest.raises(RankFailedError, match="rank 1 .* exited"):
            llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        assert time.monotonic() - start < 30
        with pytest.raises(RankFailedError, match="shut down"):
            llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    finally:
        llm.shutdown()


def test_four_ranks_with_idle_ranks(ckpt, batch, reference, monkeypatch) -> None:
    prompts, params = batch
    monkeypatch.setenv("DEEPINFER_EP_TIMING", "1")  # the ranks time their all-to-alls
    with LLM(ckpt, data_parallel_size=4, expert_parallel_size=4, num_redundant_experts=4,
             eplb_rebalance_interval=3, dp_split="tokens", **KW) as llm:
        assert tokens(llm, prompts, params) == reference
        stats = llm.comm_stats()
        # every rank joins both all-to-alls of every MoE layer of every step, idle or not
        assert len(stats) == 4 and len({s["calls"] for s in stats}) == 1 and stats[0]["calls"] % 2 == 0
        assert all(s["calls"] > 0 and s["seconds"] > 0 and s["bytes"] > 0 for s in stats)
        assert llm.comm_stats()[0]["calls"] == 0, "read resets"
        assert llm.rebalance_reports(), "rebalanced during generate()"
        assert tokens(llm, prompts[:1], params[:1]) == reference[:1], "three ranks idle: dummy MoE batches"
        assert tokens(llm, prompts, params) == reference


def test_bad_parallel_settings_fail_before_spawning(ckpt) -> None:
    with pytest.raises(ConfigError, match="each must be 1 or 3"):
        LLM(ckpt, data_parallel_size=2, expert_parallel_size=3)
    with pytest.raises(ConfigError, match="num_redundant_experts must be an int >= 0"):
        LLM(ckpt, data_parallel_size=2, expert_parallel_size=2, num_redundant_experts=-1)
    with pytest.raises(ConfigError, match="dp_split"):
        LLM(ckpt, data_parallel_size=2, expert_parallel_size=2, dp_split="random")


TORCHRUN_SCRIPT = '''
import json, sys
from deepinfer import SamplingParams
from deepinfer.parallel.launcher import rank_llm_from_torchrun
ckpt, prompts, max_tokens, out_dir = json.loads(sys.argv[1])
llm = rank_llm_from_torchrun(ckpt, dtype="float32", max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64,
                             num_redundant_experts=2, eplb_rebalance_interval=3)
mine = list(range(llm.comm.rank, len(prompts), llm.comm.world_size))
params = [SamplingParams(temperature=0, max_tokens=max_tokens[i], ignore_eos=True) for i in mine]
outs = llm.generate_rank(prompt_token_ids=[prompts[i] for i in mine], sampling_params=params)
# One file per rank: two ranks printing to one stdout pipe can interleave within a line.
with open(f"{out_dir}/rank{llm.comm.rank}.json", "w") as f:
    json.dump({"rank": llm.comm.rank, "index": mine, "tokens": [o.token_ids for o in outs],
               "rebalances": len(llm.eplb.reports)}, f)
'''


def test_torchrun_ranks_match_single_process(ckpt, batch, reference, tmp_path) -> None:
    import json
    import subprocess
    import sys

    from deepinfer.parallel.launcher import find_free_port

    prompts, params = batch
    script = tmp_path / "ranks.py"
    script.write_text(TORCHRUN_SCRIPT)
    arg = json.dumps([ckpt, prompts, [p.max_tokens for p in params], str(tmp_path)])
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(find_free_port()), str(script), arg],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(f.read_text()) for f in sorted(tmp_path.glob("rank*.json"))]
    assert sorted(r["rank"] for r in rows) == [0, 1]
    got = {i: toks for r in rows for i, toks in zip(r["index"], r["tokens"])}
    assert [got[i] for i in range(len(prompts))] == reference
    assert all(r["rebalances"] >= 1 for r in rows), "live rebalances under torchrun too"


def test_ranks_adopt_the_drivers_deepinfer_env(monkeypatch) -> None:
    """A forkserver child starts with the server's environment: the spec carries the
    driver's DEEPINFER_* variables and the rank adopts exactly those."""
    import os

    from deepinfer.parallel.launcher import WorkerSpec, adopt_env

    monkeypatch.setenv("DEEPINFER_EP_TIMING", "1")
    monkeypatch.delenv("DEEPINFER_FP8_GEMM", raising=False)
    spec = WorkerSpec("m", None, 2, 0, "cpu", 1.0, True)
    assert spec.env["DEEPINFER_EP_TIMING"] == "1" and "DEEPINFER_FP8_GEMM" not in spec.env
    monkeypatch.setenv("DEEPINFER_FP8_GEMM", "ref")  # stale in the rank's inherited environment
    monkeypatch.setenv("DEEPINFER_EP_TIMING", "0")
    adopt_env(spec.env)
    assert os.environ["DEEPINFER_EP_TIMING"] == "1" and "DEEPINFER_FP8_GEMM" not in os.environ
