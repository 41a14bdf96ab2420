"""FLOPs of a training step and model FLOP utilization (MFU): the one convention bench/train.py and the
trainer's log (distsparse/train/progress.py) both use.

Convention (PaLM App. B; nanoGPT's `estimate_mfu`), per token of a step:
    6 x matmul parameters                      forward 2, backward 4 FLOPs per weight
    + 12 x layers x hidden x seq_len           attention scores and values, not halved for causality
The input embedding is a lookup and is not counted. Two parameter counts, each named where it is reported:
    dense_equivalent   backbone projections at their dense size (in x out) + LM head: a sparse model is charged
                       the dense model's FLOPs, so runs of different sparsity compare at equal work
    active             kept backbone weights + residual-branch weights (CoMoLoRA, LoRA) + LM head: the
                       multiply-adds the kept weights do
MFU = FLOPs per step / step time / (peak x ranks), against the bf16 dense tensor-core peak of one GPU (vendor data
sheets). On a device not in PEAK_FLOPS, the CPU included, no peak is assumed and MFU is left out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from distsparse.models import parameter_counts

# First substring of torch.cuda.get_device_name that matches wins; None: a variant with another peak, not assumed.
PEAK_FLOPS: tuple[tuple[str, float | None], ...] = (
    ("H200", 989e12),
    ("H100 PCIe", None),
    ("H100 NVL", None),
    ("H100", 989e12),        # SXM ("NVIDIA H100 80GB HBM3")
    ("A100", 312e12),
)


@dataclass(frozen=True)
class StepFlops:
    """FLOPs of one optimizer step over all ranks, in both counts."""
    dense_equivalent: float
    active: float


def step_flops(num_matmul_params: int, layers: int, hidden: int, seq_len: int, tokens: int) -> float:
    """FLOPs of one training step over `tokens` tokens with `num_matmul_params` weights in matmuls."""
    return 6.0 * num_matmul_params * tokens + 12.0 * layers * hidden * seq_len * tokens


def model_step_flops(model: torch.nn.Module, seq_len: int, tokens: int) -> StepFlops:
    """Both counts for a built model (`distsparse.models.build_model`) over `tokens` tokens of `seq_len`."""
    counts = parameter_counts(model)
    cfg = model.config
    head = cfg.vocab_size * cfg.hidden_size
    dense = counts["backbone_dense_equivalent"] + head
    active = counts["backbone_active"] + counts["branch"] + head

    def flops(params: int) -> float:
        return step_flops(params, cfg.num_hidden_layers, cfg.hidden_size, seq_len, tokens)

    return StepFlops(dense_equivalent=flops(dense), active=flops(active))


def peak_flops(device_name: str) -> float | None:
    """The bf16 dense peak FLOP/s of one GPU named `device_name`, or None when it is not known."""
    for key, peak in PEAK_FLOPS:
        if key in device_name:
            return peak
    return None


def device_peak_flops(device: torch.device) -> tuple[float | None, str]:
    """(peak FLOP/s of `device`, a note for the log): (None, why) on CPU and on GPUs not in PEAK_FLOPS."""
    device = torch.device(device)
    if device.type != "cuda":
        return None, f"{device.type} device: no peak FLOP/s assumed, MFU left out"
    name = torch.cuda.get_device_name(device)
    peak = peak_flops(name)
    if peak is None:
        return None, f"{name}: no bf16 dense peak known (distsparse/perf/flops.py PEAK_FLOPS), MFU left out"
    return peak, f"{name}: assumed peak {peak / 1e12:.0f} TFLOP/s bf16 dense per GPU"


def mfu(flops_per_step: float, step_s: float, peak: float, world_size: int) -> float:
    """Model FLOP utilization of a step of `flops_per_step` (all ranks) taking `step_s` on `world_size` GPUs."""
    return flops_per_step / step_s / (peak * world_size)
