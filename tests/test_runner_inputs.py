"""The runner's per-step device inputs: ids, positions and the async placeholder index at
16-byte-aligned offsets whatever the token count (Triton compiles a kernel again for a
pointer of other alignment, and the start-up warm-up only ever sees aligned ones), and
the right positions in every step."""

from __future__ import annotations

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.models.tiny import tiny_config, write_tiny_checkpoint

VOCAB = 512


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_inputs")
    write_tiny_checkpoint(str(path), seed=5, cfg=tiny_config(vocab_size=VOCAB, sliding_window=32))
    return str(path)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_positions_are_aligned_for_odd_token_counts(ckpt, async_scheduling) -> None:
    llm = LLM(ckpt, dtype="float32", max_model_len=256, max_num_seqs=8, async_scheduling=async_scheduling)
    seen = []
    build = llm.runner.build_batch

    def recording(so, *a, **kw):
        batch = build(so, *a, **kw)
        if batch.positions is not None:
            want = [p for r in so.scheduled for p in range(r.start_pos, r.start_pos + r.num_tokens)]
            seen.append((batch.input_ids.shape[0], batch.positions.data_ptr() % 16, batch.positions.tolist() == want))
        return batch

    llm.runner.build_batch = recording
    prompts = [[(7 * i + j) % VOCAB for j in range(n)] for i, n in enumerate((3, 6, 10))]  # 19 tokens: odd
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=5, temperature=0,
                                                                                  ignore_eos=True), use_tqdm=False)
    assert all(len(o.token_ids) == 5 for o in outs)
    assert any(n % 2 for n, _, _ in seen), "no odd-sized step ran"
    assert all(align == 0 and right for _, align, right in seen), seen


def test_aligned_starts_pack_parts_at_even_offsets() -> None:
    from deepinfer.engine.transfer import aligned_starts

    starts, total = aligned_starts([3, 0, 5, 2])
    assert starts == [0, 4, 4, 10] and total == 12
    assert aligned_starts([]) == ([], 0)
