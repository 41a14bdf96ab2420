"""DESIGN decision 17 on CPU: the engine lives where DeepSpeed put the model, collectives take their tensors on the
device `ddist.comm_device` names, and nothing on those paths falls back to the default device.

Two tools make device mistakes visible without a GPU:
- `torch.device("meta")` as the default device: a tensor made without naming its device lands on `meta`, which no
  collective accepts and no value can be read from, so a helper that relies on the default device fails here as
  it would under NCCL with a CPU tensor.
- `recorded_collectives`: wraps torch.distributed's collectives and asserts that every tensor handed to one lives
  on `ddist.comm_device(group)`.
- `meta_named`: the one place (`ddist.backend_device`) made to name `meta` instead of the CPU, as it names cuda:N
  under NCCL, so a wire tensor staged on the CPU by name (which gloo accepts) fails as NCCL would refuse it.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from distsparse import dist as ddist
from distsparse.config import load_config
from distsparse.layers.llama_projections import PROJECTIONS
from distsparse.models import build_model, projection_names
from distsparse.train.deepspeed.config import build_ds_config
from synthetic_data import make_data_dir

COLLECTIVES = ("all_reduce", "reduce_scatter_tensor", "reduce_scatter", "all_gather_into_tensor", "broadcast")


@contextlib.contextmanager
def recorded_collectives(seen: list):
    """Every collective call appends (name, device); a tensor off the named device fails the call."""
    import torch.distributed as dist
    real = {name: getattr(dist, name) for name in COLLECTIVES}

    def wrap(name):
        def call(*args, **kwargs):
            group = kwargs.get("group")
            tensors = [t for a in args for t in (a if isinstance(a, (list, tuple)) else [a])
                       if isinstance(t, torch.Tensor)]   # reduce_scatter takes a list of inputs
            for t in tensors:
                assert t.device == ddist.comm_device(group), \
                    f"{name}: tensor on {t.device}, the process group's backend wants {ddist.comm_device(group)}"
            seen.append((name, tensors[0].device.type))
            return real[name](*args, **kwargs)
        return call

    for name in COLLECTIVES:
        setattr(dist, name, wrap(name))
    try:
        yield seen
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)


def test_backend_device_is_the_current_cuda_device_under_nccl_and_the_cpu_under_gloo(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert ddist.backend_device("nccl") == torch.device("cuda", 3)
    assert ddist.backend_device("cpu:gloo,cuda:nccl") == torch.device("cuda", 3)
    assert ddist.backend_device("gloo") == torch.device("cpu")
    assert ddist.comm_device() == torch.device("cpu"), "no process group: nothing to hand to"


def _stats(rank: int) -> dict[str, dict]:
    """Refresh statistics of the matrices one rank owns (layer 0 on rank 0, layer 1 on rank 1)."""
    out = {}
    for j, proj in enumerate(PROJECTIONS):
        out[f"model.layers.{rank}.mlp.{proj}"] = {"groups_selected": 10.0 + j + rank, "groups_changed": 2.0 + rank,
                                                   "mpr_exclusions": float(j), "links_changed": 4.0 * (rank + 1),
                                                   "zeta": 0.05, "temperature": 3.0}
    return out


def _scalar_helpers(rank, world_size):
    from distsparse.train.topology_policy import refresh_metrics
    seen: list = []
    with recorded_collectives(seen), torch.device("meta"):
        out = {"sum": float(ddist.dist_sum(rank + 1.0)),
               "sum_tensor": ddist.dist_sum(torch.tensor([rank, 2.0 * rank], device="cpu")).tolist(),
               "max": ddist.dist_max(float(rank) - 5.0),
               "any": (ddist.any_rank(rank == 1), ddist.any_rank(False)),
               "metrics": refresh_metrics(_stats(rank), seconds=0.5 + rank)}
    return out, seen


def test_scalar_collectives_take_their_tensors_on_the_named_device(ranks2):
    (r0, seen0), (r1, seen1) = ranks2.run(_scalar_helpers)
    assert r0 == r1
    assert r0["sum"] == 3.0 and r0["sum_tensor"] == [1.0, 2.0] and r0["max"] == -4.0
    assert r0["any"] == (True, False)
    m = r0["metrics"]
    assert m["topology/refresh_s"] == 1.5
    for j, proj in enumerate(PROJECTIONS):   # both ranks' matrices of one projection type, summed by hand
        selected, changed = (10.0 + j) + (11.0 + j), 2.0 + 3.0
        assert m[f"topology/{proj}/groups_selected"] == selected
        assert m[f"topology/{proj}/effective_refresh_rate"] == pytest.approx(changed / selected)
        assert m[f"topology/{proj}/mpr_exclusions"] == 2.0 * j
        assert m[f"topology/{proj}/links_changed"] == 4.0 + 8.0
    assert m["topology/zeta"] == pytest.approx(0.05) and m["topology/temperature"] == pytest.approx(3.0)
    assert seen0 and {device for _, device in seen0} == {"cpu"}


def _uneven_refresh(rank, world_size):
    """Rank 1's q_proj matrix selected no group this refresh; it still ran the same schedule (zeta, T)."""
    from distsparse.train.topology_policy import refresh_metrics
    stats = {f"model.layers.{rank}.self_attn.q_proj": {"groups_selected": 0.0 if rank else 8.0, "groups_changed": 0.0,
                                                       "mpr_exclusions": 0.0, "links_changed": 0.0,
                                                       "zeta": 0.04, "temperature": 2.0}}
    return refresh_metrics(stats, seconds=0.1)


