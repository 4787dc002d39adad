"""The 2-rank gloo engine under a careless / hostile user: Ctrl-C mid-generate leaves no
stale replies behind, a stopped rank fails the call within the collective timeout and is
named, bad inputs are refused before any rank runs, the rendezvous listens on loopback
only, and a rank's own admission failure of any type reaches every rank's verdict."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.errors import ConfigError, InvalidRequestError
from deepinfer.models.tiny import tiny_config, write_tiny_checkpoint
from deepinfer.parallel.dp_engine import RankFailedError
from deepinfer.parallel.launcher import listen_store
from deepinfer.parallel.rank_engine import RankStepError

VOCAB = 512
KW = dict(dtype="float32", max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64)
SHORT = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
PROMPTS = [[3, 4, 5], [6, 7], [8, 9, 10, 11]]


class BrokenParams(SamplingParams):
    """A user's SamplingParams subclass that breaks inside admission with a plain RuntimeError."""

    def for_request(self) -> SamplingParams:
        raise RuntimeError("a user subclass failed")


class FailsMidStep(SamplingParams):
    """A user's SamplingParams subclass that passes admission and then breaks mid-step, when
    the scheduler's stop check reads it after a forward (a plain ValueError, as user code raises)."""

    def __getattribute__(self, name: str):  # type: ignore[no-untyped-def]
        if name == "stop_token_ids" and sys._getframe(1).f_globals.get("__name__") == "deepinfer.engine.stop":
            raise ValueError("a user subclass failed mid-step")
        return super().__getattribute__(name)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny_dp_hardening")
    write_tiny_checkpoint(str(path), seed=11, cfg=tiny_config(vocab_size=VOCAB, sliding_window=32))
    return str(path)


@pytest.fixture(scope="module")
def reference(ckpt) -> list[list[int]]:
    return [o.token_ids for o in LLM(ckpt, **KW).generate(prompt_token_ids=PROMPTS, sampling_params=SHORT,
                                                          use_tqdm=False)]


@pytest.fixture()
def engine(ckpt, monkeypatch):
    monkeypatch.setenv("DEEPINFER_DIST_TIMEOUT_S", "3")
    llm = LLM(ckpt, data_parallel_size=2, expert_parallel_size=2, **KW)
    yield llm
    llm.shutdown()


def _listening(pids: list[int]) -> list[str]:
    out = subprocess.run(["ss", "-ltnp"], capture_output=True, text=True).stdout.splitlines()
    return [line.split()[3] for line in out if any(f"pid={p}," in line for p in pids)]


def test_ctrl_c_then_next_call_gets_its_own_outputs(engine, reference) -> None:
    assert [o.token_ids for o in engine.generate(prompt_token_ids=PROMPTS, sampling_params=SHORT,
                                                 use_tqdm=False)] == reference
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    def interrupt(*_):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 0.3)
    try:
        with pytest.raises(KeyboardInterrupt):
            engine.generate(prompt_token_ids=[[1, 2]] * 3, sampling_params=long, use_tqdm=False)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    for i in range(2):  # the abandoned call's replies arrive meanwhile: both calls get their own
        start = time.monotonic()
        outs = engine.generate(prompt_token_ids=PROMPTS, sampling_params=SHORT, use_tqdm=False)
        assert [o.token_ids for o in outs] == reference
        assert [o.prompt_token_ids for o in outs] == PROMPTS
        if i == 0:  # the ranks aborted the abandoned call at their next step, not after its 200 tokens
            assert time.monotonic() - start < 4, "the next call waited for the abandoned one to run out"


def test_input_error_mid_step_in_one_rank_fails_the_call_at_once_and_the_engine_serves(engine, reference) -> None:
    """Rank 1's share breaks after its first step: rank 1 reports the error, rank 0 learns of it
    at the next step's has-work exchange (not after DEEPINFER_DIST_TIMEOUT_S=3 s), both abort
    the call, the driver raises it, and the next call runs on the same group."""
    long = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    odd = FailsMidStep(temperature=0, max_tokens=60, ignore_eos=True, seq_seed=1)
    for failing in (1, 0):  # either rank
        payloads = [{"prompt_token_ids": [[1, 2]], "sampling_params": [long]} for _ in range(2)]
        payloads[failing]["sampling_params"] = [odd]
        start = time.monotonic()
        with pytest.raises(RankStepError, match=rf"rank {failing} failed mid-step \(ValueError: a user subclass "
                                                r"failed mid-step\).*the engine keeps serving"):
            engine._call("generate", payloads)
        assert time.monotonic() - start < 3, "reported at the next step, not after the collective timeout"
        assert engine.alive
        outs = engine.generate(prompt_token_ids=PROMPTS, sampling_params=SHORT, use_tqdm=False)
        assert [o.token_ids for o in outs] == reference


