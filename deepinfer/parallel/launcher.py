"""Process groups for the parallel engine: spawned workers and ``torchrun``.

Spawned (``LLM(data_parallel_size=N, expert_parallel_size=N)``): the driver starts N
processes running :func:`worker_main`; each joins a TCP-rendezvous group (NCCL on GPUs,
gloo on CPU) with a collective timeout, builds a `RankLLM` and serves commands from its
pipe until told to stop. Every command is ``(call_id, cmd, payload)`` and every reply
``(call_id, "ok", result)`` or ``(call_id, "error", (exc, tb))``: the driver drops the
replies of calls it abandoned (request-scoped replies).

Rendezvous: the driver holds the group's TCPStore (:func:`listen_store`) on a socket it
binds first and hands to the store, so the port is never picked, released and re-bound
(another process could take it in between). It listens on ``DEEPINFER_DIST_HOST``
(default 127.0.0.1: the store has no authentication, so it is not exposed to the
network unless asked); on 127.0.0.1 gloo's own connections use the loopback interface too.

torchrun: each process calls :func:`rank_llm_from_torchrun` and then
``llm.generate_rank(...)`` with its own prompts (every rank the same number of times)::

    torchrun --nproc-per-node 2 my_script.py
    # my_script.py
    from deepinfer.parallel.launcher import rank_llm_from_torchrun
    llm = rank_llm_from_torchrun("path/to/ckpt", num_redundant_experts=2)
    outs = llm.generate_rank(prompt_token_ids=my_prompts, sampling_params=my_params)
"""

from __future__ import annotations

import datetime
import os
import signal
import socket
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from deepinfer import envs
from deepinfer.config import detect_accelerator
from deepinfer.errors import ConfigError
from deepinfer.parallel.comm import EPComm
from deepinfer.parallel.eplb import EPLBConfig
from deepinfer.parallel.placement import ExpertPlacement
from deepinfer.platform import get_platform

__all__ = ["WorkerSpec", "dist_host", "dist_timeout_s", "find_free_port", "init_distributed", "listen_store",
           "rank_llm_from_torchrun", "split_kwargs", "worker_main"]

DEFAULT_TIMEOUT_S: float = envs.ENV_VARS["DEEPINFER_DIST_TIMEOUT_S"].default


def dist_timeout_s(environ: dict[str, str] | None = None) -> float:
    """``DEEPINFER_DIST_TIMEOUT_S`` (seconds a collective waits for a peer), default 120."""
    return envs.get("DEEPINFER_DIST_TIMEOUT_S", environ)


def dist_host(environ: dict[str, str] | None = None) -> str:
    """``DEEPINFER_DIST_HOST``: the address the spawned group's rendezvous listens on."""
    return envs.get("DEEPINFER_DIST_HOST", environ)


def find_free_port() -> int:
    """A port free now (racy: prefer :func:`listen_store`, which never releases its socket)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def listen_store(host: str, world_size: int, timeout_s: float) -> tuple[tuple[dist.TCPStore, socket.socket], int]:
    """The group's rendezvous store, served from this process on ``host`` and a port the OS
    picks for a socket that stays bound (handed to the store): ((store, socket), port).
    Keep both alive as long as the group runs (the store serves from the socket)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((host, 0))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"DEEPINFER_DIST_HOST={host!r}: cannot listen there ({exc}); use an address of this "
                          f"host (default 127.0.0.1)", field="DEEPINFER_DIST_HOST") from None
    sock.listen(max(16, 2 * world_size))
    port = int(sock.getsockname()[1])
    store = dist.TCPStore(host, port, world_size + 1, True, datetime.timedelta(seconds=timeout_s),
                          wait_for_workers=False, master_listen_fd=sock.fileno())
    return (store, sock), port


def init_distributed(rank: int, world_size: int, init_method: str | None, accelerator: str,
                     timeout_s: float, local_rank: int | None = None, store: Any = None) -> EPComm:
    """Select this rank's device, join the default process group (through ``store`` when
    given, else ``init_method`` / torchrun's environment), return its `EPComm`."""
    platform = get_platform(accelerator)
    if platform.device_type != "cpu":
        platform.set_device((rank if local_rank is None else local_rank) % max(1, platform.device_count()))
    kwargs: dict[str, Any] = {"backend": platform.dist_backend, "rank": rank, "world_size": world_size,
                              "timeout": datetime.timedelta(seconds=timeout_s)}
    if store is not None:
        kwargs["store"] = store
    elif init_method is not None:
        kwargs["init_method"] = init_method
    dist.init_process_group(**kwargs)
    return EPComm()


def split_kwargs(kwargs: dict[str, Any]) -> tuple[dict[str, Any], EPLBConfig, ExpertPlacement | None]:
    """Pull the EPLB kwargs (num_redundant_experts, eplb_*) and placement out of LLM kwargs."""
    kw = dict(kwargs)
    eplb = EPLBConfig.from_env(
        num_redundant_experts=kw.pop("num_redundant_experts", None),
        rebalance_interval=kw.pop("eplb_rebalance_interval", None),
        window_size=kw.pop("eplb_window_size", None), policy=kw.pop("eplb_policy", None),
        num_groups=kw.pop("eplb_num_groups", None), num_nodes=kw.pop("eplb_num_nodes", None))
    placement = kw.pop("placement", None)
    if isinstance(placement, dict):
        placement = ExpertPlacement.from_dict(placement)
    return kw, eplb, placement


