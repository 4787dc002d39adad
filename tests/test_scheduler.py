"""Scheduler on CPU with a fake runner that simulates the paged KV cache.

The fake runner writes each fed token into a dict "memory" per (group, block),
checks that every position a real model would read (whole context / window)
holds the right token and that it never writes into a block another request
sees, and samples from what it reads back: outputs only match a huge-pool run
if the cache was used correctly.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import pytest

from deepinfer.engine.kv_cache_manager import HybridKVCacheManager, KVCacheGroupSpec
from deepinfer.engine.outputs import ModelRunnerOutput, SchedulerOutput
from deepinfer.engine.request import Request, RequestStatus
from deepinfer.engine.scheduler import Scheduler, SchedulerConfig

B, W = 4, 8
GROUPS = [KVCacheGroupSpec("swa", W), KVCacheGroupSpec("csa", None), KVCacheGroupSpec("hca", None)]


@dataclass
class SP:  # stand-in for deepinfer.sampling_params.SamplingParams
    max_tokens: int = 8
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    min_tokens: int = 0


def make(blocks: int | dict[str, int] = 256, seqs: int = 8, budget: int = 32, max_len: int = 128,
         chunked: bool = True, caching: bool = True) -> Scheduler:
    nb = blocks if isinstance(blocks, dict) else {g.name: blocks for g in GROUPS}
    kv = HybridKVCacheManager(GROUPS, nb, B, seqs, caching)
    return Scheduler(SchedulerConfig(seqs, budget, max_len, B, chunked, caching), kv)


class FakeRunner:
    """Deterministic 'model': next token = f(request, position, cache contents)."""

    def __init__(self, sched: Scheduler, token_fn: Callable[[Request, int], int] | None = None) -> None:
        self.sched, self.token_fn = sched, token_fn
        self.store: dict[str, dict[int, list[int | None]]] = {g.name: {} for g in GROUPS}
        self.reqs: dict[str, Request] = {}
        self.active: set[str] = set()  # requests whose runner-side state exists
        self.log: list[SchedulerOutput] = []

    def _read(self, group: str, table: list[int], p: int) -> int | None:
        block = table[p // B]
        assert block != -1, f"{group}: position {p} needed but its block is not held"
        return self.store[group].get(block, [None] * B)[p % B]

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.log.append(so)
        cfg = self.sched.config
        assert so.num_batched_tokens == sum(s.num_tokens for s in so.scheduled) <= cfg.max_num_batched_tokens
        slots = [s.state_slot for s in so.scheduled]
        assert len(set(slots)) == len(slots) and all(0 <= x < cfg.max_num_seqs for x in slots)
        for rid in so.preempted_req_ids + so.finished_req_ids:
            self.active.discard(rid)
        owners = Counter((g, b) for s in so.scheduled for g, t in s.block_table.items() for b in t if b != -1)
        ids, sampled = [], []
        for s in so.scheduled:
            truth = self.reqs[s.req_id].all_token_ids
            assert s.is_new == (s.req_id not in self.active)
            self.active.add(s.req_id)
            assert not s.is_new or s.start_pos % B == 0
            assert s.token_ids == truth[s.start_pos : s.start_pos + s.num_tokens].tolist()
            for g in GROUPS:
                table = s.block_table[g.name]
                assert len(table) * B >= s.start_pos + s.num_tokens
                lo = 0 if g.sliding_window is None else max(0, s.start_pos - W + 1)
                for p in range(lo, s.start_pos):  # the context a model would read
                    assert self._read(g.name, table, p) == truth[p], (s.req_id, g.name, p)
                for p, tok in enumerate(s.token_ids, start=s.start_pos):
                    block = table[p // B]
                    assert block != -1 and owners[(g.name, block)] == 1, "write into a shared block"
                    self.store[g.name].setdefault(block, [None] * B)[p % B] = tok
            ids.append(s.req_id)
            sampled.append([self._sample(s)] if s.needs_sample else [])
        return ModelRunnerOutput(ids, sampled)

    def _sample(self, s) -> int:
        if self.token_fn is not None:
            return self.token_fn(self.reqs[s.req_id], s.output_len)
        p = s.start_pos + s.num_tokens - 1  # last fed position
        full = sum(self._read(g, s.block_table[g], q) for g in ("csa", "hca") for q in range(p + 1))
        win = sum(self._read("swa", s.block_table["swa"], q) for q in range(max(0, p - W + 1), p + 1))
        return (full * 31 + win * 17 + p * 7 + sum(map(ord, s.req_id))) % 97 + 2  # never eos (1)

    def add(self, req: Request) -> None:
        self.reqs[req.req_id] = req
        self.sched.add_request(req)


def drive(sched: Scheduler, runner: FakeRunner, arrivals: list[list[Request]] | None = None) -> int:
    """Step until everything finished; returns the number of steps."""
    arrivals = list(arrivals or [])
    steps = empty = 0
    while sched.has_unfinished() or arrivals:
        for r in arrivals.pop(0) if arrivals else []:
            runner.add(r)
        so = sched.schedule()
        assert sched.num_running <= sched.config.max_num_seqs
        assert not set(so.preempted_req_ids) & {s.req_id for s in so.scheduled}
        empty = empty + 1 if not so.scheduled else 0
        assert empty < 2 or not sched.has_unfinished(), "scheduler made no progress"
        sched.update(so, runner.execute(so))
        sched.kv.assert_consistent()
        steps += 1
    return steps


def all_free(sched: Scheduler) -> bool:
    kv = sched.kv
    return all(p.num_free == p.num_blocks for p in kv.pools.values()) and kv.num_free_slots == kv.max_num_seqs


def R(rid: str, prompt: list[int], max_tokens: int = 8, eos: int | None = 1, **kw) -> Request:
    return Request(rid, prompt, SP(max_tokens=max_tokens, **kw), 0.0, eos)


def setup(*reqs: Request, token_fn: Callable | None = None, **cfg) -> tuple[Scheduler, FakeRunner]:
    sched = make(**cfg)
    runner = FakeRunner(sched, token_fn)
    for r in reqs:
        runner.add(r)
    return sched, runner


def step(sched: Scheduler, runner: FakeRunner) -> tuple[SchedulerOutput, list[Request]]:
    so = sched.schedule()
    return so, sched.update(so, runner.execute(so))


# ---------------------------------------------------------------- chunking
def test_chunked_prefill_splits_long_prompt() -> None:
    sched, runner = setup(R("a", list(range(2, 42)), max_tokens=3), budget=16)
    drive(sched, runner)
    chunks = [(s.start_pos, s.num_tokens, s.needs_sample) for so in runner.log for s in so.scheduled]
    assert chunks == [(0, 16, False), (16, 16, False), (32, 8, True), (40, 1, True), (41, 1, True)]
    assert runner.reqs["a"].num_output_tokens == 3 and all_free(sched)


def test_chunked_off_keeps_prompts_whole() -> None:
    a, b = R("a", list(range(2, 22)), max_tokens=4), R("b", list(range(30, 50)), max_tokens=4)
    sched, runner = setup(a, b, budget=32, max_len=32, chunked=False)
    drive(sched, runner)
    steps = [[(s.req_id, s.num_tokens) for s in so.scheduled] for so in runner.log]
    assert steps[:2] == [[("a", 20)], [("a", 1), ("b", 20)]]  # b did not fit beside a's 20
    assert all(n in (1, 20) for st in steps for _, n in st) and all_free(sched)


# ---------------------------------------------------------- prefix caching
def test_prefix_hit_shares_full_blocks() -> None:
    prefix = [5, 6, 7, 8, 9, 10, 11, 12]
    sched, runner = setup(R("a", prefix + [20, 21, 22], max_tokens=6))
    a_table = step(sched, runner)[0].scheduled[0].block_table
    runner.add(R("b", prefix + [30, 31, 32, 33, 34], max_tokens=6))
    b = next(s for s in step(sched, runner)[0].scheduled if s.req_id == "b")
    assert b.is_new and b.start_pos == 2 * B and b.token_ids == [30, 31, 32, 33, 34]
    assert runner.reqs["b"].num_cached_tokens == 2 * B
    for g in ("csa", "hca"):
        assert b.block_table[g][:2] == a_table[g][:2] and b.block_table[g][2] != a_table[g][2]
    drive(sched, runner)
    assert all_free(sched)


@pytest.mark.parametrize("caching", [True, False])
def test_prefix_hit_cap_leaves_one_token(caching: bool) -> None:
    sched, runner = setup(R("a", list(range(2, 10)), max_tokens=2), caching=caching)
    drive(sched, runner)  # a finished: its blocks are free but still hittable
    runner.add(R("b", list(range(2, 10)), max_tokens=2))  # identical 8-token prompt
    first = step(sched, runner)[0].scheduled[0]
    hit = B if caching else 0  # not 2*B: the last prompt token must be computed
    assert first.start_pos == hit and first.num_tokens == 8 - hit and first.needs_sample
    assert runner.reqs["b"].num_cached_tokens == hit


# ------------------------------------------------------------------ window
def test_window_blocks_are_freed_during_decode() -> None:
    sched, runner = setup(R("a", list(range(2, 6)), max_tokens=30), blocks=64)
    drive(sched, runner)
    last = runner.log[-1].scheduled[0]  # query at 32 reads 25..32
    assert last.start_pos == 32
    assert last.block_table["swa"][:6] == [-1] * 6 and -1 not in last.block_table["swa"][6:]
    assert -1 not in last.block_table["csa"] and all_free(sched)


def test_window_pool_smaller_than_context() -> None:
    # The window pool could never hold the whole context, yet the request fits.
    sched, runner = setup(R("a", list(range(2, 60)), max_tokens=40),
                          blocks={"swa": 6, "csa": 40, "hca": 40}, budget=8)
    drive(sched, runner)
    assert runner.reqs["a"].num_output_tokens == 40 and all_free(sched)


# -------------------------------------------------------------- preemption
def _reference_outputs(prompts: dict[str, tuple[list[int], int]]) -> dict[str, list[int]]:
    sched, runner = setup(*(R(rid, p, mt) for rid, (p, mt) in prompts.items()),
                          blocks=4096, seqs=256, budget=512)
    drive(sched, runner)
    return {rid: r.output_token_ids for rid, r in runner.reqs.items()}


def test_preemption_under_tiny_pool() -> None:
    prompts = {f"r{i}": (list(range(10 * i + 2, 10 * i + 8)), 10) for i in range(3)}
    # Each request needs 4 blocks at its end: 8 blocks cannot hold all three.
    sched, runner = setup(*(R(rid, p, mt) for rid, (p, mt) in prompts.items()), blocks=8)
    drive(sched, runner)
    readmitted = [
        s for k, so in enumerate(runner.log) for s in so.scheduled
        if s.is_new and any(s.req_id in o.preempted_req_ids for o in runner.log[:k])
    ]
    assert readmitted and all(s.start_pos % B == 0 for s in readmitted)
    for s in readmitted:  # earlier outputs are re-fed as part of the prompt
        assert s.start_pos + s.num_tokens == len(prompts[s.req_id][0]) + s.output_len
    assert any(s.output_len > 0 for s in readmitted)
    ref = _reference_outputs(prompts)
    assert {rid: r.output_token_ids for rid, r in runner.reqs.items()} == ref
    assert all(len(v) == 10 for v in ref.values()) and all_free(sched)


def test_latest_arrival_preempts_itself() -> None:
    # A pool that fits one request at full length: the later one yields.
    sched, runner = setup(R("a", [2] * 6, 14), R("b", [3] * 6, 14), blocks=5, budget=64)
    drive(sched, runner)
    assert runner.reqs["b"].num_preemptions >= 1 and runner.reqs["a"].num_preemptions == 0
    assert all(r.num_output_tokens == 14 for r in runner.reqs.values()) and all_free(sched)


def stress_prompts(seed: int) -> dict[str, tuple[list[int], int]]:
    """200 requests (id -> (prompt, max_tokens)), many sharing one of 5 prefixes."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(2, 99) for _ in range(rng.randrange(0, 17))] for _ in range(5)]
    prompts: dict[str, tuple[list[int], int]] = {}
    for i in range(200):
        body = [rng.randrange(2, 99) for _ in range(rng.randrange(1, 30))]
        prompts[f"q{i}"] = (rng.choice(prefixes) + body, rng.randrange(1, 20))
    return prompts


