"""The dense side as a part of a run checkpoint (checkpoint/parts.py): DeepSpeed's own files and the dense state
by parameter name.

Save: the dense state gathered by name (collective, dense_state.py), DeepSpeed's `save_checkpoint` into the
checkpoint folder, and the list of what it wrote on this rank by its own naming (deepspeed==0.19.8's
`_get_ckpt_name`, `_get_zero_ckpt_name` and writer flags; its recovery scripts go to the folder's parent, outside
the checkpoint); rank 0 adds dense_state.safetensors.

Load: where the ZeRO partitions are the saved ones (the same world size and the same parameter groups) DeepSpeed's
own `load_checkpoint`. Otherwise (ZeRO files are per partition and per parameter group: another world size, or
method.branch_lr / branch_weight_decay switched on or off) the module alone, then masters, moments and step by
name. Either way DeepSpeed's clip threshold goes back to train.grad_clip (side.py's `hold_threshold`).
"""

from __future__ import annotations

from pathlib import Path

from distsparse import dist as ddist
from distsparse.checkpoint.files import save_safetensors
from distsparse.checkpoint.parts import DENSE_STATE, LoadedCheckpoint, Part, load_tensors
from distsparse.config import separate_branch_group
from distsparse.train.deepspeed.dense_state import gather_dense_state, restore_dense_state
from distsparse.train.deepspeed.side import DeepSpeedSide


def deepspeed_files(ds_engine, root: Path, tag: str) -> list[str]:
    """The files `ds_engine.save_checkpoint(root, tag)` wrote on this rank, relative to the checkpoint directory,
    by DeepSpeed's own naming and writer flags: the module file on its data-parallel writer, the ZeRO partition
    named by this rank's data-parallel rank."""
    written = []
    if ds_engine.save_non_zero_checkpoint:
        written.append(ds_engine._get_ckpt_name(str(root), tag))
    if ds_engine.save_zero_checkpoint:
        written.append(ds_engine._get_zero_ckpt_name(str(root), tag))
    return [Path(p).relative_to(root / tag).as_posix() for p in written]


class DeepSpeedPart(Part):
    """The dense side in a checkpoint (module docstring). `separate_branch_group`: this run's
    method.separate_branch_group, whether the branch parameters form a DeepSpeed parameter group of their own."""

    def __init__(self, side: DeepSpeedSide, *, separate_branch_group: bool):
        self.side, self.separate_branch_group = side, separate_branch_group

    def save(self, folder: Path) -> list[str]:
        engine = self.side.engine
        dense = gather_dense_state(engine, engine.module, ddist.rank())
        engine.save_checkpoint(str(folder.parent), tag=folder.name, save_latest=False)
        written = deepspeed_files(engine, folder.parent, folder.name)
        if dense is not None:
            save_safetensors(dense, folder / DENSE_STATE)
            written.append(DENSE_STATE)
        return written

    def same_partitions(self, manifest: dict) -> bool:
        """Whether DeepSpeed's ZeRO files of the checkpoint fit this run's partitions."""
        return manifest["world_size"] == ddist.world_size() and \
            separate_branch_group(manifest["config"]["method"]) == self.separate_branch_group

    def load(self, ckpt: LoadedCheckpoint) -> None:
        engine = self.side.engine
        root, tag = str(ckpt.path.parent), ckpt.path.name
        if self.same_partitions(ckpt.manifest):
            engine.load_checkpoint(root, tag=tag)
        else:
            engine.load_checkpoint(root, tag=tag, load_module_only=True, load_optimizer_states=False,
                                   load_lr_scheduler_states=False)
            restore_dense_state(engine, engine.module, load_tensors(ckpt, DENSE_STATE), ckpt.manifest["step"])
        self.side.hold_threshold()
