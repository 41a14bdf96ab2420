"""Benchmark of ShuffleSparse input permutations (issue 8): their cost in training and inference.

Every figure compares a `60m` 1:4 row-wise model (preset chts24_1of4_row, vocab 32000) with permutations
against the same model built without them (`method.permutation.mode=none`), both measured in this run:

1. `train_step_ratio_soft` (target <= 1.15): one training step (forward, backward, optimizer step of one process)
   with learned permutations in their soft phase (per-block doubly stochastic matmul and Sinkhorn on theta once
   per distinct input and forward: q/k/v and gate/up reuse their shared module's output; the penalty lambda_t * sum(l1 - l2) added to the loss as the trainer does) over the same step without
   permutations. The optimizer is a plain `torch.optim.AdamW` over all parameters for both variants, not the
   project's Trainer (DeepSpeed + matrix engine): the permutations add work to the forward and backward only,
   and their parameters (d x b per group) are < 2% of the model, so the optimizer is the same on both sides.
   The hardening check that the trainer runs every `check_interval` steps is not timed.
2. `train_step_ratio_hard` (target <= 1.03): the same with every permutation hardened (`harden_all` on random
   theta, so the gathers read real block permutations): index gathers only (one per distinct input: qkv, o,
   gate_up, down), theta unread.
3. `memory_ratio_soft` (target <= 1.15): peak tensor memory of training, soft over none. Counted by a tracking
   dispatch mode (`LiveTensorBytes`): the parameters, buffers and token ids held at the start plus every storage an
   aten op allocates during MEMORY_STEPS training steps from a fresh AdamW (activations, gradients, AdamW state,
   temporaries), each from its allocation until its storage is freed; the figure is the peak of that sum. It is
   exactly the tensor bytes the permutations add (theta, its gradient and AdamW state, the permuted inputs and
   block products kept for backward, Sinkhorn intermediates), and nothing else: not allocator slack, not the
   interpreter. DESIGN s6's `ru_maxrss` of fresh processes was tried first and dropped here: at the quick shapes
   it put soft 11% *below* none, allocator noise larger than the effect being measured.
4. `infer_ratio_hard` (target <= 1.05): one inference forward (eval, inference_mode, logits of the whole batch)
   with hardened permutations folded where exact (distsparse/layers/fold.py: down_proj's and o_proj's gathers go
   into gate/up and v rows; q, k, v, gate and up keep their gathers) over the model without permutations.

Timing is paired and interleaved (tools/benchlib.paired_ratio: both variants every round, alternating order, median
of per-round ratios). The figures use the process CPU time of each call (`time.process_time`), wall-clock ratios
are reported next to them (`wall_ratios`): on a shared VM whose load exceeds its cores, a step that waits for a
core accrues wall time but no CPU time, and with one thread CPU time is the step's busy time; on a quiet machine
the two agree. Block size 32 by default: the largest power of two dividing both 60m widths, 512 and the FFN
width 1376 (the config default 64 does not divide 1376). One CPU thread by default, as each of 2 ranks gets on 2
cores; the micro-batch is 4 x 256 tokens (the GaLore/CHTs sequence length).

    python tools/bench_permutation.py --json out.json
    python tools/bench_permutation.py --quick --json out.json     # tiny model, for the test suite
"""

from __future__ import annotations

import argparse
import os
import sys
import weakref
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from benchlib import add_json_arg, count_ops, machine_info, paired_cpu_and_wall, print_table, write_json
from distsparse.config import Config, load_config
from distsparse.layers.fold import fold_permutations
from distsparse.layers.permutation import BlockPermutation
from distsparse.layers.permutation_math import perm_lambda
from distsparse.models import build_model
from distsparse.train.permutation_policy import PermutationPolicy

PRESET = "chts24_1of4_row"
VOCAB = 32000               # quick runs too: its head and logits lift the training peak well above the imports'
TOTAL_STEPS = 10000          # the penalty is timed at T_perm / 2, where lambda_t = lambda_max / 2 > 0
LR = 1e-4                    # small, so the timed steps stay finite without a schedule or clipping
MEMORY_STEPS = 2             # the first step allocates AdamW's state, the second peaks with it held
TARGETS = {"train_step_ratio_soft": 1.15, "train_step_ratio_hard": 1.03, "memory_ratio_soft": 1.15,
           "infer_ratio_hard": 1.05}
