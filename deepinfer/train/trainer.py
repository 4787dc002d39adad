"""Training loop of the default model: phase A trains the model, its MTP stage and the
indexers; phase B trains the DSpark stages on the frozen model's features.

The run is sized by wall clock (`time_budget_s`) but stays reproducible: a few timed
steps fix the step counts, which are recorded and can be passed back (`steps_a`,
`steps_b`) to replay the same schedule on any machine.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from tqdm.auto import tqdm

from deepinfer.models.v4.config import DeepseekV4Config
from deepinfer.models.v4.dspark import DSparkStage
from deepinfer.models.v4.model import DeepseekV4Model

from .dense_dspark import draft_forward, make_blocks, target_features
from .dense_model import head_logits, model_forward, mtp_forward
from .losses import dspark_loss, next_token_ce
from .recipe import init_for_training


@dataclass
class TrainSettings:
    """Hyper-parameters and budget of one run (all recorded in the model card)."""

    seq_len: int = 1024
    batch_size: int = 32
    lr: float = 2e-3
    dspark_lr: float = 2e-3
    min_lr_frac: float = 0.05
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    mtp_weight: float = 0.3
    bias_update: float = 1e-3  # aux-loss-free balancing: router bias step per update
    anchors_per_seq: int = 128  # DSpark blocks per training sequence
    time_budget_s: float = 540.0
    dspark_share: float = 0.3  # share of the budget for phase B
    steps_a: int | None = None
    steps_b: int | None = None
    eval_every: int = 200
    eval_batches: int = 4
    seed: int = 0


@dataclass
class TrainResult:
    """What the run measured."""

    steps_a: int = 0
    steps_b: int = 0
    tokens_a: int = 0
    seconds: float = 0.0
    best_val_loss: float = math.inf
    history: list[dict] = field(default_factory=list)
    draft_accept: list[float] = field(default_factory=list)  # held-out mean 1 - TV per draft position
    settings: dict = field(default_factory=dict)


class BatchSampler:
    """Random crops of seq_len + 1 tokens from one long uint16 token stream (seeded)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int, device: torch.device) -> None:
        if len(tokens) <= seq_len + 1:
            raise ValueError(f"token stream of {len(tokens)} ids is shorter than seq_len + 2 = {seq_len + 2}")
        self.tokens, self.seq_len, self.batch_size, self.device = tokens, seq_len, batch_size, device
        self.rng = np.random.default_rng(seed)

    def next(self) -> torch.Tensor:
        starts = self.rng.integers(0, len(self.tokens) - self.seq_len - 1, self.batch_size)
        rows = np.stack([self.tokens[s: s + self.seq_len + 1] for s in starts]).astype(np.int64)
        return torch.from_numpy(rows).to(self.device, non_blocking=True)


def fixed_batches(tokens: np.ndarray, seq_len: int, n: int, batch_size: int, device: torch.device) -> list[torch.Tensor]:
    """Deterministic evaluation batches: n batches of evenly spaced crops."""
    count = n * batch_size
    starts = np.linspace(0, len(tokens) - seq_len - 2, count).astype(np.int64)
    rows = np.stack([tokens[s: s + seq_len + 1] for s in starts]).astype(np.int64)
    return [torch.from_numpy(rows[i * batch_size:(i + 1) * batch_size]).to(device) for i in range(n)]


def lr_at(step: int, total: int, warmup: int, peak: float, min_frac: float) -> float:
    """Linear warm-up then cosine decay to min_frac * peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (min_frac + (1 - min_frac) * 0.5 * (1 + math.cos(math.pi * t)))


def _optimizer(params: list[tuple[str, torch.nn.Parameter]], lr: float, wd: float) -> torch.optim.AdamW:
    decay = [p for n, p in params if p.dim() >= 2 and "embed" not in n and not n.endswith("_fn")]
    other = [p for n, p in params if not (p.dim() >= 2 and "embed" not in n and not n.endswith("_fn"))]
    fused = all(p.is_cuda for _, p in params)
    return torch.optim.AdamW([{"params": decay, "weight_decay": wd}, {"params": other, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)


def _autocast(device: torch.device):
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)


def _balance_routers(model: DeepseekV4Model, counts: dict[int, torch.Tensor], step: float) -> None:
    """Aux-loss-free balancing: push each routed layer's bias toward under-loaded experts."""
    for i, c in counts.items():
        gate = model.layers[i].ffn.gate
        load = c.float()
        gate.bias.data += step * torch.sign(load.mean() - load)
        c.zero_()


