"""EPLB policy: which logical expert goes into which physical slot of which rank.

Pure functions of recorded loads (numpy, no torch, no state), so they are tested on CPU
against brute force. The objective is DeepInfer's (REFERENCE.md section 9): the sum over
recorded steps of the per-step maximum rank load, where a logical expert's load is split
evenly over its replicas (routing spreads tokens round-robin over replicas). With one step
it is the plain maximum rank load of DeepSeek's EPLB.

1. Replication: every expert starts with one replica; each redundant slot goes to the
   expert whose extra copy lowers the objective most (ties: highest load per replica).
   An expert gets at most ``num_ranks`` replicas when that leaves every slot fillable, so
   two copies of one expert never have to share a rank. Then the counts are searched with
   packing in the loop: every count vector when there are few (small instances: exact in
   the counts), else single-replica moves between experts while the packed objective drops.
2. Packing (`eplb_packing`): replicas heaviest first onto the non-full rank that keeps the objective
   lowest (ties: lightest rank), never onto a rank already holding that expert when
   another is open; then pairwise swaps out of the critical ranks while they lower the
   objective (or, at equal objective, the spread of rank totals).
3. Hierarchical: expert groups are packed onto nodes first (whole groups, balanced), then
   each node replicates and packs its own experts onto its GPUs.

Everything is deterministic (ties broken by index), so every rank computes the same plan.
"""

from __future__ import annotations

import numpy as np

from deepinfer.parallel.eplb_packing import (rank_loads_of, totals_spread, as_step_loads, pack_replicas,
                                             step_max_objective)

__all__ = ["as_step_loads", "replicate_experts", "pack_replicas", "global_policy", "hierarchical_policy",
           "rebalance_experts", "step_max_objective"]


def replicate_experts(load: np.ndarray, num_slots: int, max_replicas: int | None = None) -> np.ndarray:
    """Replica count per expert (each >= 1, summing to ``num_slots``) for loads [W, E]."""
    load = as_step_loads(load)
    num_experts = load.shape[1]
    if num_slots < num_experts:
        raise ValueError(f"{num_slots} physical slots cannot hold {num_experts} logical experts")
    if max_replicas is not None and max_replicas * num_experts < num_slots:
        max_replicas = None  # the cap would leave slots empty: duplicates are unavoidable
    counts = np.ones(num_experts, dtype=np.int64)
    steps = np.arange(load.shape[0])
    for _ in range(num_slots - num_experts):
        per = load / counts
        top = np.argsort(-per, axis=1, kind="stable")[:, :2]
        m1 = per[steps, top[:, 0]]
        m2 = per[steps, top[:, 1]] if num_experts > 1 else np.zeros_like(m1)
        split = load / (counts + 1)  # per-replica load of each candidate with one more copy
        # objective when expert e gets another replica: only steps where e is the max change
        is_max = top[:, :1] == np.arange(num_experts)[None, :]
        new_max = np.where(is_max, np.maximum(m2[:, None], split), m1[:, None])
        obj = new_max.sum(axis=0)
        if max_replicas is not None:
            obj = np.where(counts >= max_replicas, np.inf, obj)
        best = np.lexsort((np.arange(num_experts), -per.sum(axis=0), obj))[0]
        counts[best] += 1
    return counts

def _pack_counts(load: np.ndarray, counts: np.ndarray, num_ranks: int, capacity: int
                 ) -> tuple[tuple[float, float], np.ndarray]:
    """Pack the replicas of ``counts``; returns ((objective, spread), phy2log)."""
    keys = np.repeat(np.arange(load.shape[1]), counts)
    item_loads = load[:, keys] / counts[keys][None, :]
    rank = pack_replicas(item_loads, keys, num_ranks, capacity)
    rl = rank_loads_of(item_loads, rank, num_ranks)
    return (step_max_objective(rl), totals_spread(rl)), keys[np.lexsort((keys, rank))]


def _count_vectors(extra: int, num_experts: int, cap: int, limit: int) -> list[np.ndarray] | None:
    """Every replica count vector (each in [1, cap], ``extra`` copies beyond one each),
    or None when there are more than ``limit`` of them."""
    ways = np.zeros((num_experts + 1, extra + 1), dtype=object)  # ways[i, r]: experts i.. take r
    ways[num_experts, 0] = 1
    for i in range(num_experts - 1, -1, -1):
        for r in range(extra + 1):
            ways[i, r] = sum(ways[i + 1, r - j] for j in range(min(cap - 1, r) + 1))
    if ways[0, extra] > limit:
        return None
    out: list[np.ndarray] = []

    def rec(i: int, left: int, acc: list[int]) -> None:
        if i == num_experts:
            if left == 0:
                out.append(np.array(acc, dtype=np.int64))
            return
        for j in range(min(cap - 1, left) + 1):
            if ways[i + 1, left - j]:
                rec(i + 1, left - j, acc + [1 + j])

    rec(0, extra, [])
    return out


