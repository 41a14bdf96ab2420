"""The matrix engine's batched step (one group kernel per group of same-shape matrices) against the per-matrix rules
(rules_*.py through rules.step_each, the reference), on every rule, with refreshes in between in each reset mode,
per-matrix counters that differ inside a group, clipping, on 1 rank and on 2 gloo ranks; and torch.compile."""

import dataclasses
import shutil

import pytest
import torch

from distsparse.config import load_config
from distsparse.layers import NMSparseLinear
from distsparse.models import backbone_param, build_model, projection_names
from distsparse.nm import NMMeta, NMSpec, encode, kept_index, move_slots, random_mask, slot_map
from distsparse.optim.engine import MatrixEngine
from distsparse.optim.matrix_state import init_shadow, move_state, update_shadow
from distsparse.optim.rules import get_rule, step_each
from distsparse.topology import RefreshResult

# method preset, hyperparameter overrides: every rule, sparse (row and block) and dense frames, the TANS switches.
CASES = {
    "tans_row": ("chtsnm_nobranch_1of4_row", {}),
    "tans_block_bias_correction_decay": ("chtsnm_nobranch_2of4_block", {"bias_correction": True, "weight_decay": 0.1}),
    "tans_pre_mask_global_no_ramp": ("chtsnm_nobranch_1of4_row", {"rms_mode": "pre_mask_global", "ramp_steps": 0}),
    "tans_rms_none": ("chtsnm_nobranch_1of4_row", {"rms_mode": "none"}),
    "tans_biascorr_preset": ("chtsnm_nobranch_biascorr_1of4_row", {}),   # the preset's rule_args reach the kernel
    "tans_geometry_only": ("chtsnm_nobranch_1of4_row", {"geometry_only": True, "bias_correction": True}),
    "tans_dense": ("dense_tans", {}),
    "muon_sparse_decay": ("chts_muon_1of4_row", {"weight_decay": 0.1}),
    "muon_dense_plain": ("dense_muon", {"nesterov": False}),
    "adam_l2": ("chts24_2of4_row", {"weight_decay": 0.01}),
    "adamw_dense": ("dense_adamw", {"weight_decay": 0.1}),
    "adams_cast": ("cast_1of4_row", {}),
}
MAX_REL_ERR = 1e-5   # float32 round-off (batched and single GEMMs may sum in another order)


def tiny_backbone(method: str, layers: int = 2):
    cfg = load_config(None, ["model.preset=tiny", f"method.preset={method}", f"model.num_hidden_layers={layers}"])
    model = build_model(cfg.model, cfg.method, 97, seed=3)
    return cfg, {n: model.get_submodule(n) for n in projection_names(model)}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def start_states(backbone, rule: str, seed: int) -> dict[str, dict[str, torch.Tensor]]:
    """A saved state with random slot tensors and counters that differ between the matrices of a group (TANS: tau
    0..5, so gamma ramps differently per matrix; steps 5..7, so bias corrections differ)."""
    spec, gen, out = get_rule(rule), torch.Generator().manual_seed(seed), {}
    for i, name in enumerate(sorted(backbone)):
        param = backbone_param(backbone[name])
        entry = {"master": param.detach().float().clone()}
        for key in spec.slot_keys:
            t = torch.rand(param.shape, generator=gen) * 1e-4 if key in ("V", "exp_avg_sq") else \
                torch.randn(param.shape, generator=gen) * 1e-3
            entry[key] = t
        counters = {"tau": i % 6, "step": 5 + i % 3}
        entry.update({key: torch.tensor(counters[key], dtype=torch.int64) for key in spec.counter_keys})
        out[name] = entry
    return out


def grads_of(backbone, rank: int, step: int) -> dict[str, torch.Tensor]:
    return {name: torch.randn(backbone_param(m).shape,
                              generator=torch.Generator().manual_seed(10_000 * rank + 100 * step + i)) * (1 + step)
            for i, (name, m) in enumerate(sorted(backbone.items()))}


