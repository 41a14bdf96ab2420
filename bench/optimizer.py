"""The optimizer step (issue 4; counts: issue 25): DeepSpeed's dense optimizers against the sharded matrix engine,
on 2 gloo ranks, on synthetic gradients (no forward or backward timed). Rows: dense_adamw and deepspeed_muon (the
dense model under DeepSpeed ZeRO-2 AdamW or MuonWithAuxAdam), sparse_muon, tans_replicated and tans_sharded (the
1:4 row-wise model: DeepSpeed's dense side plus the matrix engine in the trainer's joint step), and the pieces the
ratios use (sparse_dense_side, tans_sharded_backbone, tans_replicated_backbone). Bytes sent and held, op counts,
and how the gradients are injected: docs/benchmarks.md.

    python -m bench.optimizer --json out.json                 # 60m shapes, vocab 32000, 1:4 row-wise
    python -m bench.optimizer model=350m --json out.json    # op counts and the error at 350m (168 matrices)
    python -m bench.optimizer --quick --json out.json         # tiny model, for the test suite
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from bench.core import Figure, Settings, finish, median_time, paired_ratio, parse, progress
from bench.memory import peak_rss_bytes
from bench.optimizer_counts import count_phase, count_rows
from bench.ranks import on_ranks
from bench.trainers import DS_CONFIG

WORLD_SIZE = 2
SPARSE_METHOD = "chtsnm_nobranch_1of4_row"   # 1:4 row-wise, rule tans
PHASES = ("dense_adamw", "deepspeed_muon", "engine", "counts")
COUNT_WIDTH = 256   # the 2-rank op count's hidden size (optimizer_counts.py): widths divided to about this
TARGETS = {   # issue 4; the op count and the error: issue 25 (at 350m: 168 matrices, one rank)
    "tans_ops_per_step": 1800,
    "tans_batched_over_per_matrix_max_rel_err": 1e-5,
    "tans_sharded_over_deepspeed_muon": 1.15,
    "tans_sharded_over_replicated": 0.6,
    "ns_flops_max_over_mean_rank": 1.1,
    "backbone_comm_bytes_over_dense_allreduce_bf16": 0.40,
    "backbone_comm_bytes_over_dense_allreduce_fp32": 0.20,
    "state_W2_over_W1": 0.55,
}


@dataclass
class OptimizerSettings(Settings):
    model: str = "60m"          # tiny, 60m, 130m or 350m (350m: counted only)
    vocab: int = 32000          # the smoke run's 512: the embeddings need not be full size
    counts_only: bool = False   # only the op counts and the error (implied by 350m: its engines do not fit 2 ranks)
    warmup: int = 1             # untimed rounds per measurement
    repeats: int = 3            # timed rounds per measurement
    eager: bool = False         # TORCH_COMPILE_DISABLE=1: DeepSpeed's Muon kernels eager (compiling costs minutes)
    QUICK = {"model": "tiny", "vocab": 512, "warmup": 0, "repeats": 1, "eager": True}

    def __post_init__(self) -> None:
        self.one_of(model=("tiny", "60m", "130m", "350m"))
        self.counts_only = self.counts_only or self.model == "350m"
        self.at_least(warmup=0, repeats=1)


# ---- per rank ------------------------------------------------------------------------------------------------------

class _InjectGrads(torch.autograd.Function):
    """A zero scalar whose backward hands each parameter a fixed gradient: DeepSpeed's hooks see gradients arrive
    as from a real backward, with no model compute in between."""

    @staticmethod
    def forward(ctx, grads, *params):
        ctx.grads = grads
        return params[0].new_zeros(())

    @staticmethod
    def backward(ctx, _):
        return (None, *ctx.grads)


def _synthetic_grads(params: list[torch.Tensor], seed: int) -> list[torch.Tensor]:
    """Random gradients for `params`, all views of one random vector (a second copy of a 130m model per rank
    would not fit next to the engines); autograd copies them into fresh .grad tensors as a backward would."""
    pool = torch.randn(max(p.numel() for p in params), generator=torch.Generator().manual_seed(seed)) * 1e-3
    return [pool[:p.numel()].view(p.shape) for p in params]


def _deepspeed_step(engine, params: list[torch.nn.Parameter], grads: list[torch.Tensor]) -> Callable[[], None]:
    def run() -> None:
        engine.backward(_InjectGrads.apply(grads, *params))   # DeepSpeed's reduce (and Muon's NS) happen here
        engine.step()
    return run


def _backbone_step(matrix, buffer: torch.Tensor, lr: float) -> Callable[[], None]:
    def run() -> None:
        matrix.grad_buffer.copy_(buffer)   # what the post-accumulate hooks leave after a backward
        matrix.reduce_gradients()
        matrix.step(lr)
    return run


def _sparse_step(joint, params, grads, buffer: torch.Tensor) -> Callable[[], None]:
    """The trainer's joint step (JointOptimizer) on synthetic gradients."""
    def run() -> None:
        joint.matrix.grad_buffer.copy_(buffer)
        joint.begin(0)
        joint.backward(_InjectGrads.apply(grads, *params), last=True)
        joint.step()
    return run


