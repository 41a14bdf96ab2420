"""The mechanisms' statistics of issue 28 item 2 beside the rule's (test_rule_metrics.py): the branch's output RMS
over the sparse core's output RMS against a float64 computation of the same branch, the share of clipped steps
against the per-step clip coefficients, and a training run that writes them to TensorBoard."""

import copy
import math
from pathlib import Path

import pytest
import torch

from distsparse.config import load_config
from distsparse.layers.llama_projections import PROJECTIONS
from distsparse.layers.projection import SparseProjection
from distsparse.memory_estimate import backbone_analytic, backbone_matrices
from distsparse.models import build_model
from distsparse.train.branch_metrics import BranchProbe
from distsparse.train.deepspeed.config import build_ds_config
from synthetic_data import make_data_dir

ROOT = Path(__file__).resolve().parents[1]


def _tiny_model(method: str, *overrides: str) -> torch.nn.Module:
    cfg = load_config(None, ["model.preset=tiny", f"method.preset={method}", "model.num_hidden_layers=2", *overrides])
    model = build_model(cfg.model, cfg.method, 97, seed=3)
    torch.manual_seed(11)
    with torch.no_grad():   # B = 0 and a zero controller at init: give every branch an output and a live gate
        for m in model.modules():
            if isinstance(m, SparseProjection) and m.branch is not None:
                for p in m.branch.parameters():
                    p.add_(torch.randn_like(p) * 0.05)
    return model


def _float64_ratios(model, batches) -> dict[str, float]:
    """Per projection: RMS(branch(x, y_s) - y_s) / RMS(y_s) over every token of `batches`, y_s = core(x), with the
    core and the branch copied to float64 and fed the float64 inputs the fp32 forward saw."""
    inputs: dict[str, list[torch.Tensor]] = {}
    handles = [m.register_forward_pre_hook(lambda _m, args, name=name: inputs.setdefault(name, []).append(args[0]))
               for name, m in model.named_modules() if isinstance(m, SparseProjection)]
    with torch.no_grad():
        for ids in batches:
            model(input_ids=ids)
    for h in handles:
        h.remove()
    out = {}
    for name, xs in inputs.items():
        module = copy.deepcopy(model.get_submodule(name)).double()
        added = backbone = 0.0
        with torch.no_grad():
            for x in xs:
                x = x.double()
                y_s = module.core(module.permutation(x) if module.permutation is not None else x)
                added += float((module.branch(x, y_s) - y_s).square().sum())
                backbone += float(y_s.square().sum())
        out[name] = math.sqrt(added / backbone)
    return out


@pytest.mark.parametrize("method", ["chtsnm_1of4_row", "chtsnm_add1_1of4_row"])
def test_branch_output_rms_ratio_equals_a_float64_computation_of_the_same_branch(method):
    model = _tiny_model(method)
    gen = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, 97, (2, 16), generator=gen) for _ in range(2)]   # two micro-batches
    want = _float64_ratios(model, batches)
    probe = BranchProbe(model)
    assert set(probe.projections) == set(want) and len(want) == 2 * len(PROJECTIONS)
    probe.start()
    with torch.no_grad():
        for ids in batches:
            model(input_ids=ids)
    metrics = probe.read()
    assert not probe.active and not any(m._forward_hooks for m in model.modules()), "hooks removed after the read"
    for proj in PROJECTIONS:
        values = [r for name, r in want.items() if name.endswith(proj)]
        assert all(v > 1e-3 for v in values)
        prefix = f"branch/{proj}/output_rms_ratio"
        assert metrics[f"{prefix}_mean"] == pytest.approx(sum(values) / len(values), rel=1e-4)
        assert metrics[f"{prefix}_min"] == pytest.approx(min(values), rel=1e-4)
        assert metrics[f"{prefix}_max"] == pytest.approx(max(values), rel=1e-4)
    assert len(metrics) == 3 * len(PROJECTIONS)


def test_the_ratio_through_a_backward_under_activation_checkpointing_is_the_forwards():
    """The recomputed forward adds the same sums again to both sides of every ratio: it leaves the ratio unchanged."""
    model = _tiny_model("chtsnm_1of4_row", "model.activation_checkpointing=true").train()
    batches = [torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(6))]
    want = _float64_ratios(model, batches)
    probe = BranchProbe(model)
    probe.start()
    calls = []
    handle = model.get_submodule(next(iter(want))).register_forward_hook(lambda *_: calls.append(1))
    for ids in batches:
        model(input_ids=ids, labels=ids).loss.backward()
    handle.remove()
    metrics = probe.read()
    assert len(calls) == 2, "the forward ran again in the backward"
    for proj in PROJECTIONS:
        values = [r for name, r in want.items() if name.endswith(proj)]
        assert metrics[f"branch/{proj}/output_rms_ratio_mean"] == pytest.approx(sum(values) / len(values), rel=1e-4)