def main_losses(model: DeepseekV4Model, batch: torch.Tensor, s: TrainSettings) -> dict[str, torch.Tensor]:
    """Phase-A losses of one batch [B, L+1]."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    out = model_forward(model, inputs, with_indexer_loss=True)
    b, length = inputs.shape
    ce = next_token_ce(head_logits(model, out.streams).view(b, length, -1), targets)
    mtp = next_token_ce(mtp_forward(model, out.streams, inputs), targets[:, 1:])
    kl = torch.stack(out.indexer_kl).mean() if out.indexer_kl else ce.new_zeros(())
    return {"loss": ce + s.mtp_weight * mtp + kl, "ce": ce, "mtp": mtp, "indexer_kl": kl}


@torch.no_grad()
def evaluate(model: DeepseekV4Model, batches: list[torch.Tensor], s: TrainSettings) -> dict[str, float]:
    """Mean held-out CE of the model and of its MTP stage."""
    tot = {"ce": 0.0, "mtp": 0.0}
    for batch in batches:
        with _autocast(batch.device):
            losses = main_losses(model, batch, s)
        tot["ce"] += float(losses["ce"]) / len(batches)
        tot["mtp"] += float(losses["mtp"]) / len(batches)
    return tot


def train_model(cfg: DeepseekV4Config, train_tokens: np.ndarray, val_tokens: np.ndarray, s: TrainSettings,
                device: torch.device, result: TrainResult) -> DeepseekV4Model:
    """Phase A. Returns the model at its best held-out loss."""
    torch.manual_seed(s.seed)
    model = DeepseekV4Model(cfg, torch.float32)
    init_for_training(model, cfg, s.seed)
    model.to(device)
    params = [(n, p) for n, p in model.named_parameters() if not n.endswith("gate.bias")]
    for n, p in model.named_parameters():
        p.requires_grad_(not n.endswith("gate.bias"))
    opt = _optimizer(params, s.lr, s.weight_decay)
    counts = {i: torch.zeros(cfg.n_routed_experts, dtype=torch.long, device=device)
              for i, layer in enumerate(model.layers) if not layer.ffn.gate.is_hash}
    for i, c in counts.items():
        model.layers[i].ffn.load_counter = c
    sampler = BatchSampler(train_tokens, s.seq_len, s.batch_size, s.seed, device)
    val = fixed_batches(val_tokens, s.seq_len, s.eval_batches, s.batch_size, device)
    total = s.steps_a or 10**9
    budget = s.time_budget_s * (1 - s.dspark_share)
    best, start = None, time.perf_counter()
    bar = tqdm(total=s.steps_a, desc="train", unit="step", mininterval=10)
    step = 0
    ev = evaluate(model, val, s)  # the untrained baseline (about log V)
    result.history.append({"step": 0, "train_ce": math.nan, "val_ce": ev["ce"], "val_mtp": ev["mtp"],
                           "indexer_kl": math.nan, "seconds": 0.0})
    while step < total:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total, s.warmup_steps, s.lr, s.min_lr_frac)
        with _autocast(device):
            losses = main_losses(model, sampler.next(), s)
        opt.zero_grad(set_to_none=True)
        losses["loss"].backward()
        torch.nn.utils.clip_grad_norm_([p for _, p in params], s.grad_clip)
        opt.step()
        _balance_routers(model, counts, s.bias_update)
        step += 1
        bar.update(1)
        if s.steps_a is None and step == 20:  # fix the schedule from the measured step time
            if device.type == "cuda":
                torch.cuda.synchronize()
            timed = (time.perf_counter() - start) / step
            total = max(s.warmup_steps + 1, int(budget / timed))
            bar.total = total
        if step % s.eval_every == 0 or step == total:
            ev = evaluate(model, val, s)
            result.history.append({"step": step, "train_ce": float(losses["ce"].detach()), "val_ce": ev["ce"],
                                   "val_mtp": ev["mtp"], "indexer_kl": float(losses["indexer_kl"].detach()),
                                   "seconds": time.perf_counter() - start})
            if ev["ce"] < result.best_val_loss:
                result.best_val_loss, best = ev["ce"], copy.deepcopy(model.state_dict())
    bar.close()
    result.steps_a, result.tokens_a = step, step * s.batch_size * s.seq_len
    if best is not None:
        model.load_state_dict(best)
    for layer in model.layers:
        layer.ffn.load_counter = None
    return model


def train_dspark(model: DeepseekV4Model, dcfg: DeepseekV4Config, train_tokens: np.ndarray, val_tokens: np.ndarray,
                 s: TrainSettings, device: torch.device, result: TrainResult) -> torch.nn.ModuleList:
    """Phase B: the DSpark stages on the frozen model. Returns the trained stages."""
    model.requires_grad_(False)
    n_stages = len(dcfg.mtp_compress_ratios)
    stages = torch.nn.ModuleList(DSparkStage(dcfg, k, n_stages, torch.float32) for k in range(n_stages))
    init_for_training(stages, dcfg, s.seed + 1)
    stages.to(device)
    params = list(stages.named_parameters())
    opt = _optimizer(params, s.dspark_lr, s.weight_decay)
    sampler = BatchSampler(train_tokens, s.seq_len, s.batch_size, s.seed + 1, device)
    total = s.steps_b or 10**9
    budget, start, step = s.time_budget_s * s.dspark_share, time.perf_counter(), 0
    gen = torch.Generator(device="cpu").manual_seed(s.seed + 2)
    while step < total:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total, min(50, s.warmup_steps), s.dspark_lr, s.min_lr_frac)
        batch = sampler.next()[:, :-1]
        with _autocast(device):
            loss = draft_batch_loss(model, stages, dcfg, batch, s, gen)
        opt.zero_grad(set_to_none=True)
        loss.total.backward()
        torch.nn.utils.clip_grad_norm_([p for _, p in params], s.grad_clip)
        opt.step()
        step += 1
        if s.steps_b is None and step == 20:
            if device.type == "cuda":
                torch.cuda.synchronize()
            total = max(21, int(budget / ((time.perf_counter() - start) / step)))
    result.steps_b = step
    return stages


@torch.no_grad()
def draft_calibration_data(model: DeepseekV4Model, stages: torch.nn.ModuleList, dcfg: DeepseekV4Config,
                           val_tokens: np.ndarray, s: TrainSettings, device: torch.device
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Held-out (confidence logits, expected acceptances 1 - TV), both [N, G], over blocks
    whose every row has a target (evenly spaced anchors of the fixed evaluation crops)."""
    g = dcfg.dspark_block_size
    logits, accepts = [], []
    for batch in fixed_batches(val_tokens, s.seq_len, s.eval_batches, s.batch_size, device):
        tokens = batch[:, :-1]
        b, length = tokens.shape
        span = torch.linspace(0, length - g - 2, min(s.anchors_per_seq, length - g - 1), device=device).long()
        with _autocast(device):
            loss = draft_batch_loss(model, stages, dcfg, tokens, s, anchors=span.expand(b, -1))
        logits.append(loss.conf_logit.float().cpu())
        accepts.append(loss.row_accept.float().cpu())
    return torch.cat(logits), torch.cat(accepts)
    return stages


