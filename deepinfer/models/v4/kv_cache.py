"""Device-side KV state of DeepSeek-V4 (the step batch it is read through: paged_batch.py).

Three paged groups share one token block size B (block i of a request covers tokens
[i*B, (i+1)*B)), each with its own physical block ids:
  swa  raw window KV of every layer (and of the MTP stages): [blocks, B, head_dim]
  csa  compressed entries of CSA layers (B/ratio per block) + indexer keys, and the
       compressor's overlap "tail" at the block end so a prefix-cache hit can resume
  hca  compressed entries of HCA layers (B/ratio per block)
plus one fixed-size state slot per running request holding the compressor's
partial-window inputs (a ring of the last 2*ratio or ratio tokens' projections).
"""

from __future__ import annotations

import torch

from ..paged_batch import check_block_size
from .config import DeepseekV4Config

GROUP_SWA, GROUP_CSA, GROUP_HCA = "swa", "csa", "hca"


#: V4's groups whose blocks hold sliding-window rows (freed as they fall out of the window).
WINDOW_GROUPS_V4 = (GROUP_SWA,)


def group_names_v4(cfg: DeepseekV4Config) -> list[str]:
    """KV groups a V4 config needs (a group with no layers is omitted). Engine code asks the
    model family (models/registry.py: ``family_of(cfg).kv_group_names``)."""
    names = [GROUP_SWA]
    if cfg.csa_layers:
        names.append(GROUP_CSA)
    if cfg.hca_layers:
        names.append(GROUP_HCA)
    return names


def block_bytes_v4(cfg: DeepseekV4Config, block_size: int, dtype: torch.dtype) -> dict[str, int]:
    """Bytes one physical block of each V4 group takes, summed over its layers."""
    elt = torch.empty((), dtype=dtype).element_size()
    n_swa = cfg.num_hidden_layers + len(cfg.mtp_compress_ratios)
    out = {GROUP_SWA: n_swa * block_size * cfg.head_dim * elt}
    r = cfg.csa_ratio
    if cfg.csa_layers:
        entries = (block_size // r) * (cfg.head_dim + cfg.index_head_dim) * elt
        tail = r * 2 * (cfg.head_dim + cfg.index_head_dim) * 4
        out[GROUP_CSA] = len(cfg.csa_layers) * (entries + tail)
    if cfg.hca_layers:
        out[GROUP_HCA] = len(cfg.hca_layers) * (block_size // cfg.hca_ratio) * cfg.head_dim * elt
    return out


def slot_bytes_v4(cfg: DeepseekV4Config, dtype: torch.dtype) -> int:
    """Bytes of one request's V4 compressor state slot (kept in float32)."""
    elt = 4
    csa = 2 * cfg.csa_ratio * 2 * 2 * (cfg.head_dim + cfg.index_head_dim)
    hca = cfg.hca_ratio * 2 * cfg.head_dim
    return (len(cfg.csa_layers) * csa + len(cfg.hca_layers) * hca) * elt


class KVCache:
    """All KV tensors of one model replica. Indexing: `swa[layer]`, `csa_kv[layer]`, ...
    keyed by layer id (MTP stage k uses swa layer id num_hidden_layers + k)."""

    def __init__(self, cfg: DeepseekV4Config, num_blocks: dict[str, int], block_size: int, num_slots: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        check_block_size(cfg, block_size)
        self.cfg, self.block_size, self.num_slots, self.dtype = cfg, block_size, num_slots, dtype
        self.num_blocks = dict(num_blocks)
        d, di = cfg.head_dim, cfg.index_head_dim

        def z(*shape: int, dtype: torch.dtype = dtype) -> torch.Tensor:
            # Uninitialised on purpose: every row is written before it is read (rings are
            # reset on admission), and untouched pages of a large budget cost nothing.
            return torch.empty(*shape, dtype=dtype, device=device)

        n_swa = cfg.num_hidden_layers + len(cfg.mtp_compress_ratios)
        self.swa = {i: z(num_blocks[GROUP_SWA], block_size, d) for i in range(n_swa)}
        r = cfg.csa_ratio
        self.csa_kv, self.csa_index, self.csa_tail, self.csa_index_tail = {}, {}, {}, {}
        self.ring, self.index_ring = {}, {}
        for i in cfg.csa_layers:
            nb = num_blocks[GROUP_CSA]
            self.csa_kv[i] = z(nb, block_size // r, d)
            self.csa_index[i] = z(nb, block_size // r, di)
            # Overlap tail: the last window's first-half (kv, score) rows at each block end.
            self.csa_tail[i] = z(nb, r, 2, d, dtype=torch.float32)
            self.csa_index_tail[i] = z(nb, r, 2, di, dtype=torch.float32)
            # Ring of the last 2*ratio tokens' (kv, score) projections, both halves.
            # float32: the scores carry the float32 position bias.
            self.ring[i] = z(num_slots, 2 * r, 2, 2 * d, dtype=torch.float32)
            self.index_ring[i] = z(num_slots, 2 * r, 2, 2 * di, dtype=torch.float32)
        self.hca_kv = {}
        for i in cfg.hca_layers:
            self.hca_kv[i] = z(num_blocks[GROUP_HCA], block_size // cfg.hca_ratio, d)
            self.ring[i] = z(num_slots, cfg.hca_ratio, 2, d, dtype=torch.float32)

    def compressor_rings(self) -> tuple[dict[int, torch.Tensor], ...]:
        """The per-request ring dicts of every compressor (main and indexer), by layer."""
        return self.ring, self.index_ring

    def nbytes(self) -> int:
        tensors = [*self.swa.values(), *self.csa_kv.values(), *self.csa_index.values(), *self.csa_tail.values(),
                   *self.csa_index_tail.values(), *self.ring.values(), *self.index_ring.values(),
                   *self.hca_kv.values()]
        return sum(t.numel() * t.element_size() for t in tensors)
