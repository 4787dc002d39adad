"""One data-parallel attention rank that holds its expert-parallel share of the experts.

A `RankLLM` is an `LLM` over a `RankEngineCore` with its own scheduler, KV cache and requests, whose MoE layers
are `ExpertParallelMoE` over the group. Ranks step in lockstep: every step starts with
an all-reduce of "has work" flags (`has_unfinished`), and a rank with nothing scheduled
runs a dummy batch of zero tokens through the MoE layers so every all-to-all matches.
EPLB steps (and rebalances) inside `execute`, so every rank counts the same steps.

Use it through ``LLM(data_parallel_size=N, expert_parallel_size=N)`` (spawned workers)
or directly under ``torchrun`` (see `deepinfer.parallel.launcher.rank_llm_from_torchrun`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from deepinfer.engine.admission import admit_generate
from deepinfer.engine.core import EngineCore
from deepinfer.engine.outputs import ModelRunnerOutput, SchedulerOutput
from deepinfer.errors import DeepInferError, InvalidRequestError
from deepinfer.llm import LLM
from deepinfer.outputs import RequestOutput
from deepinfer.parallel.comm import EPComm
from deepinfer.parallel.eplb import EPLBConfig, EPLBController
from deepinfer.parallel.expert_parallel import ExpertParallelMoE
from deepinfer.parallel.placement import ExpertPlacement, PlacementError
from deepinfer.sampling_params import SamplingParams

__all__ = ["RankEngineCore", "RankLLM", "PeerRejectedError", "CallAbandonedError"]


class PeerRejectedError(DeepInferError):
    """Another rank rejected its share of a generate() call (nothing was run), or failed
    mid-step (this rank's requests of the call were aborted)."""


class RankStepError(DeepInferError):
    """This rank's step failed outside the group's collectives (an input its requests carry,
    e.g. a user's SamplingParams subclass, or a grammar failing mid-generation): the call's
    requests were aborted on every rank, and the group still serves."""


class CallAbandonedError(DeepInferError):
    """The driver abandoned this call (Ctrl-C in ``generate``): every rank aborted its
    requests at the same step. Its reply is stale; the driver drops it."""


class _InSync(Exception):
    """A step failure after which this rank has entered every collective of the step."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


class _LockstepRunner:
    """Wraps the engine's runner: EPLB step bookkeeping around every execute, and a dummy
    MoE pass when this rank has nothing scheduled (or failed before its forward)."""

    def __init__(self, inner: Any, engine: RankEngineCore) -> None:
        self.inner, self.engine = inner, engine
        #: collectives of one forward (measured on a good one; the same on every rank)
        self.forward_collectives: int | None = None

    def execute(self, so: SchedulerOutput, *args: Any, **kwargs: Any) -> ModelRunnerOutput:
        eplb, comm = self.engine.eplb, self.engine.comm
        if eplb is not None:
            eplb.begin_step()
        failure: Exception | None = None
        start = comm.num_collectives
        if so.scheduled:
            try:
                out = self.inner.execute(so, *args, **kwargs)
                self.forward_collectives = comm.num_collectives - start
            except Exception as exc:  # noqa: BLE001 - re-raised below, or the group is broken anyway
                done = comm.num_collectives - start
                if done == 0:  # before the forward (inputs): join the peers' all-to-alls empty-handed
                    self.engine.dummy_moe_pass()
                elif done != self.forward_collectives:
                    raise  # inside the forward: the peers wait in a collective this rank left
                failure = exc
                out = ModelRunnerOutput([], [])
        else:
            self.engine.dummy_moe_pass()
            self.forward_collectives = comm.num_collectives - start
            out = ModelRunnerOutput([], [])
        if eplb is not None:
            eplb.end_step()
        self.engine.executed_this_step = True
        if failure is not None:
            raise _InSync(failure)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class RankEngineCore(EngineCore):
    """An `EngineCore` that is one rank of a data-parallel + expert-parallel group."""

    #: every rank must run the same collectives per step (has-work all-reduce, dummy MoE
    #: passes, EPLB steps inside execute): ranks keep the synchronous loop
    async_scheduling_unsupported = ("data-parallel / expert-parallel ranks step in lockstep through the "
                                    "synchronous loop (collectives and EPLB bookkeeping run inside execute)")

    def __init__(self, model: str | None = None, tokenizer: str | None = None, *, comm: EPComm,
                 expert_parallel: bool = True, eplb: EPLBConfig | None = None,
                 placement: ExpertPlacement | None = None, **kwargs: Any) -> None:
        self.comm = comm
        self.expert_parallel = expert_parallel
        self.eplb_config = eplb or EPLBConfig.from_env()
        self._initial_placement = placement
        self.eplb: EPLBController | None = None
        self.ep_layers: list[ExpertParallelMoE] = []
        #: the exception of this rank's failed step, reported to the group at the next has_unfinished
        self.step_error: Exception | None = None
        self.executed_this_step = False
        super().__init__(model, tokenizer, **kwargs)

    # ---- construction ----------------------------------------------------------------
    def warm_up(self) -> int:
        """No throwaway requests on a rank: each of its steps runs collectives with its peers,
        which a rank-local warm-up would start out of step with them."""
        return 0

    def init_model(self) -> None:
        super().init_model()
        if self.expert_parallel:
            self.init_expert_parallel()

    def init_expert_parallel(self) -> None:
        """Swap every layer's MoE for this rank's expert slots (the other experts are freed)."""
        mcfg, world = self.model_config, self.comm.world_size
        num_layers = len(self.model.layers)
        num_logical = mcfg.n_routed_experts
        placement = self._initial_placement or ExpertPlacement.default(
            num_layers, num_logical, world, self.eplb_config.num_redundant_experts)
        if (placement.num_layers, placement.num_logical, placement.num_ranks) != (num_layers, num_logical, world):
            raise PlacementError(
                f"placement is for {placement.num_layers} layers x {placement.num_logical} experts over "
                f"{placement.num_ranks} ranks; this engine has {num_layers} x {num_logical} over {world}")
        for i, block in enumerate(self.model.layers):
            block.ffn = ExpertParallelMoE(block.ffn, i, placement.phy2log[i], self.comm)
            self.ep_layers.append(block.ffn)
        self.eplb = EPLBController(self.ep_layers, placement, self.eplb_config, self.comm, self.device)

    def init_cache_and_scheduler(self) -> None:
        super().init_cache_and_scheduler()
        self.runner = _LockstepRunner(self.runner, self)

    # ---- lockstep ----------------------------------------------------------------------
    def step(self) -> list:
        """One lockstep step. A failure outside the group's collectives (before this rank's
        forward, or after it: sampling, grammars, detokenization) is caught: the rank still
        enters every collective of the step, aborts its requests and reports the error at
        the next ``has_unfinished``, where every rank learns of it at once (no rank waits
        for a collective timeout, and the group keeps serving). A failure inside the
        forward leaves the peers in a collective: it propagates (the group is broken)."""
        self.executed_this_step = False
        start = self.comm.num_collectives
        try:
            return super().step()
        except _InSync as exc:
            error = exc.error
        except Exception as exc:  # noqa: BLE001 - reported to the group below
            if not self.executed_this_step:
                if self.comm.num_collectives != start:
                    raise
                self.runner.execute(SchedulerOutput())  # the step's collectives, with nothing scheduled
            error = exc
        self.step_error = error
        self._abort_all()
        return []

    def _abort_all(self) -> None:
        for rid in [*self.scheduler.requests, *self.structured.pending]:
            self.abort(rid)

    #: whether the driver abandoned the call being served (set by the worker loop; each
    #: rank reads it at its own moment, the has-work all-reduce makes the verdict common)
    call_abandoned: Callable[[], bool] = staticmethod(lambda: False)

    def has_unfinished(self) -> bool:
        local = super().has_unfinished()
        failed, abandoned = -1, bool(self.call_abandoned())
        if self.comm.world_size == 1:
            failed = self.comm.rank if self.step_error is not None else -1
        else:
            flag = torch.tensor([1 if local else 0, 0 if self.step_error is None else self.comm.rank + 1,
                                 int(abandoned)], dtype=torch.int64, device=self.device)
            self.comm.all_reduce(flag, "max")
            local, failed, abandoned = bool(flag[0].item()), int(flag[1].item()) - 1, bool(flag[2].item())
        if abandoned and local:
            self._abort_all()
            self.step_error = None
            raise CallAbandonedError("the driver abandoned this generate() call; its requests were aborted on "
                                     "every rank")
        if failed < 0:
            return local
        self._abort_all()
        error, self.step_error = self.step_error, None
        if error is not None:
            raise RankStepError(f"rank {self.comm.rank} failed mid-step ({type(error).__name__}: {error}); this "
                                f"call's requests were aborted on every rank, the engine keeps serving") from error
        raise PeerRejectedError(f"rank {failed} failed mid-step; this rank's requests of the call were aborted")

    @torch.no_grad()
    def dummy_moe_pass(self) -> None:
        """Zero tokens through every EP layer, so this idle rank joins its peers' all-to-alls."""
        x = torch.empty(0, self.model_config.hidden_size, dtype=self.model.dtype, device=self.device)
        ids = torch.empty(0, dtype=torch.long, device=self.device)
        for layer in self.ep_layers:
            layer(x, ids)