def draft_batch_loss(model: DeepseekV4Model, stages: torch.nn.ModuleList, dcfg: DeepseekV4Config,
                     tokens: torch.Tensor, s: TrainSettings, gen: torch.Generator | None = None,
                     anchors: torch.Tensor | None = None):
    """DSpark loss on tokens [B, L] at `anchors` [B, A] (default: random ones drawn from
    `gen`); the model runs without grad."""
    b, length = tokens.shape
    layers = list(dcfg.dspark_target_layer_ids)
    with torch.no_grad():
        out = model_forward(model, tokens, capture=tuple(layers))
        logits = head_logits(model, out.streams).view(b, length, -1)
    main_x = target_features(stages[0], out.layer_inputs, layers, (b, length))
    if anchors is None:
        a = min(s.anchors_per_seq, length - 2)
        anchors = torch.stack([torch.randperm(length - 2, generator=gen)[:a] for _ in range(b)]).to(tokens.device)
    blocks = make_blocks(tokens, anchors, dcfg.dspark_block_size, dcfg.dspark_noise_token_id)
    draft_logits, hidden = draft_forward(model, stages, main_x, blocks)
    # the target's logits for the token row j predicts sit at row p + 1 + j
    tgt = logits.gather(1, blocks.positions.clamp(max=length - 1).reshape(b, -1, 1).expand(-1, -1, logits.shape[-1]))
    return dspark_loss(draft_logits, hidden, blocks, tgt.view(*blocks.positions.shape, -1), stages[-1])


def settings_dict(s: TrainSettings) -> dict:
    return asdict(s)
