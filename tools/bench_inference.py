"""Inference benchmark: measured 2:4 speedup on NVIDIA GPUs and the CSR surrogate for 1:4 (issue 9 item 4).

CHTsNM paper App. M (Tables A11, A12); research/sparse_kernels.md s1 (PyTorch semi-structured API), s4 (CSR
surrogate), s5 (how to measure 2:4).

GPU part (CUDA, compute capability >= 8.0; skipped elsewhere with the reason in the JSON, never estimated):
for each model size, a LlamaForCausalLM (vocab 32000) in bf16 whose 7 projections per layer hold a row-wise 2:4
backbone (legal random masks, distsparse.nm.mask_from_scores: kernel speed does not depend on the values). Two
engines from the same weights (paper App. M.2): `dense` runs nn.Linear on the weights with their zeros, `2:4` runs
`torch.sparse.to_sparse_semi_structured` weights (cuSPARSELt when torch has it, else CUTLASS); embeddings, norms and
head are dense in both. Batch 8 x sequence 128 and 256, 20 warmup and 100 timed forwards each (CUDA events around the
100), same process. A weight whose shape is not a multiple of the kernel's tile (cuSPARSELt bf16: 16 x 16; CUTLASS:
32 x 64; e.g. the 1b FFN width 5464) is zero-padded; the 2:4 engine pads the activation and slices the output inside
the timed forward, so the padding is paid, and the JSON lists every padded shape.

CSR part (any machine): R_CSR = t(2:4 CSR) / t(1:4 CSR) for the projections of one decoder layer (4 x [d, d],
2 x [ff, d], 1 x [d, ff], ff the rounded FFN width), both masks row-wise on weights of the same shapes, the same
activations X [tokens, in] for both, `F.linear(X, W_csr)` (research s4.2: the nnz-proportional path; torch.sparse.mm
was erratic), fp32 (MKL's CSR kernels have no bf16), one backend for both. Paired rounds: in each round every distinct
shape runs at 1:4 and at 2:4 back to back (order alternating between rounds), the round's ratio is
sum_s mult_s * t24_s / sum_s mult_s * t14_s, and R_CSR is the median over rounds; per-shape medians are reported too.
A ratio outside [1.3, 2.3] is flagged: halving the kept values should roughly halve CSR time (paper: 1.74-1.88;
research s4.2: 1.78-2.04 at 2048 tokens).

Projected 1:4 speedup = S_2:4 x R_CSR (paper App. M.3), with S_2:4 the mean of the seq-128 and seq-256 speedups
measured here, or, where this run has no GPU measurement for the size, the paper's Table A11 value (RTX 5080,
TensorRT), labelled `assumed`.

    python tools/bench_inference.py --json out.json                        # sizes 60m..1b
    python tools/bench_inference.py --models 130m,350m,1b --tokens 256 --json out.json
    python tools/bench_inference.py --quick --json out.json                # tiny shapes, for the test suite
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import warnings
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import LlamaForCausalLM

from benchlib import add_json_arg, machine_info, paired_ratio, print_table, write_json
from distsparse.config import ModelConfig, load_config
from distsparse.models import llama_config, projection_names
from distsparse.nm import NMSpec, mask_from_scores, random_mask

SIZES = ("60m", "130m", "250m", "350m", "1b")
QUICK_SIZES = ("tiny", "small")
VOCAB = 32000                  # DESIGN s6: benchmark shapes use the paper's vocabulary
BATCH = 8
SEQ_LENS = (128, 256)
RATIO_RANGE = (1.3, 2.3)
# CHTsNM paper Table A11: measured 2:4 speedups (seq 128, seq 256), RTX 5080, TensorRT 10.15, bf16.
PAPER_A11 = {"60m": (1.17, 1.20), "130m": (1.24, 1.31), "250m": (1.43, 1.38), "350m": (1.42, 1.49),
             "1b": (1.66, 1.65)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_json_arg(p)
    p.add_argument("--quick", action="store_true", help="tiny and small shapes, few repeats (smoke test)")
    p.add_argument("--models", default=None, help=f"comma-separated sizes (default {','.join(SIZES)}; "
                                                  f"{','.join(QUICK_SIZES)} with --quick)")
    p.add_argument("--tokens", type=int, default=None, help="CSR activation rows (default 256; 32 with --quick)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads for the CSR part (default 1)")
    p.add_argument("--warmup", type=int, default=None, help="CSR untimed rounds (default 1)")
    p.add_argument("--repeats", type=int, default=None, help="CSR paired rounds (default 5; 3 with --quick)")
    p.add_argument("--gpu-warmup", type=int, default=None, help="GPU warmup forwards (default 20; 2 with --quick)")
    p.add_argument("--gpu-iters", type=int, default=None, help="GPU timed forwards (default 100; 5 with --quick)")
    p.add_argument("--backend", default="auto", choices=("auto", "cusparselt", "cutlass"),
                   help="2:4 kernel library (auto: cuSPARSELt when available)")
    p.add_argument("--skip-csr", action="store_true", help="GPU part only")
    args = p.parse_args(argv)
    args.models = (args.models or ",".join(QUICK_SIZES if args.quick else SIZES)).split(",")
    defaults = {"tokens": (256, 32), "warmup": (1, 1), "repeats": (5, 3), "gpu_warmup": (20, 2), "gpu_iters": (100, 5)}
    for key, (full, quick) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, quick if args.quick else full)
    for key in ("tokens", "threads", "repeats", "gpu_iters", "warmup", "gpu_warmup"):
        least = 0 if "warmup" in key else 1
        if getattr(args, key) < least:
            p.error(f"--{key.replace('_', '-')}: got {getattr(args, key)}; allowed: >= {least}")
    return args


def model_config(size: str) -> ModelConfig:
    try:
        return load_config(None, [f"model.preset={size}"]).model
    except ValueError as err:
        raise SystemExit(f"--models: {size!r}: {err}") from None


def layer_shapes(cfg: ModelConfig) -> list[tuple[tuple[int, int], int]]:
    """((out, in), multiplicity) of one decoder layer's projections: q, k, v, o; gate, up; down."""
    d, ff = cfg.hidden_size, cfg.ffn_width
    return [((d, d), 4), ((ff, d), 2), ((d, ff), 1)]