def stress_scheduler(chunked: bool, caching: bool) -> Scheduler:
    # max_len 64 -> 16 full-group blocks per request: the pools fit ~1-2 long requests.
    return make(blocks={"swa": 16, "csa": 24, "hca": 20}, seqs=16, budget=32 if chunked else 64,
                max_len=64, chunked=chunked, caching=caching)


@pytest.mark.parametrize("chunked,caching", [(True, True), (True, False), (False, True)])
def test_stress_200_requests_match_huge_pool(chunked: bool, caching: bool) -> None:
    prompts = stress_prompts(1234)
    ref = _reference_outputs(prompts)
    sched = stress_scheduler(chunked, caching)
    runner = FakeRunner(sched)
    reqs = [R(rid, p, max_tokens=mt) for rid, (p, mt) in prompts.items()]
    drive(sched, runner, [reqs[i : i + 7] for i in range(0, len(reqs), 7)])  # 7 arrive per step
    assert sum(r.num_preemptions for r in reqs) > 10
    for r in reqs:
        assert r.status == RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == ref[r.req_id][: len(r.output_token_ids)]
        assert r.num_output_tokens == min(r.sampling_params.max_tokens, 64 - r.num_prompt_tokens)
    assert all_free(sched)
    assert (sum(r.num_cached_tokens for r in reqs) > 0) == caching


