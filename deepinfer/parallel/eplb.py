"""EPLB at run time: settings, the on-device load ring buffer and live rebalancing.

Each step every rank adds, per MoE layer, the tokens it routed to each physical slot into
row ``step % window`` of a device ring buffer (no host sync). At a rebalance the ring is
summed over ranks (one all-reduce), mapped to logical experts with the placement it was
recorded under, fed to the policy on rank 0, and the new placement is broadcast; then
every layer moves its weights in place (`ExpertParallelMoE.rearrange`) and the window
restarts under the new placement.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from deepinfer import envs
from deepinfer.errors import ConfigError
from deepinfer.parallel.comm import EPComm
from deepinfer.parallel.eplb_policy import rebalance_experts
from deepinfer.parallel.expert_parallel import ExpertParallelMoE
from deepinfer.parallel.placement import ExpertPlacement, PlacementError, imbalance, rank_loads

__all__ = ["EPLBConfig", "LoadRecorder", "EPLBController", "RebalanceReport"]

POLICIES = ("auto", "global", "hierarchical")
_ENV = {"num_redundant_experts": "DEEPINFER_EPLB_NUM_REDUNDANT_EXPERTS",
        "rebalance_interval": "DEEPINFER_EPLB_REBALANCE_INTERVAL", "window_size": "DEEPINFER_EPLB_WINDOW_SIZE",
        "policy": "DEEPINFER_EPLB_POLICY", "num_groups": "DEEPINFER_EPLB_NUM_GROUPS",
        "num_nodes": "DEEPINFER_EPLB_NUM_NODES"}


@dataclass
class EPLBConfig:
    """EPLB settings (kwargs of ``LLM(...)`` win over ``DEEPINFER_EPLB_*``)."""

    num_redundant_experts: int = 0
    rebalance_interval: int = 0  # steps; 0 = rebalance only on request
    window_size: int = 100
    policy: str = "auto"
    num_groups: int | None = None
    num_nodes: int = 1

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> EPLBConfig:
        env = os.environ if environ is None else environ
        values = {fname: envs.get(var, env) for fname, var in _ENV.items() if envs.is_set(var, env)}
        values.update({k: v for k, v in overrides.items() if v is not None})
        cfg = cls(**values)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        def need(ok: bool, name: str, allowed: str) -> None:
            if not ok:
                raise ConfigError(f"EPLB {name} must be {allowed}, got {getattr(self, name)!r} "
                                  f"(kwarg {name} or env {_ENV[name]})", field=name)
        is_int = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731
        need(is_int(self.num_redundant_experts) and self.num_redundant_experts >= 0, "num_redundant_experts",
             "an int >= 0")
        need(is_int(self.rebalance_interval) and self.rebalance_interval >= 0, "rebalance_interval", "an int >= 0")
        need(is_int(self.window_size) and self.window_size >= 1, "window_size", "an int >= 1")
        need(self.policy in POLICIES, "policy", f"one of {list(POLICIES)}")
        need(self.num_groups is None or (is_int(self.num_groups) and self.num_groups >= 1), "num_groups",
             "None or an int >= 1")
        need(is_int(self.num_nodes) and self.num_nodes >= 1, "num_nodes", "an int >= 1")
        need(self.policy != "hierarchical" or self.num_groups is not None, "num_groups",
             "set (expert groups) when policy='hierarchical'")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class LoadRecorder:
    """Ring buffer [window, layers, slots] int64 on the device: tokens this rank routed to
    each physical slot in each of the last ``window`` steps."""

    def __init__(self, num_layers: int, num_slots: int, window: int, device: torch.device | str) -> None:
        self.ring = torch.zeros(window, num_layers, num_slots, dtype=torch.int64, device=device)
        self.steps = 0  # steps recorded since the last reset
        self._row = 0

    def begin_step(self) -> None:
        self._row = self.steps % self.ring.shape[0]
        self.ring[self._row].zero_()

    def add(self, layer: int, counts: torch.Tensor) -> None:
        self.ring[self._row, layer] += counts

    def end_step(self) -> None:
        self.steps += 1

    def window(self) -> torch.Tensor:
        """The recorded steps, oldest first: [min(steps, window), layers, slots] (same device)."""
        w = self.ring.shape[0]
        if self.steps <= w:
            return self.ring[: self.steps]
        start = self.steps % w
        return torch.cat([self.ring[start:], self.ring[:start]])

    def reset(self) -> None:
        self.steps = 0


@dataclass
class RebalanceReport:
    """What one rebalance did (imbalance = max / mean rank load over the window)."""

    step: int
    window_steps: int
    imbalance_before: float
    imbalance_after: float
    experts_moved: int
    seconds: float
    manual: bool = False
    per_layer_before: list[float] = field(default_factory=list)
    per_layer_after: list[float] = field(default_factory=list)


class EPLBController:
    """Owns the placement of one rank's EP layers, their load recorder and rebalancing."""

    def __init__(self, layers: list[ExpertParallelMoE], placement: ExpertPlacement, config: EPLBConfig,
                 comm: EPComm, device: torch.device | str) -> None:
        self.layers, self.placement, self.config, self.comm = layers, placement, config, comm
        self.recorder = LoadRecorder(placement.num_layers, placement.num_slots, config.window_size, device)
        for layer in layers:
            layer.recorder = self.recorder
        self.total_steps = 0
        self.reports: list[RebalanceReport] = []

    def begin_step(self) -> None:
        self.recorder.begin_step()

    def end_step(self) -> None:
        """Close the step; rebalance when the interval says so (every rank reaches the same
        step count, because ranks step in lockstep)."""
        self.recorder.end_step()
        self.total_steps += 1
        interval = self.config.rebalance_interval
        if interval and self.total_steps % interval == 0:
            self.rebalance()

    def physical_window(self) -> torch.Tensor:
        """Slot loads summed over ranks, [steps, layers, slots] int64 on the host (a collective)."""
        window = self.recorder.window().clone()
        return self.comm.all_reduce(window).cpu()

    def logical_window(self, physical: torch.Tensor | None = None) -> np.ndarray:
        """[steps, layers, logical experts] loads under the current placement."""
        phys = self.physical_window() if physical is None else physical
        out = torch.zeros(phys.shape[0], self.placement.num_layers, self.placement.num_logical, dtype=torch.int64)
        index = self.placement.phy2log[None].expand(phys.shape[0], -1, -1)
        return out.scatter_add_(2, index, phys).numpy()

    def _policy(self, load: np.ndarray) -> ExpertPlacement:
        cfg, pl = self.config, self.placement
        hierarchical = cfg.policy == "hierarchical" or (cfg.policy == "auto" and cfg.num_groups and cfg.num_nodes > 1)
        groups = cfg.num_groups if hierarchical else None
        nodes = cfg.num_nodes if hierarchical else 1
        phy2log = rebalance_experts(load, pl.num_ranks, pl.num_slots, num_groups=groups, num_nodes=nodes)
        return ExpertPlacement(torch.as_tensor(phy2log), pl.num_ranks, pl.num_logical).aligned_to(pl, nodes)

    def check(self, placement: ExpertPlacement) -> ExpertPlacement:
        """``placement`` if it fits this model and group, else PlacementError saying why."""
        pl = self.placement
        if not isinstance(placement, ExpertPlacement):
            raise PlacementError(f"expected an ExpertPlacement, got {type(placement).__name__}")
        for name in ("num_layers", "num_ranks", "num_logical"):
            if getattr(placement, name) != getattr(pl, name):
                raise PlacementError(f"placement has {name}={getattr(placement, name)}, but the engine has "
                                     f"{getattr(pl, name)}")
        return placement

    def rebalance(self, placement: ExpertPlacement | None = None, progress: bool = False) -> RebalanceReport:
        """Re-place experts (from the recorded window, or the given ``placement``) and move
        the weights in place. A collective: every rank calls it at the same step."""
        start = time.perf_counter()
        physical = self.physical_window()
        load = self.logical_window(physical)
        if placement is None:
            if load.shape[0] == 0 or load.sum() == 0:
                new = self.placement  # nothing recorded: keep the placement
            else:
                new = self._policy(load) if self.comm.rank == 0 else self.placement
                agreed = self.comm.broadcast(new.phy2log.to(self.recorder.ring.device), src=0).cpu()
                new = ExpertPlacement(agreed, new.num_ranks, new.num_logical)
        else:
            new = self.check(placement)
        before = imbalance(rank_loads(load, self.placement)) if load.size else np.ones(self.placement.num_layers)
        after = imbalance(rank_loads(load, new)) if load.size else np.ones(self.placement.num_layers)
        moved = 0
        for layer, row in tqdm(list(zip(self.layers, new.phy2log)), desc="rebalance", disable=not progress):
            moved += layer.rearrange(row)
        moved_all = int(self.comm.all_reduce(torch.tensor([moved], device=self.recorder.ring.device)).item())
        self.placement = new
        self.recorder.reset()
        if new.num_slots != self.recorder.ring.shape[2]:  # redundant slot count changed
            ring = self.recorder.ring
            self.recorder.ring = ring.new_zeros(ring.shape[0], ring.shape[1], new.num_slots)
        report = RebalanceReport(self.total_steps, int(load.shape[0]), float(before.mean()), float(after.mean()),
                                 moved_all, time.perf_counter() - start, placement is not None,
                                 before.tolist(), after.tolist())
        self.reports.append(report)
        return report