def test_stopped_rank_fails_within_the_timeout_and_is_named(engine, reference) -> None:
    listening = _listening([os.getpid(), *(p.pid for p in engine._procs)])
    assert listening and all(a.startswith("127.0.0.1:") for a in listening), listening
    # bad inputs are refused by the driver, before any rank runs, and the engine serves
    with pytest.raises(InvalidRequestError, match="lone surrogate"):
        engine.generate(["ok", "a\ud800"], use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="float32"):
        sp = SamplingParams(structured_output={"regex": "[ab]+"})
        sp.temperature = 1e39
        engine.generate(prompt_token_ids=PROMPTS[:2], sampling_params=sp, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="int64"):
        sp = SamplingParams(structured_output={"regex": "[ab]+"})
        sp.top_k = 2**70
        engine.generate(prompt_token_ids=PROMPTS[:2], sampling_params=sp, use_tqdm=False)
    # a bad schema is refused by the ranks' admission, before any step, naming the keyword
    with pytest.raises(InvalidRequestError, match="schema/minLength: 'minLength' must be a non-negative integer"):
        engine.generate(prompt_token_ids=PROMPTS[:2], use_tqdm=False, sampling_params=SamplingParams(
            structured_output={"json": {"type": "string", "minLength": -1}}))
    # a share only one rank rejects (sent past the driver's checks): both ranks agree, nothing runs
    with pytest.raises(InvalidRequestError, match="outside"):
        engine._call("generate", [{"prompt_token_ids": [[1, VOCAB]], "sampling_params": [SHORT]},
                                  {"prompt_token_ids": [[1, 2]], "sampling_params": [SHORT]}])
    # one rank's admission failing with a non-deepinfer exception still reaches the verdict exchange
    odd = BrokenParams(max_tokens=4)
    with pytest.raises(InvalidRequestError, match="rank 0 could not admit its share"):
        engine._call("generate", [{"prompt_token_ids": [[1, 2]], "sampling_params": [odd]},
                                  {"prompt_token_ids": [[1, 2]], "sampling_params": [SHORT]}])
    outs = engine.generate(prompt_token_ids=PROMPTS, sampling_params=SHORT, use_tqdm=False)
    assert [o.token_ids for o in outs] == reference, "the group serves correctly after every refusal"
    victim = engine._procs[1].pid
    os.kill(victim, signal.SIGSTOP)
    start = time.monotonic()
    with pytest.raises(RankFailedError, match=rf"rank 1 \(pid {victim}\) had not replied and is stopped"):
        engine.generate(prompt_token_ids=PROMPTS, sampling_params=SHORT, use_tqdm=False)
    assert time.monotonic() - start < 3 + 20
    assert not engine._procs[1].is_alive(), "a stopped rank is killed on shutdown"


def test_rendezvous_binds_loopback_without_releasing_its_port(monkeypatch) -> None:
    (store, sock), port = listen_store("127.0.0.1", 2, 5.0)
    assert sock.getsockname() == ("127.0.0.1", port), "the socket stays bound: no pick-and-release"
    store.set("k", "v")
    assert store.get("k") == b"v"
    monkeypatch.setenv("DEEPINFER_DIST_HOST", "not a host")
    from deepinfer.parallel.launcher import dist_host
    with pytest.raises(ConfigError, match="DEEPINFER_DIST_HOST"):
        dist_host()


_SHUTDOWN_SCRIPT = r"""
import os, signal, sys
from deepinfer import LLM, SamplingParams
llm = LLM(sys.argv[1], data_parallel_size=2, expert_parallel_size=2, dtype="float32", max_model_len=256,
          max_num_seqs=8, max_num_batched_tokens=64)
outs = llm.generate(prompt_token_ids=[[3, 4, 5], [6, 7]], sampling_params=SamplingParams(max_tokens=4),
                    use_tqdm=False)
assert len(outs) == 2
# what Jupyter does on interrupt / kernel shutdown: SIGINT to the kernel's whole process group
old = signal.signal(signal.SIGINT, signal.SIG_IGN)
os.killpg(os.getpgid(0), signal.SIGINT)
signal.signal(signal.SIGINT, old)
assert len(llm.generate(prompt_token_ids=[[8, 9]], sampling_params=SamplingParams(max_tokens=4),
                        use_tqdm=False)) == 1
llm.shutdown()
print("clean exit")
"""


def test_shutdown_prints_no_traceback(ckpt) -> None:
    """A normal shutdown of the spawned ranks, also after the process group got a SIGINT (a
    Jupyter interrupt): no KeyboardInterrupt traceback from a rank blocked in conn.recv()."""
    run = subprocess.run([sys.executable, "-c", _SHUTDOWN_SCRIPT, ckpt], capture_output=True, text=True,
                         timeout=120, start_new_session=True)  # its own process group: the SIGINT stays there
    assert run.returncode == 0 and "clean exit" in run.stdout, run.stderr[-3000:]
    assert "Traceback" not in run.stderr and "KeyboardInterrupt" not in run.stderr, run.stderr[-3000:]
