"""Inference (issue 9 item 4; CHTsNM paper App. M, Tables A11-A12; research/sparse_kernels.md s1, s4, s5): the
measured 2:4 speedup of LlamaForCausalLM forwards on NVIDIA GPUs (skipped elsewhere with the reason, never
estimated), the CSR surrogate R_CSR = t(2:4 CSR) / t(1:4 CSR) of one decoder layer's projections on the CPU, and
the projected 1:4 speedup S_2:4 x R_CSR (App. M.3). Engines, padding and pairing: docs/benchmarks.md.

    python -m bench.inference --json out.json                        # sizes 60m..1b
    python -m bench.inference models=130m,350m,1b tokens=256 --json out.json
    python -m bench.inference --quick --json out.json                # tiny shapes, for the test suite
"""

from __future__ import annotations

import copy
import statistics
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import LlamaForCausalLM

from bench.core import Figure, Settings, Timed, finish, parse, progress
from distsparse.config import ModelConfig, load_config
from distsparse.models import llama_config, projection_names
from distsparse.nm import NMSpec, mask_from_scores, random_mask

SIZES = ("60m", "130m", "250m", "350m", "1b")
VOCAB = 32000                  # DESIGN s6: benchmark shapes use the paper's vocabulary
BATCH = 8
SEQ_LENS = (128, 256)
RATIO_RANGE = (1.3, 2.3)
# CHTsNM paper Table A11: measured 2:4 speedups (seq 128, seq 256), RTX 5080, TensorRT 10.15, bf16.
PAPER_A11 = {"60m": (1.17, 1.20), "130m": (1.24, 1.31), "250m": (1.43, 1.38), "350m": (1.42, 1.49),
             "1b": (1.66, 1.65)}


@dataclass
class InferenceSettings(Settings):
    models: str = ",".join(SIZES)   # comma-separated sizes
    tokens: int = 256               # CSR activation rows
    threads: int = 1                # torch CPU threads for the CSR part
    warmup: int = 1                 # CSR untimed rounds
    repeats: int = 5                # CSR paired rounds
    gpu_warmup: int = 20            # GPU warmup forwards
    gpu_iters: int = 100            # GPU timed forwards
    backend: str = "auto"           # 2:4 kernel library: auto (cuSPARSELt when available), cusparselt, cutlass
    skip_csr: bool = False          # GPU part only
    QUICK = {"models": "tiny,small", "tokens": 32, "repeats": 3, "gpu_warmup": 2, "gpu_iters": 5}

    def __post_init__(self) -> None:
        self.at_least(tokens=1, threads=1, warmup=0, repeats=1, gpu_warmup=0, gpu_iters=1)
        self.one_of(backend=("auto", "cusparselt", "cutlass"))

    def configs(self) -> dict[str, ModelConfig]:
        return {size: load_config(None, [f"model.preset={size}"]).model for size in self.models.split(",")}


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
        cases.append((f"{out_f}x{in_f}", mult, Timed(lambda x=x, w=w14: F.linear(x, w)),
                      Timed(lambda x=x, w=w24: F.linear(x, w))))
    for _, _, f14, f24 in cases * warmup:
        f14.fn()
        f24.fn()
    for r in range(repeats):
        for _, _, f14, f24 in cases:
            for f in ((f14, f24) if r % 2 == 0 else (f24, f14)):
                f()
    round_ratios = [sum(m * f24.wall[r] for _, m, _, f24 in cases) / sum(m * f14.wall[r] for _, m, f14, _ in cases)
                    for r in range(repeats)]
    shapes = {name: {"multiplicity": mult, "t14_ms": statistics.median(f14.wall) * 1e3,
                     "t24_ms": statistics.median(f24.wall) * 1e3,
                     "paired_ratio": statistics.median(b / a for a, b in zip(f14.wall, f24.wall))}
              for name, mult, f14, f24 in cases}
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
        raise SystemExit("backend=cusparselt: this torch build has no cuSPARSELt")
    use_cutlass = name == "cutlass" or (name == "auto" and not have_cslt)
    SparseSemiStructuredTensor._FORCE_CUTLASS = use_cutlass
    cls = SparseSemiStructuredTensorCUTLASS if use_cutlass else SparseSemiStructuredTensorCUSPARSELT
    tile = cls._DTYPE_SHAPE_CONSTRAINTS[torch.bfloat16]
    return ("cutlass" if use_cutlass else "cusparselt"), (tile.sparse_min_rows, tile.sparse_min_cols)


@torch.no_grad()
def build_engines(cfg: ModelConfig, tile: tuple[int, int], seed: int) -> tuple[nn.Module, nn.Module, list[str]]:
    """(dense engine, 2:4 engine, padded shapes) sharing the same bf16 weights on the GPU."""
    with torch.device("cuda"):
        dense = LlamaForCausalLM(llama_config(cfg, VOCAB)).to(torch.bfloat16).eval()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for name in projection_names(dense):
        weight = dense.get_submodule(name).weight
        weight.mul_(mask_from_scores(torch.rand(weight.shape, device="cuda", generator=gen), 2, "row"))
    sparse = copy.deepcopy(dense)
    padded = set()
    for name in projection_names(sparse):
        layer = SemiStructuredLinear(sparse.get_submodule(name).weight, tile)
        if layer.pad_in or layer.pad_out:
            padded.add(f"{layer.out_features}x{layer.in_features} -> "
                       f"{layer.out_features + layer.pad_out}x{layer.in_features + layer.pad_in}")
        sparse.set_submodule(name, layer)
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