def test_refresh_schedule_metrics_average_over_the_ranks_that_refreshed(ranks2):
    m0, m1 = ranks2.run(_uneven_refresh)
    assert m0 == m1
    assert m0["topology/q_proj/groups_selected"] == 8.0
    assert m0["topology/zeta"] == pytest.approx(0.04) and m0["topology/temperature"] == pytest.approx(2.0)


def _tiny_backbone(layers: int = 1):
    cfg = load_config(None, ["model.preset=tiny", "method.preset=chtsnm_nobranch_1of4_row",
                             f"model.num_hidden_layers={layers}"])
    model = build_model(cfg.model, cfg.method, 97, seed=3)
    for p in model.parameters():
        p.requires_grad_(False)
    backbone = {n: model.get_submodule(n) for n in projection_names(model)}
    for m in backbone.values():
        m.values.requires_grad_(True)
    return cfg, model, backbone


def _engine_steps(rank, world_size, *, meta_default: bool, single_rank_group: bool = False,
                  force_collectives: bool = False, steps: int = 3, grad_accum_mode: str = "full"):
    """Two micro-batches per step, then the engine's boundary (reduce, norm, finiteness, update, refresh, gather)
    with the default device set to meta when asked. Backward runs outside it: autograd runs the hooks with torch
    function modes off, so a meta default cannot reach them (their staging names its device; the recorded
    collectives check the devices of the reduces they launch). Returns values, codes, the collectives seen, the
    devices of what the engine holds and its accumulation mode."""
    import torch.distributed as dist

    from distsparse.optim.engine import MatrixEngine
    from distsparse.optim.rules import get_rule
    from distsparse.config import TopologyConfig
    from distsparse.train.topology_policy import TopologyPolicy

    torch.manual_seed(0)
    cfg, model, backbone = _tiny_backbone()
    singles = [dist.new_group([r]) for r in range(world_size)]   # every rank creates every group
    group = singles[rank] if single_rank_group else None
    engine = MatrixEngine(backbone, rule="tans", hparams=get_rule("tans").hparams(lr=1e-2), group=group,
                          device="cpu", force_collectives=force_collectives, grad_accum_mode=grad_accum_mode,
                          micro_batches=2, bucket_bytes=4 * 4000)
    topology = TopologyPolicy(TopologyConfig(enabled=True, update_interval=2), total_steps=steps, seed=7)
    gen = torch.Generator().manual_seed(100 + (0 if single_rank_group else rank))
    seen: list = []
    for step in range(1, steps + 1):
        x = torch.randint(0, 97, (2, 12), generator=gen)
        with recorded_collectives(seen):
            for micro, part in enumerate(x.chunk(2)):
                with torch.device("meta") if meta_default else contextlib.nullcontext():
                    engine.start_boundary() if micro == 1 else engine.start_micro_step()
                model(input_ids=part, labels=part).loss.backward()   # buckets launch their reduce from the hooks
            with torch.device("meta") if meta_default else contextlib.nullcontext():
                engine.reduce_gradients()
                norm = float(engine.grad_sq_norm())
                assert engine.grads_finite() and norm > 0
                engine.step(1e-2, 0.5, refresh=topology.refresh_fn(step) if topology.due(step) else None)
                engine.zero_grad()
    placed = [*engine.masters.values(), *engine.grads.persistent(),
              *[t for s in engine.states.values() for t in s.values() if t.dim()]]
    return ({n: m.values.detach().clone() for n, m in backbone.items()},
            {n: m.codes.clone() for n, m in backbone.items()}, seen, {t.device.type for t in placed},
            engine.grad_accum_mode)


def _meta_and_plain(rank, world_size, grad_accum_mode):
    return (_engine_steps(rank, world_size, meta_default=True, grad_accum_mode=grad_accum_mode),
            _engine_steps(rank, world_size, meta_default=False, grad_accum_mode=grad_accum_mode))


