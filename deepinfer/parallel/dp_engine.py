"""``LLM(data_parallel_size=N, expert_parallel_size=N)``: the driver of N rank processes.

`DataParallelEngine` is the engine such an `LLM` is a client of (``llm.engine``), as an
`EngineCore` is for one process; it is not an `LLM` itself. The driver holds no model. It
spawns one `RankLLM` per rank (a client of that rank's `RankEngineCore`, see `launcher`),
splits each generate() call's prompts across ranks (round robin, or by tokens), lets the ranks run
their own schedulers in lockstep, and returns outputs in prompt order. Placement and
EPLB are driven from here: `placement`, `set_placement`, `rebalance`, `expert_load`.

Failures: a rank that dies raises `RankFailedError` at once (the driver watches every
process) and shuts the group down; a rank stuck in a collective fails after the group's
timeout (``DEEPINFER_DIST_TIMEOUT_S``) and its error is reported the same way. Ranks step
in lockstep, so once one rank has answered a command the others get that timeout (plus
`REPLY_SLACK_S`) to answer too: a rank that does not (stopped, hung outside a
collective) is named, with its process state, in the RankFailedError. A rank that fails
with anything but an input error ends the call at once, without waiting for its peers.
Input errors (bad prompts, placements) are raised as themselves and leave the engine
serving; prompts and sampling values are checked here, before any rank sees the call.

Replies are request-scoped: every command carries a call id and every reply echoes it, so
the replies of a call abandoned half-way (Ctrl-C in ``generate``) are recognised as stale
and dropped by the next call instead of being returned as its outputs. The abandoned id is
also shared with the ranks, which abort that call at their next step, so the next call
does not wait for the abandoned one to run out its tokens.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import time
import weakref
from collections.abc import Sequence
from multiprocessing.connection import wait
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from deepinfer.engine.admission import check_sampling_values, prompt_items
from deepinfer.engine.inputs import expand_sampling_params
from deepinfer.errors import ConfigError, DeepInferError, InvalidRequestError
from deepinfer.models.default_model import resolve_model
from deepinfer.outputs import RequestOutput
from deepinfer.parallel.eplb import RebalanceReport
from deepinfer.parallel.launcher import WorkerSpec, dist_host, dist_timeout_s, listen_store, split_kwargs, worker_main
from deepinfer.parallel.placement import ExpertPlacement
from deepinfer.parallel.rank_engine import PeerRejectedError
from deepinfer.sampling_params import SamplingParams

__all__ = ["DataParallelEngine", "RankFailedError", "split_requests", "REPLY_SLACK_S"]

#: seconds a rank may answer later than the first rank of a call, beyond the collective
#: timeout (ranks run in lockstep: any longer and it is stopped or hung)
REPLY_SLACK_S: float = 10.0
#: how long a failed call waits for a silent peer's exit to show (its death names the cause)
DEATH_GRACE_S: float = 1.0


class RankFailedError(RuntimeError):
    """A rank process died or failed mid-step; the engine is shut down."""


def split_requests(lengths: Sequence[int], world: int, policy: str = "round_robin") -> list[list[int]]:
    """Prompt indices per rank: ``round_robin`` (i % world) or ``tokens`` (longest first
    onto the rank with the fewest tokens so far); each rank's list stays in prompt order."""
    if policy == "round_robin":
        return [list(range(r, len(lengths), world)) for r in range(world)]
    if policy != "tokens":
        raise ConfigError(f"dp_split must be 'round_robin' or 'tokens', got {policy!r}", field="dp_split")
    load, shares = [0] * world, [[] for _ in range(world)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        shares[r].append(i)
        load[r] += lengths[i]
    return [sorted(s) for s in shares]


def _context() -> Any:
    """A forkserver that imports torch and the engine once, so N ranks start in about the
    time of one import (a clean fork of a thread-free server; CUDA is never touched there).
    Falls back to spawn where forkserver does not exist."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    # torch._dynamo: model construction imports it lazily (about 3 s per process otherwise)
    ctx.set_forkserver_preload(["torch._dynamo", "deepinfer.parallel.rank_engine", "deepinfer.parallel.launcher"])
    return ctx


def _shutdown(procs: list[Any], conns: list[Any]) -> None:
    for conn in conns:
        try:
            conn.send((-1, "shutdown", None))
        except (OSError, ValueError):
            pass
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.terminate()
            p.join(timeout=5)
        if p.is_alive():  # a stopped (SIGSTOP) process only leaves on SIGKILL
            p.kill()
            p.join(timeout=5)
    for conn in conns:
        conn.close()


def process_state(pid: int | None) -> str:
    """A rank process's state for error messages ("stopped", "sleeping" ...), from /proc."""
    names = {"R": "running", "S": "sleeping", "D": "in uninterruptible wait", "T": "stopped", "t": "stopped "
             "(traced)", "Z": "a zombie", "X": "dead"}
    try:
        with open(f"/proc/{pid}/stat") as f:
            code = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "in an unknown state"
    return names.get(code, f"in state {code!r}")


class DataParallelEngine:
    """Data-parallel attention + expert-parallel MoE over spawned rank processes (the engine
    of ``LLM(data_parallel_size=N, expert_parallel_size=N)``)."""

    #: `LLM.generate` hands whole calls here: the ranks step in lockstep, the driver has no step()
    runs_whole_calls = True

    def __init__(self, model: str | None = None, tokenizer: str | None = None, *, dp_split: str = "round_robin",
                 **kwargs: Any) -> None:
        dp, ep = int(kwargs.get("data_parallel_size", 1)), int(kwargs.get("expert_parallel_size", 1))
        world = max(dp, ep)
        if dp not in (1, world) or ep not in (1, world):
            raise ConfigError(f"data_parallel_size={dp} and expert_parallel_size={ep}: the ranks are shared, so "
                              f"each must be 1 or {world} (DP attention ranks = EP ranks)", field="expert_parallel_size")
        split_requests([], 1, dp_split)  # validates dp_split
        self.world_size, self.dp_split, self.data_parallel_size = world, dp_split, dp
        self._ids = itertools.count()
        self._call_ids = itertools.count(1)
        self._tokenizer = None
        accelerator = str(kwargs.get("accelerator", "auto"))
        if accelerator == "auto":
            from deepinfer.config import detect_accelerator
            accelerator = detect_accelerator()
        kw = dict(kwargs)
        if isinstance(kw.get("placement"), ExpertPlacement):
            kw["placement"] = kw["placement"].to_dict()
        split_kwargs(kw)  # bad EPLB settings / placements fail here, before any process starts
        model = resolve_model(model)
        self.timeout_s = dist_timeout_s()
        # the rendezvous store lives here, on a socket bound before its port is known (no
        # pick-and-release race), on 127.0.0.1 unless DEEPINFER_DIST_HOST names another address
        self._store, port = listen_store(dist_host(), world, self.timeout_s)
        spec = WorkerSpec(model, tokenizer, world, port, accelerator, self.timeout_s, ep > 1, kw, host=dist_host())
        ctx = _context()
        self._abandoned = ctx.Value("q", 0, lock=False)  # written here only; ranks read it each step
        self._procs, self._conns = [], []
        for rank in range(world):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(rank, spec, child, self._abandoned), daemon=True,
                               name=f"deepinfer-rank{rank}")
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        self._finalizer = weakref.finalize(self, _shutdown, self._procs, self._conns)
        self._collect("start", call_id=0)
        info = self._call("info", ranks=[0])[0]
        self.config, self.model_config, self.model_dir = info["config"], info["model_config"], info["model_dir"]
        self.eos_token_id = self.model_config.eos_token_id

    # ---- plumbing ----------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._finalizer.alive

    def shutdown(self) -> None:
        """Stop every rank process (idempotent)."""
        self._finalizer()

    close = shutdown

    def __enter__(self) -> DataParallelEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _call(self, cmd: str, payloads: list[Any] | Any = None, ranks: list[int] | None = None) -> list[Any]:
        """Send ``cmd`` to ``ranks`` (default all; a list of payloads = one per rank) and
        return their results in rank order."""
        if not self.alive:
            raise RankFailedError("this engine was shut down (a rank failed, or shutdown() was called); create a "
                                  "new LLM")
        ranks = list(range(self.world_size)) if ranks is None else ranks
        call_id = next(self._call_ids)
        for i, r in enumerate(ranks):
            try:
                self._conns[r].send((call_id, cmd, payloads[i] if isinstance(payloads, list) else payloads))
            except OSError:  # broken pipe: the rank is gone
                self._procs[r].join(timeout=5)
                self._rank_died(r, cmd, {})
        try:
            return self._collect(cmd, ranks, call_id)
        except KeyboardInterrupt:
            self._abandoned.value = call_id  # the ranks abort it at their next step
            raise

    def _collect(self, cmd: str, ranks: list[int] | None = None, call_id: int = 0) -> list[Any]:
        """The replies of call ``call_id`` from ``ranks`` (stale replies of earlier, abandoned
        calls are dropped). Once one rank has replied, the others have the collective timeout
        plus REPLY_SLACK_S to reply too; a rank that fails with a non-input error ends the
        call at once."""
        ranks = list(range(self.world_size)) if ranks is None else ranks
        replies: dict[int, tuple[str, Any]] = {}
        pending = set(ranks)
        deadline: float | None = None
        while pending:
            waitables = {self._conns[r]: r for r in pending} | {self._procs[r].sentinel: r for r in pending}
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = wait(list(waitables), timeout=timeout)
            if not ready and deadline is not None and time.monotonic() >= deadline:
                self._ranks_silent(cmd, sorted(pending), replies)
            for obj in ready:
                r = waitables[obj]
                if r not in pending:
                    continue
                try:
                    if self._conns[r].poll():
                        reply_id, status, value = self._conns[r].recv()
                        if reply_id != call_id:
                            continue  # the reply of a call abandoned earlier (Ctrl-C): stale
                        replies[r] = (status, value)
                        pending.discard(r)
                        if deadline is None:
                            deadline = time.monotonic() + self.timeout_s + REPLY_SLACK_S
                        if status == "error" and not isinstance(value[0], DeepInferError) and pending:
                            # the group is broken: waiting for the peers' timeouts helps nobody. A peer
                            # that died is often the cause (its exit reaches us after the survivor's
                            # collective error): name it when it is gone within a moment
                            for q in sorted(pending):
                                self._procs[q].join(timeout=DEATH_GRACE_S)
                                if not self._procs[q].is_alive():
                                    self._rank_died(q, cmd, replies)
                            break
                        continue
                except (EOFError, OSError):  # the pipe closed: the process is going away
                    self._procs[r].join(timeout=5)
                if not self._procs[r].is_alive():
                    self._rank_died(r, cmd, replies)
            else:
                continue
            break  # a rank failed mid-call: report it now
        errors = {r: v for r, (status, v) in replies.items() if status == "error"}
        silent = sorted(pending)
        if errors:
            clean = all(isinstance(exc, DeepInferError) for exc, _ in errors.values())
            first = next((exc for exc, _ in errors.values() if not isinstance(exc, PeerRejectedError)),
                         next(iter(errors.values()))[0])
            if clean and cmd != "start":
                raise first  # input errors: nothing ran, the engine keeps serving
            notes = self._silent_notes(silent)
            self.shutdown()
            if clean:
                raise first
            detail = "\n".join(f"--- rank {r}: {type(e).__name__}: {e}\n{tb}" for r, (e, tb) in sorted(errors.items()))
            failed = ", ".join(str(r) for r in sorted(errors))
            raise RankFailedError(f"rank(s) {failed} failed during {cmd!r}{notes}; the engine is shut down\n{detail}")
        return [replies[r][1] for r in ranks]

    def _silent_notes(self, silent: list[int]) -> str:
        return "".join(f"; rank {r} (pid {self._procs[r].pid}) had not replied and is "
                       f"{process_state(self._procs[r].pid)}" for r in silent)

    def _ranks_silent(self, cmd: str, silent: list[int], replies: dict[int, tuple[str, Any]]) -> None:
        notes = "; ".join(f"rank {q}: {type(v[0]).__name__}: {v[0]}" for q, (s, v) in replies.items() if s == "error")
        states = ", ".join(f"rank {r} (pid {self._procs[r].pid}, {process_state(self._procs[r].pid)})" for r in silent)
        waited = self.timeout_s + REPLY_SLACK_S
        self.shutdown()
        raise RankFailedError(f"{states} did not reply to {cmd!r} within {waited:g} s of the first rank's reply "
                              f"(DEEPINFER_DIST_TIMEOUT_S={self.timeout_s:g} + {REPLY_SLACK_S:g} s); the engine is "
                              f"shut down" + (f" ({notes})" if notes else ""))

    def _rank_died(self, rank: int, cmd: str, replies: dict[int, tuple[str, Any]]) -> None:
        proc = self._procs[rank]
        notes = "; ".join(f"rank {q}: {type(v[0]).__name__}: {v[0]}" for q, (s, v) in replies.items() if s == "error")
        self.shutdown()
        raise RankFailedError(f"rank {rank} (pid {proc.pid}) exited with code {proc.exitcode} during {cmd!r}; the "
                              f"engine is shut down" + (f" ({notes})" if notes else ""))

    # ---- LLM interface -----------------------------------------------------------------
    @property
    def tokenizer(self):  # noqa: ANN201 - the driver loads its own copy, on first use
        if self._tokenizer is None:
            from deepinfer.tokenizer import load_tokenizer
            self._tokenizer = load_tokenizer(self.config.tokenizer or self.model_dir)
        return self._tokenizer

    def generate(self, prompts: str | Sequence[str] | None = None,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 prompt_token_ids: Sequence[Sequence[int]] | Sequence[int] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """`LLM.generate` across the ranks; outputs in prompt order."""
        # types, token ids and sampling values of the whole call, before any rank sees it
        admitted = prompt_items(self, prompts, prompt_token_ids)
        key = "prompts" if prompts is not None else "prompt_token_ids"
        items = [text if key == "prompts" else ids for text, ids in admitted]
        params = expand_sampling_params(sampling_params, len(items))
        for i, sp in enumerate(params):
            check_sampling_values(sp, i, self.model_config.vocab_size)
        lengths = [len(ids) for _, ids in admitted]
        shares = split_requests(lengths, self.world_size if self.data_parallel_size > 1 else 1, self.dp_split)
        shares += [[] for _ in range(self.world_size - len(shares))]
        payloads = [{key: [items[i] for i in idx], "sampling_params": [params[i] for i in idx]} for idx in shares]
        with tqdm(total=len(items), desc="generate", disable=not use_tqdm) as bar:
            results = self._call("generate", payloads)
            bar.update(len(items))
        outputs: list[RequestOutput | None] = [None] * len(items)
        for idx, outs in zip(shares, results):
            for i, out in zip(idx, outs):
                outputs[i] = out
        for out in outputs:
            out.request_id = f"req-{next(self._ids)}"
        return outputs  # type: ignore[return-value]

    def step(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("the data-parallel driver steps its ranks inside generate(); there is no "
                                  "driver-side step()")

    # ---- placement and EPLB --------------------------------------------------------------
    @property
    def placement(self) -> ExpertPlacement:
        """The expert placement in use (logical expert -> physical slots per rank)."""
        return ExpertPlacement.from_dict(self._call("placement", ranks=[0])[0])

    def set_placement(self, placement: ExpertPlacement) -> RebalanceReport:
        """Adopt a hand-made placement now, moving expert weights between ranks in place."""
        if not isinstance(placement, ExpertPlacement):
            raise InvalidRequestError(f"set_placement needs an ExpertPlacement, got {type(placement).__name__}")
        return self._call("rebalance", placement.to_dict())[0]

    def rebalance(self) -> RebalanceReport:
        """Run the EPLB policy on the recorded window now and move the weights."""
        return self._call("rebalance", None)[0]

    def expert_load(self) -> dict[str, Any]:
        """The recorded window, summed over ranks: ``physical`` [steps, layers, slots],
        ``logical`` [steps, layers, experts], ``rank`` [steps, layers, ranks] (numpy),
        plus the ``placement`` it was recorded under and ``total_steps``."""
        data = self._call("load")[0]
        placement = ExpertPlacement.from_dict(data["placement"])
        phys = np.asarray(data["physical"])
        rank = phys.reshape(phys.shape[0], phys.shape[1], placement.num_ranks, placement.slots_per_rank).sum(axis=3)
        return {**data, "placement": placement, "rank": rank}

    def comm_stats(self) -> list[dict[str, float] | None]:
        """Each rank's all-to-all ``seconds`` / ``calls`` / ``bytes`` since the last call
        (None per rank unless the ranks started with ``DEEPINFER_EP_TIMING=1``)."""
        return self._call("comm_stats")

    def rebalance_reports(self) -> list[RebalanceReport]:
        return self._call("reports", ranks=[0])[0]