# ---------------------------------------------------- abort / rejection / seats
def test_abort_frees_blocks_and_reports_finished() -> None:
    sched, runner = setup(R("a", list(range(2, 20)), 50), R("b", list(range(2, 20)), 50), seqs=1)
    step(sched, runner)
    assert sched.num_running == 1 and sched.num_waiting == 1
    for rid in ("a", "b", "nope"):  # running, waiting, unknown (no-op)
        sched.abort(rid)
    a = runner.reqs["a"]
    assert a.status == RequestStatus.FINISHED_ABORTED and a.finish_reason == "abort" and a.finished_time
    assert not sched.has_unfinished() and all_free(sched)
    assert sched.schedule().finished_req_ids == ["a", "b"]
    assert sched.kv.pools["csa"].get_cached(a.block_hashes[0]) is not None  # still hittable


def test_add_request_rejects_impossible_request() -> None:
    sched = make(blocks={"swa": 64, "csa": 10, "hca": 64}, max_len=128)
    with pytest.raises(ValueError, match=r"'huge'.*needs 20 blocks.*'csa'.*only 10"):
        sched.add_request(R("huge", list(range(2, 62)), max_tokens=20))
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request(R("long", [2] * 128))
    with pytest.raises(ValueError, match="empty"):
        sched.add_request(R("empty", []))
    with pytest.raises(ValueError, match="chunked prefill is off"):
        make(budget=16, chunked=False).add_request(R("big", [2] * 10, max_tokens=10))
    sched.add_request(R("ok", [2] * 10))
    with pytest.raises(ValueError, match="already"):
        sched.add_request(R("ok", [2] * 10))