# ---- CSR surrogate ---------------------------------------------------------------------------------------------

def csr_weight(out_f: int, in_f: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """A CSR weight with exactly one stored value per kept position of a random row-wise n:4 mask (values put in
    after the conversion: a dense randn * mask would drop the rare exact zeros)."""
    pattern = random_mask(out_f, in_f, NMSpec(n, 4, "row"), gen).float().to_sparse_csr()
    values = torch.randn(pattern.values().shape, generator=gen)
    return torch.sparse_csr_tensor(pattern.crow_indices(), pattern.col_indices(), values, (out_f, in_f),
                                   check_invariants=True)


def csr_ratio(cfg: ModelConfig, tokens: int, warmup: int, repeats: int, gen: torch.Generator) -> dict[str, Any]:
    """R_CSR of one decoder layer: per round, every distinct shape runs at 1:4 and 2:4 back to back (order alternating
    between rounds) on the same activations, the round's ratio is sum_s mult_s * t24_s / sum_s mult_s * t14_s, and
    R_CSR is the median over rounds, so a burst of load hits both sides of one round."""
    cases = []
    for (out_f, in_f), mult in layer_shapes(cfg):
        x = torch.randn(tokens, in_f, generator=gen)          # the same activations for both sparsities
        w14, w24 = csr_weight(out_f, in_f, 1, gen), csr_weight(out_f, in_f, 2, gen)
        assert w24._nnz() == 2 * w14._nnz(), (w24._nnz(), w14._nnz())
        cases.append((f"{out_f}x{in_f}", mult, lambda x=x, w=w14: F.linear(x, w), lambda x=x, w=w24: F.linear(x, w)))
    for _, _, f14, f24 in cases * warmup:
        f14()
        f24()
    times = {name: ([], []) for name, _, _, _ in cases}   # shape -> (t14 per round, t24 per round)
    round_ratios = []
    for r in range(repeats):
        for name, _, f14, f24 in cases:
            # benchlib.paired_ratio with one round times its first callable first: swap the pair every round.
            if r % 2 == 0:
                _, t14, t24 = paired_ratio(f14, f24, 0, 1)
            else:
                _, t24, t14 = paired_ratio(f24, f14, 0, 1)
            times[name][0].append(t14)
            times[name][1].append(t24)
        round_ratios.append(sum(m * times[n][1][r] for n, m, _, _ in cases) /
                            sum(m * times[n][0][r] for n, m, _, _ in cases))
    shapes = {name: {"multiplicity": mult, "t14_ms": statistics.median(times[name][0]) * 1e3,
                     "t24_ms": statistics.median(times[name][1]) * 1e3,
                     "paired_ratio": statistics.median(b / a for a, b in zip(*times[name]))}
              for name, mult, _, _ in cases}
    return {"ratio": statistics.median(round_ratios), "round_ratios": round_ratios,
            "layer_t14_ms": sum(v["multiplicity"] * v["t14_ms"] for v in shapes.values()),
            "layer_t24_ms": sum(v["multiplicity"] * v["t24_ms"] for v in shapes.values()),
            "shapes": shapes, "hidden": cfg.hidden_size, "ffn": cfg.ffn_width}


# ---- GPU 2:4 ---------------------------------------------------------------------------------------------------

class SemiStructuredLinear(nn.Module):
    """y = x W^T with W held as a zero-padded 2:4 semi-structured tensor; pads x and slices y in the forward, so a
    benchmark pays for the padding."""

    def __init__(self, weight: torch.Tensor, tile: tuple[int, int]):
        super().__init__()
        from torch.sparse import to_sparse_semi_structured
        self.out_features, self.in_features = weight.shape
        self.pad_out, self.pad_in = -self.out_features % tile[0], -self.in_features % tile[1]
        padded = F.pad(weight.detach(), (0, self.pad_in, 0, self.pad_out)).contiguous()
        self.weight = to_sparse_semi_structured(padded)   # a tensor subclass, deliberately not a Parameter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.pad_in:
            x2 = F.pad(x2, (0, self.pad_in))
        y = F.linear(x2, self.weight)
        if self.pad_out:
            y = y[:, :self.out_features]
        return y.reshape(*lead, self.out_features)


def gpu_skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False): 2:4 semi-structured kernels are CUDA-only"
    major, minor = torch.cuda.get_device_capability()
    if major < 8:
        return f"compute capability {major}.{minor} < 8.0: no sparse tensor cores"
    return None


