"""The manifest of a checkpoint and the checks made before anything in it is loaded.

Two levels, so that the cheap one can run before any process group exists (launch/pretrain.py's validate) and
the expensive one is split over the ranks:
- `read_manifest`: the manifest is UTF-8 JSON whose own digest matches, of a readable format, whose step matches
  its directory, and every file it lists exists with the size it lists (stat only, no data read).
- `verify_digests`: the sha256 of the files one rank is assigned (`verifier`); over all ranks every file is
  read once. The trainer agrees on the result with one collective (CheckpointManager.find).
Every refusal is a CheckpointError that names the file.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Callable

from distsparse.checkpoint.files import sha256_file

FORMAT_VERSION = 2       # 2: every file (DeepSpeed's too) listed with its writer rank; the manifest holds its digest
READABLE_VERSIONS = (1, 2)
MANIFEST = "manifest.json"
DIGEST_KEY = "manifest_sha256"
_TAG = re.compile(r"step(\d{8})")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the file."""


def tag_for(step: int) -> str:
    return f"step{step:08d}"


def deepspeed_file(rel: str) -> bool:
    """DeepSpeed's files are pickles (`*.pt`); the project's own are safetensors or JSON."""
    return rel.endswith(".pt")


def _digest(manifest: dict) -> str:
    return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()


def sealed_text(manifest: dict) -> str:
    """The manifest as JSON with its own digest (of every other key), so a damaged or edited manifest is refused
    even where it still parses."""
    return json.dumps({**manifest, DIGEST_KEY: _digest(manifest)}, indent=1)


def _refuse(file: Path, why: str) -> CheckpointError:
    return CheckpointError(f"checkpoint file {file} is corrupt: {why}")


def read_manifest(path: Path) -> dict:
    """The manifest of checkpoint directory `path` after the cheap checks (module docstring)."""
    file = path / MANIFEST
    if not file.is_file():
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is missing (not a checkpoint directory, or an "
                              f"incomplete save)")
    try:
        manifest = json.loads(file.read_bytes().decode("utf-8"))
    except OSError as err:
        raise CheckpointError(f"checkpoint file {file} cannot be read ({err.strerror})") from None
    except UnicodeDecodeError as err:
        raise _refuse(file, f"not valid UTF-8 (byte {err.start})") from None
    except json.JSONDecodeError as err:
        raise _refuse(file, f"not valid JSON ({err})") from None
    if not isinstance(manifest, dict):
        raise _refuse(file, f"a JSON {type(manifest).__name__}, not an object")
    version = manifest.get("format_version")
    if version not in READABLE_VERSIONS:
        raise CheckpointError(f"checkpoint file {file}: format_version {version!r}; this code reads "
                              f"{', '.join(map(str, READABLE_VERSIONS))}")
    stored_digest = manifest.pop(DIGEST_KEY, None)
    _check_structure(manifest, file)
    for what, name in (("tag", str(manifest.get("tag", ""))), ("directory", path.name)):
        found = _TAG.fullmatch(name)
        if found and int(found.group(1)) != manifest["step"]:
            raise _refuse(file, f"step {manifest['step']} but its {what} is {name} (step {int(found.group(1))})")
    if version >= 2 and stored_digest != _digest(manifest):
        raise _refuse(file, "its content does not match its digest (damaged or edited)")
    for rel, info in manifest["files"].items():
        f = path / rel
        if not f.is_file():
            raise CheckpointError(f"checkpoint file {f} is missing")
        size = f.stat().st_size
        if size != info["bytes"]:
            raise CheckpointError(f"checkpoint file {f} is truncated or corrupt ({size} bytes, manifest says "
                                  f"{info['bytes']})")
    return manifest


def _check_structure(manifest: dict, file: Path) -> None:
    """Types of what the loaders read, so a wrong one is a refusal naming the file, not a KeyError later."""
    for key, kind in (("step", int), ("world_size", int), ("files", dict), ("owners", dict)):
        if not isinstance(manifest.get(key), kind):
            raise _refuse(file, f"'{key}' is {manifest.get(key)!r}; expected a {kind.__name__}")
    for rel, info in manifest["files"].items():
        inside = not Path(rel).is_absolute() and ".." not in Path(rel).parts
        if not (inside and isinstance(info, dict) and isinstance(info.get("bytes"), int)
                and isinstance(info.get("sha256"), str)):
            raise _refuse(file, f"bad entry for file {rel!r}: {info!r}")


def verifier(info: dict, index: int, world_size: int) -> int:
    """The rank that checks a file's digest: the rank that wrote it (it is also the rank that reads it when the
    world size is unchanged: its ZeRO partition, RNG state and backbone shard), else spread by position."""
    return info.get("rank", index) % world_size


def verify_digests(path: Path, manifest: dict, rank: int, world_size: int,
                   wanted: Callable[[str], bool] = lambda rel: True) -> list[str]:
    """Errors (naming the file) of the wanted files whose digest this rank checks; [] when they all match."""
    errors = []
    for index, (rel, info) in enumerate(sorted(manifest["files"].items())):
        if wanted(rel) and verifier(info, index, world_size) == rank and sha256_file(path / rel) != info["sha256"]:
            errors.append(f"checkpoint file {path / rel} is corrupt (its sha256 is not the manifest's)")
    return errors


def checkpoint_tags(root: Path) -> list[str]:
    """Names of the checkpoint directories under `root`, oldest first: exactly `stepNNNNNNNN`, so a user's copy
    (`step00000040.bak`) or a save's temporary directory is never resumed, counted or pruned."""
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if _TAG.fullmatch(p.name) and p.is_dir())


def candidates(root: Path) -> list[Path]:
    """Checkpoint directories under `root` in the order `resume=auto` tries them: `latest`, then newest first."""
    tags = checkpoint_tags(root)[::-1]
    latest_file = root / "latest"
    latest = latest_file.read_text(errors="replace").strip() if latest_file.is_file() else None
    if latest in tags:
        tags.remove(latest)
        tags.insert(0, latest)
    return [root / tag for tag in tags]
