"""Train and export the default model in one command.

    python -m deepinfer.train.run --tokens build/tokens --tokenizer build/tokenizer \\
        --out build/deepinfer-tiny [--time-budget 540] [--steps-a N --steps-b M]

Phase A (model + MTP + indexers) and phase B (DSpark stages on the frozen model), then
confidence temperatures fitted on held-out blocks, then the official-layout export
(`deepinfer.train.export`) and `train_result.json` beside it: settings, step counts (pass
them back with --steps-a / --steps-b to replay the schedule), loss curve, held-out loss,
expected draft acceptance per position, calibration errors, hardware and commit.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from dataclasses import asdict

import numpy as np
import torch

from deepinfer import envs

from .calibrate import fit_temperatures
from .export import checkpoint_bytes, export_dspark, export_model
from .recipe import dspark_config, trained_config
from .trainer import TrainResult, TrainSettings, draft_calibration_data, train_dspark, train_model
from .vocab import special_ids


def _commit() -> str:
    """DEEPINFER_COMMIT when set (a device's copy of the tree may carry a stale .git), else HEAD."""
    if envs.DEEPINFER_COMMIT:
        return envs.DEEPINFER_COMMIT
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _hardware(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def run(train_tokens: np.ndarray, val_tokens: np.ndarray, tokenizer_dir: str, out_dir: str,
        settings: TrainSettings, device: torch.device, config_overrides: dict | None = None) -> dict:
    """Train, calibrate and export; returns (and writes) the result record."""
    t0 = time.perf_counter()
    ids = special_ids(tokenizer_dir)
    cfg = trained_config(ids["vocab_size"], ids["bos"], ids["eos"], **(config_overrides or {}))
    dcfg = dspark_config(cfg, ids["noise"])
    result = TrainResult(settings=asdict(settings))
    model = train_model(cfg, train_tokens, val_tokens, settings, device, result)
    stages = train_dspark(model, dcfg, train_tokens, val_tokens, settings, device, result)
    conf_logits, accept = draft_calibration_data(model, stages, dcfg, val_tokens, settings, device)
    temps, ece_before, ece_after = fit_temperatures(conf_logits, accept)
    dcfg.dspark_confidence_temperatures = temps
    export_model(model, cfg, tokenizer_dir, out_dir)
    export_dspark(model, stages, dcfg, out_dir)
    record = {
        **asdict(result), "draft_accept": [float(x) for x in accept.mean(0)],
        "confidence_temperatures": temps, "cumulative_ece_before": ece_before, "cumulative_ece_after": ece_after,
        "params": sum(p.numel() for p in model.parameters()),
        "dspark_params": sum(p.numel() for p in stages.parameters()),
        "checkpoint_bytes": checkpoint_bytes(out_dir), "train_tokens": int(len(train_tokens)),
        "val_tokens": int(len(val_tokens)), "seconds": time.perf_counter() - t0, "hardware": _hardware(device),
        "torch": torch.__version__, "commit": _commit(), "config": cfg.to_official_json(),
    }
    with open(os.path.join(out_dir, "train_result.json"), "w") as f:
        json.dump(record, f, indent=1)
    return record


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Train and export deepinfer's default model.")
    p.add_argument("--tokens", required=True, help="tokenized corpus (python -m deepinfer.train.data)")
    p.add_argument("--tokenizer", required=True, help="tokenizer dir (python -m deepinfer.train.bpe)")
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--time-budget", type=float, default=TrainSettings.time_budget_s)
    p.add_argument("--steps-a", type=int, default=None)
    p.add_argument("--steps-b", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=TrainSettings.batch_size)
    p.add_argument("--seq-len", type=int, default=TrainSettings.seq_len)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    settings = TrainSettings(time_budget_s=args.time_budget, steps_a=args.steps_a, steps_b=args.steps_b,
                             batch_size=args.batch_size, seq_len=args.seq_len, seed=args.seed)
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    from .data import load_tokens  # the corpus package's loader (uint16 token streams)

    train_tokens, val_tokens = load_tokens(args.tokens, "train"), load_tokens(args.tokens, "val")
    record = run(train_tokens, val_tokens, args.tokenizer, args.out, settings, torch.device(args.device))
    print(json.dumps({k: record[k] for k in ("steps_a", "steps_b", "best_val_loss", "draft_accept",
                                             "confidence_temperatures", "cumulative_ece_after",
                                             "checkpoint_bytes", "seconds")}, indent=1))


if __name__ == "__main__":
    main()
