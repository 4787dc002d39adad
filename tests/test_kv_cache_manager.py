"""HybridKVCacheManager: block tables, window freeing, prefix hits, atomicity."""

from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer.engine.kv_cache_manager import HybridKVCacheManager, KVCacheGroupSpec
from deepinfer.engine.request import Request

B = 4  # token block size
W = 8  # sliding window


@dataclass
class SP:
    """Stand-in for deepinfer.sampling_params.SamplingParams."""

    max_tokens: int = 16
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    min_tokens: int = 0


def make(num_blocks: int = 32, window_blocks: int | None = None, caching: bool = True) -> HybridKVCacheManager:
    groups = [KVCacheGroupSpec("swa", W), KVCacheGroupSpec("csa", None)]
    nb = {"swa": window_blocks or num_blocks, "csa": num_blocks}
    return HybridKVCacheManager(groups, nb, B, max_num_seqs=4, enable_prefix_caching=caching)


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SP(), 0.0, eos_token_id=None)


def admit(kv: HybridKVCacheManager, r: Request, n: int | None = None) -> int:
    """Prefix lookup + allocate + compute everything (as scheduler+runner would)."""
    blocks, hit = kv.get_computed_blocks(r)
    n = r.num_tokens - hit if n is None else n
    assert kv.allocate_slots(r, n, blocks, hit)
    r.num_computed_tokens = hit + n
    kv.cache_blocks(r)
    return hit


def test_tables_cover_tokens_and_free_returns_everything() -> None:
    kv = make()
    r = req("a", list(range(10)))
    admit(kv, r, 10)
    assert len(r.block_table["csa"]) == 3 and len(r.block_table["swa"]) == 3
    assert r.state_slot == 0
    kv.free(r)
    assert r.state_slot is None and r.block_table == {}
    assert kv.num_free_blocks("csa") == 32 and kv.num_free_blocks("swa") == 32
    assert kv.num_free_slots == 4
    kv.assert_consistent()


def test_window_group_frees_blocks_out_of_window() -> None:
    kv = make()
    r = req("a", list(range(20)))
    admit(kv, r, 20)  # one big chunk: 5 blocks in both groups
    assert kv.num_free_blocks("swa") == 27
    # Next decode step: earliest query at 20 reads 13..20 -> blocks 3,4,5 needed.
    r.all_token_ids.append(99)
    assert kv.allocate_slots(r, 1)
    assert r.block_table["swa"][:3] == [-1, -1, -1]
    assert all(b != -1 for b in r.block_table["swa"][3:])
    assert kv.num_free_blocks("swa") == 32 - 3  # 3 freed, 1 new (block 5)
    assert -1 not in r.block_table["csa"] and kv.num_free_blocks("csa") == 32 - 6
    assert kv.usage()["swa"] == 3 / 32
    kv.free(r)
    assert kv.num_free_blocks("swa") == 32 and kv.num_free_blocks("csa") == 32
    kv.assert_consistent()


def test_prefix_hit_shares_full_blocks() -> None:
    kv = make()
    prefix = list(range(100, 108))  # 2 full blocks
    a = req("a", prefix + [1, 2, 3])
    admit(kv, a)
    b = req("b", prefix + [7, 7, 7, 7, 7])
    blocks, hit = kv.get_computed_blocks(b)
    assert hit == 2 * B
    assert blocks["csa"] == a.block_table["csa"][:2]
    assert kv.allocate_slots(b, b.num_tokens - hit, blocks, hit)
    assert b.block_table["csa"][:2] == a.block_table["csa"][:2]
    assert kv.pools["csa"].ref_cnt[a.block_table["csa"][0]] == 2
    assert b.state_slot != a.state_slot
    kv.free(a)
    kv.free(b)
    kv.assert_consistent()
    assert kv.num_free_blocks("csa") == 32


def test_hit_cap_leaves_one_token_to_compute() -> None:
    kv = make()
    a = req("a", list(range(8)))  # exactly 2 full blocks
    admit(kv, a)
    kv.free(a)  # freed blocks stay hittable
    b = req("b", list(range(8)))
    _, hit = kv.get_computed_blocks(b)
    assert hit == B  # not 8: the last token must be computed for its logits
    c = req("c", list(range(9)))
    _, hit = kv.get_computed_blocks(c)
    assert hit == 2 * B


def test_window_hit_uses_placeholders_for_old_blocks() -> None:
    kv = make()
    toks = list(range(24))
    a = req("a", toks)
    admit(kv, a)
    b = req("b", toks + [5])
    blocks, hit = kv.get_computed_blocks(b)
    assert hit == 24
    # A query at 24 reads 17..24: window blocks 4 and 5 only.
    assert blocks["swa"][:4] == [-1] * 4 and -1 not in blocks["swa"][4:]
    assert len(blocks["csa"]) == 6 and -1 not in blocks["csa"]


