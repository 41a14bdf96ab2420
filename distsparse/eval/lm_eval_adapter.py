"""lm-evaluation-harness (0.4.x) on distsparse models: the LM wrapper, task loading and the offline check.

research/pretraining_ecosystem.md s6. What this file owns:
- `make_lm`: lm-eval's own `HFLM`, either on a Hugging Face folder (`pretrained=path`) or on an in-memory model
  object (`pretrained=model`, e.g. a checkpoint's training model with input-dependent branches, DESIGN decision 13).
  `max_length` is always passed: left to lm-eval it resolves to `max_position_embeddings` (1024 here), so rolling
  log-likelihoods (wikitext) would run windows far longer than the training sequence length.
- `load_task_manager`: lm-eval's registry plus local task folders (`include_path`: YAML configs whose
  `dataset_path: json` + `data_files` point at local files). When every requested task is in the local folders, the
  built-in registry (~15k YAML files, tens of seconds to index) is not scanned.
- `check_tasks_offline`: builds every requested task up front with the Hugging Face hub offline, so a missing
  dataset fails before any model call, with every missing dataset listed at once.
- `offline_hub`: the hub and `datasets` offline inside a `with` block. Both libraries read HF_HUB_OFFLINE at import
  time, so the flags of modules already imported are set too, and everything is restored on exit.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

OFFLINE_ENV = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
# (module, attribute) pairs that hold the offline flag once imported (huggingface_hub 1.x, datasets 4-5).
OFFLINE_FLAGS = (("huggingface_hub.constants", "HF_HUB_OFFLINE"), ("datasets.config", "HF_HUB_OFFLINE"),
                 ("datasets.config", "HF_DATASETS_OFFLINE"))


@contextlib.contextmanager
def offline_hub(enabled: bool = True) -> Iterator[None]:
    """Hub downloads off (datasets and models come from the local HF cache only) inside the block."""
    if not enabled:
        yield
        return
    saved_env = {key: os.environ.get(key) for key in OFFLINE_ENV}
    saved_flags = [(sys.modules[mod], attr, getattr(sys.modules[mod], attr)) for mod, attr in OFFLINE_FLAGS
                   if mod in sys.modules and hasattr(sys.modules[mod], attr)]
    os.environ.update({key: "1" for key in OFFLINE_ENV})
    for module, attr, _ in saved_flags:
        setattr(module, attr, True)
    try:
        yield
    finally:
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        for module, attr, value in saved_flags:
            setattr(module, attr, value)


def load_task_manager(tasks: Sequence[str], include_path: Sequence[str | Path] = ()):
    """A TaskManager that knows `tasks`; ValueError naming the unknown ones."""
    from lm_eval.tasks import TaskManager

    paths = [str(p) for p in include_path]
    for path in paths:
        if not Path(path).is_dir():
            raise ValueError(f"--include-path: got {path!r}, which is not a directory of task YAML files")
    manager = None
    if paths:
        manager = TaskManager(include_path=paths, include_defaults=False)
        if not all(name in manager.task_index for name in tasks):
            manager = None
    if manager is None:
        manager = TaskManager(include_path=paths or None)
    unknown = [name for name in tasks if name not in manager.task_index]
    if unknown:
        raise ValueError(f"--tasks: unknown {', '.join(unknown)}; allowed: lm-eval task, group or tag names, or tasks "
                         f"defined in --include-path folders")
    return manager


def _dataset_of(manager, name: str) -> str:
    cfg = manager.task_index[name].cfg or {}
    path, subset = cfg.get("dataset_path"), cfg.get("dataset_name")
    if path is None:
        return "dataset of a group or tag"
    return f"{path}" + (f" ({subset})" if subset else "")


def check_tasks_offline(manager, tasks: Sequence[str]) -> None:
    """Build each task (which loads its dataset) inside `offline_hub`; ValueError listing every task whose dataset is
    not in the local HF cache, with the dataset and the loader's message. `evaluate` builds the tasks again: the
    second load reads the cache this one filled, and keeps to lm-eval's public API."""
    missing = []
    with offline_hub():
        for name in tasks:
            try:
                manager.load([name])
            except Exception as err:   # datasets raises ConnectionError, FileNotFoundError, DatasetNotFoundError...
                message = str(err).splitlines()[0] if str(err) else type(err).__name__
                missing.append(f"{name}: {_dataset_of(manager, name)}: {message}")
    if missing:
        raise ValueError("datasets missing from the local Hugging Face cache (offline run):\n  " + "\n  ".join(missing)
                         + "\npopulate the cache on a machine with internet (run once there with --online) and copy "
                         "its HF_HOME over, or point a local task YAML at your own copy of the data (--include-path)")


def make_lm(pretrained: str | Path | torch.nn.Module, *, max_length: int, tokenizer: Any = None,
            batch_size: int = 8, device: str | None = None, dtype: str = "float32"):
    """lm-eval's HFLM on a Hugging Face folder or an in-memory causal LM (already on its device).

    `tokenizer`: a tokenizer object or a folder; None loads it from the HF folder. `dtype` applies to folders
    (an in-memory model keeps its own)."""
    from lm_eval.models.huggingface import HFLM

    if max_length < 1:
        raise ValueError(f"max_length: got {max_length}; allowed: >= 1 (the training sequence length)")
    if isinstance(tokenizer, Path):
        tokenizer = str(tokenizer)
    if isinstance(pretrained, torch.nn.Module):
        if tokenizer is None:
            raise ValueError("tokenizer: got None for an in-memory model; allowed: a tokenizer folder or object")
        if isinstance(tokenizer, str):
            from transformers import AutoTokenizer
            tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        return HFLM(pretrained=pretrained.eval(), tokenizer=tokenizer, batch_size=batch_size, max_length=max_length)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return HFLM(pretrained=str(pretrained), tokenizer=tokenizer, batch_size=batch_size, max_length=max_length,
                device=device, dtype=dtype)


def evaluate(lm, manager, tasks: Sequence[str], *, limit: int | None = None, num_fewshot: int = 0,
             bootstrap_iters: int = 1000, offline: bool = True) -> dict[str, dict[str, float]]:
    """{task: {metric: value}} from `lm_eval.simple_evaluate`; lm-eval's ",none" filter suffix is dropped, other
    filters stay in the key (`exact_match,strict-match`), and non-numeric entries (aliases, "N/A") are left out."""
    import lm_eval

    with offline_hub(offline):
        out = lm_eval.simple_evaluate(model=lm, tasks=list(tasks), task_manager=manager, num_fewshot=num_fewshot,
                                      limit=limit, bootstrap_iters=bootstrap_iters, log_samples=False)
    results: dict[str, dict[str, float]] = {}
    for task, metrics in out["results"].items():
        results[task] = {key.removesuffix(",none"): float(value) for key, value in metrics.items()
                         if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "sample_len"}
    return results