class _Rank:
    """One rank's setup: configs, DeepSpeed configs, and (built once, on first use) the sparse model with its
    DeepSpeed dense side and the TANS sharded engine. Each `phase_*` method returns its figures."""

    def __init__(self, rank: int, s: OptimizerSettings):
        import torch.distributed as dist

        from distsparse.config import load_config
        from distsparse.optim import MuonHParams, TansHParams
        from distsparse.train.deepspeed.config import build_ds_config

        self.rank, self.s, self.sync = rank, s, dist.barrier
        self.progress = progress("bench.optimizer", rank)
        common = [f"model.preset={s.model}", "train.dtype=fp32"]
        self.cfg_dense = load_config(None, common + ["method.preset=dense_adamw"])
        self.cfg_sparse = load_config(None, common + [f"method.preset={SPARSE_METHOD}"])
        self.ds_adamw = build_ds_config(DS_CONFIG, self.cfg_dense)
        adam = self.ds_adamw["optimizer"]["params"]
        self.ds_muon = {**self.ds_adamw, "optimizer": {"type": "Muon", "params": {
            "muon_lr": MuonHParams().lr, "momentum": MuonHParams().momentum, "adam_lr": adam["lr"],
            "betas": adam["betas"], "eps": adam["eps"], "weight_decay": adam["weight_decay"], "torch_adam": True}}}
        # ramp_steps 0: the NS correction runs from a matrix's first step (tau = 0 would skip it), so every timed
        # TANS step, warm-up or not, costs what a step costs once the ramp is over.
        self.tans_hp = TansHParams(lr=self.cfg_sparse.method.lr, ramp_steps=0)
        self.muon_hp = MuonHParams()
        self.sparse = None
        self.row_counts: dict[str, dict[str, int]] = {}

    def log(self, msg: str) -> None:
        self.progress(f"[peak {peak_rss_bytes() / 2**30:.1f} GiB] {msg}")

    def time(self, name: str, fn: Callable[[], Any]) -> float:
        """Median time of `fn`, and one more call under the dispatch counter (row `name`)."""
        t = median_time(fn, self.s.warmup, self.s.repeats, self.sync)
        self.count(name, fn)
        return t

    def paired(self, name_a: str, fn_a: Callable[[], Any], name_b: str, fn_b: Callable[[], Any]
               ) -> tuple[float, float, float]:
        out = paired_ratio(fn_a, fn_b, self.s.warmup, self.s.repeats, self.sync)
        self.count(name_a, fn_a)
        self.count(name_b, fn_b)
        return out

    def count(self, name: str, fn: Callable[[], Any]) -> None:
        """Aten ops and host syncs of one untimed call of `fn` on this rank (every rank calls: collectives)."""
        from distsparse.op_count import count_ops
        counts, _ = count_ops(fn)
        self.row_counts[name] = {"ops": counts.ops, "syncs": counts.syncs}

    def dense_step(self, ds_config: dict) -> Callable[[], None]:
        """A DeepSpeed engine over the whole dense model. DeepSpeed keeps its engines alive after `destroy()`
        (references held outside Python's view), so the driver gives each dense engine its own processes."""
        import deepspeed

        from distsparse.models import build_model
        model = build_model(self.cfg_dense.model, self.cfg_dense.method, self.s.vocab, seed=0)
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()),
                                               config=ds_config)
        params = [p for p in model.parameters() if p.requires_grad]
        return _deepspeed_step(engine, params, _synthetic_grads(params, 10 + self.rank))

    def build_sparse(self) -> None:
        import deepspeed

        from distsparse.models import backbone_modules, build_model
        from distsparse.optim.engine import MatrixEngine
        from distsparse.train.deepspeed.config import build_ds_config
        from distsparse.train.trainer import dense_side_parameters
        if self.sparse is not None:
            return
        self.sparse = build_model(self.cfg_sparse.model, self.cfg_sparse.method, self.s.vocab, seed=0)
        self.backbone = backbone_modules(self.sparse)
        groups = dense_side_parameters(self.sparse, self.backbone)
        self.side_params = [p for group in groups for p in group["params"]]
        self.side_engine, _, _, _ = deepspeed.initialize(model=self.sparse, model_parameters=groups,
                                                         config=build_ds_config(DS_CONFIG, self.cfg_sparse))
        self.side_grads = _synthetic_grads(self.side_params, 20 + self.rank)
        self.tans_sharded = MatrixEngine(self.backbone, rule="tans", hparams=self.tans_hp, mode="sharded",
                                         grad_accum_mode="full")
        self.buffer = _synthetic_grads([self.tans_sharded.grad_buffer], 30 + self.rank)[0]

    def full_step(self, matrix, lr: float) -> Callable[[], None]:
        from distsparse.train.joint_step import JointOptimizer
        joint = JointOptimizer(self.side_engine, matrix, grad_clip=self.cfg_sparse.train.grad_clip,
                               backbone_lr=lambda step: lr)
        return _sparse_step(joint, self.side_params, self.side_grads, self.buffer)

    # ---- phases ----------------------------------------------------------------------------------------------

    def phase_dense_adamw(self) -> dict[str, Any]:
        self.log("dense AdamW (DeepSpeed ZeRO-2)")
        return {"opt_step_s": {"dense_adamw": self.time("dense_adamw", self.dense_step(self.ds_adamw))}}

    def phase_deepspeed_muon(self) -> dict[str, Any]:
        self.log("building DeepSpeed Muon")
        muon_step = self.dense_step(self.ds_muon)
        self.log("building the sparse model")
        self.build_sparse()
        self.log("TANS sharded vs DeepSpeed Muon, full steps (paired; DeepSpeed's first call compiles)")
        ratio, t_tans, t_muon = self.paired("tans_sharded", self.full_step(self.tans_sharded, self.tans_hp.lr),
                                            "deepspeed_muon", muon_step)
        return {"opt_step_s": {"tans_sharded": t_tans, "deepspeed_muon": t_muon},
                "tans_sharded_over_deepspeed_muon": ratio}
    def phase_engine(self) -> dict[str, Any]:
        import torch.distributed as dist

        from distsparse.dist import dist_max
        from distsparse.models import backbone_param
        from distsparse.optim.engine import MatrixEngine
        from distsparse.optim.owners import assign_owners, rank_loads
        from distsparse.train.joint_step import JointOptimizer

        self.build_sparse()
        backbone, sharded, hp = self.backbone, self.tans_sharded, self.tans_hp
        times = {}
        self.log("sparse model's dense side alone")
        times["sparse_dense_side"] = self.time("sparse_dense_side", _deepspeed_step(self.side_engine, self.side_params,
                                                                                    self.side_grads))
        replicated = MatrixEngine(backbone, rule="tans", hparams=hp, mode="replicated")
        self.log("TANS sharded vs replicated, matrix engine alone (paired)")
        ratio, times["tans_sharded_backbone"], times["tans_replicated_backbone"] = self.paired(
            "tans_sharded_backbone", _backbone_step(sharded, self.buffer, hp.lr),
            "tans_replicated_backbone", _backbone_step(replicated, self.buffer, hp.lr))
        self.log("TANS replicated and sparse Muon, full steps")
        times["tans_replicated"] = self.time("tans_replicated", self.full_step(replicated, hp.lr))
        del replicated
        muon = MatrixEngine(backbone, rule="muon", hparams=self.muon_hp, mode="sharded", grad_accum_mode="full")
        times["sparse_muon"] = self.time("sparse_muon", self.full_step(muon, self.muon_hp.lr))
        del muon

        # Bytes of bf16 training: bf16 values gathered, fp32 reduce-scatter (the engine's default).
        interval = self.cfg_sparse.method.topology.update_interval
        bf16 = MatrixEngine({n: copy.deepcopy(m).to(torch.bfloat16) for n, m in backbone.items()},
                            rule="tans", hparams=hp, mode="sharded", grad_accum_mode="full")
        sent = bf16.comm_bytes_per_step(interval)
        del bf16
        scalars = JointOptimizer.scalar_bytes_per_step(WORLD_SIZE)   # the step's one all-reduce
        sent = {**sent, "scalars": scalars, "total": sent["total"] + scalars}
        dense_numel = sum(m.out_features * m.in_features for m in backbone.values())
        ring = 2 * (WORLD_SIZE - 1) / WORLD_SIZE

        # State: W = 1 from a one-rank group (every rank creates every group), W = 2 the larger rank's.
        # Optimizer state (fp32 masters, V, P, counters) is what sharding splits 1/W; the fp32 gradient buffer
        # [W * S] is a full copy on every rank (each accumulates its own gradients before the reduce-scatter),
        # so it is reported next to it, and the ratio with it included as well.
        singles = [dist.new_group([r]) for r in range(WORLD_SIZE)]
        one = MatrixEngine(backbone, rule="tans", hparams=hp, mode="sharded", group=singles[self.rank],
                           grad_accum_mode="full")
        buffers = {"W=1": one.grad_buffer.untyped_storage().nbytes(),
                   "W=2": sharded.grad_buffer.untyped_storage().nbytes()}
        own = MatrixEngine(backbone, rule="tans", hparams=hp, mode="sharded", grad_accum_mode="sharded")
        accumulator = int(dist_max(own.grad_bytes()["persistent"]))
        del own
        with_buffer = {"W=1": one.state_bytes(), "W=2": int(dist_max(sharded.state_bytes()))}
        state = {"W=1": with_buffer["W=1"] - buffers["W=1"],
                 "W=2": int(dist_max(sharded.state_bytes() - buffers["W=2"]))}
        state["W=2_over_W=1"] = state["W=2"] / state["W=1"]
        state.update({f"grad_buffer_{w}": b for w, b in buffers.items()})
        state.update({f"with_grad_buffer_{w}": b for w, b in with_buffer.items()})
        state["with_grad_buffer_W=2_over_W=1"] = with_buffer["W=2"] / with_buffer["W=1"]
        state["grad_accumulator_W=2"] = accumulator
        state["derived_cache_W=1"] = one.cache_bytes()
        state["derived_cache_W=2"] = int(dist_max(sharded.cache_bytes()))
        state["with_grad_accumulator_W=2_over_W=1"] = (state["W=2"] + accumulator) / with_buffer["W=1"]

        balance = {}
        for w in (WORLD_SIZE, 4, 8):
            owners = sharded.owners if w == WORLD_SIZE else assign_owners(sharded.costs, w)
            loads = rank_loads(sharded.costs, owners, w)
            balance[w] = max(loads) / (sum(loads) / w)
        return {
            "opt_step_s": times,
            "tans_sharded_over_replicated": ratio,
            "ns_flops_max_over_mean_rank": balance[WORLD_SIZE],
            "backbone_comm_bytes_over_dense_allreduce_bf16": sent["total"] / (ring * dense_numel * 2),
            "backbone_comm_bytes_over_dense_allreduce_fp32": sent["total"] / (ring * dense_numel * 4),
            "backbone_state_bytes_per_rank": state,
            "_extra": {"sent_bf16": sent, "dense_numel": dense_numel, "matrices": len(backbone), "balance": balance,
                       "values": sum(backbone_param(m).numel() for m in backbone.values()),
                       "update_interval": interval, "shard_size": sharded.shard_size},
        }



    def phase_counts(self) -> dict[str, Any]:
        """Op counts of a steady TANS backbone step and the batched step's error (optimizer_counts.py)."""
        hidden, layers = self.cfg_sparse.model.hidden_size, self.cfg_sparse.model.num_hidden_layers
        return {"opt_step_s": {}, **count_phase(self.rank, WORLD_SIZE, self.s.model, self.tans_hp, layers=layers,
                                                width_divisor=max(1, hidden // COUNT_WIDTH), log=self.log)}


def _rank_main(rank: int, world_size: int, s: OptimizerSettings, phases: tuple[str, ...]) -> dict[str, Any]:
    me = _Rank(rank, s)
    result: dict[str, Any] = {"opt_step_s": {}}
    for phase in phases:
        part = getattr(me, f"phase_{phase}")()
        result["opt_step_s"].update(part.pop("opt_step_s"))
        result.update(part)
    result["row_counts"] = me.row_counts
    me.log(f"done: {', '.join(phases)}")
    return result


# ---- driver ------------------------------------------------------------------------------------------------------

def run_ranks(s: OptimizerSettings) -> dict[str, Any]:
    """Run the phases on 2 fresh ranks and merge rank 0's figures. A full run gives each DeepSpeed dense engine
    fresh processes (a 130m dense engine pair would not fit next to the sparse set); --quick runs one pool."""
    if s.eager:   # read by the ranks when they start
        os.environ["TORCH_COMPILE_DISABLE"] = "1"
    phases = ("counts",) if s.counts_only else PHASES
    merged: dict[str, Any] = {"opt_step_s": {}, "row_counts": {}}
    for group in ([phases] if s.quick else [(phase,) for phase in phases]):
        part = on_ranks(None, WORLD_SIZE, _rank_main, s, group)[0]
        merged["opt_step_s"].update(part.pop("opt_step_s"))
        merged["row_counts"].update(part.pop("row_counts"))
        merged.update(part)
    return merged


def _config(s: OptimizerSettings, extra: dict | None, counts: dict, load_start) -> dict[str, Any]:
    """Every setting that moves the numbers; how each figure is made: docs/benchmarks.md#optimizer."""
    config = {
        "model": s.model, "vocab_size": s.vocab, "method": SPARSE_METHOD, "sparsity": "1:4", "layout": "row",
        "world_size": WORLD_SIZE, "backend": "gloo", "threads_per_rank": 1, "dtype": "fp32 (CPU)",
        "quick": s.quick, "counts_only": s.counts_only, "warmup": s.warmup, "repeats": s.repeats,
        "op_counts": "one untimed call per row on rank 0 (distsparse/op_count.py); tans_ops_per_step: one steady "
                     "TANS backbone step on one rank at the model's shapes on the meta device; 2 ranks at widths "
                     f"/ {counts['width_divisor']}",
        "tans_hparams": "paper defaults with ramp_steps 0 (the NS correction on every step)",
        "tans_batched_over_per_matrix_max_rel_err": "2 TANS steps, group kernels vs rules.step_each: max relative "
                                                    "update error, and V, P",
        "targets": TARGETS, "load_average_1_5_15_min": {"start": load_start, "end": os.getloadavg()},
    }
    if extra is None:
        return config
    return {**config,
            "deepspeed": "ZeRO-2 (configs/ds/zero2.json), torch AdamW; Muon: type 'Muon', gram NS, momentum 0.95",
            "deepspeed_muon_kernels": "eager (TORCH_COMPILE_DISABLE=1)" if s.eager else "torch.compile",
            "gradients": "synthetic, injected through autograd (DeepSpeed) or into the engine buffer",
            "statistic": "median over rounds; ratios: median of per-round ratios, paired rounds in alternating order",
            "tans_sharded_over_deepspeed_muon": "sparse model's full step (dense side + engine) / DeepSpeed Muon's",
            "tans_sharded_over_replicated": "matrix engine alone: reduce_gradients + step, sharded / replicated",
            "comm_bytes": "per rank per step, ring model, bf16 training, codes amortized; over 2 (W-1)/W x dense "
                          "numel x bytes",
            "update_interval": extra["update_interval"], "backbone_matrices": extra["matrices"],
            "backbone_values": extra["values"], "backbone_dense_numel": extra["dense_numel"],
            "shard_size": extra["shard_size"],
            "state_bytes": "MatrixEngine.state_bytes() minus the fp32 gradients (grad_buffer_, grad_accumulator_ "
                           "apart); derived_cache_: MatrixEngine.cache_bytes()",
            "grad_accum_mode": "full (the buffer is filled directly); the accumulator from a sharded-mode engine"}


def _mib_pair(state: dict, key: str) -> str:
    return f"{state[f'{key}W=1'] / 2**20:.1f} / {state[f'{key}W=2'] / 2**20:.1f}"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    s, json_path = parse(OptimizerSettings, argv, __doc__.split("\n\n")[0])
    load_start = os.getloadavg()   # the machines are shared: the load next to the numbers says how noisy they are
    result = run_ranks(s)
    extra = result.pop("_extra", None)
    per_row = result.pop("row_counts")
    result["ops_per_step"] = {k: v["ops"] for k, v in per_row.items()}
    result["syncs_per_step"] = {k: v["syncs"] for k, v in per_row.items()}
    names = [k for k in TARGETS if k in result]
    figures = [Figure(k, result.pop(k), TARGETS[k]) for k in names]
    rows: list[list[Any]] = [[f"opt_step_s/{k}", v, result["ops_per_step"].get(k, ""),
                              result["syncs_per_step"].get(k, "")] for k, v in result["opt_step_s"].items()]
    rows += [[what, "", ops, syncs] for what, ops, syncs in count_rows(result["op_counts"])]
    if extra is not None:
        state, sent = result["backbone_state_bytes_per_rank"], extra["sent_bf16"]
        rows += [[f"ns_flops_max_over_mean_rank (W={w})", b, "", ""] for w, b in extra["balance"].items()
                 if int(w) != WORLD_SIZE]
        rows += [[f"state bytes W=2 / W=1 (target <= {TARGETS['state_W2_over_W1']})", state["W=2_over_W=1"], "", ""],
                 ["state bytes W=1 / W=2 (MiB)", _mib_pair(state, ""), "", ""],
                 ["derived cache W=1 / W=2 (MiB)", _mib_pair(state, "derived_cache_"), "", ""],
                 ["state + grad buffer W=2 / W=1", state["with_grad_buffer_W=2_over_W=1"], "", ""],
                 ["grad buffer W=1 / W=2 (MiB)", _mib_pair(state, "grad_buffer_"), "", ""],
                 ["state + grad accumulator W=2 / W=1", state["with_grad_accumulator_W=2_over_W=1"], "", ""],
                 ["sent/rank/step bf16 (MiB): reduce+values+codes+scalars",
                  (f"{sent['reduce'] / 2**20:.2f}+{sent['values'] / 2**20:.2f}+{sent['codes'] / 2**20:.4f}"
                   f"+{sent['scalars']:.0f}B"), "", ""]]
    timed = "counts only" if s.counts_only else f"{s.repeats} timed rounds"
    return finish(json_path, figures, result, _config(s, extra, result["op_counts"], load_start),
                  [(["figure", "value", "ops/step", "syncs/step"], rows)],
                  f"{s.model} shapes, vocab {s.vocab}, 1:4 row-wise, {WORLD_SIZE} gloo ranks x 1 thread, {timed}")


if __name__ == "__main__":
    main()
