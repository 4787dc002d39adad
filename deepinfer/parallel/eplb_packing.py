"""Packing replicas onto ranks for the EPLB policy (pure numpy; see `eplb_policy`).

Heaviest replica first onto the non-full rank that keeps the objective (sum over steps of
the per-step maximum rank load) lowest, never onto a rank that already holds that expert
while another is open; then duplicate repair and pairwise swaps out of the critical ranks
while they lower the objective (or, at equal objective, the spread of rank totals).
"""

from __future__ import annotations

import numpy as np

__all__ = ["as_step_loads", "step_max_objective", "pack_replicas", "rank_loads_of", "totals_spread"]

#: Swap search: critical ranks tried per round, and candidate x step cells scored exactly
#: (beyond it candidates are pre-filtered by their total loads).
_CRITICAL_RANKS = 3
_EXACT_CELLS = 1 << 16


def as_step_loads(load: np.ndarray) -> np.ndarray:
    """[E] or [W, E] loads -> float64 [W, E] (one row per recorded step)."""
    arr = np.asarray(load, dtype=np.float64)
    if arr.ndim == 1:
        arr = arr[None, :]
    if arr.ndim != 2:
        raise ValueError(f"expert loads must be [experts] or [steps, experts], got shape {arr.shape}")
    if (arr < 0).any() or not np.isfinite(arr).all():
        raise ValueError("expert loads must be finite and >= 0")
    return arr

def step_max_objective(rank_loads: np.ndarray) -> float:
    """Sum over steps of the per-step maximum rank load; ``rank_loads`` is [W, N]."""
    return float(rank_loads.max(axis=1).sum())

def totals_spread(rank_loads: np.ndarray) -> float:
    return float((rank_loads.sum(axis=0) ** 2).sum())


def _repair_duplicates(loads: np.ndarray, keys: np.ndarray, rank: np.ndarray, num_ranks: int) -> None:
    """Swap replicas so no rank holds two copies of one key where the counts allow it."""
    key_count = np.bincount(keys)
    for _ in range(len(keys)):
        holds = np.zeros((num_ranks, key_count.size), dtype=np.int64)
        np.add.at(holds, (rank, keys), 1)
        bad = [(r, k) for r, k in zip(*np.nonzero(holds > 1)) if key_count[k] <= num_ranks]
        if not bad:
            return
        r, k = bad[0]
        a = np.nonzero((rank == r) & (keys == k))[0][-1]
        best, best_score = None, None
        for b in range(len(keys)):
            r2 = rank[b]
            if r2 == r or holds[r2, k] > 0 or holds[r, keys[b]] > 0:
                continue
            rank[a], rank[b] = r2, r
            rl = rank_loads_of(loads, rank, num_ranks)
            score = (step_max_objective(rl), totals_spread(rl), b)
            rank[a], rank[b] = r, r2
            if best_score is None or score < best_score:
                best, best_score = b, score
        if best is None:
            return  # no legal swap exists (cannot happen when counts allow a duplicate-free packing)
        rank[a], rank[best] = rank[best], r


def rank_loads_of(loads: np.ndarray, rank: np.ndarray, num_ranks: int) -> np.ndarray:
    out = np.zeros((loads.shape[0], num_ranks))
    np.add.at(out.T, rank, loads.T)
    return out