VARIANTS = ("none", "soft", "hard")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_json_arg(p)
    p.add_argument("--quick", action="store_true", help="tiny model, small batch, few rounds (smoke test)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: one rank's share)")
    p.add_argument("--block-size", type=int, default=None, help="permutation block size (default 32; 16 quick)")
    p.add_argument("--batch", type=int, default=None, help="sequences per micro-batch (default 4; 2 quick)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 256; 64 quick)")
    p.add_argument("--warmup", type=int, default=None, help="untimed rounds per figure (default 2; 1 quick)")
    p.add_argument("--repeats", type=int, default=None, help="timed rounds per figure (default 7; 2 quick)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.model = "tiny" if args.quick else "60m"
    args.vocab = VOCAB
    args.block_size = args.block_size or (16 if args.quick else 32)
    args.batch = args.batch or (2 if args.quick else 4)
    args.seq_len = args.seq_len or (64 if args.quick else 256)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    args.repeats = args.repeats if args.repeats is not None else (2 if args.quick else 7)
    for key in ("threads", "block_size", "batch", "seq_len", "repeats"):
        if getattr(args, key) < 1:
            p.error(f"--{key.replace('_', '-')}: got {getattr(args, key)}; allowed: an integer >= 1")
    if args.warmup < 0:
        p.error(f"--warmup: got {args.warmup}; allowed: an integer >= 0")
    return args


def run_config(model: str, variant: str, block_size: int) -> Config:
    mode = "none" if variant == "none" else "learned"
    return load_config(None, [f"model.preset={model}", f"method.preset={PRESET}", f"method.permutation.mode={mode}",
                              f"method.permutation.block_size={block_size}", f"train.steps={TOTAL_STEPS}"])


def permutations(model: nn.Module) -> list[BlockPermutation]:
    return list({id(m): m for m in model.modules() if isinstance(m, BlockPermutation)}.values())


@torch.no_grad()
def harden_random(model: nn.Module, seed: int) -> None:
    """Every block hardened from a random theta: real block permutations, as after training (fresh theta leads
    with the identity, whose gather would read memory in order)."""
    gen = torch.Generator().manual_seed(seed)
    for perm in permutations(model):
        perm.theta.copy_(torch.rand(perm.theta.shape, generator=gen))
        perm.harden_all()


def build(args: argparse.Namespace, variant: str) -> tuple[nn.Module, Config]:
    cfg = run_config(args.model, variant, args.block_size)
    model = build_model(cfg.model, cfg.method, args.vocab, args.seed)
    if variant == "hard":
        harden_random(model, args.seed)
    return model, cfg


def penalty_step(policy: PermutationPolicy) -> int:
    return policy.t_perm // 2


def train_step_fn(model: nn.Module, cfg: Config, ids: torch.Tensor) -> Callable[[], float]:
    """One step as the trainer computes the loss (LM loss + permutation penalty of the soft blocks), with AdamW."""
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    policy = PermutationPolicy(cfg.method.permutation, model, TOTAL_STEPS)
    step = penalty_step(policy)

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


def tokens(args: argparse.Namespace) -> torch.Tensor:
    gen = torch.Generator().manual_seed(args.seed + 1)
    return torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=gen)


