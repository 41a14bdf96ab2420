"""The DeepSpeed JSON of a run: the file the user gives, with the keys the project config owns filled in.

The project config owns batch sizes, clipping, precision and the dense-side AdamW hyperparameters, so a run is
described by one config; a DeepSpeed file that sets one of those keys to a different value is refused.

DeepSpeed's timing instruments synchronize the device (issue 25): its throughput timer (`timers.throughput`, on by
default in 0.19.8: `engine.tput_timer` calls `synchronize()` at every forward and every `engine.step()`, which the
joint step calls every micro-batch), `wall_clock_breakdown` and `flops_profiler`. The completed config turns the
throughput timer off unless the user's file sets it, and a file that turns any of them on is warned about by key:
the trainer reports its own phase times (StepReport.timings) on logging steps only.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from distsparse.config import Config, shipped_or_given

log = logging.getLogger("distsparse")
SUPPORTED_STAGES = (1, 2)
OBJECT_SECTIONS = ("zero_optimization", "fp16", "bf16", "optimizer", "optimizer.params", "timers",
                   "timers.throughput", "flops_profiler")   # parents first
# DeepSpeed keys whose `true` adds a device synchronize to every micro-batch (or step), and DeepSpeed's default.
SYNCING_KEYS = {"timers.throughput.enabled": True, "wall_clock_breakdown": False, "flops_profiler.enabled": False}


def resolve_dtype(cfg: Config, cuda_available: bool | None = None) -> str:
    """`train.dtype`, with `auto` decided by the machine that trains: bf16 with CUDA, fp32 without.
    `cuda_available` defaults to this process's machine; launch/slurm.py passes both values at submit time to
    check a config for whatever node the job lands on, and resolves for real on the node."""
    if cfg.train.dtype != "auto":
        return cfg.train.dtype
    cuda = torch.cuda.is_available() if cuda_available is None else cuda_available
    return "bf16" if cuda else "fp32"


def _set(ds: dict, path: str, value, source: dict) -> None:
    """Set ds[path] = value, refusing a conflicting value written in the user's file."""
    keys = path.split(".")
    node, src = ds, source
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        src = src.get(key, {}) if isinstance(src, dict) else {}
    given = src.get(keys[-1]) if isinstance(src, dict) else None
    if given is not None and given != value and given != "auto":
        raise ValueError(f"--ds_config {path}: got {given!r} but the run config gives {value!r}; the project "
                         f"config owns this key (set it there, or remove it from the DeepSpeed file)")
    node[keys[-1]] = value


def build_ds_config(path: str | Path, cfg: Config) -> dict:
    """Read, check and complete the DeepSpeed config. Raises ValueError before any process group starts."""
    return complete_ds_config(read_ds_json(path), cfg)


def read_ds_json(path: str | Path) -> dict:
    """The user's DeepSpeed JSON as written, checked to be an object whose sections are objects."""
    p = shipped_or_given(path, "ds", ".json", "--ds_config")
    try:
        source = json.loads(p.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"--ds_config: {p} is not valid UTF-8 JSON: {err}") from None
    if not isinstance(source, dict):
        raise ValueError(f"--ds_config: {p} holds a JSON {type(source).__name__}; allowed: a JSON object of "
                         f"DeepSpeed settings, e.g. configs/ds/zero2.json")
    for key in OBJECT_SECTIONS:   # read below with .get(); anything but an object would fail as AttributeError
        node = source
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node is not None and not isinstance(node, dict):
            raise ValueError(f"--ds_config {key}: got {node!r} in {p}; allowed: a JSON object")
    return source


