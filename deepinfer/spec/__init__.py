"""Speculative decoding: drafters (MTP, DSpark), lossless verification, confidence-
scheduled verify lengths, metrics. `setup(llm)` wires it into an engine when
``num_speculative_tokens > 0`` (DEEPINFER_USE_NEXTN_DECODE)."""

from __future__ import annotations

from deepinfer import batch_invariant
from deepinfer.errors import ConfigError
from deepinfer.models.registry import family_of

from .drafter import Draft, DraftContext, Drafter, OracleDrafter, RandomDrafter
from .metrics import SpecMetrics
from .scheduling import StepTimeCurve, plan_verify_lengths, split_budget

__all__ = ["Draft", "DraftContext", "Drafter", "OracleDrafter", "RandomDrafter", "SpecMetrics", "StepTimeCurve",
           "plan_verify_lengths", "split_budget", "setup", "make_drafter", "require_draft_stages"]


def require_draft_stages(model, k: int) -> None:
    """ConfigError unless speculation with k > 0 draft tokens has the checkpoint's MTP /
    next-n stage to draft with. Checked when the model is loaded, before the KV cache is
    sized and anything is queued."""
    if k <= 0 or len(getattr(model, "mtp", [])):
        return
    where = getattr(model, "model_dir", None)
    raise ConfigError(
        f"num_speculative_tokens={k} (DEEPINFER_USE_NEXTN_DECODE) needs an MTP / next-n stage, but the checkpoint"
        f"{f' at {where!r}' if where else ''} has none (no mtp.* tensors; config.json num_nextn_predict_layers "
        f"counts the stages a checkpoint has). transformers' save_pretrained does not write the MTP stage. Set "
        f"num_speculative_tokens=0 / DEEPINFER_USE_NEXTN_DECODE=0 to decode without speculation, or load a "
        f"checkpoint that has its mtp.* stage (e.g. the official release).", field="num_speculative_tokens")


def make_drafter(model, cache, k: int):
    """DSpark when the checkpoint has it, else its MTP stage (V4 only: V4.1's `mtp.*` stages
    are DSpark stages, without the e_proj / h_proj an MTP stage needs)."""
    cfg = model.cfg
    require_draft_stages(model, k)
    family = family_of(cfg)
    if not family.plain_mtp_stages and not cfg.has_dspark:
        raise ValueError(f"num_speculative_tokens > 0 on a {family.display_name} checkpoint needs its DSpark drafter "
                         f"(dspark_block_size > 0); {family.display_name} has no plain MTP stage")
    if cfg.has_dspark:
        from .dspark_drafter import DSparkDrafter
        return DSparkDrafter(model, cache, k)
    from .mtp_drafter import MTPDrafter
    return MTPDrafter(model, cache, k)


def setup(llm) -> None:
    """Enable speculation on an `LLM` built with num_speculative_tokens = k > 0."""
    from .kv import widen_compressor_rings
    from .runner import SpecDecoder

    k = llm.config.num_speculative_tokens
    widen_compressor_rings(llm.kv_cache, k)
    drafter = make_drafter(llm.model, llm.kv_cache, k)
    fast = llm.runner.fast
    drafter.fast_ops = fast.ops if fast is not None else None  # drafters that can, run the fused kernels
    if fast is not None and hasattr(drafter, "prepare_graphs"):  # the draft step's graphs, captured now
        # in the runner's mode, as its own graphs are: the drafter keeps its eager, invariant
        # pass in batch-invariant mode (a captured one would run the mode's reference MoE)
        with batch_invariant.batch_invariant_mode(llm.runner.batch_invariant):
            drafter.prepare_graphs(llm.config.max_num_seqs, fast.graphs_enabled, fast=fast,
                                   max_model_len=llm.config.max_model_len)
    # the confidence scheduler's T(verify tokens) is measured by `measure_step_curve` once the
    # verify graphs are captured (`ModelRunner.warmup`): it times the steps verification runs
    spec = llm.runner.spec = SpecDecoder(drafter, k, varlen=llm.config.enable_mtp_varlen)
    # what a plan made ahead reads (engine/token_buffer.py), allocated before the graphs that record into it
    from deepinfer.engine.token_buffer import DeviceTokenBuffer
    spec.token_storage = DeviceTokenBuffer.allocate(llm.config.max_num_seqs, 1 + k, llm.runner.device)
    verify = spec.verify_executor(llm.runner, llm.config.max_num_seqs)
    if verify is not None and verify.has_greedy_lane:  # the lane's graphs feed themselves; the drafter's tail
        verify.token_storage = spec.token_storage
        verify.tail = drafter.verify_tail(*spec.token_storage)
    llm.scheduler.config.num_lookahead_tokens = drafter.lookahead
    if drafter.plans_ahead and llm.config.async_scheduling:  # rows of a plan made ahead sit up to k lower
        llm.kv_manager.window_slack = k


def measure_step_curve(llm) -> None:
    """Give a confidence-scheduled engine (enable_mtp_varlen) its step-time curve: measured on
    this engine's verify path at start-up, or reloaded from the per-hardware + model cache."""
    spec = llm.runner.spec
    if spec is None or not llm.config.enable_mtp_varlen:
        return
    from .step_curve import curve_for_engine
    spec.curve, spec.curve_source = curve_for_engine(llm)
