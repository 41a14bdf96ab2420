"""What bench/optimizer.py counts of the matrix engine's step (issue 25 items 1 and 5): aten ops and host syncs of
one steady backbone step (reduce_gradients, local_grad_sq_norm, step with clip 0.5, zero_grad; distsparse/op_count.py)
at the model's shapes on the meta device and on 2 gloo ranks at reduced widths, and the batched step's error against
the per-matrix rules. Why the counts do not depend on the widths: docs/benchmarks.md#optimizer."""

from __future__ import annotations

from typing import Any

import torch

METHOD = "chtsnm_nobranch_1of4_row"   # 1:4 row-wise, rule tans
VOCAB = 512                           # only the backbone is used


def backbone(preset: str, *, layers: int | None = None, width_divisor: int = 1, device: str = "cpu"
             ) -> dict[str, torch.nn.Module]:
    """The backbone of `preset` at 1:4 row-wise: all its layers or `layers`, its widths divided by `width_divisor`
    (the FFN width rounded up as the config rounds it), built on `device` ("meta": shapes only)."""
    from transformers import LlamaForCausalLM

    from distsparse.config import load_config
    from distsparse.models import backbone_modules, build_model
    from distsparse.models.build import branch_rank, llama_config, sparsify

    base = load_config(None, [f"model.preset={preset}"]).model
    overrides = [f"model.preset={preset}", f"method.preset={METHOD}"]
    if layers is not None:
        overrides.append(f"model.num_hidden_layers={layers}")
    if width_divisor > 1:
        overrides += [f"model.hidden_size={base.hidden_size // width_divisor}",
                      f"model.intermediate_size={base.intermediate_size // width_divisor}"]
    cfg = load_config(None, overrides)
    if device == "meta":
        with torch.device("meta"):
            model = LlamaForCausalLM(llama_config(cfg.model, VOCAB))
            sparsify(model, cfg.method, 0, branch_rank(cfg.model, cfg.method))
    else:
        model = build_model(cfg.model, cfg.method, VOCAB, seed=0)
    return backbone_modules(model)


def engine_step_counts(engine, lr: float) -> dict[str, Any]:
    """Ops, views and host syncs of one steady backbone step of `engine` (a full-mode engine: its gradient buffer is
    filled directly, as the hooks would leave it)."""
    from distsparse.op_count import count_ops

    engine.grad_buffer.normal_()
    engine.reduce_gradients()
    engine.step(lr)
    engine.zero_grad()
    engine.grad_buffer.normal_()

    def step() -> None:
        engine.reduce_gradients()
        engine.local_grad_sq_norm()
        engine.step(lr, 0.5)
        engine.zero_grad()
    counts, _ = count_ops(step)
    return {"matrices": len(engine.updated_here()), "groups": len(engine.groups), "ops": counts.ops,
            "views": counts.views, "syncs": counts.syncs, "sync_ops": dict(counts.sync_ops),
            "top_ops": dict(counts.by_op.most_common(8))}


def batched_vs_per_matrix(modules: dict[str, torch.nn.Module], hp, group, *, steps: int = 2, seed: int = 0) -> float:
    """The module docstring's error figure, for a one-rank `group`."""
    from distsparse.nm import kept_index
    from distsparse.optim.engine import MatrixEngine
    from distsparse.optim.rules import init_state, step_each

    engine = MatrixEngine(modules, rule="tans", hparams=hp, group=group, grad_accum_mode="full")
    start = {n: t.clone() for n, t in engine.masters.items()}
    masters = {n: t.clone() for n, t in start.items()}
    states = {n: init_state("tans", tuple(t.shape)) for n, t in start.items()}
    indices = {n: kept_index(engine.matrices[n].module.meta) if engine.matrices[n].sparse else None for n in start}
    shapes = {n: engine.matrices[n].shape for n in start}
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        engine.grad_buffer.copy_(torch.randn(engine.grad_buffer.shape, generator=gen) * 1e-3)
        engine.reduce_gradients()
        grads = {n: engine.grads.grad(n).view_as(masters[n]).clone() for n in masters}
        engine.step(hp.lr)
        step_each("tans", masters, grads, states, lr=hp.lr, hp=hp, indices=indices, shapes=shapes)
        engine.zero_grad()

    def rel(got: torch.Tensor, want: torch.Tensor) -> float:
        return float((got.double() - want.double()).abs().max() / want.double().abs().max())

    worst = 0.0
    for name, master in engine.masters.items():
        worst = max(worst, rel(master - start[name], masters[name] - start[name]))
        worst = max(worst, *(rel(engine.states[name][k], states[name][k]) for k in ("V", "P")))
    return worst


def count_phase(rank: int, world_size: int, preset: str, hp, *, layers: int, width_divisor: int, log) -> dict[str, Any]:
    """bench/optimizer.py's counts phase on every rank (module docstring): `tans_ops_per_step`, the error figure and
    every count behind them (`op_counts`). Rank 0 also computes the error; the others wait for it."""
    import torch.distributed as dist

    from distsparse import dist as ddist
    from distsparse.optim.engine import GATHER_CHUNK, MatrixEngine

    singles = [dist.new_group([r]) for r in range(world_size)]   # every rank creates every group
    one, counts = singles[rank], {}
    for label, n in (("one_rank", layers), ("one_rank_half_layers", max(1, layers // 2))):
        log(f"op counts: {preset} shapes, {n} layers, one rank, meta device")
        engine = MatrixEngine(backbone(preset, layers=n, device="meta"), rule="tans", hparams=hp, group=one,
                              grad_accum_mode="full", device="meta")
        counts[label] = engine_step_counts(engine, hp.lr)
    reduced = backbone(preset, width_divisor=width_divisor)
    chunk = max(1, GATHER_CHUNK // width_divisor ** 2)
    log(f"op counts: {preset} layers at widths / {width_divisor}, one and {world_size} gloo ranks")
    counts["one_rank_reduced_widths"] = engine_step_counts(MatrixEngine(
        reduced, rule="tans", hparams=hp, group=one, grad_accum_mode="full", gather_chunk=chunk), hp.lr)
    every = engine_step_counts(MatrixEngine(reduced, rule="tans", hparams=hp, grad_accum_mode="full",
                                            gather_chunk=chunk), hp.lr)
    counts["two_ranks_reduced_widths"] = ddist.gather_objects(every)   # in rank order
    errors = {}
    if rank == 0:
        log("batched step vs the per-matrix rules: one layer at full width, every layer at reduced widths")
        errors = {"one_layer": batched_vs_per_matrix(backbone(preset, layers=1), hp, one),
                  "reduced_widths": batched_vs_per_matrix(reduced, hp, one)}
    dist.barrier()
    return {"tans_ops_per_step": counts["one_rank"]["ops"],
            "tans_batched_over_per_matrix_max_rel_err": max(errors.values()) if errors else None,
            "op_counts": {**counts, "batched_over_per_matrix_rel_err": errors, "width_divisor": width_divisor,
                          "gather_chunk_reduced": chunk}}


def count_rows(counts: dict[str, Any]) -> list[list[Any]]:
    """The detail rows of the counts: [what, ops, syncs] per counted engine."""
    labelled = [(label, counts[label]) for label in ("one_rank", "one_rank_half_layers", "one_rank_reduced_widths")]
    labelled += [(f"two_ranks_reduced_widths rank {r}", c) for r, c in enumerate(counts["two_ranks_reduced_widths"])]
    return [[f"tans ops: {label} ({c['matrices']} matrices, {c['groups']} groups)", c["ops"], c["syncs"]]
            for label, c in labelled]