def random_refresh(step: int):
    """A refresh to a random legal pattern per matrix (seeded by step and name): many links leave and come back."""
    def refresh(name, master, meta):
        new = encode(random_mask(*meta.shape, meta.spec, torch.Generator().manual_seed(1000 * step + len(name))),
                     meta.spec)
        slots = slot_map(meta, new)
        return RefreshResult(new, slots, move_slots(master, slots), {})
    return refresh


class PerMatrix:
    """The reference: each matrix stepped alone by its per-matrix rule; refreshes move its state (matrix_state.py)."""

    def __init__(self, backbone, rule: str, hp, reset_mode: str, start):
        self.backbone, self.rule, self.hp, self.reset_mode = backbone, rule, hp, reset_mode
        self.masters = {n: e["master"].clone() for n, e in start.items()}
        self.states = {n: {k: v.clone() for k, v in e.items() if k != "master"} for n, e in start.items()}
        self.metas = {n: NMMeta(m.codes.clone(), m.spec, (m.out_features, m.in_features))
                      for n, m in backbone.items() if isinstance(m, NMSparseLinear)}
        self.shadows = {n: init_shadow(self.states[n], self.metas[n].shape)
                        for n in self.metas if reset_mode == "none"}

    def step(self, grads, lr: float, clip: float, refresh) -> None:
        shapes = {n: (m.out_features, m.in_features) for n, m in self.backbone.items()}
        masks = {n: m.current_mask() for n, m in self.backbone.items()} if get_rule(self.rule).needs_support_mask \
            else None
        step_each(self.rule, self.masters, {n: g * clip for n, g in grads.items()}, self.states, lr=lr, hp=self.hp,
                  indices={n: kept_index(self.metas[n]) if n in self.metas else None for n in self.masters},
                  shapes=shapes, masks=masks)
        if refresh is None:
            return
        for name, meta in self.metas.items():
            outcome = refresh(name, self.masters[name], meta)
            shadow, new_index = self.shadows.get(name), None
            if shadow is not None:
                update_shadow(shadow, kept_index(meta), self.states[name])
                new_index = kept_index(outcome.meta)
            _, self.states[name] = move_state(self.states[name], outcome.new_values, outcome.slots, self.reset_mode,
                                              shadow=shadow, new_index=new_index)
            self.masters[name], self.metas[name] = outcome.new_values, outcome.meta


def train_both(method: str, overrides: dict, reset_mode: str, rank: int = 0, world_size: int = 1,
               mode: str = "sharded", steps: int = 5, refresh_at=(2,), compile: bool = False):
    """The engine and the per-matrix reference from the same state, the same mean gradients (of `world_size` ranks'
    seeded gradients), refreshes at `refresh_at`, clipping 0.5 on step 3. Returns what the test compares."""
    cfg, backbone = tiny_backbone(method)
    rule = cfg.method.rule
    hp = dataclasses.replace(cfg.method.rule_params, **overrides)
    start = start_states(backbone, rule, seed=5)
    engine = MatrixEngine(backbone, rule=rule, hparams=hp, mode=mode, reset_mode=reset_mode, compile=compile)
    saved = {n: {k: v.clone() for k, v in e.items()} for n, e in start.items()}
    for name, shadow in engine.shadows.items():   # reset mode none: nothing has left yet
        saved[name].update({f"shadow.{k}": torch.zeros_like(t) for k, t in shadow.items()})
    engine.load_state_dict(saved)
    ref = PerMatrix(backbone, rule, hp, reset_mode, start)
    for step in range(1, steps + 1):
        mine = grads_of(backbone, rank, step)
        engine.start_boundary()
        for name, g in mine.items():
            engine.grads.add(name, g)
        engine.reduce_gradients()
        every = [grads_of(backbone, r, step) for r in range(world_size)]
        mean = {n: sum(g[n] for g in every) / world_size for n in mine}   # the reduce's sum, then / W (exact)
        refresh, clip = (random_refresh(step) if step in refresh_at else None), (0.5 if step == 3 else 1.0)
        engine.step(1e-2, clip, refresh=refresh)
        ref.step(mean, 1e-2, clip, refresh)
        engine.zero_grad()
    return engine, ref, backbone