class RankLLM(LLM):
    """An `LLM` over a `RankEngineCore` (``comm``, ``eplb`` ... read through to the core)."""

    def make_core(self, model: str | None, tokenizer: str | None, **kwargs: Any) -> EngineCore:
        return RankEngineCore(model, tokenizer, **kwargs)

    def generate_rank(self, prompts: Sequence[str] | None = None,
                      sampling_params: Sequence[SamplingParams] | None = None,
                      prompt_token_ids: Sequence[Sequence[int]] | None = None,
                      use_tqdm: bool = False) -> list[RequestOutput]:
        """This rank's share of a generate() call; every rank of the group must call it
        (with its own share, possibly empty). Inputs are checked on every rank first and
        the verdicts exchanged, so a bad prompt anywhere fails everywhere before any step."""
        error: Exception | None = None
        try:
            _, params = admit_generate(self.engine, prompts, sampling_params, prompt_token_ids)
        except DeepInferError as exc:
            error = exc
        except Exception as exc:  # noqa: BLE001 - every rank must reach the verdict exchange below
            error = InvalidRequestError(f"rank {self.comm.rank} could not admit its share of this generate() "
                                        f"call: {type(exc).__name__}: {exc}")
        if self.comm.world_size > 1:
            flag = torch.tensor([0 if error is None else 1], dtype=torch.int64, device=self.device)
            if self.comm.all_reduce(flag, "max").item() and error is None:
                error = PeerRejectedError("another data-parallel rank rejected its share of this generate() call")
        if error is not None:
            raise error
        return self.generate(prompts, params, prompt_token_ids, use_tqdm=use_tqdm)