def test_no_branch_no_branch_statistics():
    model = _tiny_model("chtsnm_nobranch_1of4_row")
    probe = BranchProbe(model)
    probe.start()
    model(input_ids=torch.zeros(1, 8, dtype=torch.long))
    assert probe.projections == {} and probe.read() == {}


BASE = ["model.preset=tiny", "data.seq_len=32", "train.dtype=fp32", "train.eval_interval=1000", "train.log_interval=3",
        "train.warmup_steps=1", "train.micro_batch=2", "train.grad_accum=2", "method.preset=chtsnm_1of4_row",
        "method.topology.update_interval=2", "train.steps=7"]


def _train(rank, world_size, data_dir, out_dir, grad_clip):
    from distsparse.train.trainer import Trainer
    cfg = load_config(None, BASE + [f"data.dir={data_dir}", f"train.out_dir={out_dir}", f"train.grad_clip={grad_clip}"])
    trainer = Trainer(cfg, build_ds_config(ROOT / "configs/ds/zero2.json", cfg))
    coefs, logged = [], {}
    original = trainer.step_once

    def recording(*args, **kwargs):
        report = original(*args, **kwargs)
        coefs.append(report.clip_coef)
        logged[trainer.step] = {k: v for k, v in report.metrics.items() if k == "optim/clipped_share"}
        return report
    trainer.step_once = recording
    measured, begin = [], trainer.joint.begin

    def measuring(step, **kwargs):   # the steps (1-based) whose forwards the branch probe measures
        begin(step, **kwargs)
        if trainer.joint.branches.active:
            measured.append(step + 1)
    trainer.joint.begin = measuring
    trainer.train()
    trainer.close()
    return coefs, logged, measured


def _expected_shares(coefs: list[float], steps: list[int]) -> dict[int, float]:
    """Per logging step (1-based), the share of coefficients < 1 since the previous logging step."""
    out, start = {}, 0
    for step in steps:
        window = coefs[start:step]
        out[step] = sum(c < 1.0 for c in window) / len(window)
        start = step
    return out


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return make_data_dir(tmp_path_factory.mktemp("data"))


@pytest.mark.parametrize("grad_clip, share", [(1e-6, 1.0), (1e6, 0.0)])
def test_clipped_share_is_one_when_every_step_clips_and_zero_when_none_does(ranks2, data_dir, tmp_path, grad_clip,
                                                                            share):
    (coefs, logged, _), _ = ranks2.run(_train, data_dir, str(tmp_path / "run"), grad_clip)
    assert [s for s, m in logged.items() if m] == [3, 6, 7]
    assert {s: m["optim/clipped_share"] for s, m in logged.items() if m} == {3: share, 6: share, 7: share}
    assert all((c < 1.0) == (share == 1.0) for c in coefs)


def test_a_run_writes_the_mechanism_statistics_to_tensorboard(ranks2, data_dir, tmp_path):
    """A mixed clip threshold (between the run's step norms): the logged shares equal those of the per-step
    coefficients; the branch ratios on logging steps only; links_ever_changed on refresh steps (2 and 4: t_end ends
    them before 6)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    (coefs, logged, measured), (coefs1, _, measured1) = ranks2.run(_train, data_dir, str(tmp_path / "run"), 2.4)
    assert coefs == coefs1
    assert measured == measured1 == [3, 6, 7], "the branch hooks run on logging steps only"
    want = _expected_shares(coefs, [3, 6, 7])
    assert 0.0 < sum(want.values()) < 3.0, f"mixed: some windows clip, not all ({coefs})"
    ea = EventAccumulator(str(tmp_path / "run" / "tb"))
    ea.Reload()
    tags = set(ea.Tags()["scalars"])
    shares = {e.step: e.value for e in ea.Scalars("optim/clipped_share")}
    assert shares == pytest.approx(want)
    for proj in PROJECTIONS:
        for agg in ("mean", "min", "max"):
            tag = f"branch/{proj}/output_rms_ratio_{agg}"
            steps = {e.step: e.value for e in ea.Scalars(tag)}
            assert set(steps) == {3, 6, 7} and all(math.isfinite(v) and v >= 0 for v in steps.values()), tag
        tag = f"topology/{proj}/links_ever_changed"
        assert tag in tags, tag
        ever = {e.step: e.value for e in ea.Scalars(tag)}
        assert set(ever) == {2, 4} and all(0.0 < v < 1.0 for v in ever.values()), (tag, ever)


# ---- links_ever_changed ------------------------------------------------------------------------------------------

def _random_refresh(step: int):
    """test_group_rules' random legal refresh (many links leave, and some come back to their step-0 positions), with
    the schedule values refresh_metrics reads."""
    from test_group_rules import random_refresh
    inner = random_refresh(step)

    def refresh(name, master, meta):
        out = inner(name, master, meta)
        out.stats.update({"zeta": 0.1, "temperature": 1.0, "groups_selected": 1.0})
        return out
    return refresh


def _brute_force_shares(backbone, origin: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per projection type: kept positions now that the step-0 masks did not keep, over kept positions now, from
    dense bool masks of every matrix."""
    from distsparse.nm import decode
    off, kept = {}, {}
    for name, module in backbone.items():
        proj, now = name.rsplit(".", 1)[-1], decode(module.meta)
        off[proj] = off.get(proj, 0) + int((now & ~origin[name]).sum())
        kept[proj] = kept.get(proj, 0) + int(now.sum())
    return {proj: off[proj] / kept[proj] for proj in kept}