def select_backend(name: str) -> tuple[str, tuple[int, int]]:
    """Set PyTorch's semi-structured backend; returns its name and the bf16 tile (rows, cols) weights must fill."""
    from torch.sparse import (SparseSemiStructuredTensor, SparseSemiStructuredTensorCUSPARSELT,
                              SparseSemiStructuredTensorCUTLASS)
    have_cslt = torch.backends.cusparselt.is_available()
    if name == "cusparselt" and not have_cslt:
        raise SystemExit("--backend cusparselt: this torch build has no cuSPARSELt")
    use_cutlass = name == "cutlass" or (name == "auto" and not have_cslt)
    SparseSemiStructuredTensor._FORCE_CUTLASS = use_cutlass
    cls = SparseSemiStructuredTensorCUTLASS if use_cutlass else SparseSemiStructuredTensorCUSPARSELT
    tile = cls._DTYPE_SHAPE_CONSTRAINTS[torch.bfloat16]
    return ("cutlass" if use_cutlass else "cusparselt"), (tile.sparse_min_rows, tile.sparse_min_cols)


@torch.no_grad()
def build_engines(cfg: ModelConfig, tile: tuple[int, int], seed: int) -> tuple[nn.Module, nn.Module, list[str]]:
    """(dense engine, 2:4 engine, padded shapes) sharing the same bf16 weights on the GPU."""
    config = llama_config(cfg, VOCAB)
    with torch.device("cuda"):
        dense = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for name in projection_names(dense):
        weight = dense.get_submodule(name).weight
        scores = torch.rand(weight.shape, device="cuda", generator=gen)
        weight.mul_(mask_from_scores(scores, 2, "row"))
    sparse = copy.deepcopy(dense)
    padded = set()
    for name in projection_names(sparse):
        layer = SemiStructuredLinear(sparse.get_submodule(name).weight, tile)
        if layer.pad_in or layer.pad_out:
            padded.add(f"{layer.out_features}x{layer.in_features} -> "
                       f"{layer.out_features + layer.pad_out}x{layer.in_features + layer.pad_in}")
        parent, _, child = name.rpartition(".")
        setattr(sparse.get_submodule(parent), child, layer)
    return dense, sparse, sorted(padded)


