"""PinnedRing (reused staging blocks for host <-> device copies) on the host: a block is
handed out again only after the event of the copy that last used it, and grows when a
larger copy needs it; copy_to_device off CUDA is a plain copy."""

from __future__ import annotations

import numpy as np
import torch

from deepinfer.engine.transfer import PinnedRing, copy_to_device


class FakeEvent:
    """Stands in for torch.cuda.Event: records whether the ring waited on it."""

    def __init__(self) -> None:
        self.waited = False

    def synchronize(self) -> None:
        self.waited = True


def test_ring_waits_for_the_previous_copy_before_reuse() -> None:
    ring = PinnedRing(slots=2, pin=False)
    events = []
    blocks = []
    for n in (10, 20, 30, 5000):
        slot, block = ring.stage(n)
        assert block.numel() >= n and block.dtype == torch.uint8
        blocks.append((slot, block))
        events.append(FakeEvent())
        ring.copied(slot, events[-1])
    assert [s for s, _ in blocks] == [0, 1, 0, 1]
    assert events[0].waited and events[1].waited  # slots 0 / 1 reused: their copies were waited on
    assert not events[2].waited and not events[3].waited
    assert blocks[2][1].data_ptr() == blocks[0][1].data_ptr()  # 30 bytes fit the first block
    assert blocks[3][1].numel() >= 5000 and blocks[3][1].data_ptr() != blocks[1][1].data_ptr()  # grown


def test_copy_to_device_on_the_host() -> None:
    dst = torch.zeros(2, 3, dtype=torch.int32)
    arr = np.arange(6, dtype=np.int32) * 7 - 5
    copy_to_device(dst, arr)
    assert dst.flatten().tolist() == arr.tolist()


def test_host_to_device_copies_per_step(monkeypatch) -> None:
    """An async step stages its host data in three copies on the reference path: the batch
    (ids, positions, the placeholder rows / slots to gather), the rows whose logits are
    sampled, and the sampling tensors (with the state slots the token buffer scatters to).
    Each is a pinned allocation + a launch on a GPU (was 13 per step: one per field). The
    fast path skips the rows copy and adds its step inputs."""
    from deepinfer import LLM, SamplingParams
    from deepinfer.engine import model_runner, sampler, token_buffer, transfer

    llm = LLM(max_num_seqs=4)
    assert llm.runner.token_buffer is not None, "async scheduling is the default"
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 6, 7], [8, 9]]
    llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
    calls = []

    def counting(values, dtype, device):
        calls.append(len(values))
        return transfer.to_device(values, dtype, device)

    for mod in (model_runner, sampler, token_buffer):
        monkeypatch.setattr(mod, "to_device", counting)
    llm.metrics.reset()
    llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
    steps = llm.metrics.steps_df()
    decode_steps = int((steps["prefill_tokens"] == 0).sum())
    assert decode_steps >= 10
    assert len(calls) <= 3 * len(steps), (len(calls), len(steps))


def test_reserved_ring_allocates_nothing_while_serving() -> None:
    """After `reserve` (the engine's warm-up) every slot is ready: steps up to that size take
    blocks without allocating (the rings used to allocate pinned memory in each of the first
    steps served); a larger copy still grows its slot, after waiting for it."""
    ring = PinnedRing(slots=4, pin=False)
    ring.reserve(8192)
    before = PinnedRing.allocations
    taken = {id(ring.stage(n)[1]) for n in (100, 8192, 4096, 1, 7000, 2)}
    assert PinnedRing.allocations == before and len(taken) == 4  # the 4 reserved blocks, reused
    event = FakeEvent()
    ring.copied(2, event)  # the next slot handed out is 2
    slot, block = ring.stage(9000)
    assert slot == 2 and block.numel() >= 9000 and event.waited and PinnedRing.allocations == before + 1
    ring.reserve(4096)  # already large enough: nothing allocated
    assert PinnedRing.allocations == before + 1