def assert_engine_equals_reference(engine, ref, backbone) -> float:
    worst = 0.0
    for name, module in backbone.items():
        # Every rank holds every matrix's values after the gather; owners also hold master and state.
        worst = max(worst, rel_err(backbone_param(module).detach(), ref.masters[name]))
        if name in ref.metas:
            assert torch.equal(module.codes, ref.metas[name].codes), name
    for name, master in engine.masters.items():
        assert torch.equal(backbone_param(backbone[name]).detach(), master.view_as(backbone_param(backbone[name])))
        for key, value in engine.states[name].items():
            if value.dim() == 0:
                assert int(value) == int(ref.states[name][key]), (name, key)
            else:
                worst = max(worst, rel_err(value, ref.states[name][key]))
        for key, shadow in engine.shadows.get(name, {}).items():
            want = ref.shadows[name][key]
            worst = max(worst, rel_err(shadow, want) if want.any() else float(shadow.abs().max()))
    assert worst <= MAX_REL_ERR, worst
    return worst


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_batched_step_equals_the_per_matrix_rules_with_a_refresh_in_between(case):
    method, overrides = CASES[case]
    engine, ref, backbone = train_both(method, overrides, "changed")
    assert len(engine.groups) == 3 and sum(len(g) for g in engine.groups) == len(backbone), "tiny: 3 shapes"
    assert_engine_equals_reference(engine, ref, backbone)


@pytest.mark.parametrize("reset_mode", ["all", "none"])
@pytest.mark.parametrize("case", ["tans_row", "adam_l2"])
def test_the_batched_step_equals_the_per_matrix_rules_in_every_reset_mode(case, reset_mode):
    method, overrides = CASES[case]
    engine, ref, backbone = train_both(method, overrides, reset_mode, steps=6, refresh_at=(2, 4))
    assert_engine_equals_reference(engine, ref, backbone)


def test_a_refresh_of_one_matrix_restarts_its_ramp_alone_inside_its_group():
    """tau restarts per matrix: after one matrix of a group is refreshed its gamma is 0 while the others ramp on."""
    method, _ = CASES["tans_row"]
    cfg, backbone = tiny_backbone(method)
    hp = cfg.method.rule_params
    engine = MatrixEngine(backbone, rule="tans", hparams=hp)
    start = start_states(backbone, "tans", seed=2)
    engine.load_state_dict({n: {k: v.clone() for k, v in e.items()} for n, e in start.items()})
    ref = PerMatrix(backbone, "tans", hp, "changed", start)
    name = sorted(backbone)[0]
    module = backbone[name]
    outcome = random_refresh(1)(name, engine.masters[name].clone(), module.meta)
    engine.on_refresh(name, outcome)
    module.set_codes(outcome.meta.codes)   # what the engine installs after its owners refreshed (one rank)
    ref_outcome = random_refresh(1)(name, ref.masters[name], ref.metas[name])
    _, ref.states[name] = move_state(ref.states[name], ref_outcome.new_values, ref_outcome.slots)
    ref.masters[name], ref.metas[name] = ref_outcome.new_values, ref_outcome.meta
    taus = [int(engine.states[n]["tau"]) for n in sorted(backbone)]
    assert taus[0] == 0 and len(set(taus)) > 2, taus
    for step in (1, 2):
        grads = grads_of(backbone, 0, step)
        engine.start_boundary()
        for n, g in grads.items():
            engine.grads.add(n, g)
        engine.reduce_gradients()
        engine.step(1e-2)
        ref.step(grads, 1e-2, 1.0, None)
        engine.zero_grad()
    assert_engine_equals_reference(engine, ref, backbone)