@torch.inference_mode()
def time_forward(model: nn.Module, ids: torch.Tensor, warmup: int, iters: int) -> float:
    """Mean seconds per forward over `iters` back-to-back calls after `warmup` (CUDA events, one sync)."""
    for _ in range(warmup):
        model(input_ids=ids)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        model(input_ids=ids)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


@torch.inference_mode()
def relative_error(dense: nn.Module, sparse: nn.Module, ids: torch.Tensor) -> float:
    ref = dense(input_ids=ids).logits.float()
    return float((sparse(input_ids=ids).logits.float() - ref).norm() / ref.norm())


def gpu_size(cfg: ModelConfig, tile: tuple[int, int], warmup: int, iters: int, seed: int) -> dict[str, Any]:
    """Dense vs 2:4 forward times of one size at every sequence length, or {"skipped": reason} when it does not fit."""
    try:
        dense, sparse, padded = build_engines(cfg, tile, seed)
        out: dict[str, Any] = {"padded_shapes": padded}
        gen = torch.Generator(device="cuda").manual_seed(seed)
        for seq in SEQ_LENS:
            ids = torch.randint(0, VOCAB, (BATCH, seq), device="cuda", generator=gen)
            t_dense = time_forward(dense, ids, warmup, iters)
            t_sparse = time_forward(sparse, ids, warmup, iters)
            out[f"seq{seq}"] = {"dense_ms": t_dense * 1e3, "sparse_ms": t_sparse * 1e3,
                                "dense_qps": BATCH / t_dense, "sparse_qps": BATCH / t_sparse,
                                "speedup": t_dense / t_sparse, "logits_rel_err": relative_error(dense, sparse, ids)}
    except torch.OutOfMemoryError as err:
        return {"skipped": f"does not fit in GPU memory: {str(err).splitlines()[0]}"}
    out["speedup_mean"] = statistics.mean(out[f"seq{s}"]["speedup"] for s in SEQ_LENS)
    return out


def run_gpu(args: argparse.Namespace, configs: dict[str, ModelConfig]) -> dict[str, Any]:
    reason = gpu_skip_reason()
    if reason is not None:
        return {"skipped": reason}
    backend, tile = select_backend(args.backend)
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "backend": backend,
                           "cusparselt_version": torch.backends.cusparselt.version(), "tile_bf16": list(tile),
                           "batch": BATCH, "warmup": args.gpu_warmup, "iters": args.gpu_iters, "models": {}}
    for size, cfg in configs.items():
        out["models"][size] = gpu_size(cfg, tile, args.gpu_warmup, args.gpu_iters, seed=0)
        torch.cuda.empty_cache()   # the engines of this size are garbage now
        print(f"bench_inference: gpu {size} done", file=sys.stderr, flush=True)
    return out


# ---- report ----------------------------------------------------------------------------------------------------

