"""Resume compatibility: the saved run's config (in the manifest) against the run that resumes it.

What decides the shape or meaning of saved state must match, and is refused by name otherwise: the model shape,
sparsity and layout, the backbone kind and update rule (its state layout), branches and permutations, the
vocabulary and the tokenizer. Everything else (world size, schedule length, intervals, learning rates, data
location, ...) may change; the changes are returned for the trainer to log. `check_resume` runs this before any
process group starts, on the checkpoint `checkpoint.resume` would pick from manifests and file sizes alone (the
same on every rank); the trainer repeats it on the checkpoint the ranks finally agree on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from distsparse.checkpoint.manifest import CheckpointError, candidates, read_manifest
from distsparse.config import Config, config_to_dict, with_added_keys
from distsparse.optim.rules import RULES
from distsparse.utils import ABSENT, config_differences

MUST_MATCH = (   # a key, or every key under a prefix ending in "."
    "model.hidden_size", "model.num_hidden_layers", "model.num_attention_heads", "model.tie_word_embeddings",
    "method.name", "method.sparsity", "method.layout", "method.backbone", "method.rule", "method.branch.",
    "method.permutation.mode", "method.permutation.block_size")
NOT_COMPARED = ("checkpoint.", "logging.")   # where this run saves and reports, not what it trains


def checkpoint_root(cfg: Config) -> Path:
    return Path(cfg.checkpoint.dir or Path(cfg.train.out_dir) / "checkpoints")


def _shown(key: str, value: Any) -> str:
    if key == "method.rule" and value in RULES:   # the rule decides the layout of the saved backbone state
        rule = RULES[value]
        return f"{value!r} (state {', '.join(rule.slot_keys + rule.counter_keys)})"
    return ABSENT if value is ABSENT else repr(value)


def resume_changes(manifest: dict, path: Path, cfg: Config, meta: dict) -> list[str]:
    """The allowed differences between the saved run and `cfg` ("key saved -> run"); ValueError naming every
    difference that is not allowed, with both values."""
    refused, changed = [], []
    saved = with_added_keys(manifest.get("config") or {})   # a key added since reads as what that run did
    for key, (old, new) in config_differences(saved, config_to_dict(cfg)).items():
        if key.startswith(NOT_COMPARED):
            continue
        if any(key == k or (k.endswith(".") and key.startswith(k)) for k in MUST_MATCH):
            refused.append(f"{key} saved {_shown(key, old)}, run {_shown(key, new)}")
        else:
            changed.append(f"{key} {_shown(key, old)} -> {_shown(key, new)}")
    run_vocab = cfg.model.vocab_size or meta["vocab_size"]
    derived = (("model.intermediate_size rounded to model.ffn_multiple_of", manifest.get("ffn_width"),
                cfg.model.ffn_width),
               ("vocabulary size", manifest.get("vocab_size"), run_vocab),
               ("tokenizer sha256 (data.dir's meta.json)", manifest.get("tokenizer_sha256"),
                meta.get("tokenizer_sha256")))
    for name, old, new in derived:
        if old and new and old != new:   # absent or "" (synthetic data has no tokenizer): nothing to compare
            refused.append(f"{name} saved {old!r}, run {new!r}")
    if refused:
        raise ValueError(f"checkpoint.resume: {path} does not match this run: {'; '.join(refused)}. Allowed: the "
                         f"saved values (a resume may change world size, schedule length, intervals and other "
                         f"training settings), or another checkpoint.dir to start a new run")
    return changed


def check_resume(cfg: Config, meta: dict) -> dict | None:
    """Before any process group: refuse a resume path that is no checkpoint, and a checkpoint that does not match
    the run; return the manifest of the checkpoint it would resume (None: the run starts fresh), whose global
    batch the run's batch plan may keep (train/batch.py). `auto` checks the checkpoint it would pick from
    manifests and sizes (digests come later, per rank), and refuses a root whose checkpoints are all damaged. A
    fresh start (resume '') is refused where checkpoints already are: its own would mix with them, and `auto` and
    `keep_last` go by step number (a later `auto` would pick the old run's newest, pruning would delete the new
    run's first)."""
    resume = cfg.checkpoint.resume
    root = checkpoint_root(cfg)
    if not resume:
        existing = candidates(root)
        if existing:
            raise ValueError(f"checkpoint.resume: got '' (start fresh), but {root} holds checkpoints "
                             f"({', '.join(p.name for p in existing[:3])}{', ...' if len(existing) > 3 else ''}); "
                             f"allowed: auto (continue that run), or another checkpoint.dir or train.out_dir")
        return None
    if resume != "auto":
        path = Path(resume)
        if not path.is_dir():
            raise ValueError(f"checkpoint.resume: got {resume!r}, which is not a directory; allowed: auto, or a "
                             f"checkpoint directory holding manifest.json (e.g. {root / 'step00000100'})")
        try:
            manifest = read_manifest(path)
        except CheckpointError as err:
            raise ValueError(f"checkpoint.resume: got {resume!r}: {err}") from None
    else:
        damaged = []
        for path in candidates(root):
            try:
                manifest = read_manifest(path)
                break
            except CheckpointError as err:
                damaged.append(str(err))   # the trainer skips it too, with a warning naming the file
        else:
            if damaged:
                raise ValueError(f"checkpoint.resume: auto, but no checkpoint under {root} is intact: "
                                 f"{'; '.join(damaged)}; allowed: repair or remove them, or another checkpoint.dir "
                                 f"to start a new run")
            return None    # nothing to resume: the run starts fresh
    resume_changes(manifest, path, cfg, meta)
    return manifest
