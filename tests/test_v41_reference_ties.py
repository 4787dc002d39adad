"""The dense V4.1 reference's near-tie guard (tests/v41_reference.py): a prompt whose
discrete choices (indexer top-k, candidate blocks, router top-k) rest on float32 rounding
must be flagged, or the model tests compare two legitimately different answers."""

from __future__ import annotations

import torch

from deepinfer.models.tiny import tiny_v41_config
from deepinfer.models.v41.layers import Gate41

from v41_reference import _near_tie_rows, _router_scores64

INF = float("inf")


def test_near_tie_at_the_boundary_is_flagged_and_exact_ties_are_not():
    s = torch.tensor([[3.0, 2.0, 1.0, 1.0 - 1e-9, 0.0],   # k-th and next differ by rounding
                      [3.0, 2.0, 1.0, 1.0, 0.0],          # exact tie: broken by id everywhere
                      [3.0, 2.0, 1.0, 0.5, 0.0]], dtype=torch.float64)
    assert _near_tie_rows(s, 3) == [0]


def test_an_always_kept_entry_leaves_the_contest_one_place_earlier():
    # the newest candidate block is forced (+inf): the other two places go to 3.0 and one of
    # the near-equal 2.0s, so row 0 is ambiguous though its 3rd and 4th scores are far apart
    s = torch.tensor([[INF, 3.0, 2.0, 2.0 - 1e-9, 0.0],
                      [INF, 3.0, 2.0, 1.0, 1.0 - 1e-9]], dtype=torch.float64)
    assert _near_tie_rows(s, 3) == [0]


def test_a_router_near_tie_is_flagged(fresh_seed):
    cfg = tiny_v41_config(vocab_size=300)
    gate = Gate41(cfg.hidden_size, 8, 2, cfg, torch.float32)
    g = torch.Generator().manual_seed(fresh_seed)
    with torch.no_grad():
        gate.weight.copy_(0.1 * torch.randn(gate.weight.shape, generator=g))
        gate.bias.zero_()
        gate.weight[1] = gate.weight[0]          # experts 0 and 1 score alike on every token
        # both win a place, one float32 step apart: which takes the second is a coin toss
        gate.bias[0] = 5.0
        gate.bias[1] = torch.nextafter(torch.tensor(5.0), torch.tensor(6.0))
        gate.bias[2] = 10.0
    x = torch.randn(6, cfg.hidden_size, generator=g)
    assert _near_tie_rows(_router_scores64(gate, x), 2) == list(range(6))
    gate.bias.data[1] = 4.0  # expert 0 now clearly second
    assert _near_tie_rows(_router_scores64(gate, x), 2) == []
