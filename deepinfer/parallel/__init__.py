"""Parallel serving: data-parallel attention ranks, expert parallelism and EPLB.

- :mod:`.eplb_policy`: the pure balancing policy (replicate hot experts, pack replicas);
  :mod:`.eplb_packing` holds its packing step.
- :mod:`.placement`: logical -> physical expert maps, validation, manual placement.
- :mod:`.comm`: the collectives behind one interface (all-to-all, p2p, timeouts).
- :mod:`.expert_parallel`: the expert-parallel MoE layer and in-place weight moves.
- :mod:`.eplb`: EPLB configuration (env vars), on-device load ring buffer, rebalancing.
- :mod:`.rank_engine`: one DP/EP rank (its own scheduler, lockstep steps).
- :mod:`.dp_engine`: ``LLM(data_parallel_size=N, expert_parallel_size=N)``, the driver.
- :mod:`.launcher`: process-group set-up for spawned workers and ``torchrun``.
- :mod:`.skew`: checkpoints with forced hot experts; :mod:`.placement_panel`: the
  workbench panel of ``notebooks/05_expert_placement.ipynb``.
"""

from __future__ import annotations