def test_seat_limit() -> None:
    sched, runner = setup(*(R(f"r{i}", [2 + i] * 3, 3) for i in range(5)), seqs=2)
    drive(sched, runner)
    assert max(len(so.scheduled) for so in runner.log) == 2 and all_free(sched)


# ------------------------------------------------------------------ stops
STOP_CASES = [  # (sampling kwargs, scripted outputs, max_len, expected outputs, reason, stop_reason)
    (dict(max_tokens=10), [7, 8, 1, 9], 128, [7, 8, 1], "stop", None),  # eos (id 1)
    (dict(max_tokens=5, ignore_eos=True), [7, 1, 1, 9], 128, [7, 1, 1, 9, 50], "length", None),
    (dict(max_tokens=10, min_tokens=3, stop_token_ids=[9]), [1, 9, 1, 4], 128, [1, 9, 1], "stop", None),
    (dict(max_tokens=10, stop_token_ids=[42, 43]), [7, 43, 8], 128, [7, 43], "stop", 43),
    (dict(max_tokens=2, stop_token_ids=[42]), [7, 42], 128, [7, 42], "stop", 42),  # stop beats length
    (dict(max_tokens=100), [7] * 100, 12, [7] * 10, "length", None),  # max_model_len = 2 + 10
]


@pytest.mark.parametrize("kw,script,max_len,expected,reason,stop_reason", STOP_CASES)
def test_stop_conditions(kw: dict, script: list[int], max_len: int, expected: list[int],
                         reason: str, stop_reason: int | None) -> None:
    req = R("a", [5, 6], **kw)
    sched, runner = setup(req, max_len=max_len, token_fn=lambda r, i: script[i] if i < len(script) else 50)
    drive(sched, runner)
    assert req.output_token_ids == expected and req.finish_reason == reason
    assert req.stop_reason == stop_reason and req.finished_time is not None and all_free(sched)


def test_finish_request_for_stop_strings() -> None:
    sched, runner = setup(R("a", [5, 6], max_tokens=10))
    (req,) = step(sched, runner)[1]
    assert req.num_output_tokens == 1 and req.first_token_time is not None
    sched.finish_request("a", reason="stop", stop_reason="\n\n")
    assert req.finish_reason == "stop" and req.stop_reason == "\n\n" and all_free(sched)
    assert sched.schedule().finished_req_ids == ["a"]


# -------------------------------------------------------- runner contract
def test_update_appends_logprobs_and_truncates_after_stop() -> None:
    sched, runner = setup(R("a", [5, 6], max_tokens=10, stop_token_ids=[9]))
    so = sched.schedule()
    top = [[(7, -0.1)], [(9, -0.2)], [(3, -0.3)]]
    out = ModelRunnerOutput(["a"], [[7, 9, 3]], logprobs=[[-0.1, -0.2, -0.3]], top_logprobs=[top])
    (req,) = sched.update(so, out)  # speculative-style: several tokens, stop in the middle
    assert req.output_token_ids == [7, 9] and req.output_logprobs == [-0.1, -0.2]
    assert req.output_top_logprobs == top[:2] and req.is_finished and all_free(sched)


def test_update_rejects_contract_violations() -> None:
    sched, _ = setup(R("a", list(range(2, 12))), budget=4)
    so = sched.schedule()  # partial prefill: no sample expected
    with pytest.raises(ValueError, match="needs_sample=False"):
        sched.update(so, ModelRunnerOutput(["a"], [[5]]))
    sched, _ = setup(R("b", [2, 3]))
    so = sched.schedule()
    with pytest.raises(ValueError, match="needs_sample=True"):
        sched.update(so, ModelRunnerOutput(["b"], [[]]))