def test_window_hit_falls_back_when_window_blocks_are_evicted() -> None:
    kv = make(num_blocks=32, window_blocks=8)
    toks = list(range(24))
    a = req("a", toks)
    admit(kv, a)  # 6 swa blocks, all cached
    kv.free(a)  # tail first: swa free queue = [6, 7, then a's blocks 5, 4, 3, 2, 1, 0]
    kv.pools["swa"].allocate(4)  # evicts a's window blocks 5 and 4
    b = req("b", toks + [5])
    blocks, hit = kv.get_computed_blocks(b)
    # csa still has all 6 blocks, but a query at 24 or 20 needs swa block 4 or 5:
    # the longest usable hit is 16 (needs swa blocks 2, 3).
    assert hit == 16
    assert blocks["swa"][:2] == [-1, -1]
    assert -1 not in blocks["swa"][2:] and len(blocks["swa"]) == 4
    # swa: 4 free of which 2 are the revived hit blocks -> room for 2 new blocks.
    assert not kv.allocate_slots(b, b.num_tokens - hit, blocks, hit)
    assert kv.allocate_slots(b, 8, blocks, hit)
    assert kv.num_free_blocks("swa") == 0
    kv.free(b)
    kv.assert_consistent()


def test_hit_alignment_rounds_hits_to_compression_boundary() -> None:
    groups = [KVCacheGroupSpec("swa", W), KVCacheGroupSpec("hca", None)]
    kv = HybridKVCacheManager(groups, {"swa": 32, "hca": 32}, B, 4, True, hit_alignment=8)
    a = req("a", list(range(14)))
    admit(kv, a)  # 3 full blocks cached
    _, hit = kv.get_computed_blocks(req("b", list(range(14)) + [1]))
    assert hit == 8  # 12 is not a multiple of 8


def test_prefix_caching_off_gives_no_hits() -> None:
    kv = make(caching=False)
    a = req("a", list(range(12)))
    admit(kv, a)
    b = req("b", list(range(13)))
    blocks, hit = kv.get_computed_blocks(b)
    assert hit == 0 and blocks == {"swa": [], "csa": []}


def test_allocation_is_all_or_nothing() -> None:
    kv = make(num_blocks=8, window_blocks=2)
    r = req("a", list(range(12)))
    assert not kv.allocate_slots(r, 12)  # swa needs 3 blocks, has 2
    assert r.block_table == {} and r.state_slot is None
    assert kv.num_free_blocks("csa") == 8 and kv.num_free_slots == 4
    assert kv.allocate_slots(r, 8)
    r.num_computed_tokens = 8
    # Query at 8 reads 1..8: swa blocks 0, 1 stay, block 2 does not fit.
    before = {g: list(t) for g, t in r.block_table.items()}
    assert not kv.allocate_slots(r, 4)
    assert r.block_table == before and kv.num_free_blocks("csa") == 6
    # Once block 0 is out of the window (query at 11 reads 4..11) it is reused.
    r.num_computed_tokens = 11
    assert kv.allocate_slots(r, 1)
    assert r.block_table["swa"][0] == -1 and r.block_table["swa"][2] == before["swa"][0]
    kv.free(r)
    kv.assert_consistent()
    assert kv.num_free_blocks("swa") == 2 and kv.num_free_blocks("csa") == 8


def test_state_slots_run_out() -> None:
    kv = make()
    rs = [req(str(i), [1, 2]) for i in range(5)]
    for r in rs[:4]:
        assert kv.allocate_slots(r, 2)
    assert not kv.allocate_slots(rs[4], 2)
    assert rs[4].block_table == {}
    slot0 = rs[0].state_slot
    kv.free(rs[0])
    assert kv.allocate_slots(rs[4], 2) and rs[4].state_slot == slot0
    assert sorted(r.state_slot for r in rs[1:]) == [0, 1, 2, 3]


def test_max_blocks_needed() -> None:
    kv = make()
    need = kv.max_blocks_needed(100, max_chunk=4)
    assert need["csa"] == 25
    assert need["swa"] == -(-(W - 1 + 4) // B) + 1


def test_decode_fast_path_matches_full_allocation() -> None:
    """A decode step inside its blocks returns early (the common case at large batches);
    tables, frees and pool state stay identical to the full allocation path, through
    prefix hits, window frees at block edges, multi-token (speculative) steps and a
    preemption with readmission."""
    fast, full = make(), make()
    full._covered = lambda *a: False  # the reference: every call takes the full path
    for kv in (fast, full):
        seed = req("s", list(range(100, 113)))
        admit(kv, seed)
        kv.free(seed)
    plan = [1] * 7 + [3, 1, 2] + [1] * 9
    reqs = {id(kv): req("a", list(range(100, 111))) for kv in (fast, full)}
    for kv in (fast, full):
        r = reqs[id(kv)]
        assert admit(kv, r) > 0  # a prefix hit (tables start with a hit, window entries -1)
    hits = []
    covered = fast._covered
    fast._covered = lambda *a: hits.append(covered(*a)) or hits[-1]
    for step, n in enumerate(plan):
        for kv in (fast, full):
            r = reqs[id(kv)]
            if step == 12:  # preempt and readmit
                kv.free(r)
                r.num_computed_tokens = 0
                admit(kv, r)
            for _ in range(n):
                r.append_output_token(7)
            assert kv.allocate_slots(r, n)
            r.num_computed_tokens += n
            kv.cache_blocks(r)
        a, b = reqs[id(fast)], reqs[id(full)]
        assert a.block_table == b.block_table, step
        assert fast.num_free_blocks("swa") == full.num_free_blocks("swa")
        assert fast.num_free_blocks("csa") == full.num_free_blocks("csa")
        fast.assert_consistent()
    assert any(hits) and not all(hits)  # both paths ran