def _search_counts(load: np.ndarray, counts: np.ndarray, num_ranks: int, capacity: int,
                   budget: int) -> np.ndarray:
    """Choose replica counts by the packed objective. Small instances (at most ``budget``
    count vectors) try every vector; larger ones move single replicas between experts
    (re-packing each time, at most ``budget`` re-packs) while the packed objective drops:
    a medium expert split in two can fill ranks better than a third copy of the hottest."""
    cap = num_ranks if num_ranks * load.shape[1] >= counts.sum() else int(counts.sum())
    every = _count_vectors(int(counts.sum()) - load.shape[1], load.shape[1], cap, budget)
    if every is not None:
        scored = [(_pack_counts(load, c, num_ranks, capacity), k) for k, c in enumerate(every)]
        return min(scored, key=lambda item: (item[0][0], item[1]))[0][1]
    best, phy2log = _pack_counts(load, counts, num_ranks, capacity)
    tried = 0
    improved = True
    while improved and tried < budget:
        improved = False
        per_rank = (load[:, phy2log] / counts[phy2log]).sum(axis=0).reshape(num_ranks, capacity).sum(axis=1)
        hot = set(phy2log.reshape(num_ranks, capacity)[int(np.argmax(per_rank))].tolist())
        per = load.sum(axis=0) / counts
        donors = [a for a in np.argsort(per, kind="stable") if counts[a] > 1]
        takers = sorted(range(load.shape[1]), key=lambda b: (b not in hot, -per[b], b))
        for a in donors:
            for b in takers:
                if b == a or counts[b] >= cap or tried >= budget:
                    continue
                trial = counts.copy()
                trial[a] -= 1
                trial[b] += 1
                tried += 1
                score, layout = _pack_counts(load, trial, num_ranks, capacity)
                if score[0] < best[0] - 1e-12 * max(best[0], 1.0):
                    best, phy2log, counts, improved = score, layout, trial, True
                    break
            if improved or tried >= budget:
                break
    return phy2log


def global_policy(load: np.ndarray, num_ranks: int, num_slots: int, search_budget: int | None = None
                  ) -> np.ndarray:
    """phy2log [num_slots] for one layer: replicate, pack over all ranks, then try moving
    replicas between experts (at most ``search_budget`` re-packs; default 64 for up to 32
    experts, 0 beyond, where greedy replication is already close and a re-pack is costly).

    Slot ``p`` lives on rank ``p // (num_slots // num_ranks)``; within a rank slots hold
    experts in ascending id order.
    """
    load = as_step_loads(load)
    if num_ranks < 1 or num_slots % num_ranks:
        raise ValueError(f"{num_slots} physical slots do not divide over {num_ranks} ranks")
    counts = replicate_experts(load, num_slots, max_replicas=num_ranks)
    if search_budget is None:
        search_budget = 64 if load.shape[1] <= 32 else 0
    if search_budget <= 0:
        return _pack_counts(load, counts, num_ranks, num_slots // num_ranks)[1]
    return _search_counts(load, counts, num_ranks, num_slots // num_ranks, search_budget)


def hierarchical_policy(load: np.ndarray, num_ranks: int, num_slots: int, num_groups: int,
                        num_nodes: int) -> np.ndarray:
    """phy2log [num_slots]: expert groups -> nodes (balanced), then per node replicate and
    pack onto its ``num_ranks // num_nodes`` GPUs. Falls back to :func:`global_policy`
    when groups, ranks or slots do not divide by ``num_nodes``."""
    load = as_step_loads(load)
    num_experts = load.shape[1]
    if (num_nodes <= 1 or num_groups < 1 or num_experts % num_groups or num_groups % num_nodes
            or num_ranks % num_nodes or num_slots % num_ranks):
        return global_policy(load, num_ranks, num_slots)
    per_group = num_experts // num_groups
    group_load = load.reshape(load.shape[0], num_groups, per_group).sum(axis=2)
    node_of_group = pack_replicas(group_load, np.arange(num_groups), num_nodes, num_groups // num_nodes)
    slots_per_node = num_slots // num_nodes
    out = np.empty(num_slots, dtype=np.int64)
    for node in range(num_nodes):
        groups = np.sort(np.nonzero(node_of_group == node)[0])
        experts = (groups[:, None] * per_group + np.arange(per_group)[None, :]).reshape(-1)
        local = global_policy(load[:, experts], num_ranks // num_nodes, slots_per_node)
        out[node * slots_per_node:(node + 1) * slots_per_node] = experts[local]
    return out


def rebalance_experts(load: np.ndarray, num_ranks: int, num_slots: int, num_groups: int | None = None,
                      num_nodes: int = 1) -> np.ndarray:
    """phy2log [L, num_slots] for loads [L, E] (window summed) or [W, L, E] (per step).

    Uses the hierarchical policy when ``num_groups`` and ``num_nodes > 1`` are given
    (and divide evenly), the global policy otherwise.
    """
    arr = np.asarray(load, dtype=np.float64)
    if arr.ndim == 2:
        arr = arr[None]
    if arr.ndim != 3:
        raise ValueError(f"loads must be [layers, experts] or [steps, layers, experts], got shape {arr.shape}")
    rows = []
    for layer in range(arr.shape[1]):
        if num_groups and num_nodes > 1:
            rows.append(hierarchical_policy(arr[:, layer], num_ranks, num_slots, num_groups, num_nodes))
        else:
            rows.append(global_policy(arr[:, layer], num_ranks, num_slots))
    return np.stack(rows)