def _two_ranks(rank, world_size, case, reset_mode, mode):
    method, overrides = CASES[case]
    engine, ref, backbone = train_both(method, overrides, reset_mode, rank=rank, world_size=world_size, mode=mode,
                                       steps=6, refresh_at=(2, 4))
    worst = assert_engine_equals_reference(engine, ref, backbone)
    return worst, len(engine.masters), {n: backbone_param(m).detach().clone() for n, m in backbone.items()}


@pytest.mark.parametrize("case,reset_mode", [("tans_row", "changed"), ("tans_block_bias_correction_decay", "none"),
                                             ("adamw_dense", "all"), ("muon_sparse_decay", "changed")])
def test_on_two_ranks_sharded_and_replicated_batched_steps_equal_the_per_matrix_rules(ranks2, case, reset_mode):
    (w0, owned0, v0), (w1, owned1, v1) = ranks2.run(_two_ranks, case, reset_mode, "sharded")
    (r0, every, rv0), _ = ranks2.run(_two_ranks, case, reset_mode, "replicated")
    assert 0 < owned0 < every and owned0 + owned1 == every, "sharded: each rank updates its own matrices only"
    for name, value in v0.items():
        assert torch.equal(value, v1[name]), f"{name}: ranks disagree"
        assert rel_err(value, rv0[name]) <= MAX_REL_ERR, f"{name}: sharded != replicated"


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="torch.compile on CPU needs a C++ compiler (inductor builds its kernels with g++); none found")
def test_compiled_group_kernels_give_the_eager_numbers(one_thread):
    """engine.compile (config optim.compile) on CPU: the same numbers as the eager kernels, to float32 round-off.
    One group shape (three 64 x 64 matrices) keeps the compile to one graph per coefficient kind."""
    from distsparse.train.trainer import build_matrix_engine
    spec = NMSpec(1, 4, "row")
    runs = []
    for compile in (False, True):
        # ramp_steps 0: the NS correction from the first step
        cfg = load_config(None, ["method.preset=chtsnm_nobranch_1of4_row", "method.rule_args={ramp_steps: 0}",
                                 f"optim.compile={str(compile).lower()}"])
        backbone = {f"m{i}": NMSparseLinear(64, 64, spec, seed=i) for i in range(3)}
        engine = build_matrix_engine(cfg, backbone, None, initial={n: m.values.detach() for n, m in backbone.items()},
                                     device=torch.device("cpu"))
        assert (engine._kernel is not engine.group_rule.kernel) == compile, "optim.compile reaches the engine"
        for step in range(1, 4):
            engine.start_boundary()
            for name, g in grads_of(backbone, 0, step).items():
                engine.grads.add(name, g)
            engine.reduce_gradients()
            engine.step(1e-2)
            engine.zero_grad()
        runs.append({n: m.values.detach().clone() for n, m in backbone.items()})
    for name, value in runs[0].items():
        assert rel_err(runs[1][name], value) <= MAX_REL_ERR, name
        assert not torch.equal(value, NMSparseLinear(64, 64, spec, seed=int(name[1:])).values), "nothing trained"


def test_at_60m_widths_the_batched_tans_step_equals_the_per_matrix_rule_bit_for_bit():
    # bench/optimizer's `tans_batched_over_per_matrix_max_rel_err` (issue 25 target <= 1e-5) at one 60m layer: the
    # group kernel and the rule normalize, reduce and add in the same order, so nothing is left to round
    # differently (a square-then-mean RMS over 700K entries, a fused division or a two-pass master update each put
    # 3e-6 to 8e-6 between them; the small shapes above hide that inside their tolerance).
    from bench.optimizer_counts import backbone, batched_vs_per_matrix
    from distsparse.optim.hparams import TansHParams

    assert batched_vs_per_matrix(backbone("60m", layers=1), TansHParams(lr=1e-3, ramp_steps=0), None) == 0.0
