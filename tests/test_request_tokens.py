"""Token ids held as int64 arrays from admission to the KV cache's block hashes.

Why it matters: a live list is walked element by element by every full garbage
collection, so a batch of long prompts held as lists stalled the step loop while serving.
"""

from __future__ import annotations

import gc
import hashlib
from array import array

import numpy as np
import pytest
import torch

from deepinfer.detokenizer import INITIAL_CONTEXT_TOKENS, IncrementalDetokenizer
from deepinfer.engine.admission import token_id_lists
from deepinfer.engine.request import Request
from tests.test_kv_cache_manager import SP, admit, make

IDS = [7, 0, 129279, 42, 5]


def walked(x: object) -> int:
    """How many token ids a collection visits through ``x`` (a list: every element)."""
    return sum(isinstance(o, int) for o in gc.get_referents(x))


@pytest.mark.parametrize("given", [IDS, tuple(IDS), np.array(IDS, dtype=np.int32), np.array(IDS, dtype=np.uint64),
                                   torch.tensor(IDS), [np.int64(t) for t in IDS]])
def test_every_accepted_container_becomes_the_same_untracked_ids(given) -> None:
    (ids,) = token_id_lists(given, vocab=129280)
    assert ids.tolist() == IDS and isinstance(ids, array) and ids.typecode == "q"
    assert walked(ids) == 0


def test_request_token_storage_is_never_walked_by_the_collector() -> None:
    assert walked(list(IDS)) == len(IDS)  # what the old lists cost
    rng = np.random.default_rng()
    prompt = rng.integers(0, 1000, 3000).tolist()
    r = Request("a", prompt, SP(), 0.0)
    r.append_output_token(int(rng.integers(0, 1000)))
    assert r.all_token_ids.tolist() == prompt + r.output_token_ids and r.prompt_token_ids.tolist() == prompt
    assert walked(r.all_token_ids) == walked(r.prompt_token_ids) == 0
    assert r.num_prompt_tokens == 3000 and r.num_tokens == 3001


def test_block_hashes_are_sha256_of_int64_ids_chained() -> None:
    """Same bytes as before the change: hashes stay stable across processes and versions."""
    kv = make()
    tokens = np.random.default_rng().integers(0, 2**40, 9).tolist()  # ids past int32 too
    r = Request("a", tokens, SP(), 0.0)
    admit(kv, r)
    want, prev = [], b""
    for i in range(2):  # block size 4: two full blocks of 9 tokens
        prev = hashlib.sha256(prev + b"".join(t.to_bytes(8, "little", signed=True) for t in tokens[4 * i:4 * i + 4])
                              ).digest()
        want.append(prev)
    assert r.block_hashes == want


def test_detokenizer_context_comes_from_the_prompt_tail() -> None:
    """A long prompt (as the int64 array a request holds): only its last ids are ever decoded,
    as context, and the output text is the output's alone."""
    decoded: list[list[int]] = []

    class Chars:  # id i decodes to chr(97 + i % 26); records every decode's ids
        def decode(self, ids, skip_special_tokens=True):
            decoded.append(list(ids))
            return "".join(chr(97 + i % 26) for i in ids)

    long_prompt = array("q", np.random.default_rng().integers(0, 26, 50_000).tolist())
    d = IncrementalDetokenizer(Chars(), long_prompt)
    assert d.update([0, 1, 2]) == "abc" and d.text == "abc"
    tail = long_prompt[-INITIAL_CONTEXT_TOKENS:].tolist()
    assert decoded[0] == tail and all(ids[:len(tail)] == tail for ids in decoded[1:] if len(ids) > len(tail))
    assert max(map(len, decoded)) <= INITIAL_CONTEXT_TOKENS + 3
