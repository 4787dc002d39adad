"""Expert-parallel MoE: each rank holds the physical expert slots of its placement.

Per layer and step: route (gate, replicated on every rank) -> pick one replica per
(token, expert) deterministically -> all-to-all the rows to the ranks owning those slots
-> run local slots -> all-to-all the outputs back -> combine. Invariant of `forward`:
for the same routed rows, the output equals `deepinfer.models.moe.MoE` bitwise when
every expert's rows reach the same matmul shapes, because each contribution is formed
exactly as there ((expert(x) * weight).to(dtype)) and a token's contributions are added
to zero in ascending logical-expert order, the order the reference's index_add_ uses.

In batch-invariant mode the expert GEMMs go through ``invariant_ops.linear`` (fixed
tiles, as the reference's ``Linear`` does in the mode), so a token's output is the same
bits whatever the other tokens, on whichever rank its experts run, and equals the
single-process MoE in the mode where that runs its torch loop (no "moe" kernel
registered for the device).

On CUDA (outside that mode) the local slots run as one fused MoE launch
(``deepinfer_kernels.fused_moe``: every received row routed to its slot with weight 1,
the same rounding points as the loop) instead of a host loop of per-slot GEMMs;
``fused_local`` forces either (tests run the kernel under the Triton interpreter).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from deepinfer import batch_invariant
from deepinfer.models import invariant_ops
from deepinfer.models.moe import MoE, clipped_swiglu
from deepinfer.parallel.comm import EPComm

__all__ = ["ExpertParallelMoE", "TransferPlan", "transfer_plan"]

_WEIGHTS = ("w1", "w2", "w3")  # gate, down, up: the official expert layout


@dataclass
class TransferPlan:
    """Weight moves for one layer, as seen by every rank (all ranks compute the same plan).

    ``local[r]``: (old local slot, new local slot) copies inside rank r;
    ``moves[(src, dst)]``: (old local slot on src, new local slots on dst) per expert sent.
    """

    local: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    moves: dict[tuple[int, int], list[tuple[int, list[int]]]] = field(default_factory=dict)

    @property
    def num_moved(self) -> int:
        return sum(len(v) for v in self.moves.values())


def transfer_plan(old_row: list[int], new_row: list[int], num_ranks: int) -> TransferPlan:
    """How to go from placement row ``old_row`` to ``new_row`` (phy2log of one layer):
    an expert already on the destination rank is copied locally; otherwise one old holder
    (chosen by destination rank, to spread the sending) sends it once per rank. The rows
    may differ in length (a different number of redundant slots)."""
    spr, new_spr = len(old_row) // num_ranks, len(new_row) // num_ranks
    plan = TransferPlan()
    holders: dict[int, list[int]] = {}
    first_slot: dict[tuple[int, int], int] = {}
    for p, e in enumerate(old_row):
        r = p // spr
        if (r, e) not in first_slot:
            first_slot[(r, e)] = p % spr
            holders.setdefault(e, []).append(r)
    for dst in range(num_ranks):
        wanted: dict[int, list[int]] = {}
        for s in range(new_spr):
            wanted.setdefault(new_row[dst * new_spr + s], []).append(s)
        for e, slots in wanted.items():
            if (dst, e) in first_slot:
                plan.local.setdefault(dst, []).extend((first_slot[(dst, e)], s) for s in slots)
            else:
                src = holders[e][dst % len(holders[e])]
                plan.moves.setdefault((src, dst), []).append((first_slot[(src, e)], slots))
    return plan


def _replica_tables(row: torch.Tensor, num_logical: int) -> tuple[torch.Tensor, torch.Tensor]:
    """phy2log row [P] -> (log2phy [E, max replicas] -1 padded, replica counts [E])."""
    counts = torch.bincount(row, minlength=num_logical)
    table = torch.full((num_logical, int(counts.max())), -1, dtype=torch.int64)
    seen = [0] * num_logical
    for p, e in enumerate(row.tolist()):
        table[e, seen[e]] = p
        seen[e] += 1
    return table, counts


class ExpertParallelMoE(nn.Module):
    """Drop-in replacement of one layer's `MoE` (`forward(x, input_ids)`), holding only this
    rank's slots: w1/w3 [slots, inter, hidden], w2 [slots, hidden, inter]."""

    def __init__(self, moe: MoE, layer_id: int, row: torch.Tensor, comm: EPComm, recorder: object | None = None
                 ) -> None:
        super().__init__()
        self.gate, self.shared_experts = moe.gate, moe.shared_experts
        self.layer_id, self.comm, self.recorder = layer_id, comm, recorder
        self.num_logical, self.top_k = moe.n_experts, moe.gate.top_k
        self.limit = moe.experts[0].limit
        self.num_slots = int(row.numel())
        if self.num_slots % comm.world_size:
            raise ValueError(f"{self.num_slots} slots do not split over {comm.world_size} ranks")
        self.slots_per_rank = self.num_slots // comm.world_size
        local = row[comm.rank * self.slots_per_rank:(comm.rank + 1) * self.slots_per_rank].tolist()
        for name in _WEIGHTS:
            stacked = torch.stack([getattr(moe.experts[e], name).weight.detach() for e in local])
            self.register_buffer(name, stacked.clone(), persistent=False)
        self.set_row(row)
        #: local slots through the fused MoE kernel: None = on CUDA outside batch-invariant mode
        self.fused_local: bool | None = None

    def set_row(self, row: torch.Tensor) -> None:
        """Adopt placement row ``row`` (phy2log [P]) for routing; weights must match it."""
        device = self.w1.device
        self.row = torch.as_tensor(row, dtype=torch.int64).cpu().clone()
        table, counts = _replica_tables(self.row, self.num_logical)
        self.log2phy, self.replicas = table.to(device), counts.to(device)

    @property
    def local_experts(self) -> list[int]:
        r, spr = self.comm.rank, self.slots_per_rank
        return self.row[r * spr:(r + 1) * spr].tolist()

    def _expert(self, s: int, x: torch.Tensor) -> torch.Tensor:
        """Local slot ``s`` on rows ``x``: exactly `Expert.forward` with this slot's weights
        (in batch-invariant mode through the mode's fixed-tile linears, as there)."""
        w1, w2, w3 = self.w1[s], self.w2[s], self.w3[s]
        return invariant_ops.linear(clipped_swiglu(invariant_ops.linear(x, w1), invariant_ops.linear(x, w3),
                                                   self.limit), w2)

    def _run_local(self, x: torch.Tensor, counts: list[list[int]]) -> torch.Tensor:
        """Rows received from each source rank, each block sorted by local slot with
        ``counts[src][slot]`` rows per slot -> expert outputs in the same order."""
        fused = self.fused_local if self.fused_local is not None else x.is_cuda and not batch_invariant.enabled()
        if fused and x.shape[0]:
            return self._run_local_fused(x, counts)
        out = torch.empty_like(x)
        starts, offset = [], 0
        for per_slot in counts:
            starts.append(offset)
            offset += sum(per_slot)
        for s in range(self.slots_per_rank):
            pieces = []
            for src, per_slot in enumerate(counts):
                if per_slot[s]:
                    begin = starts[src] + sum(per_slot[:s])
                    pieces.append(torch.arange(begin, begin + per_slot[s], device=x.device))
            if pieces:
                idx = torch.cat(pieces)
                out[idx] = self._expert(s, x[idx])
        return out

    def _run_local_fused(self, x: torch.Tensor, counts: list[list[int]]) -> torch.Tensor:
        """:meth:`_run_local` in one fused MoE launch: row i goes to its local slot, weight 1."""
        from deepinfer_kernels.fused_moe import fused_moe

        per = torch.tensor(counts, dtype=torch.int64).flatten()  # [src * slots]: rows per (source, slot)
        slot = torch.arange(self.slots_per_rank).repeat(len(counts))
        ids = torch.repeat_interleave(slot, per).to(device=x.device, dtype=torch.int32)[:, None]
        ones = torch.ones(ids.shape, dtype=x.dtype, device=x.device)
        return fused_moe(x, self.w1, self.w3, self.w2, ones, ids, self.limit)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """x [T, D] (T may be 0 on an idle rank: it still joins both all-to-alls)."""
        num_tokens, k, world = x.shape[0], self.top_k, self.comm.world_size
        if num_tokens:
            weights, ids = self.gate(x, input_ids)
        else:
            weights = torch.empty(0, k, dtype=torch.float32, device=x.device)
            ids = torch.empty(0, k, dtype=torch.int64, device=x.device)
        # one replica per (token, expert): round robin by token index, offset by rank
        token = torch.arange(num_tokens, device=x.device)[:, None]
        choice = (token + self.comm.rank) % self.replicas[ids]
        phys = self.log2phy[ids, choice].flatten()  # [T * k]
        if self.recorder is not None:
            self.recorder.add(self.layer_id, torch.bincount(phys, minlength=self.num_slots))
        order = torch.argsort(phys, stable=True)
        send_slot_counts = torch.bincount(phys, minlength=self.num_slots).view(world, self.slots_per_rank)
        recv_slot_counts = self.comm.exchange_counts(send_slot_counts)
        send_splits = send_slot_counts.sum(dim=1).tolist()  # the host learns the split sizes here
        recv_counts = recv_slot_counts.tolist()
        recv_splits = [sum(c) for c in recv_counts]
        received = self.comm.all_to_all(x[order // k], send_splits, recv_splits)
        y_back = self.comm.all_to_all(self._run_local(received, recv_counts), recv_splits, send_splits)
        y = torch.empty_like(y_back)
        y[order] = y_back
        contrib = (y.view(num_tokens, k, x.shape[1]) * weights[..., None]).to(x.dtype)
        rank_in_token = torch.argsort(ids, dim=1)  # ascending logical expert, as MoE adds them
        out = torch.zeros_like(x)
        for j in range(k):
            out = out + contrib[token[:, 0], rank_in_token[:, j]]
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    @torch.no_grad()
    def rearrange(self, new_row: torch.Tensor) -> int:
        """Move weights in place to placement row ``new_row`` (a collective: every rank of
        the group calls it with the same row). Returns the experts received by this rank."""
        new_row = torch.as_tensor(new_row, dtype=torch.int64).cpu()
        plan = transfer_plan(self.row.tolist(), new_row.tolist(), self.comm.world_size)
        me = self.comm.rank
        old = {name: getattr(self, name) for name in _WEIGHTS}
        new_spr = new_row.numel() // self.comm.world_size
        new = {name: t.new_empty((new_spr, *t.shape[1:])) for name, t in old.items()}
        for src_slot, dst_slot in plan.local.get(me, []):
            for name in new:
                new[name][dst_slot] = old[name][src_slot]

        def packed(slots: list[int]) -> torch.Tensor:  # one row per expert: w1 | w2 | w3 flattened
            return torch.cat([old[n][slots].reshape(len(slots), -1) for n in _WEIGHTS], dim=1)

        sizes = [old[n][0].numel() for n in _WEIGHTS]
        sends = {dst: packed([m[0] for m in moves]) for (src, dst), moves in plan.moves.items() if src == me}
        recvs = {src: self.w1.new_empty(len(moves), sum(sizes))
                 for (src, dst), moves in plan.moves.items() if dst == me}
        self.comm.exchange(sends, recvs, tag=self.layer_id)
        received = 0
        for src, buf in recvs.items():
            for row_i, (_, dst_slots) in enumerate(plan.moves[(src, me)]):
                for name, part in zip(_WEIGHTS, torch.split(buf[row_i], sizes)):
                    for s in dst_slots:
                        new[name][s] = part.view_as(old[name][0])
                received += 1
        for name, t in new.items():
            setattr(self, name, t)
        self.num_slots, self.slots_per_rank = new_row.numel(), new_spr
        self.set_row(new_row)
        return received