@pytest.mark.parametrize("grad_accum_mode", ["full", "sharded"])
def test_engine_never_uses_the_default_device_and_hands_collectives_the_named_device(ranks2, grad_accum_mode):
    (meta0, plain0), (meta1, _) = ranks2.run(_meta_and_plain, grad_accum_mode)
    assert meta0[4] == grad_accum_mode
    for name in plain0[0]:
        assert torch.equal(meta0[0][name], plain0[0][name]) and torch.equal(meta0[0][name], meta1[0][name]), name
        assert torch.equal(meta0[1][name], plain0[1][name]), name
    kinds = {name for name, _ in meta0[2]}
    # full: one even reduce-scatter per bucket and step; sharded: uneven ones, per bucket and micro-batch
    reduce = "reduce_scatter_tensor" if grad_accum_mode == "full" else "reduce_scatter"
    assert {reduce, "all_reduce", "all_gather_into_tensor"} <= kinds
    assert meta0[3] == {"cpu"}


def _forced(rank, world_size, grad_accum_mode):
    return (_engine_steps(rank, world_size, meta_default=False, single_rank_group=True, force_collectives=True,
                          grad_accum_mode=grad_accum_mode),
            _engine_steps(rank, world_size, meta_default=False, single_rank_group=True,
                          grad_accum_mode=grad_accum_mode))


@pytest.mark.parametrize("grad_accum_mode", ["full", "sharded"])
def test_forced_collectives_run_at_world_size_one_and_change_nothing(ranks2, grad_accum_mode):
    (forced, skipped), _ = ranks2.run(_forced, grad_accum_mode)
    assert {name for name, _ in forced[2]} >= {"reduce_scatter_tensor", "all_reduce", "all_gather_into_tensor"}
    assert skipped[2] == [], "a world of one skips every collective unless forced"
    for name in forced[0]:
        assert torch.equal(forced[0][name], skipped[0][name]) and torch.equal(forced[1][name], skipped[1][name])


def test_forced_collectives_without_a_process_group_are_refused():
    from distsparse.optim.engine import MatrixEngine
    from distsparse.optim.rules import get_rule
    _, _, backbone = _tiny_backbone()
    with pytest.raises(ValueError, match="engine.force_collectives: got True without a process group"):
        MatrixEngine(backbone, rule="adam", hparams=get_rule("adam").hparams(lr=1e-3), force_collectives=True)


# ---- the one place made to name a device other than the CPU (as it names cuda:N under NCCL) -------------------

class _Reached(Exception):
    """Raised by the fake collectives of `meta_named`: a collective was handed its tensors on the named device."""


@pytest.fixture
def meta_named(monkeypatch):
    """One process in a faked process group of one whose backend device, as `ddist.backend_device` names it, is
    `meta` (standing in for cuda:N under NCCL). Every collective is replaced by a check that all of its tensors are
    on that device; the call then ends with _Reached (a meta tensor holds no value to go on with). A tensor staged
    on the CPU for a collective, by name or by default, fails the check, as NCCL refuses it. Returns the names of
    the collectives reached."""
    import torch.distributed as dist
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(ddist, "backend_device", lambda backend: torch.device("meta"))
    reached: list = []

    def fake(name):
        def call(*args, **kwargs):
            tensors = [t for a in (*args, *kwargs.values()) for t in (a if isinstance(a, (list, tuple)) else [a])
                       if isinstance(t, torch.Tensor)]
            devices = {t.device.type for t in tensors}
            assert tensors and devices == {"meta"}, f"{name}: tensors on {devices}; the named device is meta"
            reached.append(name)
            raise _Reached(name)
        return call

    for name in COLLECTIVES:
        monkeypatch.setattr(dist, name, fake(name))
    return reached


def test_scalar_collectives_take_their_tensors_on_the_named_device_when_it_is_not_the_cpu(meta_named):
    from distsparse.train.topology_policy import refresh_metrics
    assert ddist.comm_device() == torch.device("meta")
    calls = {"sum of a float": lambda: ddist.dist_sum(2.0),
             "sum of a CPU tensor": lambda: ddist.dist_sum(torch.ones(3)),
             "max": lambda: ddist.dist_max(1.0), "any": lambda: ddist.any_rank(True),
             "refresh metrics": lambda: refresh_metrics(_stats(0), seconds=0.5)}
    for what, call in calls.items():
        with pytest.raises(_Reached):
            call()
        assert len(meta_named) == list(calls).index(what) + 1, what
    assert meta_named == ["all_reduce"] * len(calls)


