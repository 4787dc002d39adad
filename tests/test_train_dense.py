"""The training forward is the engine's forward: dense logits (model, MTP stage, DSpark
drafting pass) equal the paged reference path's on random tiny configs, and gradients
reach every trainable parameter."""

from __future__ import annotations

import pytest
import torch

from deepinfer.models.fast.decode import kernel_ops
from deepinfer.models.paged_batch import ForwardBatch, SeqMeta, scatter_rows
from deepinfer.models.standalone import StandaloneRunner
from deepinfer.models.tiny import init_random, tiny_config, tiny_dspark_config
from deepinfer.models.v4.kv_cache import GROUP_SWA
from deepinfer.models.v4.model import DeepseekV4Model
from deepinfer.spec.dspark_drafter import DSparkDrafter
from deepinfer.spec.mtp_drafter import MTPDrafter
from deepinfer.train.dense_dspark import draft_forward, make_blocks, target_features
from deepinfer.train.dense_model import head_logits, model_forward, mtp_forward

# window 8, CSA ratio 4 with top-3 indexer selection, HCA ratio 8: every branch is hit
# within a few dozen tokens, and the indexer really drops entries.
SMALL = dict(vocab_size=300, sliding_window=8, hca_ratio=8, compress_ratios=[8, 4, 0, 4], index_topk=3,
             num_hash_layers=1)


def _model(seed: int, dspark: bool = False) -> DeepseekV4Model:
    cfg = (tiny_dspark_config if dspark else tiny_config)(**SMALL)
    model = DeepseekV4Model(cfg, torch.float32)
    init_random(model, seed)
    return model


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().norm() / b.detach().norm())


@pytest.mark.parametrize("seed,length", [(1, 45), (2, 17), (3, 64)])
def test_dense_logits_equal_engine_prefill_and_chunks(seed: int, length: int) -> None:
    torch.manual_seed(seed)
    model = _model(seed)
    tokens = torch.randint(0, 300, (2, length))
    dense = head_logits(model, model_forward(model, tokens).streams).view(2, length, -1)
    for b in range(2):
        ref = StandaloneRunner(model, max_seqs=1, max_len=64, block_size=16).step([(0, tokens[b].tolist())])[0]
        assert _rel(dense[b], ref) < 1e-5
        runner = StandaloneRunner(model, max_seqs=1, max_len=64, block_size=16)  # chunked prefill + decode
        cut = length // 3
        parts = [runner.step([(0, tokens[b, :cut].tolist())])[0]]
        parts += [runner.step([(0, [t])])[0] for t in tokens[b, cut:].tolist()]
        assert _rel(dense[b], torch.cat(parts)) < 1e-5


def test_dense_mtp_equals_engine_mtp_stage() -> None:
    torch.manual_seed(4)
    model, length = _model(4), 40
    tokens = torch.randint(0, 300, (1, length))
    out = model_forward(model, tokens)
    dense = mtp_forward(model, out.streams, tokens)[0]
    runner = StandaloneRunner(model, max_seqs=1, max_len=64, block_size=16)
    table = runner._table(0)
    streams = model(ForwardBatch(tokens[0], torch.arange(length), [SeqMeta(0, length, 0, table, 0, True)]),
                    runner.cache)
    batch = ForwardBatch(tokens[0, 1:], torch.arange(length - 1), [SeqMeta(0, length - 1, 0, table, 0, False)])
    ref_streams, ref = model.mtp_forward(0, streams[:-1], batch, runner.cache)
    assert _rel(dense, ref) < 1e-5
    # the engine's MTP drafter on the fast path's fused mHC / MoE ops (their torch references)
    drafter = MTPDrafter(model, runner.cache, 2)
    drafter.fast_ops = kernel_ops("ref")
    fast_streams, fast = drafter._stage(streams[:-1], batch)
    assert _rel(fast, ref) < 1e-5 and _rel(fast_streams, ref_streams) < 1e-5


