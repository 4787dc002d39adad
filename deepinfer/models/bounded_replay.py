"""SWA bounded replay for DeepSeek-V4.1 (DeepInfer's "YOCO truncation", vLLM's
"decoder replay", SGLang's "decoder SWA bounded replay").

The decoder layers (the last KV source and every layer after it) own nothing but a
128-token window of raw KV; the shared KV and index keys they read are published by the
last KV source's compressor, which keeps running on every row. So in prefill the
decoder layers only need to run on each request's last `keep` prompt positions:

  cut = prompt_len - keep   (0 when the prompt is no longer than keep)

  off      every row runs every layer (exact)
  mask     every row runs every layer, but a decoder layer's window attention of the
           row at position p sees only keys in [max(p - W + 1, cut), p]
  compact  rows at positions < cut skip the decoder layers altogether; the kept rows
           see the same narrowed window as in `mask`, so compact == mask

It is an approximation for prompts longer than keep (the first kept rows see a
truncated window), and exact (== off) for prompts of at most keep tokens. Decode rows
(p >= prompt_len) always see their full window because keep >= W. keep must also
cover the speculative backtracking (a rejected draft rolls the request back by up to
MAX_BACKTRACK positions, whose window must still lie inside the kept suffix).

`cut` depends on the prompt length only (not on how many tokens were generated), so a
preempted request recomputes exactly what it had. Prefix-cache hits are capped at
`cut` (`hit_limit`): every decoder-window row a request reads is then one it computed
itself, so a hit changes nothing (and compact == mask under hits).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from deepinfer import envs
from deepinfer.errors import ConfigError
from deepinfer.models.registry import family_of

MODES = ("off", "mask", "compact")
#: Positions a request can be rolled back by speculative verification (DSpark block 5 + 1).
MAX_BACKTRACK = 6
#: DeepInfer's names (declared in deepinfer/envs.py with today's DEEPINFER_SWA_REPLAY_MODE /
#: DEEPINFER_SWA_REPLAY_KEEP as aliases: either works, both set to different values is an error).
ENV_MODE, ENV_KEEP = "DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS"
DEFAULT_KEEP: int = envs.ENV_VARS[ENV_KEEP].default  # 140


@dataclass(frozen=True)
class ReplayConfig:
    """Engine-wide bounded-replay setting, carried to the model in ForwardBatch.replay."""

    mode: str = "off"
    keep: int = DEFAULT_KEEP

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"swa_replay_mode must be one of {list(MODES)}, got {self.mode!r} "
                              f"(kwarg swa_replay_mode or env {ENV_MODE})", field="swa_replay_mode")
        if isinstance(self.keep, bool) or not isinstance(self.keep, int) or self.keep < 1:
            raise ConfigError(f"swa_replay_keep must be a positive int, got {self.keep!r} "
                              f"(kwarg swa_replay_keep or env {ENV_KEEP})", field="swa_replay_keep")

    @property
    def active(self) -> bool:
        return self.mode != "off"

    @classmethod
    def resolve(cls, kwargs: dict, environ: Mapping[str, str] | None = None) -> "ReplayConfig":
        """Pop `swa_replay_mode` / `swa_replay_keep` from LLM kwargs (they win) over the env
        (``DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE`` / ``DEEPINFER_YOCO_PREFILL_KEEP_TOKENS``, or their
        aliases ``DEEPINFER_SWA_REPLAY_MODE`` / ``DEEPINFER_SWA_REPLAY_KEEP``)."""
        mode = kwargs.pop("swa_replay_mode", None)
        keep = kwargs.pop("swa_replay_keep", None)
        # read both even when a kwarg wins: a bad or contradictory variable is an error either way
        env_mode, env_keep = envs.get(ENV_MODE, environ), envs.get(ENV_KEEP, environ)
        return cls(env_mode if mode is None else mode, env_keep if keep is None else keep)

    def validate_for(self, cfg) -> None:
        """Check against the model: it must have decoder layers, and keep must cover the
        window plus the speculative backtracking."""
        if not self.active:
            return
        if family_of(cfg).replay_start_layer(cfg) is None:
            raise ConfigError(f"swa_replay_mode={self.mode!r} needs a model with V4.1 decoder layers (a KV-source "
                              f"schedule); this checkpoint is {getattr(cfg, 'model_type', '?')!r}. Use "
                              f"swa_replay_mode='off' (env {ENV_MODE}=off)", field="swa_replay_mode")
        bound = cfg.sliding_window + MAX_BACKTRACK
        if self.keep < bound:
            raise ConfigError(
                f"swa_replay_keep={self.keep} is too small: it must be >= sliding_window ({cfg.sliding_window}) + "
                f"max speculative backtracking ({MAX_BACKTRACK}) = {bound}, or decode would read window KV the "
                f"decoder layers never computed (kwarg swa_replay_keep or env {ENV_KEEP})", field="swa_replay_keep")

    def cut(self, prompt_len: int) -> int:
        """First position the decoder layers process in prefill (0 = every position)."""
        if not self.active or prompt_len <= self.keep:
            return 0
        return prompt_len - self.keep

    def hit_limit(self, request) -> int:
        """Longest prefix-cache hit (tokens) a request may use: its cut."""
        return self.cut(request.num_prompt_tokens)


def replay_free(so, replay: ReplayConfig | None, cfg) -> bool:
    """Whether bounded replay changes nothing for this step's rows: every row's window
    ``[p - W + 1, p]`` lies at or after its request's cut (decode rows always do, since
    keep >= W). Such steps may run on a batched path that does not narrow windows."""
    if replay is None or not replay.active:
        return True
    w = cfg.sliding_window
    cuts = ((r.start_pos, replay.cut(r.num_prompt_tokens)) for r in so.scheduled)
    return all(cut == 0 or start - w + 1 >= cut for start, cut in cuts)


def batch_cuts(batch) -> list[int]:
    """Per-sequence cut of a ForwardBatch (all 0 when replay is off or absent)."""
    replay = getattr(batch, "replay", None)
    if replay is None or not replay.active:
        return [0] * len(batch.seqs)
    return [replay.cut(getattr(s, "prompt_len", 0)) for s in batch.seqs]


def kept_rows(batch, cuts: list[int]) -> torch.Tensor | None:
    """Flattened rows at positions >= their sequence's cut; None when every row is kept."""
    if not any(c > s.start for c, s in zip(cuts, batch.seqs)):
        return None
    parts = [torch.arange(s.offset + max(0, c - s.start), s.offset + s.length)
             for c, s in zip(cuts, batch.seqs) if s.start + s.length > c]
    if not parts:
        return torch.zeros(0, dtype=torch.long, device=batch.input_ids.device)
    return torch.cat(parts).to(batch.input_ids.device)
