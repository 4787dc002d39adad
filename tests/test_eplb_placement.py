"""Placement data structures, weight-transfer plans, the load ring buffer and EPLB settings."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deepinfer.errors import ConfigError
from deepinfer.parallel.eplb import EPLBConfig, LoadRecorder
from deepinfer.parallel.expert_parallel import transfer_plan
from deepinfer.parallel.placement import ExpertPlacement, PlacementError, imbalance, padded_num_slots, rank_loads


def test_default_placement_is_contiguous_and_padded() -> None:
    p = ExpertPlacement.default(num_layers=3, num_logical=8, num_ranks=2)
    assert p.rank_experts(0, 0) == [0, 1, 2, 3] and p.rank_experts(2, 1) == [4, 5, 6, 7]
    assert padded_num_slots(8, 3, 4) == 12
    q = ExpertPlacement.default(3, 8, 4, num_redundant=3)
    assert (q.num_slots, q.slots_per_rank, q.num_redundant) == (12, 3, 4)
    counts = q.replica_counts()
    assert counts.shape == (3, 8) and counts.sum(dim=1).tolist() == [12, 12, 12] and counts.min() >= 1
    for r in range(4):  # redundant copies never share a rank with their original
        assert len(set(q.rank_experts(0, r))) == 3


def test_log2phy_and_table() -> None:
    p = ExpertPlacement.from_rank_lists([[0, 1, 2], [3, 0, 1]], num_logical=4, num_layers=2)
    table = p.log2phy()
    assert table[0, 0].tolist() == [0, 4] and table[0, 2].tolist() == [2, -1]
    rows = p.table(layer=1)
    assert rows[4] == {"layer": 1, "rank": 1, "slot": 4, "local_slot": 1, "expert": 0, "replicas": 2}
    assert "rank 1: 3 0* 1*" in p.describe(0)
    assert ExpertPlacement.from_dict(p.to_dict()).phy2log.equal(p.phy2log)


@pytest.mark.parametrize("layers, match", [
    ([[[0, 1], [2, 9]]], "holds expert 9; allowed: 0..3"),
    ([[[0, 1], [2, 2]]], r"experts \[3\] have no physical slot"),
    ([[[0, 1, 2], [3]]], "every rank must hold the same number"),
])
def test_bad_manual_placements_name_the_problem(layers, match) -> None:
    with pytest.raises(PlacementError, match=match):
        ExpertPlacement.from_rank_lists(layers, num_logical=4)


def test_with_layer_and_uneven_slots() -> None:
    p = ExpertPlacement.default(2, 4, 2)
    q = p.with_layer(1, [[3, 2], [1, 0]])
    assert q.rank_experts(1, 0) == [3, 2] and q.rank_experts(0, 0) == [0, 1]
    with pytest.raises(PlacementError, match="needs 2 ranks x 2 experts"):
        p.with_layer(0, [[0, 1, 2], [3]])
    with pytest.raises(PlacementError, match="do not split evenly"):
        ExpertPlacement(torch.tensor([[0, 1, 2]]), num_ranks=2, num_logical=3)


def test_aligned_to_keeps_experts_in_place() -> None:
    old = ExpertPlacement.from_rank_lists([[0, 1, 2], [3, 4, 5]], num_logical=6, num_layers=1)
    new = ExpertPlacement.from_rank_lists([[5, 3, 0], [2, 1, 4]], num_logical=6, num_layers=1)
    aligned = new.aligned_to(old)
    # new rank 1 {2, 1, 4} shares two experts with old rank 0: the ranks swap labels, and
    # staying experts keep their slots
    assert aligned.rank_experts(0, 0) == [4, 1, 2] and aligned.rank_experts(0, 1) == [3, 0, 5]
    moved = transfer_plan(old.phy2log[0].tolist(), aligned.phy2log[0].tolist(), 2).num_moved
    assert moved <= transfer_plan(old.phy2log[0].tolist(), new.phy2log[0].tolist(), 2).num_moved
    assert moved == 2  # 4 goes to rank 0, 0 goes to rank 1


def test_transfer_plan() -> None:
    old = [0, 1, 2, 3]          # rank 0: 0 1 | rank 1: 2 3
    new = [2, 0, 1, 3, 2, 0]    # rank 0: 2 0 1 | rank 1: 3 2 0  (more slots per rank)
    plan = transfer_plan(old, new, 2)
    assert plan.local[0] == [(0, 1), (1, 2)] and plan.local[1] == [(1, 0), (0, 1)]
    assert plan.moves == {(1, 0): [(0, [0])], (0, 1): [(0, [2])]}


def test_rank_loads_and_imbalance() -> None:
    p = ExpertPlacement.from_rank_lists([[0, 1], [0, 2]], num_logical=3, num_layers=1)
    load = np.array([[[10.0, 2.0, 4.0]], [[0.0, 6.0, 0.0]]])  # [W=2, L=1, E=3]
    rl = rank_loads(load, p)
    assert rl.tolist() == [[[7.0, 9.0]], [[6.0, 0.0]]]
    assert imbalance(rl)[0] == pytest.approx((9 + 6) / (8 + 3))


def test_load_recorder_ring() -> None:
    rec = LoadRecorder(num_layers=2, num_slots=3, window=2, device="cpu")
    for step in range(3):
        rec.begin_step()
        rec.add(0, torch.tensor([step, 1, 0]))
        rec.add(1, torch.tensor([0, 0, step]))
        rec.end_step()
    w = rec.window()
    assert w.shape == (2, 2, 3) and w[:, 0, 0].tolist() == [1, 2]  # oldest first, step 0 dropped
    rec.reset()
    assert rec.window().shape[0] == 0


def test_eplb_config_env_and_errors() -> None:
    env = {"DEEPINFER_EPLB_NUM_REDUNDANT_EXPERTS": "4", "DEEPINFER_EPLB_REBALANCE_INTERVAL": "50",
           "DEEPINFER_EPLB_WINDOW_SIZE": "20", "DEEPINFER_EPLB_POLICY": "Hierarchical",
           "DEEPINFER_EPLB_NUM_GROUPS": "4", "DEEPINFER_EPLB_NUM_NODES": "2"}
    cfg = EPLBConfig.from_env(env, window_size=30)
    assert (cfg.num_redundant_experts, cfg.rebalance_interval, cfg.window_size, cfg.policy) == (4, 50, 30,
                                                                                                 "hierarchical")
    with pytest.raises(ConfigError, match="DEEPINFER_EPLB_WINDOW_SIZE"):
        EPLBConfig.from_env({"DEEPINFER_EPLB_WINDOW_SIZE": "-3"})
    assert (cfg.num_groups, cfg.num_nodes) == (4, 2)
    with pytest.raises(ConfigError, match="num_groups must be set"):
        EPLBConfig.from_env({}, policy="hierarchical")
    with pytest.raises(ConfigError, match="policy must be one of"):
        EPLBConfig.from_env({}, policy="best")
    from deepinfer.config import KNOWN_ENV_VARS, EngineConfig
    assert "DEEPINFER_EPLB_REBALANCE_INTERVAL" in KNOWN_ENV_VARS
    EngineConfig.from_kwargs(environ=env, accelerator="cpu")  # registered: not rejected as a typo