def run_gpu(s: InferenceSettings, configs: dict[str, ModelConfig], log: Callable[[str], None]) -> dict[str, Any]:
    reason = gpu_skip_reason()
    if reason is not None:
        return {"skipped": reason}
    backend, tile = select_backend(s.backend)
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "backend": backend,
                           "cusparselt_version": torch.backends.cusparselt.version(), "tile_bf16": list(tile),
                           "batch": BATCH, "warmup": s.gpu_warmup, "iters": s.gpu_iters, "models": {}}
    for size, cfg in configs.items():
        out["models"][size] = gpu_size(cfg, tile, s.gpu_warmup, s.gpu_iters, seed=0)
        torch.cuda.empty_cache()   # the engines of this size are garbage now
        log(f"gpu {size} done")
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
    s, json_path = parse(InferenceSettings, argv, __doc__.split("\n\n")[0])
    configs, log = s.configs(), progress("bench.inference")
    threads = torch.get_num_threads()
    torch.set_num_threads(s.threads)
    csr: dict[str, Any] = {}
    try:
        gen = torch.Generator().manual_seed(0)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
            for size, cfg in ({} if s.skip_csr else configs).items():
                csr[size] = csr_ratio(cfg, s.tokens, s.warmup, s.repeats, gen)
                log(f"csr {size} ratio {csr[size]['ratio']:.3f}")
    finally:
        torch.set_num_threads(threads)
    gpu = run_gpu(s, configs, log)

    ratios = {size: c["ratio"] for size, c in csr.items()}
    flagged = [size for size, r in ratios.items() if not RATIO_RANGE[0] <= r <= RATIO_RANGE[1]]
    projected = {size: projection(size, r, gpu) for size, r in ratios.items()}
    config = {
        "quick": s.quick, "models": s.models.split(","), "vocab": VOCAB,
        "csr": {"tokens": s.tokens, "threads": s.threads, "warmup": s.warmup, "repeats": s.repeats,
                "dtype": "fp32", "device": "cpu", "op": "F.linear(X, W_csr)", "masks": "row-wise random legal",
                "layer": "4 x [d,d] + 2 x [ff,d] + 1 x [d,ff]",
                "statistic": "median over rounds of sum_s mult*t24 / sum_s mult*t14; order alternating per round",
                "flag_outside": list(RATIO_RANGE)},
        "gpu": {"batch": BATCH, "seq_lens": list(SEQ_LENS), "warmup": s.gpu_warmup, "iters": s.gpu_iters,
                "dtype": "bf16", "backend": s.backend, "weights": "random row-wise 2:4 masks on HF init",
                "padding": "zero-padded to the kernel tile; activation pad and output slice are timed"},
        "projection": "speedup_1of4 = speedup_2of4 x csr_ratio (CHTsNM App. M.3)",
    }
    tables = []
    if "skipped" in gpu:
        head = f"GPU 2:4 part skipped: {gpu['skipped']}"
    else:
        head = (f"GPU 2:4 ({gpu['device']}, {gpu['backend']}, batch {gpu['batch']}, {gpu['warmup']} warmup + "
                f"{gpu['iters']} timed forwards)")
        rows = [[size, "-", "-", "-", "-", res["skipped"]] if "skipped" in res else
                [f"{size}/seq{seq}", f"{res[f'seq{seq}']['dense_qps']:.0f} -> {res[f'seq{seq}']['sparse_qps']:.0f}",
                 res[f"seq{seq}"]["dense_ms"], res[f"seq{seq}"]["sparse_ms"], res[f"seq{seq}"]["speedup"],
                 f"{len(res['padded_shapes'])} padded shapes"]
                for size, res in gpu["models"].items() for seq in (SEQ_LENS[:1] if "skipped" in res else SEQ_LENS)]
        tables.append((["model", "seq/s dense -> 2:4", "dense ms", "2:4 ms", "speedup", "note"], rows))
    head += (f"\nCSR surrogate: {s.tokens} tokens, {s.threads} thread(s), {s.repeats} paired rounds; R_CSR outside "
             f"[{RATIO_RANGE[0]}, {RATIO_RANGE[1]}] flagged")
    rows = [[size, f"{c['hidden']}/{c['ffn']}", c["layer_t14_ms"], c["layer_t24_ms"], c["ratio"],
             "FLAG" if size in flagged else "ok",
             *("-" if projected[size][k] is None else f"{projected[size][k]:.2f}" for k in ("speedup_2of4",
                                                                                          "speedup_1of4")),
             projected[size]["source"].split(":")[0]] for size, c in csr.items()]
    tables.append((["model", "d/ff", "layer 1:4 ms", "layer 2:4 ms", "R_CSR", "range", "S_2:4", "S_1:4 projected",
                    "S_2:4 source"], rows))
    return finish(json_path, [Figure("csr_ratio", ratios)],
                  {"csr_flagged": flagged, "csr": csr, "gpu": gpu, "projected_1of4_speedup": projected}, config,
                  tables, head)


if __name__ == "__main__":
    main()