def rank_llm_from_torchrun(model: str | None = None, tokenizer: str | None = None, **kwargs: Any):
    """Build this process's `RankLLM` under torchrun (RANK / WORLD_SIZE / LOCAL_RANK / MASTER_*)."""
    from deepinfer.parallel.rank_engine import RankLLM

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    accelerator = str(kwargs.get("accelerator") or envs.DEEPINFER_ACCELERATOR)
    accelerator = detect_accelerator() if accelerator == "auto" else accelerator
    comm = init_distributed(rank, world, None, accelerator, dist_timeout_s(), int(os.environ.get("LOCAL_RANK", rank)))
    kw, eplb, placement = split_kwargs(kwargs)
    kw.setdefault("data_parallel_size", world)
    kw.setdefault("expert_parallel_size", world)
    return RankLLM(model, tokenizer, comm=comm, expert_parallel=kw["expert_parallel_size"] > 1, eplb=eplb,
                   placement=placement, **kw)


@dataclass
class WorkerSpec:
    """Everything a spawned worker needs (picklable)."""

    model: str
    tokenizer: str | None
    world_size: int
    port: int
    accelerator: str
    timeout_s: float
    expert_parallel: bool
    kwargs: dict[str, Any] = field(default_factory=dict)
    #: the rendezvous store's address (the driver serves it)
    host: str = "127.0.0.1"
    #: the driver's DEEPINFER_* variables when the engine was made: a forkserver child
    #: inherits the server's environment from when it started, not the driver's current one
    env: dict[str, str] = field(default_factory=lambda: deepinfer_env())


def deepinfer_env() -> dict[str, str]:
    """This process's DEEPINFER_* environment variables."""
    return {k: v for k, v in os.environ.items() if k.startswith("DEEPINFER_")}


def adopt_env(env: dict[str, str]) -> None:
    """Make this process's DEEPINFER_* variables exactly ``env``."""
    for k in [k for k in os.environ if k.startswith("DEEPINFER_") and k not in env]:
        del os.environ[k]
    os.environ.update(env)


def _handle(engine: Any, cmd: str, payload: Any) -> Any:
    if cmd == "generate":
        return engine.generate_rank(payload.get("prompts"), payload["sampling_params"],
                                    payload.get("prompt_token_ids"), use_tqdm=False)
    if cmd == "info":
        return {"config": engine.config, "model_config": engine.model_config, "model_dir": engine.model_dir,
                "placement": engine.eplb.placement.to_dict() if engine.eplb else None}
    if cmd == "comm_stats":  # this rank's all-to-all totals (DEEPINFER_EP_TIMING=1), then reset
        return None if engine.comm.timer is None else engine.comm.timer.read(reset=True)
    if engine.eplb is None:
        raise ConfigError(f"{cmd!r} needs expert parallelism (expert_parallel_size > 1)")
    if cmd == "placement":
        return engine.eplb.placement.to_dict()
    if cmd == "rebalance":
        placement = None if payload is None else engine.eplb.check(ExpertPlacement.from_dict(payload))
        return engine.eplb.rebalance(placement)
    if cmd == "load":
        physical = engine.eplb.physical_window()
        return {"physical": physical.numpy(), "logical": engine.eplb.logical_window(physical),
                "placement": engine.eplb.placement.to_dict(), "total_steps": engine.eplb.total_steps}
    if cmd == "reports":
        return list(engine.eplb.reports)
    raise ValueError(f"unknown worker command {cmd!r}")


def worker_main(rank: int, spec: WorkerSpec, conn: Any, abandoned: Any = None) -> None:
    """Entry point of a spawned rank: join the group, build the engine, serve commands.
    ``abandoned`` (a shared int64) holds the id of the last call the driver gave up on:
    the rank's lockstep loop aborts that call at its next step instead of running it out."""
    from deepinfer.parallel.rank_engine import RankLLM

    # Ctrl-C (and Jupyter's interrupt / shutdown, which signal the kernel's whole process
    # group) is the driver's to handle: it abandons the call (its replies are dropped as
    # stale) or shuts the ranks down through the pipe. A rank interrupted in conn.recv()
    # would only print a KeyboardInterrupt traceback and leave its peers in a collective.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    call_id = 0  # the start-up reply's id; then every reply echoes its command's id

    def reply(status: str, value: Any) -> None:
        try:
            conn.send((call_id, status, value))
        except Exception:  # an unpicklable exception: send its text
            conn.send((call_id, "error", (RuntimeError(repr(value[0] if status == "error" else value)), "")))

    try:
        adopt_env(spec.env)
        if spec.accelerator == "cpu":
            torch.set_num_threads(1)  # ranks share the host's cores
        if spec.host in ("127.0.0.1", "localhost") and "GLOO_SOCKET_IFNAME" not in os.environ:
            os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # gloo's pair sockets on loopback too
        store = dist.TCPStore(spec.host, spec.port, spec.world_size + 1, False,
                              datetime.timedelta(seconds=spec.timeout_s))
        comm = init_distributed(rank, spec.world_size, None, spec.accelerator, spec.timeout_s, store=store)
        kw, eplb, placement = split_kwargs(spec.kwargs)
        engine = RankLLM(spec.model, spec.tokenizer, comm=comm, expert_parallel=spec.expert_parallel, eplb=eplb,
                         placement=placement, **kw)
        if abandoned is not None:
            engine.engine.call_abandoned = lambda: abandoned.value >= call_id > 0
        reply("ok", rank)
    except BaseException as exc:  # noqa: BLE001 - reported to the driver
        reply("error", (exc, traceback.format_exc()))
        return
    while True:
        try:
            call_id, cmd, payload = conn.recv()
        except (EOFError, OSError):  # the driver went away
            break
        if cmd == "shutdown":
            reply("ok", None)
            break
        try:
            reply("ok", _handle(engine, cmd, payload))
        except BaseException as exc:  # noqa: BLE001
            reply("error", (exc, traceback.format_exc()))
    if dist.is_initialized():
        dist.destroy_process_group()