def complete_ds_config(source: dict, cfg: Config, cuda_available: bool | None = None) -> dict:
    """The user's DeepSpeed JSON (its contents) checked against the run config and completed with the keys the
    project config owns, for a machine with or without CUDA (`cuda_available`, default: this one). A job carries
    the contents and calls this on the node that trains, so `train.dtype: auto` is that node's answer."""
    ds = json.loads(json.dumps(source))
    stage = ds.get("zero_optimization", {}).get("stage", 0)
    if stage not in SUPPORTED_STAGES:
        raise ValueError(
            f"--ds_config zero_optimization.stage: got {stage}; allowed: 1, 2. ZeRO-3 (and 0) are not supported: "
            f"ZeRO-3 converts and partitions the backbone values excluded from DeepSpeed's optimizer, which the "
            f"project's matrix engine owns (DESIGN decision 1)")
    cuda = torch.cuda.is_available() if cuda_available is None else cuda_available
    dtype = resolve_dtype(cfg, cuda)
    if dtype == "bf16" and stage == 1:
        raise ValueError("--ds_config zero_optimization.stage: got 1 with train.dtype bf16; allowed: 2. bf16 with "
                         "ZeRO-1 selects DeepSpeed's BF16_Optimizer, whose clipping internals the joint gradient "
                         "clip does not drive; use configs/ds/zero2.json or train.dtype=fp32")
    if "fp16" in ds and ds["fp16"].get("enabled"):
        raise ValueError("--ds_config fp16.enabled: got true; allowed: false (use train.dtype=bf16)")
    _set(ds, "train_micro_batch_size_per_gpu", cfg.train.micro_batch, source)
    if cfg.train.global_batch_size:   # accumulation follows from the world size: the trainer sets it (batch.py)
        for key in ("gradient_accumulation_steps", "train_batch_size"):
            if source.get(key) not in (None, "auto"):
                raise ValueError(f"--ds_config {key}: got {source[key]!r} with train.global_batch_size "
                                 f"{cfg.train.global_batch_size}; the trainer derives it from the global batch and "
                                 f"the world size; allowed: remove it from the DeepSpeed file, or \"auto\"")
            ds.pop(key, None)
    else:
        _set(ds, "gradient_accumulation_steps", cfg.train.grad_accum, source)
    _set(ds, "gradient_clipping", cfg.train.grad_clip, source)
    _set(ds, "bf16.enabled", dtype == "bf16", source)
    ds.pop("train_batch_size", None)   # the trainer sets it from its batch plan
    opt = ds.setdefault("optimizer", {"type": "AdamW", "params": {}})
    if opt.get("type", "AdamW").lower() not in ("adamw", "adam"):
        raise ValueError(f"--ds_config optimizer.type: got {opt.get('type')!r}; allowed: AdamW, Adam "
                         f"(the backbone has its own rules; never DeepSpeed's Muon, DESIGN decision 1)")
    params = opt.setdefault("params", {})
    for key, value in (("lr", cfg.train.lr), ("betas", [cfg.train.beta1, cfg.train.beta2]),
                       ("weight_decay", cfg.train.weight_decay)):
        _set(ds, f"optimizer.params.{key}", value, source)
    if not cuda:
        params.setdefault("torch_adam", True)   # no JIT C++ build on CPU
    ds.setdefault("steps_per_print", 10**9)      # the trainer prints its own line
    # Off unless the file names the timer (then DeepSpeed's own default, on, and the warning below say so).
    ds.setdefault("timers", {}).setdefault("throughput", {"enabled": False})
    warn_syncing_keys(source)
    return ds


def _lookup(source: dict, path: str):
    node = source
    for part in path.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def warn_syncing_keys(source: dict) -> list[str]:
    """Warn, by key, about each DeepSpeed timing instrument the user's JSON turns on (module docstring); returns
    the keys. `timers.throughput` counts as on when the file names the section without `enabled: false`
    (DeepSpeed's default is on) and leaves `synchronized` on."""
    syncing = []
    for key, default in SYNCING_KEYS.items():
        value = _lookup(source, key)
        if key == "timers.throughput.enabled":
            section = _lookup(source, "timers.throughput")
            on = isinstance(section, dict) and value is not False and section.get("synchronized", True) is not False
        else:
            on = bool(value if value is not None else default)
        if on:
            syncing.append(key)
            log.warning("--ds_config %s: on; it synchronizes the device at every micro-batch or step, so the host "
                        "can no longer run ahead of the GPU (set it to false; StepReport.timings times the phases "
                        "on logging steps)", key)
    return syncing
