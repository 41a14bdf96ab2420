"""Run checkpoints, for training (save, verified resume, resume compatibility) and for evaluation and export
(`distsparse.checkpoint.model.load_trained_model`, imported from there: it builds the model).

    files.py     digests, durable writes, safetensors with the user's file mode, RNG state as JSON
    manifest.py  the manifest and the checks made before anything is loaded
    manager.py   CheckpointManager: collective save, find (verified, agreed on by every rank), load, walking the
                 parts registered by name
    parts.py     the Part base and the generic parts: backbone shards, method registry, RNG
    compat.py    the saved run's config against the resuming run's, before any process group starts
    model.py     the training model of a checkpoint, from the project's own files
"""

from distsparse.checkpoint.compat import check_resume, checkpoint_root, resume_changes
from distsparse.checkpoint.manager import CheckpointManager
from distsparse.checkpoint.manifest import CheckpointError, tag_for
from distsparse.checkpoint.parts import LoadedCheckpoint, Part

__all__ = ["CheckpointError", "CheckpointManager", "LoadedCheckpoint", "Part", "check_resume", "checkpoint_root",
           "resume_changes", "tag_for"]
