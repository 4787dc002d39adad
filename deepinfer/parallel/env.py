"""``DEEPINFER_*`` variables of the parallel engine, declared to the config module so
``EngineConfig`` accepts them (it rejects unknown ``DEEPINFER_*`` names to catch typos).

REFERENCE.md names DeepInfer's EPLB knobs (redundant slots, rebalance interval, window)
but not their variable names; these are ours, in DeepInfer's ``DEEPINFER_`` namespace.
"""

from __future__ import annotations

from deepinfer.config import register_env_var

#: name -> description; read by :class:`deepinfer.parallel.eplb.EPLBConfig` and the launcher.
PARALLEL_ENV_VARS: dict[str, str] = {
    "DEEPINFER_EPLB_NUM_REDUNDANT_EXPERTS": "int >= 0: redundant expert slots per MoE layer (padded so "
                                            "routed + redundant divides by the EP size; default 0)",
    "DEEPINFER_EPLB_REBALANCE_INTERVAL": "int >= 0: engine steps between automatic rebalances (0 = only on "
                                         "request; default 0)",
    "DEEPINFER_EPLB_WINDOW_SIZE": "int >= 1: steps of expert load the policy sees (default 100)",
    "DEEPINFER_EPLB_POLICY": "auto|global|hierarchical: EPLB policy (auto = hierarchical when groups and "
                             "nodes are set)",
    "DEEPINFER_EPLB_NUM_GROUPS": "int >= 1: expert groups for the hierarchical policy",
    "DEEPINFER_EPLB_NUM_NODES": "int >= 1: nodes for the hierarchical policy (default 1)",
    "DEEPINFER_DIST_TIMEOUT_S": "seconds a collective may wait for a peer before failing (default 120)",
}

for _name, _description in PARALLEL_ENV_VARS.items():
    register_env_var(_name, _description)