def _refresh_step(engine, backbone, rank: int, step: int) -> dict[str, float]:
    from distsparse.train.topology_policy import refresh_metrics
    from test_group_rules import grads_of
    engine.start_boundary()
    for name, g in grads_of(backbone, rank, step).items():
        engine.grads.add(name, g)
    engine.reduce_gradients()
    stats = engine.step(1e-2, refresh=_random_refresh(step))
    return {proj: v for proj in PROJECTIONS
            if (v := refresh_metrics(stats, 0.0).get(f"topology/{proj}/links_ever_changed")) is not None}


def _two_refreshes(rank, world_size):
    """Two refreshes from step 0; returns the logged and brute-force shares after each, every rank's saved matrix
    state merged, and the bytes of the step-0 codes this rank keeps against its owned matrices' codes."""
    from distsparse import dist as ddist
    from distsparse.nm import decode
    from distsparse.optim.engine import MatrixEngine
    from test_group_rules import tiny_backbone
    cfg, backbone = tiny_backbone("chtsnm_nobranch_1of4_row")
    origin = {n: decode(m.meta) for n, m in backbone.items()}
    engine = MatrixEngine(backbone, rule="tans", hparams=cfg.method.rule_params)
    shares = [(_refresh_step(engine, backbone, rank, step), _brute_force_shares(backbone, origin)) for step in (1, 2)]
    merged = {n: e for part in ddist.gather_objects(engine.state_dict()) for n, e in part.items()}
    owned_codes = sum(m.module.codes.numel() for m in engine.owned())
    return shares, merged, engine.origin_code_bytes(), owned_codes


def _resume_and_refresh(states, rank: int = 0):
    """A fresh model and engine (step-0 codes of the same seed) loaded from `states`, then a third refresh."""
    from distsparse.nm import decode
    from distsparse.optim.engine import MatrixEngine
    from test_group_rules import tiny_backbone
    cfg, backbone = tiny_backbone("chtsnm_nobranch_1of4_row")
    origin = {n: decode(m.meta) for n, m in backbone.items()}
    engine = MatrixEngine(backbone, rule="tans", hparams=cfg.method.rule_params)
    engine.load_state_dict(states)
    assert any(not torch.equal(engine.origin_codes[n], backbone[n].codes) for n in backbone), "the resume moved on"
    return _refresh_step(engine, backbone, rank, 3), _brute_force_shares(backbone, origin)


def _check_shares(shares):
    for logged, brute in shares:
        assert set(logged) == set(PROJECTIONS)
        for proj in PROJECTIONS:
            assert logged[proj] == pytest.approx(brute[proj], rel=1e-12)
            assert 0.05 < logged[proj] < 1.0, (proj, logged[proj])


def test_links_ever_changed_equals_a_brute_force_count_across_two_refreshes_and_a_resume_on_one_rank():
    shares, states, origin_bytes, owned_codes = _two_refreshes(0, 1)
    _check_shares(shares)
    assert origin_bytes == owned_codes   # one uint8 per code byte: 2 bits per kept value at 1:4 row-wise
    assert all(states[n]["origin_codes"].dtype == torch.uint8 for n in states)
    _check_shares([_resume_and_refresh(states)])


def test_links_ever_changed_on_two_ranks_and_after_an_elastic_resume_on_one(ranks2):
    (s0, states0, bytes0, owned0), (s1, states1, bytes1, owned1) = ranks2.run(_two_refreshes)
    assert s0 == s1
    _check_shares(s0)
    assert bytes0 == owned0 and bytes1 == owned1 and min(bytes0, bytes1) > 0, "each rank keeps its own matrices'"
    # The dry-run's arithmetic (memory_estimate) counts the same bytes per rank from the shapes and owner map alone.
    cfg = load_config(None, ["model.preset=tiny", "method.preset=chtsnm_nobranch_1of4_row",
                             "model.num_hidden_layers=2"])
    planned = backbone_analytic(backbone_matrices(build_model(cfg.model, cfg.method, 97, seed=3)), cfg.method, 2,
                                "sharded")
    assert [r["origin_codes"] for r in planned] == [bytes0, bytes1]
    assert states0.keys() == states1.keys()
    _check_shares([_resume_and_refresh(states0)])