def projection(size: str, ratio: float, gpu: dict[str, Any]) -> dict[str, Any]:
    """S_1:4 = S_2:4 x R_CSR with S_2:4 measured here, else the paper's Table A11 (labelled), else none."""
    measured = gpu.get("models", {}).get(size, {})
    if "speedup_mean" in measured:
        s24, source = measured["speedup_mean"], "measured"
    elif size in PAPER_A11:
        s24, source = statistics.mean(PAPER_A11[size]), "assumed: CHTsNM paper Table A11 (RTX 5080, TensorRT)"
    else:
        return {"speedup_2of4": None, "source": "none (no GPU measurement, no paper value)", "speedup_1of4": None}
    return {"speedup_2of4": s24, "source": source, "speedup_1of4": s24 * ratio}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    configs = {size: model_config(size) for size in args.models}
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    csr: dict[str, Any] = {}
    try:
        gen = torch.Generator().manual_seed(0)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
            for size, cfg in ({} if args.skip_csr else configs).items():
                csr[size] = csr_ratio(cfg, args.tokens, args.warmup, args.repeats, gen)
                print(f"bench_inference: csr {size} ratio {csr[size]['ratio']:.3f}", file=sys.stderr, flush=True)
    finally:
        torch.set_num_threads(threads)
    gpu = run_gpu(args, configs)

    ratios = {size: c["ratio"] for size, c in csr.items()}
    flagged = [size for size, r in ratios.items() if not RATIO_RANGE[0] <= r <= RATIO_RANGE[1]]
    projected = {size: projection(size, r, gpu) for size, r in ratios.items()}
    config = {
        "quick": args.quick, "models": args.models, "vocab": VOCAB,
        "csr": {"tokens": args.tokens, "threads": args.threads, "warmup": args.warmup, "repeats": args.repeats,
                "dtype": "fp32", "device": "cpu", "op": "F.linear(X, W_csr)", "masks": "row-wise random legal",
                "layer": "4 x [d,d] + 2 x [ff,d] + 1 x [d,ff]",
                "statistic": "median over rounds of sum_s mult*t24 / sum_s mult*t14; order alternating per round",
                "flag_outside": list(RATIO_RANGE)},
        "gpu": {"batch": BATCH, "seq_lens": list(SEQ_LENS), "warmup": args.gpu_warmup, "iters": args.gpu_iters,
                "dtype": "bf16", "backend": args.backend, "weights": "random row-wise 2:4 masks on HF init",
                "padding": "zero-padded to the kernel tile; activation pad and output slice are timed"},
        "projection": "speedup_1of4 = speedup_2of4 x csr_ratio (CHTsNM App. M.3)",
    }
    payload = {"machine": machine_info(), "config": config, "csr_ratio": ratios, "csr_flagged": flagged,
               "csr": csr, "gpu": gpu, "projected_1of4_speedup": projected}
    if args.json:
        write_json(args.json, payload)
    report(payload)
    return payload


def report(payload: dict[str, Any]) -> None:
    gpu = payload["gpu"]
    if "skipped" in gpu:
        print(f"\nGPU 2:4 part skipped: {gpu['skipped']}")
    else:
        print(f"\nGPU 2:4 ({gpu['device']}, {gpu['backend']}, batch {gpu['batch']}, {gpu['warmup']} warmup + "
              f"{gpu['iters']} timed forwards)")
        rows = []
        for size, res in gpu["models"].items():
            if "skipped" in res:
                rows.append([size, "-", "-", "-", "-", res["skipped"]])
                continue
            for seq in SEQ_LENS:
                r = res[f"seq{seq}"]
                rows.append([f"{size}/seq{seq}", f"{r['dense_qps']:.0f} -> {r['sparse_qps']:.0f}", r["dense_ms"],
                             r["sparse_ms"], r["speedup"], f"{len(res['padded_shapes'])} padded shapes"])
        print_table(["model", "seq/s dense -> 2:4", "dense ms", "2:4 ms", "speedup", "note"], rows)
    rows = []
    for size, c in payload["csr"].items():
        p = payload["projected_1of4_speedup"][size]
        flag = "FLAG" if size in payload["csr_flagged"] else "ok"
        rows.append([size, f"{c['hidden']}/{c['ffn']}", c["layer_t14_ms"], c["layer_t24_ms"], c["ratio"], flag,
                     "-" if p["speedup_2of4"] is None else f"{p['speedup_2of4']:.2f}",
                     "-" if p["speedup_1of4"] is None else f"{p['speedup_1of4']:.2f}", p["source"].split(":")[0]])
    csr_cfg = payload["config"]["csr"]
    print(f"\nCSR surrogate: {csr_cfg['tokens']} tokens, {csr_cfg['threads']} thread(s), {csr_cfg['repeats']} paired "
          f"rounds; R_CSR outside [{RATIO_RANGE[0]}, {RATIO_RANGE[1]}] flagged")
    print_table(["model", "d/ff", "layer 1:4 ms", "layer 2:4 ms", "R_CSR", "range", "S_2:4", "S_1:4 projected",
                 "S_2:4 source"], rows)


if __name__ == "__main__":
    main()
