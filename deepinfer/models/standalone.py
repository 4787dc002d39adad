"""A minimal driver of the model over its paged cache, without the scheduler.

Used by oracle tests and quick experiments: each sequence id owns a fixed slot and a
contiguous range of physical blocks in every group; `step` feeds new tokens of any
number of sequences as one flattened batch and returns the logits of every fed row.
"""

from __future__ import annotations

import torch

from .paged_batch import ForwardBatch, SeqMeta
from .registry import family_of
from .v4.model import DeepseekV4Model


class StandaloneRunner:
    """Runs `model` for up to `max_seqs` sequences of at most `max_len` tokens."""

    def __init__(self, model: DeepseekV4Model, max_seqs: int = 8, max_len: int = 1024, block_size: int = 128,
                 replay: object | None = None) -> None:
        self.model, self.block_size = model, block_size
        self.replay = replay  # V4.1 bounded replay (bounded_replay.ReplayConfig); None = off
        self.blocks_per_seq = -(-max_len // block_size)
        family = family_of(model.cfg)
        groups = family.kv_group_names(model.cfg)
        device = next(model.parameters()).device
        self.cache = family.new_kv_cache(model.cfg, {g: max_seqs * self.blocks_per_seq for g in groups},
                                         block_size, max_seqs, model.dtype, device)
        self.groups, self.max_seqs, self.max_len = groups, max_seqs, max_len
        self.lengths: dict[int, int] = {}

    def _table(self, seq_id: int) -> dict[str, list[int]]:
        base = seq_id * self.blocks_per_seq
        return {g: list(range(base, base + self.blocks_per_seq)) for g in self.groups}

    @torch.no_grad()
    def step(self, feeds: list[tuple[int, list[int]]], prompt_lens: dict[int, int] | None = None
             ) -> list[torch.Tensor]:
        """feeds: (sequence id, new token ids). Returns float32 logits [len, vocab] per feed.
        `prompt_lens` (sequence id -> prompt length) drives V4.1 bounded replay."""
        ids, pos, seqs, offset = [], [], [], 0
        for seq_id, tokens in feeds:
            if not 0 <= seq_id < self.max_seqs:
                raise ValueError(f"sequence id must be in [0, {self.max_seqs}), got {seq_id}")
            start = self.lengths.get(seq_id, 0)
            if start + len(tokens) > self.max_len:
                raise ValueError(f"sequence {seq_id} would exceed max_len={self.max_len}")
            seqs.append(SeqMeta(start, len(tokens), offset, self._table(seq_id), seq_id, is_new=start == 0,
                                prompt_len=(prompt_lens or {}).get(seq_id, 0)))
            ids += tokens
            pos += range(start, start + len(tokens))
            offset += len(tokens)
            self.lengths[seq_id] = start + len(tokens)
        device = self.cache.swa[0].device
        batch = ForwardBatch(torch.tensor(ids, device=device), torch.tensor(pos, device=device), seqs, self.replay)
        logits = self.model.compute_logits(self.model(batch, self.cache))
        return [logits[s.offset: s.offset + s.length] for s in seqs]
