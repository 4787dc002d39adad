"""Expert placement: which logical expert each physical slot of each rank holds.

``phy2log[layer, slot]`` is the whole truth; slot ``p`` lives on rank
``p // slots_per_rank``. Everything else (replica lists, counts, per-rank tables, load
per rank) is derived from it. Placements are validated up front with errors that name
the layer, rank or expert at fault, so a hand-made placement fails before it reaches a
model. Routing spreads an expert's tokens evenly over its replicas, so its load splits
evenly too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from deepinfer.errors import DeepInferError

__all__ = ["PlacementError", "ExpertPlacement", "padded_num_slots", "rank_loads", "imbalance"]


class PlacementError(DeepInferError):
    """A placement does not fit the model or the ranks (the message says where)."""


def padded_num_slots(num_logical: int, num_redundant: int, num_ranks: int) -> int:
    """Physical slots: logical + redundant, rounded up so every rank holds as many."""
    if num_redundant < 0:
        raise PlacementError(f"num_redundant_experts must be >= 0, got {num_redundant}")
    total = num_logical + num_redundant
    return -(-total // num_ranks) * num_ranks


@dataclass(frozen=True)
class ExpertPlacement:
    """Logical -> physical expert placement for every MoE layer.

    Attributes:
        phy2log: int64 [layers, slots]: logical expert held by each physical slot.
        num_ranks: expert-parallel ranks; slots split evenly, in order, across them.
        num_logical: logical (routed) experts per layer.
    """

    phy2log: torch.Tensor
    num_ranks: int
    num_logical: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "phy2log", torch.as_tensor(self.phy2log, dtype=torch.int64).cpu().clone())
        self.validate()

    # ---- shape -----------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return int(self.phy2log.shape[0])

    @property
    def num_slots(self) -> int:
        return int(self.phy2log.shape[1])

    @property
    def slots_per_rank(self) -> int:
        return self.num_slots // self.num_ranks

    @property
    def num_redundant(self) -> int:
        return self.num_slots - self.num_logical

    def validate(self) -> None:
        """Raise PlacementError unless every layer gives every expert a slot on some rank."""
        if self.phy2log.dim() != 2:
            raise PlacementError(f"phy2log must be [layers, slots], got shape {tuple(self.phy2log.shape)}")
        if self.num_ranks < 1 or self.num_slots % self.num_ranks:
            raise PlacementError(f"{self.num_slots} physical slots do not split evenly over {self.num_ranks} "
                                 f"ranks; pad with redundant slots (padded_num_slots)")
        bad = (self.phy2log < 0) | (self.phy2log >= self.num_logical)
        if bad.any():
            layer, slot = (int(v) for v in bad.nonzero()[0])
            raise PlacementError(f"layer {layer} slot {slot} (rank {slot // self.slots_per_rank}) holds expert "
                                 f"{int(self.phy2log[layer, slot])}; allowed: 0..{self.num_logical - 1}")
        for layer in range(self.num_layers):
            missing = sorted(set(range(self.num_logical)) - set(self.phy2log[layer].tolist()))
            if missing:
                raise PlacementError(f"layer {layer}: experts {missing[:8]} have no physical slot on any rank; "
                                     f"every logical expert needs at least one replica")

    # ---- construction ----------------------------------------------------------------
    @classmethod
    def default(cls, num_layers: int, num_logical: int, num_ranks: int, num_redundant: int = 0) -> ExpertPlacement:
        """Contiguous blocks (rank r holds experts r*E/N .. (r+1)*E/N - 1, the first E % N
        ranks one more); a rank's spare slots hold copies of the experts that follow its
        block (wrapping around), never of one it already holds while others remain."""
        num_slots = padded_num_slots(num_logical, num_redundant, num_ranks)
        per_rank = num_slots // num_ranks
        sizes = [num_logical // num_ranks + (r < num_logical % num_ranks) for r in range(num_ranks)]
        if max(sizes) > per_rank:
            raise PlacementError(f"{num_logical} experts need more than {per_rank} slots per rank on {num_ranks} "
                                 f"ranks; add redundant slots")
        row: list[int] = []
        start = 0
        for r in range(num_ranks):
            mine = list(range(start, start + sizes[r]))
            start += sizes[r]
            others = [(start + i) % num_logical for i in range(num_logical)]
            spare = [e for e in others if e not in mine] or others
            row += mine + [spare[i % len(spare)] for i in range(per_rank - len(mine))]
        return cls(torch.as_tensor(np.tile(np.array(row), (num_layers, 1))), num_ranks, num_logical)

    @classmethod
    def from_rank_lists(cls, layers: Sequence[Sequence[Sequence[int]]] | Sequence[Sequence[int]],
                        num_logical: int, num_layers: int | None = None) -> ExpertPlacement:
        """A manual placement: ``layers[l][r]`` lists the experts of rank ``r`` in layer
        ``l``; a single ``[rank][experts]`` table applies to ``num_layers`` layers.
        Every rank must list the same number of experts."""
        table = [list(map(list, layer)) for layer in layers] if _is_3d(layers) else None
        if table is None:
            if num_layers is None:
                raise PlacementError("a single [rank][experts] table needs num_layers")
            table = [[list(r) for r in layers] for _ in range(num_layers)]  # type: ignore[arg-type]
        num_ranks = len(table[0])
        for layer, ranks in enumerate(table):
            if len(ranks) != num_ranks:
                raise PlacementError(f"layer {layer} lists {len(ranks)} ranks; layer 0 lists {num_ranks}")
            sizes = {len(r) for r in ranks}
            if len(sizes) != 1:
                raise PlacementError(f"layer {layer}: ranks hold {[len(r) for r in ranks]} experts; "
                                     f"every rank must hold the same number of slots")
        rows = [[e for rank in ranks for e in rank] for ranks in table]
        if len({len(r) for r in rows}) != 1:
            raise PlacementError("every layer must have the same number of physical slots")
        return cls(torch.tensor(rows, dtype=torch.int64), num_ranks, num_logical)

    def with_layer(self, layer: int, ranks: Sequence[Sequence[int]]) -> ExpertPlacement:
        """A copy with layer ``layer`` replaced by the per-rank lists ``ranks``."""
        row = [e for rank in ranks for e in rank]
        if len(ranks) != self.num_ranks or len(row) != self.num_slots or len({len(r) for r in ranks}) != 1:
            raise PlacementError(f"layer {layer} needs {self.num_ranks} ranks x {self.slots_per_rank} experts, "
                                 f"got {[len(r) for r in ranks]}")
        phy2log = self.phy2log.clone()
        phy2log[layer] = torch.tensor(row)
        return ExpertPlacement(phy2log, self.num_ranks, self.num_logical)

    # ---- derived views ---------------------------------------------------------------
    def replica_counts(self) -> torch.Tensor:
        """int64 [layers, logical]: replicas of each expert."""
        out = torch.zeros(self.num_layers, self.num_logical, dtype=torch.int64)
        return out.scatter_add_(1, self.phy2log, torch.ones_like(self.phy2log))

    def log2phy(self) -> torch.Tensor:
        """int64 [layers, logical, max replicas]: physical slots of each expert, -1 padded,
        in ascending slot order."""
        width = int(self.replica_counts().max())
        out = torch.full((self.num_layers, self.num_logical, width), -1, dtype=torch.int64)
        for layer in range(self.num_layers):
            seen = [0] * self.num_logical
            for slot, e in enumerate(self.phy2log[layer].tolist()):
                out[layer, e, seen[e]] = slot
                seen[e] += 1
        return out

    def rank_slots(self, rank: int) -> range:
        return range(rank * self.slots_per_rank, (rank + 1) * self.slots_per_rank)

    def rank_experts(self, layer: int, rank: int) -> list[int]:
        """Logical experts held by ``rank`` in ``layer``, in slot order."""
        return self.phy2log[layer, rank * self.slots_per_rank:(rank + 1) * self.slots_per_rank].tolist()

    def table(self, layer: int | None = None) -> list[dict[str, int]]:
        """Rows {layer, rank, slot, local_slot, expert, replicas} (a DataFrame source)."""
        counts = self.replica_counts()
        layers = range(self.num_layers) if layer is None else [layer]
        return [{"layer": l, "rank": p // self.slots_per_rank, "slot": p, "local_slot": p % self.slots_per_rank,
                 "expert": int(e), "replicas": int(counts[l, e])}
                for l in layers for p, e in enumerate(self.phy2log[l].tolist())]

    def describe(self, layer: int = 0) -> str:
        """One line per rank: its experts in ``layer`` (replicated ones marked with *)."""
        counts = self.replica_counts()[layer]
        lines = [f"layer {layer}: {self.num_logical} experts in {self.num_slots} slots over {self.num_ranks} ranks"]
        for r in range(self.num_ranks):
            cells = [f"{e}{'*' if counts[e] > 1 else ''}" for e in self.rank_experts(layer, r)]
            lines.append(f"  rank {r}: " + " ".join(cells))
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"num_ranks": self.num_ranks, "num_logical": self.num_logical, "phy2log": self.phy2log.tolist()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ExpertPlacement:
        return cls(torch.tensor(data["phy2log"]), int(data["num_ranks"]), int(data["num_logical"]))

    def aligned_to(self, previous: ExpertPlacement, num_nodes: int = 1) -> ExpertPlacement:
        """The same per-rank expert sets with fewer weight moves from ``previous``: ranks
        are relabelled (within each of ``num_nodes`` blocks) to keep the most experts
        where they are, then each rank's slots are reordered so a staying expert keeps
        its old slot. Balance is unchanged (ranks are interchangeable)."""
        if (previous.num_slots, previous.num_ranks) != (self.num_slots, self.num_ranks):
            return self
        out = self.phy2log.clone()
        spr = self.slots_per_rank
        per_node = self.num_ranks // num_nodes if num_nodes >= 1 and self.num_ranks % num_nodes == 0 else self.num_ranks
        for layer in range(self.num_layers):
            for base in range(0, self.num_ranks, per_node):
                ranks = range(base, base + per_node)
                overlap = {(n, o): _multiset_overlap(self.rank_experts(layer, n), previous.rank_experts(layer, o))
                           for n in ranks for o in ranks}
                target: dict[int, int] = {}
                for (n, o), _ in sorted(overlap.items(), key=lambda kv: (-kv[1], kv[0])):
                    if n not in target and o not in target.values():
                        target[n] = o
                for n, o in target.items():
                    out[layer, o * spr:(o + 1) * spr] = self.phy2log[layer, n * spr:(n + 1) * spr]
        relabelled = ExpertPlacement(out, self.num_ranks, self.num_logical)
        out = relabelled.phy2log.clone()
        for layer in range(self.num_layers):
            for r in range(self.num_ranks):
                left = relabelled.rank_experts(layer, r)
                row: list[int | None] = []
                for e in previous.rank_experts(layer, r):
                    row.append(e if e in left else None)
                    if e in left:
                        left.remove(e)
                out[layer, r * spr:(r + 1) * spr] = torch.tensor([e if e is not None else left.pop(0) for e in row])
        return ExpertPlacement(out, self.num_ranks, self.num_logical)


def _multiset_overlap(a: list[int], b: list[int]) -> int:
    rest = list(b)
    hits = 0
    for e in a:
        if e in rest:
            rest.remove(e)
            hits += 1
    return hits


def _is_3d(layers: Any) -> bool:
    try:
        return isinstance(layers[0][0], (list, tuple))
    except (IndexError, TypeError):
        return False


def rank_loads(logical_load: np.ndarray | torch.Tensor, placement: ExpertPlacement) -> np.ndarray:
    """Per-step rank loads [W, layers, ranks] for logical loads [W, layers, E] (or
    [layers, E]), each expert's load split evenly over its replicas."""
    load = np.asarray(logical_load, dtype=np.float64)
    if load.ndim == 2:
        load = load[None]
    counts = placement.replica_counts().numpy()
    phy = placement.phy2log.numpy()
    per_slot = np.take_along_axis(load, phy[None], axis=2) / np.take_along_axis(counts, phy, axis=1)[None]
    return per_slot.reshape(load.shape[0], placement.num_layers, placement.num_ranks, -1).sum(axis=3)


def imbalance(rank_load: np.ndarray) -> np.ndarray:
    """max / mean rank load per layer for rank loads [W, layers, ranks]: the sum over steps
    of the per-step maximum over the sum of the per-step mean (1.0 = perfectly even)."""
    rl = np.asarray(rank_load, dtype=np.float64)
    if rl.ndim == 2:
        rl = rl[None]
    mean = rl.mean(axis=2).sum(axis=0)
    return np.where(mean > 0, rl.max(axis=2).sum(axis=0) / np.maximum(mean, 1e-30), 1.0)