@pytest.mark.parametrize("grad_accum_mode", ["full", "sharded"])
def test_engine_collectives_take_their_tensors_on_the_named_device_when_it_is_not_the_models(meta_named,
                                                                                           grad_accum_mode):
    """The model (and so the engine) on the CPU, the backend's device elsewhere: gradient buckets, the norm and
    finiteness sums, the code and value gathers all stage their wire tensors on the named device."""
    from distsparse.config import TopologyConfig
    from distsparse.optim.engine import MatrixEngine
    from distsparse.optim.rules import get_rule
    from distsparse.train.topology_policy import TopologyPolicy

    _, _, backbone = _tiny_backbone()
    engine = MatrixEngine(backbone, rule="tans", hparams=get_rule("tans").hparams(lr=1e-2), device="cpu",
                          force_collectives=True, grad_accum_mode=grad_accum_mode, micro_batches=2,
                          bucket_bytes=4 * 4000)
    assert engine.comm_device == torch.device("meta") and engine.device == torch.device("cpu")
    engine.start_boundary()
    with pytest.raises(_Reached):   # the first complete bucket launches its reduce from the gradient hook
        for name in engine.grad_layout[0].names:
            engine.grads.add(name, torch.zeros(backbone_numel(backbone[name])))
    topology = TopologyPolicy(TopologyConfig(enabled=True, update_interval=2), total_steps=4, seed=7)
    for call in (engine.grad_sq_norm, engine.grads_finite, lambda: engine.step(1e-2, 1.0),
                 lambda: engine.step(1e-2, 1.0, refresh=topology.refresh_fn(2))):
        with pytest.raises(_Reached):
            call()
    reduce = "reduce_scatter_tensor" if grad_accum_mode == "full" else "reduce_scatter"
    assert meta_named[0] in (reduce, "reduce_scatter_tensor")
    assert meta_named[1:] == ["all_reduce", "all_reduce", "all_gather_into_tensor", "all_gather_into_tensor"]


def backbone_numel(module) -> int:
    from distsparse.models import backbone_param
    return backbone_param(module).numel()


# ---- the trainer: engine built where DeepSpeed put the model, masters from the model before the cast ----------

BASE = ["model.preset=tiny", "data.seq_len=32", "train.dtype=fp32", "method.preset=chtsnm_nobranch_1of4_row",
        "train.steps=2"]


def _placed_trainer(rank, world_size, data_dir, out_dir, after_init: str):
    """Build the real Trainer with deepspeed.initialize followed by what a GPU run does to the module: `meta` moves
    it to another device (DeepSpeed's engine.device too), `bf16` casts it (bf16 training)."""
    import deepspeed

    from distsparse.models import backbone_modules, backbone_param
    from distsparse.train.trainer import Trainer

    real = deepspeed.initialize

    def initialize(*args, **kwargs):
        out = real(*args, **kwargs)
        if after_init == "meta":
            out[0].module.to("meta")
            out[0].device = torch.device("meta")
        else:
            out[0].module.to(torch.bfloat16)
        return out

    cfg = load_config(None, BASE + [f"data.dir={data_dir}", f"train.out_dir={out_dir}"])
    deepspeed.initialize = initialize
    try:
        trainer = Trainer(cfg, build_ds_config("configs/ds/zero2.json", cfg))
    finally:
        deepspeed.initialize = real
    m = trainer.matrix
    placed = [*m.masters.values(), *m.grads.persistent(),
              *[t for s in m.states.values() for t in s.values() if t.dim()]]
    fresh = backbone_modules(build_model(cfg.model, cfg.method, 97, cfg.train.seed))
    exact = all(torch.equal(master.cpu(), backbone_param(fresh[name]).detach().float())
                for name, master in m.masters.items()) if after_init == "bf16" else None
    out = {"devices": {t.device.type for t in placed}, "engine_device": str(m.device), "masters_exact": exact,
           "owned": len(m.masters)}
    trainer.close()
    return out


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return make_data_dir(tmp_path_factory.mktemp("data"))


def test_trainer_builds_the_engine_on_the_device_deepspeed_put_the_model_on(ranks2, data_dir, tmp_path):
    for r in ranks2.run(_placed_trainer, data_dir, str(tmp_path / "meta"), "meta"):
        assert r["devices"] == {"meta"} and r["engine_device"] == "meta" and r["owned"] > 0


def test_trainer_masters_are_the_fp32_weights_from_before_deepspeed_casts_the_model(ranks2, data_dir, tmp_path):
    for r in ranks2.run(_placed_trainer, data_dir, str(tmp_path / "bf16"), "bf16"):
        assert r["masters_exact"] is True and r["devices"] == {"cpu"}


def test_deepspeed_is_handed_the_cuda_device_the_launcher_selected(monkeypatch):
    from distsparse.train.trainer import deepspeed_device_args
    assert deepspeed_device_args() is None or torch.cuda.is_available()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    assert deepspeed_device_args().device_rank == 2, "not LOCAL_RANK: the launcher's choice (LOCAL_RANK % visible)"
