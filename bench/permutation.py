"""ShuffleSparse input permutations (issue 8): their cost in training and inference. A 60m 1:4 row-wise model
(chts24_1of4_row, vocab 32000) with permutations against the same model without them, in this run:
`train_step_ratio_soft` (<= 1.15) and `train_step_ratio_hard` (<= 1.03), one training step with soft or hardened
permutations over one without; `memory_ratio_soft` (<= 1.15), peak tensor bytes of training, soft over none;
`infer_ratio_hard` (<= 1.05), one inference forward with hardened permutations folded where exact. What each step
holds, why CPU seconds and why tensor bytes: docs/benchmarks.md.

    python -m bench.permutation --json out.json
    python -m bench.permutation --quick --json out.json     # tiny model, for the test suite
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from bench.core import Figure, Settings, finish, paired_cpu_and_wall, parse, progress
from bench.memory import LiveTensorBytes
from distsparse.config import Config, load_config
from distsparse.layers.fold import fold_permutations
from distsparse.layers.permutation import BlockPermutation
from distsparse.layers.permutation_math import perm_lambda
from distsparse.models import build_model
from distsparse.op_count import count_ops
from distsparse.train.permutation_policy import PermutationPolicy

PRESET = "chts24_1of4_row"
VOCAB = 32000               # quick runs too: its head and logits lift the training peak well above the imports'
TOTAL_STEPS = 10000          # the penalty is timed at T_perm / 2, where lambda_t = lambda_max / 2 > 0
LR = 1e-4                    # small, so the timed steps stay finite without a schedule or clipping
MEMORY_STEPS = 2             # the first step allocates AdamW's state, the second peaks with it held
TARGETS = {"train_step_ratio_soft": 1.15, "train_step_ratio_hard": 1.03, "memory_ratio_soft": 1.15,
           "infer_ratio_hard": 1.05}
VARIANTS = ("none", "soft", "hard")


@dataclass
class PermutationSettings(Settings):
    model: str = "60m"
    threads: int = 1          # torch CPU threads (one rank's share of 2 cores)
    block_size: int = 32      # the largest power of two dividing both 60m widths, 512 and 1376
    batch: int = 4            # sequences per micro-batch
    seq_len: int = 256        # the GaLore/CHTs sequence length
    warmup: int = 2           # untimed rounds per figure
    repeats: int = 7          # timed rounds per figure
    seed: int = 0
    QUICK = {"model": "tiny", "block_size": 16, "batch": 2, "seq_len": 64, "warmup": 1, "repeats": 2}

    def __post_init__(self) -> None:
        self.at_least(threads=1, block_size=1, batch=1, seq_len=1, repeats=1, warmup=0)


def run_config(model: str, variant: str, block_size: int) -> Config:
    mode = "none" if variant == "none" else "learned"
    return load_config(None, [f"model.preset={model}", f"method.preset={PRESET}", f"method.permutation.mode={mode}",
                              f"method.permutation.block_size={block_size}", f"train.steps={TOTAL_STEPS}"])


@torch.no_grad()
def harden_random(model: nn.Module, seed: int) -> None:
    """Every block hardened from a random theta: real block permutations, as after training (fresh theta leads
    with the identity, whose gather would read memory in order)."""
    gen = torch.Generator().manual_seed(seed)
    for perm in {id(m): m for m in model.modules() if isinstance(m, BlockPermutation)}.values():
        perm.theta.copy_(torch.rand(perm.theta.shape, generator=gen))
        perm.harden_all()


def build(s: PermutationSettings, variant: str) -> tuple[nn.Module, Config]:
    cfg = run_config(s.model, variant, s.block_size)
    model = build_model(cfg.model, cfg.method, VOCAB, s.seed)
    if variant == "hard":
        harden_random(model, s.seed)
    return model, cfg


def train_step_fn(model: nn.Module, cfg: Config, ids: torch.Tensor) -> Callable[[], float]:
    """One step as the trainer computes the loss (LM loss + permutation penalty of the soft blocks), with AdamW."""
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    policy = PermutationPolicy(cfg.method.permutation, model, TOTAL_STEPS)
    step = policy.t_perm // 2

    def run() -> float:
        optimizer.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        penalty = policy.penalty(step)
        if penalty is not None:
            loss = loss + penalty
        loss.backward()
        optimizer.step()
        return loss.item()
    return run


def infer_fn(model: nn.Module, ids: torch.Tensor) -> Callable[[], torch.Tensor]:
    model.eval()

    def run() -> torch.Tensor:
        with torch.inference_mode():
            return model(input_ids=ids).logits
    return run


def peak_training_bytes(model: nn.Module, cfg: Config, ids: torch.Tensor) -> int:
    """Peak live tensor bytes over MEMORY_STEPS steps of a fresh AdamW (memory.LiveTensorBytes)."""
    step = train_step_fn(model, cfg, ids)
    tracker = LiveTensorBytes()
    tracker.hold([*model.parameters(), *model.buffers(), ids])
    with tracker:
        for _ in range(MEMORY_STEPS):
            step()
    return tracker.peak


def main(argv: list[str] | None = None) -> dict[str, Any]:
    s, json_path = parse(PermutationSettings, argv, __doc__.split("\n\n")[0])
    torch.set_num_threads(s.threads)
    models = {variant: build(s, variant) for variant in VARIANTS}
    ids = torch.randint(0, VOCAB, (s.batch, s.seq_len), generator=torch.Generator().manual_seed(s.seed + 1))
    memory = {variant: peak_training_bytes(model, cfg, ids) for variant, (model, cfg) in models.items()}

    steps = {variant: train_step_fn(model, cfg, ids) for variant, (model, cfg) in models.items()}
    hard, none = models["hard"][0], models["none"][0]
    ratios, wall_ratios, seconds, spread, log = {}, {}, {}, {}, progress("bench.permutation")

    def pair(key: str, with_perm: Callable, without: Callable, name_a: str, name_b: str) -> list[float]:
        r = paired_cpu_and_wall(with_perm, without, s.warmup, s.repeats)
        ratios[key], wall_ratios[key] = r["ratio"], r["wall_ratio"]
        seconds[name_a] = {"cpu": r["cpu_a"], "wall": r["wall_a"]}
        seconds[name_b] = {"cpu": r["cpu_b"], "wall": r["wall_b"]}
        log(f"{key} cpu {r['ratio']:.3f} wall {r['wall_ratio']:.3f}")
        return [min(r["ratios"]), max(r["ratios"])]

    for variant in ("soft", "hard"):
        spread[f"train_step_ratio_{variant}"] = pair(f"train_step_ratio_{variant}", steps[variant], steps["none"],
                                                     f"train_{variant}", f"train_none_vs_{variant}")
    # Device-independent: what each variant dispatches in a warm step (the timed rounds ran it already).
    train_ops = {variant: count_ops(step)[0].ops for variant, step in steps.items()}
    steps.clear()
    fold = fold_permutations(hard)
    pair("infer_ratio_hard", infer_fn(hard, ids), infer_fn(none, ids), "infer_hard_folded", "infer_none")
    ratios["memory_ratio_soft"] = memory["soft"] / memory["none"]
    cfg = models["soft"][1]
    policy = PermutationPolicy(cfg.method.permutation, models["soft"][0], TOTAL_STEPS)
    step = policy.t_perm // 2
    perm_params = sum(p.numel() for p in models["soft"][0].parameters()) - sum(p.numel() for p in none.parameters())

    config = {
        "quick": s.quick, "model": s.model, "preset": PRESET, "sparsity": cfg.method.sparsity,
        "layout": cfg.method.layout, "vocab": VOCAB, "block_size": s.block_size,
        "micro_batch": [s.batch, s.seq_len], "threads": s.threads,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "dtype": "fp32", "world_size": 1,
        "optimizer": f"torch.optim.AdamW(lr={LR}) over all parameters (not the project's Trainer)",
        "penalty": {"step": step, "t_perm": policy.t_perm,
                    "lambda": perm_lambda(step, cfg.method.permutation.lambda_max, policy.t_perm)},
        "permutation_parameters": perm_params, "warmup": s.warmup, "repeats": s.repeats, "seed": s.seed,
        "memory_steps": MEMORY_STEPS,
        "statistic": "median over paired rounds (alternating order) of t_with / t_without, t = process CPU "
                     "seconds of the call (wall_ratios: the same rounds on the wall clock)",
        "ops": "aten ops of one warm training step per variant (distsparse.op_count.count_ops, views included); "
               "round_ratio_range: min and max of the per-round CPU ratios behind each median",
        "memory": "peak live tensor bytes over the training steps (LiveTensorBytes: params, buffers, ids held, "
                  "plus every storage an aten op allocates until it is freed)",
        "fold": {"folded": sorted(fold["folded"]), "kept": len(fold["kept"])},
        "targets": TARGETS,
    }
    rest = {"wall_ratios": wall_ratios, "round_ratio_range": spread, "train_step_ops": train_ops,
            "train_step_ops_ratio_hard": train_ops["hard"] / train_ops["none"], "seconds": seconds,
            "memory_peak_bytes": memory, "load_average": os.getloadavg()}
    head = (f"{s.model} 1:4 row-wise, vocab {VOCAB}, block {s.block_size}, micro-batch {s.batch} x {s.seq_len}, "
            f"{s.threads} thread(s), {s.repeats} paired rounds, load average {os.getloadavg()[0]:.1f}; "
            f"{len(fold['folded'])} gathers folded, {len(fold['kept'])} projections keep theirs; aten ops per "
            f"training step {train_ops}; wall-clock ratios {wall_ratios}")
    mib = {name: memory[name] / 2**20 for name in VARIANTS}
    sec = {k: (v["cpu"], v["wall"]) for k, v in seconds.items()}
    table = [["none", *sec["train_none_vs_soft"], *sec["infer_none"], mib["none"]],
             ["soft", *sec["train_soft"], "-", "-", mib["soft"]],
             ["hard", *sec["train_hard"], *sec["infer_hard_folded"], mib["hard"]]]
    return finish(json_path, [Figure(key, ratios[key], target) for key, target in TARGETS.items()], rest, config,
                  [(["variant", "train cpu s", "train wall s", "infer cpu s", "infer wall s", "peak tensor MiB"],
                    table)], head)


if __name__ == "__main__":
    main()