def _improve_by_swaps(loads: np.ndarray, keys: np.ndarray, rank: np.ndarray, num_ranks: int,
                      max_iters: int) -> None:
    """Pairwise swaps from critical ranks while (objective, spread) strictly decreases."""
    totals = loads.sum(axis=0)
    steps = np.arange(loads.shape[0])
    for _ in range(max_iters):
        rl = rank_loads_of(loads, rank, num_ranks)
        f0, g0 = step_max_objective(rl), totals_spread(rl)
        tol = 1e-12 * max(f0, 1.0)
        holds = np.zeros((num_ranks, keys.max() + 1), dtype=np.int64)
        np.add.at(holds, (rank, keys), 1)
        order = np.argsort(-rl, axis=1, kind="stable")
        top = np.concatenate([order[:, :3], np.full((len(steps), max(0, 3 - num_ranks)), -1)], axis=1)
        top_val = np.where(top >= 0, rl[steps[:, None], np.maximum(top, 0)], 0.0)
        crit = np.bincount(order[:, 0], weights=rl[steps, order[:, 0]], minlength=num_ranks)
        moved = False
        for r in np.argsort(-crit, kind="stable")[:_CRITICAL_RANKS]:
            if crit[r] <= 0:
                break
            a_idx, b_idx = np.nonzero(rank == r)[0], np.nonzero(rank != r)[0]
            A, B = np.repeat(a_idx, len(b_idx)), np.tile(b_idx, len(a_idx))
            r2 = rank[B]
            ok = (keys[A] != keys[B]) & (holds[r2, keys[A]] == 0) & (holds[r, keys[B]] == 0)
            if not ok.any():
                continue
            A, B, r2 = A[ok], B[ok], r2[ok]
            if A.size * loads.shape[0] > _EXACT_CELLS:  # keep the best by totals, then score per step
                d = totals[B] - totals[A]
                tot = rl.sum(axis=0)
                approx = np.maximum(tot[r] + d, tot[r2] - d)
                keep = np.argsort(approx, kind="stable")[:max(1, _EXACT_CELLS // loads.shape[0])]
                A, B, r2 = A[keep], B[keep], r2[keep]
            new_r = rl[:, r][None, :] - loads[:, A].T + loads[:, B].T  # [C, W]
            new_r2 = rl[:, r2].T - loads[:, B].T + loads[:, A].T
            excl = (top[None, :, :] != r) & (top[None, :, :] != r2[:, None, None])
            first = np.argmax(excl, axis=2)  # first top-3 entry that is neither rank
            other = np.where(excl.any(axis=2), np.take_along_axis(
                np.broadcast_to(top_val, excl.shape), first[..., None], axis=2)[..., 0], 0.0)
            f = np.maximum(other, np.maximum(new_r, new_r2)).sum(axis=1)
            tr, tr2 = rl[:, r].sum(), rl[:, r2].sum(axis=0)
            d = totals[B] - totals[A]
            g = g0 - tr ** 2 - tr2 ** 2 + (tr + d) ** 2 + (tr2 - d) ** 2
            best = np.lexsort((B, A, g, f))[0]
            if f[best] < f0 - tol or (f[best] <= f0 + tol and g[best] < g0 - 1e-9 * max(g0, 1.0)):
                rank[A[best]], rank[B[best]] = r2[best], r
                moved = True
                break
        if not moved:
            return


def pack_replicas(loads: np.ndarray, keys: np.ndarray, num_ranks: int, capacity: int,
                  max_swaps: int | None = None) -> np.ndarray:
    """Assign items (replicas) to ranks, ``capacity`` each, minimising the objective.

    Args:
        loads: [W, P] per-step load of each item, P = num_ranks * capacity.
        keys: [P] expert id of each item; two items with one key avoid sharing a rank.
        max_swaps: cap on improving swaps (default 4 * P).
    Returns:
        [P] rank of each item.
    """
    loads = as_step_loads(loads)
    keys = np.asarray(keys, dtype=np.int64)
    num_items = loads.shape[1]
    if num_items != num_ranks * capacity or keys.shape != (num_items,):
        raise ValueError(f"{num_items} items with {keys.size} keys do not fill {num_ranks} ranks x {capacity}")
    rank = np.full(num_items, -1, dtype=np.int64)
    rl = np.zeros((loads.shape[0], num_ranks))
    fill = np.zeros(num_ranks, dtype=np.int64)
    holds = np.zeros((num_ranks, keys.max() + 1 if num_items else 1), dtype=bool)
    for i in np.lexsort((keys, -loads.sum(axis=0))):
        v = loads[:, i]
        open_ = fill < capacity
        free = open_ & ~holds[:, keys[i]]
        cand = free if free.any() else open_
        obj = np.maximum(rl.max(axis=1)[:, None], rl + v[:, None]).sum(axis=0)
        obj = np.where(cand, obj, np.inf)
        r = np.lexsort((np.arange(num_ranks), rl.sum(axis=0), obj))[0]
        rank[i] = r
        rl[:, r] += v
        fill[r] += 1
        holds[r, keys[i]] = True
    _repair_duplicates(loads, keys, rank, num_ranks)
    _improve_by_swaps(loads, keys, rank, num_ranks, 4 * num_items if max_swaps is None else max_swaps)
    return rank
