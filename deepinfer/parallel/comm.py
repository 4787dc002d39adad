"""The collectives expert parallelism needs, behind one small interface.

``EPComm`` wraps a ``torch.distributed`` group (NCCL on GPUs, gloo on CPU; gloo supports
``all_to_all_single`` with uneven splits, checked on torch 2.13) and degrades to local
no-ops for a single rank, so the same MoE code runs in one process and in many. Every
collective inherits the process group's timeout: a dead peer surfaces as a RuntimeError
on the survivors instead of a hang.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from deepinfer import envs

from .comm_timing import AllToAllTimer

__all__ = ["EPComm"]


class EPComm:
    """Collectives over one expert-parallel group (the default group unless given)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        if dist.is_available() and dist.is_initialized():
            self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        else:
            self.rank, self.world_size = 0, 1
        #: all-to-all time / bytes, when DEEPINFER_EP_TIMING=1 (the EP benchmark)
        self.timer = AllToAllTimer() if envs.DEEPINFER_EP_TIMING else None
        #: collectives this rank has entered: ranks of a group enter the same sequence, so a
        #: rank that failed mid-step can tell whether it stopped between two of them
        #: (``RankEngineCore.step``) and may rejoin at the next one
        self.num_collectives = 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def all_to_all(self, x: torch.Tensor, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
        """Rows ``x`` split by destination rank (``send_splits``) -> rows received from
        every rank, concatenated in rank order (``recv_splits``)."""
        if not self.distributed:
            return x
        out = x.new_empty((sum(recv_splits), *x.shape[1:]))
        self.num_collectives += 1
        token = self.timer.start(x) if self.timer is not None else None
        dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=self.group)
        if self.timer is not None:
            self.timer.stop(token, (x.numel() + out.numel()) * x.element_size())
        return out

    def exchange_counts(self, send_counts: torch.Tensor) -> torch.Tensor:
        """int64 [world, ...] counts for each destination -> [world, ...] counts from each source."""
        if not self.distributed:
            return send_counts
        out = torch.empty_like(send_counts)
        self.num_collectives += 1
        dist.all_to_all_single(out.view(self.world_size, -1), send_counts.contiguous().view(self.world_size, -1),
                               group=self.group)
        return out

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In-place all-reduce (``op`` in sum, max, min); returns ``t``."""
        if self.distributed:
            self.num_collectives += 1
            ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
            dist.all_reduce(t, op=ops[op], group=self.group)
        return t

    def all_gather_object(self, obj: object) -> list[object]:
        """Every rank's ``obj`` (picklable), in rank order."""
        if not self.distributed:
            return [obj]
        out: list[object] = [None] * self.world_size
        self.num_collectives += 1
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.distributed:
            self.num_collectives += 1
            dist.broadcast(t, src=self._global(src), group=self.group)
        return t

    def exchange(self, sends: Mapping[int, torch.Tensor], recvs: Mapping[int, torch.Tensor], tag: int = 0) -> None:
        """Point-to-point: send ``sends[dst]`` to each ``dst`` and fill ``recvs[src]`` from
        each ``src`` (group ranks), all posted at once so no ordering can deadlock."""
        if not self.distributed:
            if sends or recvs:
                raise RuntimeError("point-to-point transfer requested in a single-rank group")
            return
        self.num_collectives += 1
        outgoing = {dst: buf.contiguous() for dst, buf in sends.items()}  # alive until every wait()
        ops = [dist.P2POp(dist.irecv, buf, self._global(src), self.group, tag) for src, buf in recvs.items()]
        ops += [dist.P2POp(dist.isend, buf, self._global(dst), self.group, tag) for dst, buf in outgoing.items()]
        if ops:  # one batch: NCCL needs the sends and receives of a step grouped to avoid deadlock
            for work in dist.batch_isend_irecv(ops):
                work.wait()

    def barrier(self) -> None:
        if self.distributed:
            self.num_collectives += 1
            dist.barrier(group=self.group)

    def _global(self, group_rank: int) -> int:
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)
