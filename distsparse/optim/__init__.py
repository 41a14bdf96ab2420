"""Backbone optimization: Newton-Schulz kernels, per-matrix update rules (TANS, Muon, Adam, AdamS) and the
state moves of topology refreshes. The sharded matrix engine that owns and calls them lives in engine.py."""

from distsparse.optim.hparams import RMS_MODES, AdamHParams, AdamSHParams, MuonHParams, TansHParams
from distsparse.optim.matrix_state import RESET_MODES, init_shadow, move_state, update_shadow
from distsparse.optim.newton_schulz import COEFFICIENT_SETS, coefficient_table, newton_schulz, ns_flops
from distsparse.optim.rules import RULES, Rule, get_rule, init_state
from distsparse.optim.rules_adam import step_adam, step_adams, step_adamw
from distsparse.optim.rules_muon import step_muon
from distsparse.optim.rules_tans import ramp_gamma, step_tans

__all__ = [
    "COEFFICIENT_SETS", "RESET_MODES", "RMS_MODES", "RULES", "AdamHParams", "AdamSHParams", "MuonHParams", "Rule",
    "TansHParams", "coefficient_table", "get_rule", "init_shadow", "init_state", "move_state", "newton_schulz",
    "ns_flops", "ramp_gamma", "step_adam", "step_adams", "step_adamw", "step_muon", "step_tans", "update_shadow",
]
