"""Benchmark of `NMSparseLinear` against `nn.Linear` (issue 2): forward + backward time and storage.

For `tokens` x (512->1376, 1376->512, 768->2048) it times one forward + backward (input, values grads) of
NMSparseLinear at 1:4 and 2:4, row- and block-wise, against an `nn.Linear` of the same shape measured in the same
run, paired and interleaved (tools/benchlib.py), and reports the median per-round ratio. The target on CPU is
every ratio <= 1.2: training runs a dense GEMM on the decompressed weight, so the decompress (index_copy_ into
zeros) and the gather of the weight gradient must stay a few percent of the three GEMMs
(research/sparse_kernels.md s2.2-3).

One CPU thread by default: on a small shared VM every OpenMP parallel region of the decompress and gather can
wait a scheduler time slice for its second thread when another process holds a core (measured here: 0.4 ms
alone, 10-20 ms under load), which swamps the compute being compared; `--threads` measures other settings.

Storage ratio: bytes of the layer's persistent state (state_dict: bf16 values + uint8 codes) over the bytes of
the dense bf16 weight; the issue bounds it by 0.29 at 1:4 and 0.57 at 2:4. Bytes are `untyped_storage().nbytes()`
of the deduplicated tensors (DESIGN s6).

    python tools/bench_layer.py --json out.json                    # CPU fp32, the issue's shapes
    python tools/bench_layer.py --device cuda --dtype bf16 --json out.json
    python tools/bench_layer.py --quick --json out.json            # tiny shapes, for the test suite
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable

import torch
import torch.nn as nn

from benchlib import add_json_arg, machine_info, paired_ratio, print_table, write_json
from distsparse.layers import NMSparseLinear
from distsparse.nm import NMSpec

SHAPES = ((512, 1376), (1376, 512), (768, 2048))   # (in, out): LLaMA-60m q/up-like, down-like, and a wider one
QUICK_SHAPES = ((32, 48), (48, 32), (64, 96))
SPARSITIES = ("1:4", "2:4")
LAYOUTS = ("row", "block")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TARGET_RATIO = 1.2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_json_arg(p)
    p.add_argument("--quick", action="store_true", help="tiny shapes and few rounds (smoke test)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default="fp32", choices=tuple(DTYPES))
    p.add_argument("--tokens", type=int, default=None, help="rows of the input (default 2048; 64 with --quick)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1: see the module docstring)")
    p.add_argument("--warmup", type=int, default=None, help="untimed rounds (default 3; 1 with --quick)")
    p.add_argument("--repeats", type=int, default=None, help="timed rounds (default 15; 3 with --quick)")
    p.add_argument("--inner", type=int, default=None,
                   help="fwd+bwd calls per timed call (default 1 on CPU, 20 on CUDA, where one call is ~100 us)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available")
    cuda = args.device == "cuda"
    args.tokens = args.tokens or (64 if args.quick else 2048)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    args.repeats = args.repeats or (3 if args.quick else 15)
    args.inner = args.inner or (20 if cuda and not args.quick else 1)
    return args


def fwd_bwd(layer: nn.Module, x: torch.Tensor, grad_y: torch.Tensor, inner: int) -> Callable[[], None]:
    """One training-like use of the layer: forward, backward to the input and the parameters, grads cleared
    first so that no call pays an accumulation the other does not."""
    params = list(layer.parameters())

    def run() -> None:
        for _ in range(inner):
            x.grad = None
            for p in params:
                p.grad = None
            layer(x).backward(grad_y)
    return run


def state_bytes(module: nn.Module) -> int:
    """Bytes of the persistent state: deduplicated storages of the state_dict tensors."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in module.state_dict().values()}
    return sum(storages.values())


def storage_ratio(spec: NMSpec, in_features: int, out_features: int) -> float:
    layer = NMSparseLinear(in_features, out_features, spec, dtype=torch.bfloat16)
    return state_bytes(layer) / (out_features * in_features * torch.bfloat16.itemsize)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    shapes = QUICK_SHAPES if args.quick else SHAPES
    gen = torch.Generator().manual_seed(0)

    ratios: dict[str, float] = {}
    rows = []
    for in_f, out_f in shapes:
        x = torch.randn(args.tokens, in_f, generator=gen).to(device, dtype).requires_grad_(True)
        grad_y = torch.randn(args.tokens, out_f, generator=gen).to(device, dtype)
        dense = nn.Linear(in_f, out_f, bias=False, device=device, dtype=dtype)
        for sparsity in SPARSITIES:
            for layout in LAYOUTS:
                spec = NMSpec.parse(sparsity, layout)
                sparse = NMSparseLinear(in_f, out_f, spec, device=device, dtype=dtype)
                ratio, t_sparse, t_dense = paired_ratio(
                    fwd_bwd(sparse, x, grad_y, args.inner), fwd_bwd(dense, x, grad_y, args.inner),
                    args.warmup, args.repeats, sync)
                case = f"{sparsity}-{layout}/{in_f}x{out_f}"
                ratios[case] = ratio
                ms = 1e3 / args.inner
                rows.append([case, t_dense * ms, t_sparse * ms, ratio])
                print(f"bench_layer: {case} ratio {ratio:.3f}", file=sys.stderr, flush=True)

    # The ratio is the same at every shape up to the padding of the last code byte; report the worst one.
    storage = {f"{s}-{lay}": max(storage_ratio(NMSpec.parse(s, lay), i, o) for i, o in shapes)
               for s in SPARSITIES for lay in LAYOUTS}

    config = {
        "quick": args.quick, "device": args.device, "dtype": args.dtype, "tokens": args.tokens,
        "threads": args.threads, "warmup": args.warmup, "repeats": args.repeats, "inner": args.inner,
        "shapes_in_x_out": [f"{i}x{o}" for i, o in shapes], "bias": False, "baseline": "nn.Linear",
        "statistic": "median over rounds of t_sparse / t_dense, order alternating per round",
        "storage": "state_dict bytes (bf16 values + uint8 codes) / dense bf16 weight bytes, worst shape",
        "target_fwd_bwd_ratio": TARGET_RATIO,
    }
    payload = {"machine": machine_info(), "config": config, "fwd_bwd_ratio": ratios, "storage_ratio": storage}
    if args.json:
        write_json(args.json, payload)

    worst = max(ratios, key=ratios.get)
    verdict = "met" if ratios[worst] <= TARGET_RATIO else "MISSED"
    print(f"\n{args.device} {args.dtype}, {args.tokens} tokens, {args.threads} threads, "
          f"{args.repeats} paired rounds; target fwd_bwd_ratio <= {TARGET_RATIO}: {verdict} "
          f"(worst {worst}: {ratios[worst]:.3f})")
    print_table(["N-layout", "state/dense bf16"], [[k, v] for k, v in storage.items()])
    print()
    print_table(["case (in x out)", "nn.Linear ms", "NMSparseLinear ms", "ratio"], rows)
    return payload


if __name__ == "__main__":
    main()