class LiveTensorBytes(TorchDispatchMode):
    """Bytes of live tensor storages, and their peak, while the mode is active (module docstring, figure 3).

    Every storage is counted once (views share it), from the op that returns it, or from `hold` for tensors that
    exist before, until Python frees it (a weakref finalizer subtracts it). Storages that an op allocates and frees
    internally without returning them are not seen; both variants run the same ops apart from the permutations.
    """

    def __init__(self) -> None:
        super().__init__()
        self._seen = WeakIdKeyDictionary()
        self.current = self.peak = 0

    def hold(self, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            self._count(t)

    def _free(self, nbytes: int) -> None:
        self.current -= nbytes

    def _count(self, t: Any) -> None:
        if not isinstance(t, torch.Tensor):
            return
        storage = t.untyped_storage()
        if storage in self._seen:
            return
        nbytes = self._seen[storage] = storage.nbytes()
        weakref.finalize(storage, self._free, nbytes)
        self.current += nbytes
        self.peak = max(self.peak, self.current)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            self._count(t)
        return out


def peak_training_bytes(model: nn.Module, cfg: Config, ids: torch.Tensor) -> int:
    """Peak live tensor bytes over MEMORY_STEPS steps of a fresh AdamW (LiveTensorBytes)."""
    step = train_step_fn(model, cfg, ids)
    tracker = LiveTensorBytes()
    tracker.hold([*model.parameters(), *model.buffers(), ids])
    with tracker:
        for _ in range(MEMORY_STEPS):
            step()
    return tracker.peak


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    models = {variant: build(args, variant) for variant in VARIANTS}
    ids = tokens(args)
    memory = {variant: peak_training_bytes(model, cfg, ids) for variant, (model, cfg) in models.items()}

    steps = {variant: train_step_fn(model, cfg, ids) for variant, (model, cfg) in models.items()}
    ratios, wall_ratios, seconds, spread = {}, {}, {}, {}
    for variant in ("soft", "hard"):
        r = paired_cpu_and_wall(steps[variant], steps["none"], args.warmup, args.repeats)
        key = f"train_step_ratio_{variant}"
        ratios[key], wall_ratios[key] = r["ratio"], r["wall_ratio"]
        seconds[f"train_{variant}"] = {"cpu": r["cpu_a"], "wall": r["wall_a"]}
        seconds[f"train_none_vs_{variant}"] = {"cpu": r["cpu_b"], "wall": r["wall_b"]}
        spread[key] = [min(r["ratios"]), max(r["ratios"])]
        print(f"bench_permutation: train {variant}/none cpu {r['ratio']:.3f} wall {r['wall_ratio']:.3f}",
              file=sys.stderr, flush=True)
    # Device-independent: what each variant dispatches in a warm step (the timed rounds ran it already).
    train_ops = {variant: count_ops(step)[0].ops for variant, step in steps.items()}
    steps.clear()

    hard = models["hard"][0]
    fold = fold_permutations(hard)
    r = paired_cpu_and_wall(infer_fn(hard, ids), infer_fn(models["none"][0], ids), args.warmup, args.repeats)
    ratios["infer_ratio_hard"], wall_ratios["infer_ratio_hard"] = r["ratio"], r["wall_ratio"]
    seconds["infer_hard_folded"] = {"cpu": r["cpu_a"], "wall": r["wall_a"]}
    seconds["infer_none"] = {"cpu": r["cpu_b"], "wall": r["wall_b"]}
    ratios["memory_ratio_soft"] = memory["soft"] / memory["none"]
    cfg = models["soft"][1]
    policy = PermutationPolicy(cfg.method.permutation, models["soft"][0], TOTAL_STEPS)
    step = penalty_step(policy)
    perm_params = sum(p.numel() for p in models["soft"][0].parameters()) - \
        sum(p.numel() for p in models["none"][0].parameters())

    config = {
        "quick": args.quick, "model": args.model, "preset": PRESET, "sparsity": cfg.method.sparsity,
        "layout": cfg.method.layout, "vocab": args.vocab, "block_size": args.block_size,
        "micro_batch": [args.batch, args.seq_len], "threads": args.threads,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "dtype": "fp32", "world_size": 1,
        "optimizer": f"torch.optim.AdamW(lr={LR}) over all parameters (not the project's Trainer)",
        "penalty": {"step": step, "t_perm": policy.t_perm,
                    "lambda": perm_lambda(step, cfg.method.permutation.lambda_max, policy.t_perm)},
        "permutation_parameters": perm_params, "warmup": args.warmup, "repeats": args.repeats, "seed": args.seed,
        "memory_steps": MEMORY_STEPS,
        "statistic": "median over paired rounds (alternating order) of t_with / t_without, t = process CPU "
                     "seconds of the call (wall_ratios: the same rounds on the wall clock)",
        "ops": "aten ops of one warm training step per variant (benchlib.count_ops, views included); "
               "round_ratio_range: min and max of the per-round CPU ratios behind each median",
        "memory": "peak live tensor bytes over the training steps (LiveTensorBytes: params, buffers, ids held, "
                  "plus every storage an aten op allocates until it is freed)",
        "fold": {"folded": sorted(fold["folded"]), "kept": len(fold["kept"])},
        "targets": TARGETS,
    }
    payload = {**ratios, "machine": machine_info(), "config": config, "wall_ratios": wall_ratios,
               "round_ratio_range": spread, "train_step_ops": train_ops,
               "train_step_ops_ratio_hard": train_ops["hard"] / train_ops["none"],
               "seconds": seconds, "memory_peak_bytes": memory, "load_average": os.getloadavg()}
    if args.json:
        write_json(args.json, payload)

    print(f"\n{args.model} 1:4 row-wise, vocab {args.vocab}, block {args.block_size}, micro-batch {args.batch} x "
          f"{args.seq_len}, {args.threads} thread(s), {args.repeats} paired rounds, load average "
          f"{os.getloadavg()[0]:.1f}; {len(fold['folded'])} gathers folded, {len(fold['kept'])} projections keep theirs; "
          f"aten ops per training step {train_ops}")
    mib = {name: memory[name] / 2**20 for name in VARIANTS}
    print_table(["variant", "train cpu s", "train wall s", "infer cpu s", "infer wall s", "peak tensor MiB"],
                [["none", seconds["train_none_vs_soft"]["cpu"], seconds["train_none_vs_soft"]["wall"],
                  seconds["infer_none"]["cpu"], seconds["infer_none"]["wall"], mib["none"]],
                 ["soft", seconds["train_soft"]["cpu"], seconds["train_soft"]["wall"], "-", "-", mib["soft"]],
                 ["hard", seconds["train_hard"]["cpu"], seconds["train_hard"]["wall"],
                  seconds["infer_hard_folded"]["cpu"], seconds["infer_hard_folded"]["wall"], mib["hard"]]])
    print()
    print_table(["figure", "value", "wall clock", "target <=", "verdict"],
                [[key, ratios[key], wall_ratios.get(key, "-"), target, "met" if ratios[key] <= target else "MISSED"]
                 for key, target in TARGETS.items()])
    return payload


if __name__ == "__main__":
    main()
