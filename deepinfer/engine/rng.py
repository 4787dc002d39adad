"""Counter-based random numbers in pure torch integer ops (CPU, CUDA, NPU).

No ``torch.Generator`` and no global RNG state is involved: the value at
``(r, j)`` of :func:`uniform` is a pure function of ``(seed[r], position[r],
case, j)``. This is what makes sampling reproducible and batch invariant: a
token's noise never depends on batch size, batch order or earlier calls.

Keying follows DeepInfer's deterministic sampler (REFERENCE.md section 8): the
stream is keyed by the request's ``seq_seed`` (plus :data:`DRAFT_SEED_OFFSET`
for draft tokens) and by the counter ``3 * position + case`` with ``case`` one
of :data:`SAMPLE`, :data:`RESIDUAL`, :data:`ACCEPT`.

The mixer is SplitMix64 done on int64 tensors with two's complement
wraparound; logical right shifts are emulated by masking after the arithmetic
shift. Seeds are uint64 values stored bit-for-bit in int64 tensors (see
:func:`seed_to_int64`).
"""

from __future__ import annotations

import torch

__all__ = [
    "SAMPLE",
    "RESIDUAL",
    "ACCEPT",
    "NUM_CASES",
    "DRAFT_SEED_OFFSET",
    "seed_to_int64",
    "draft_seed",
    "counter",
    "random_bits",
    "uniform",
]

#: Case of the draw of a regular (target) sample at a position.
SAMPLE: int = 0
#: Case of the resample from the residual max(p - q, 0) after a rejected draft.
RESIDUAL: int = 1
#: Case of the accept test U < min(1, p / q) of a draft token.
ACCEPT: int = 2
#: Number of cases; the counter is ``NUM_CASES * position + case``.
NUM_CASES: int = 3


def _s64(value: int) -> int:
    """Reinterpret an unsigned 64-bit Python int as a signed int64 value."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= (1 << 63) else value


#: Added (mod 2**64) to ``seq_seed`` to key the drafter's samples.
DRAFT_SEED_OFFSET: int = _s64(0xD1B54A32D192ED03)

_GOLDEN = _s64(0x9E3779B97F4A7C15)
_MUL1 = _s64(0xBF58476D1CE4E5B9)
_MUL2 = _s64(0x94D049BB133111EB)


def seed_to_int64(seed: int) -> int:
    """Map a uint64 ``seq_seed`` (0 .. 2**64-1) to the int64 with the same bits."""
    if not 0 <= seed < (1 << 64):
        raise ValueError(f"seed must be in [0, 2**64 - 1] (uint64), got {seed!r}")
    return _s64(seed)


def draft_seed(seed: torch.Tensor) -> torch.Tensor:
    """Seeds used for draft-token samples: ``seed + DRAFT_SEED_OFFSET`` (wrapping)."""
    return seed + DRAFT_SEED_OFFSET


def counter(position: torch.Tensor, case: int) -> torch.Tensor:
    """The RNG counter ``3 * position + case`` (int64)."""
    if not 0 <= case < NUM_CASES:
        raise ValueError(f"case must be in [0, {NUM_CASES - 1}], got {case!r}")
    return position * NUM_CASES + case


def _srl(x: torch.Tensor, shift: int) -> torch.Tensor:
    """Logical right shift of int64 bits (``>>`` on int64 is arithmetic)."""
    return (x >> shift) & ((1 << (64 - shift)) - 1)


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64 finaliser (a bijection on 64-bit values)."""
    x = x ^ _srl(x, 30)
    x = x * _MUL1
    x = x ^ _srl(x, 27)
    x = x * _MUL2
    return x ^ _srl(x, 31)


def _check(seed: torch.Tensor, position: torch.Tensor, width: int) -> None:
    """Validate shapes and dtypes of the RNG inputs."""
    if seed.dtype != torch.int64 or position.dtype != torch.int64:
        raise TypeError(f"seed and position must be int64, got {seed.dtype} and {position.dtype}")
    if seed.dim() != 1 or seed.shape != position.shape:
        raise ValueError(f"seed and position must be 1-D of equal length, got "
                         f"{tuple(seed.shape)} and {tuple(position.shape)}")
    if width < 0:
        raise ValueError(f"width must be >= 0, got {width!r}")


def random_bits(seed: torch.Tensor, position: torch.Tensor, case: int,
                width: int) -> torch.Tensor:
    """64 random bits per element, as int64 ``[R, width]``.

    Element ``(r, j)`` is ``mix(row_key[r] + (j + 1) * golden)`` with
    ``row_key[r] = mix(mix(seed[r]) + counter[r] * golden)``, i.e. a SplitMix64
    stream indexed by ``j`` whose starting state is a hash of (seed, counter).
    """
    _check(seed, position, width)
    key = _mix64(_mix64(seed) + counter(position, case) * _GOLDEN)
    lanes = (torch.arange(1, width + 1, dtype=torch.int64, device=seed.device) * _GOLDEN)
    return _mix64(key.unsqueeze(1) + lanes.unsqueeze(0))


def uniform(seed: torch.Tensor, position: torch.Tensor, case: int, width: int,
            dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Uniform floats in ``[0, 1)`` of shape ``[R, width]``.

    Args:
        seed: int64 ``[R]`` per-row seeds (uint64 bits, see :func:`seed_to_int64`).
        position: int64 ``[R]`` per-row token positions.
        case: :data:`SAMPLE`, :data:`RESIDUAL` or :data:`ACCEPT`.
        width: number of values per row (e.g. the vocabulary size).
        dtype: ``torch.float32`` (24 high bits, exact multiples of 2**-24) or
            ``torch.float64`` (53 high bits, multiples of 2**-53).
    """
    bits = random_bits(seed, position, case, width)
    if dtype == torch.float32:
        return _srl(bits, 40).to(torch.float32) * (2.0 ** -24)
    if dtype == torch.float64:
        return _srl(bits, 11).to(torch.float64) * (2.0 ** -53)
    raise TypeError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