def test_dense_draft_pass_equals_dspark_drafter() -> None:
    torch.manual_seed(5)
    model, length = _model(5, dspark=True), 30
    cfg = model.cfg
    tokens = torch.randint(0, 290, (1, length))
    layers = list(cfg.dspark_target_layer_ids)
    out = model_forward(model, tokens, capture=tuple(layers))
    main_x = target_features(model.mtp[0], out.layer_inputs, layers, (1, length))
    anchors = torch.tensor([[0, 6, 13, 27]])  # before, across and past the 8-token window
    blocks = make_blocks(tokens, anchors, cfg.dspark_block_size, cfg.dspark_noise_token_id)
    logits, hidden = draft_forward(model, model.mtp, main_x, blocks)
    runner = StandaloneRunner(model, max_seqs=1, max_len=64, block_size=16)
    table = runner._table(0)
    capture = {i: None for i in layers}
    model(ForwardBatch(tokens[0], torch.arange(length), [SeqMeta(0, length, 0, table, 0, True)]), runner.cache,
          capture=capture)
    drafter = DSparkDrafter(model, runner.cache, 3)
    feats = drafter.features(capture, torch.arange(length))
    for s, stage in enumerate(drafter.stages):
        kv = stage.context_kv(feats, torch.arange(length), model.rotary_main)
        scatter_rows(runner.cache.swa[drafter._cache_id(s)], table[GROUP_SWA], 0, kv)
    for a, p in enumerate(anchors[0].tolist()):
        ref_logits, ref_hidden = drafter.draft_logits([int(tokens[0, p + 1])], [p], [table[GROUP_SWA]])
        assert _rel(logits[0, a], ref_logits[0]) < 1e-5
        assert _rel(hidden[0, a], ref_hidden[0]) < 1e-5
    # all four blocks in one batched pass (context windows of different lengths, padded), on the
    # reference modules and on the fast path's fused ops (their torch references here)
    ps = anchors[0].tolist()
    for ops in (None, kernel_ops("ref")):
        drafter.fast_ops = ops
        assert drafter._fast() == (ops is not None)
        all_logits, all_hidden = drafter.draft_logits([int(tokens[0, p + 1]) for p in ps], ps, [table[GROUP_SWA]] * 4)
        for a in range(len(ps)):
            assert _rel(logits[0, a], all_logits[a]) < 1e-5
            assert _rel(hidden[0, a], all_hidden[a]) < 1e-5


def test_gradients_reach_every_trained_parameter() -> None:
    torch.manual_seed(6)
    model = _model(6)
    tokens = torch.randint(0, 300, (2, 40))
    blocks = [(f"layers.{i}", b) for i, b in enumerate(model.layers)] + [(f"mtp.{i}", b) for i, b in enumerate(model.mtp)]
    for _, block in blocks:
        block.ffn.load_counter = torch.zeros(model.cfg.n_routed_experts, dtype=torch.long)
    out = model_forward(model, tokens, with_indexer_loss=True)
    loss = head_logits(model, out.streams).logsumexp(-1).mean() + mtp_forward(model, out.streams, tokens).mean()
    loss = loss + torch.stack(out.indexer_kl).sum()
    loss.backward()
    frozen = {n for n, _ in model.named_parameters() if n.endswith("gate.bias")}  # balanced by bias updates
    for prefix, block in blocks:  # an expert no token was routed to has no gradient
        frozen |= {n for n, _ in model.named_parameters()
                   for e in (block.ffn.load_counter == 0).nonzero().flatten().tolist()
                   if n.startswith(f"{prefix}.ffn.experts.{e}.")}
        block.ffn.load_counter = None
    assert len(frozen) < 30  # most experts were used
    missing = [n for n, p in model.named_parameters()
               if n not in frozen and (p.grad is None or not p.grad.abs().sum() > 0)]
    assert not missing, missing
    # the indexer learns only from its KL loss: the main loss alone leaves it untouched
    model.zero_grad()
    head_logits(model, model_forward(model, tokens).streams).logsumexp(-1).mean().backward()
    assert model.layers[1].attn.indexer.wq_b.weight.grad is None
