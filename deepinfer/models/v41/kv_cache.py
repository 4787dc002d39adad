"""Device-side KV state of DeepSeek-V4.1.

Three paged groups share one token block size B (block i of a request covers tokens
[i*B, (i+1)*B) in every group), each with its own physical block ids and lifetime:

  swa  window KV (B rows per block) of the encoder layers (those before the last KV
       source) and of the DSpark stages, plus the raw token ids of each position (the
       engram look-back reads them back)                          -- sliding window
  dec  window KV of the decoder layers (the last KV source and every layer after it:
       the bounded-replay region)                                  -- sliding window
  src  the shared KV of the KV-source layers: B / ratio compressed entries per block
       (head_dim) and their index keys (index_head_dim)           -- full context

plus one state slot per running request holding, for each pooling (ratio > 1) source,
the projections of the tokens of the group still open (a ring of `ratio` rows). Prefix
hits land on block boundaries and B is a multiple of every ratio, so a resumed request
never has an open group and needs no restore.
"""

from __future__ import annotations

import torch

from ..paged_batch import check_block_size
from .config import DeepseekV41Config

GROUP_SWA, GROUP_DEC, GROUP_SRC = "swa", "dec", "src"
WINDOW_GROUPS = (GROUP_SWA, GROUP_DEC)


def group_names_v41(cfg: DeepseekV41Config) -> list[str]:
    names = [GROUP_SWA]
    if cfg.decoder_layers:
        names.append(GROUP_DEC)
    if cfg.kv_source_layer_ids:
        names.append(GROUP_SRC)
    return names


def window_layers(cfg: DeepseekV41Config) -> tuple[list[int], list[int]]:
    """(layers whose window lives in swa incl. DSpark stage ids n+k, layers in dec)."""
    n = cfg.num_hidden_layers
    dec = cfg.decoder_layers
    swa = [i for i in range(n) if i not in dec] + [n + k for k in range(len(cfg.mtp_compress_ratios))]
    return swa, dec


def block_bytes_v41(cfg: DeepseekV41Config, block_size: int, dtype: torch.dtype) -> dict[str, int]:
    """Bytes one physical block of each group takes, summed over its layers."""
    elt = torch.empty((), dtype=dtype).element_size()
    swa, dec = window_layers(cfg)
    out = {GROUP_SWA: len(swa) * block_size * cfg.head_dim * elt + (block_size * 8 if cfg.engram_layer_ids else 0)}
    if dec:
        out[GROUP_DEC] = len(dec) * block_size * cfg.head_dim * elt
    if cfg.kv_source_layer_ids:
        out[GROUP_SRC] = sum((block_size // cfg.compress_ratios[s]) * (cfg.head_dim + cfg.index_head_dim) * elt
                             for s in cfg.kv_source_layer_ids)
    return out


def slot_bytes_v41(cfg: DeepseekV41Config, dtype: torch.dtype) -> int:
    """Bytes of one request's compressor state slot (float32 (kv, score) rows)."""
    return sum(cfg.compress_ratios[s] * 2 * cfg.head_dim * 4 for s in cfg.kv_source_layer_ids
               if cfg.compress_ratios[s] > 1)


class KVCacheV41:
    """All KV tensors of one V4.1 model replica. `window(layer)` gives a layer's window
    pool; `src_kv[s]` / `src_index[s]` the shared entries / index keys of source s."""

    def __init__(self, cfg: DeepseekV41Config, num_blocks: dict[str, int], block_size: int, num_slots: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        check_block_size(cfg, block_size)
        self.cfg, self.block_size, self.num_slots, self.dtype = cfg, block_size, num_slots, dtype
        self.num_blocks = dict(num_blocks)
        d, di = cfg.head_dim, cfg.index_head_dim

        def z(*shape: int, dtype: torch.dtype = dtype) -> torch.Tensor:
            # Uninitialised on purpose (like the V4 cache): every row is written before it
            # is read; a read of an unwritten row is a bug the tests are there to catch.
            return torch.empty(*shape, dtype=dtype, device=device)

        swa_layers, dec_layers = window_layers(cfg)
        self.swa = {i: z(num_blocks[GROUP_SWA], block_size, d) for i in swa_layers}
        self.dec = {i: z(num_blocks[GROUP_DEC], block_size, d) for i in dec_layers}
        self.tokens = z(num_blocks[GROUP_SWA], block_size, dtype=torch.int64) if cfg.engram_layer_ids else None
        self.src_kv, self.src_index, self.ring = {}, {}, {}
        for s in cfg.kv_source_layer_ids:
            r = cfg.compress_ratios[s]
            self.src_kv[s] = z(num_blocks[GROUP_SRC], block_size // r, d)
            self.src_index[s] = z(num_blocks[GROUP_SRC], block_size // r, di)
            if r > 1:
                self.ring[s] = z(num_slots, r, 2, d, dtype=torch.float32)

    def window(self, layer: int) -> tuple[torch.Tensor, str]:
        """(window pool, its group) of a layer (DSpark stage k: layer id n + k)."""
        if layer in self.dec:
            return self.dec[layer], GROUP_DEC
        return self.swa[layer], GROUP_SWA

    def compressor_rings(self) -> tuple[dict[int, torch.Tensor], ...]:
        """The per-request ring dicts of every compressor (the ratio > 1 KV sources), by layer."""
        return (self.ring,)

    def nbytes(self) -> int:
        tensors = [*self.swa.values(), *self.dec.values(), *self.src_kv.values(), *self.src_index.values(),
                   *self.ring.values()] + ([self.tokens] if self.tokens is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)
