"""Checkpoints: exact resume, elastic resume (2 -> 1, 1 -> 2), atomicity, corrupt files, preemption."""

import json
import os
from pathlib import Path

import pytest
import torch

from distsparse.config import load_config
from distsparse.models import backbone_param
from distsparse.checkpoint import CheckpointError, CheckpointManager, Part
from distsparse.checkpoint.files import unflatten_states
from distsparse.checkpoint.parts import BackbonePart, RngPart
from distsparse.layers.permutation import BlockPermutation
from distsparse.train.deepspeed.config import build_ds_config
from preempt import signal_during_step
from synthetic_data import make_data_dir

BASE = ["model.preset=tiny", "data.seq_len=32", "train.dtype=fp32", "train.eval_interval=1000",
        "train.log_interval=1", "train.warmup_steps=2", "train.eval_samples=16", "train.micro_batch=2",
        "method.preset=chtsnm_nobranch_1of4_row", "method.topology.update_interval=2", "train.steps=8",
        "method.permutation.mode=learned", "method.permutation.block_size=16", "method.permutation.lambda_max=0.01"]


def _losses(out_dir: str) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    ea = EventAccumulator(str(Path(out_dir) / "tb"))
    ea.Reload()
    return {e.step: e.value for e in ea.Scalars("loss/train")}


def _train(rank, world_size, data_dir, out_dir, overrides, stop_after=None, signal_rank=None):
    from distsparse.train.trainer import Trainer
    cfg = load_config(None, BASE + [f"data.dir={data_dir}", f"train.out_dir={out_dir}"] + overrides)
    trainer = Trainer(cfg, build_ds_config("configs/ds/zero2.json", cfg))
    if stop_after is not None:
        signal_during_step(trainer, stop_after, rank == signal_rank)
    result = trainer.train()
    values = {n: backbone_param(m).detach().clone() for n, m in trainer.backbone.items()}
    codes = {n: m.codes.clone() for n, m in trainer.backbone.items()}
    dense = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "embed" in n or "norm" in n}
    dense.update({n: b.clone() for n, b in trainer.model.named_buffers() if "hard_" in n})   # permutation state
    learned = sorted(n for n, m in trainer.model.named_modules() if isinstance(m, BlockPermutation) and m.mode ==
                     "learned")
    trainer.close()
    return {"result": result, "values": values, "codes": codes, "dense": dense, "learned": learned}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return make_data_dir(tmp_path_factory.mktemp("data"))


def test_preempted_run_resumes_bit_for_bit(ranks2, data_dir, tmp_path):
    full = ranks2.run(_train, data_dir, str(tmp_path / "full"), [])
    # SIGUSR1 to rank 1 only after step 4: every rank saves a complete checkpoint and stops cleanly.
    part = ranks2.run(_train, data_dir, str(tmp_path / "part"), [], 4, 1)
    assert all(r["result"].preempted and r["result"].step == 4 for r in part)
    ckpt = tmp_path / "part" / "checkpoints"
    assert (ckpt / "latest").read_text() == "step00000004"
    from safetensors.torch import load_file   # the registry export and consolidation read: every learned block
    registry = unflatten_states(load_file(ckpt / "step00000004" / "registry.safetensors"))
    assert part[0]["learned"] and sorted(registry) == part[0]["learned"]
    resumed = ranks2.run(_train, data_dir, str(tmp_path / "part"), ["checkpoint.resume=auto"])
    for name, v in full[0]["values"].items():
        assert torch.equal(v, resumed[0]["values"][name]), name
        assert torch.equal(full[0]["codes"][name], resumed[0]["codes"][name]), name
    for name, v in full[0]["dense"].items():
        assert torch.equal(v, resumed[0]["dense"][name]), name
    a, b = _losses(tmp_path / "full"), _losses(tmp_path / "part")
    assert [a[s] for s in range(5, 9)] == [b[s] for s in range(5, 9)]


def test_elastic_resume_two_to_one_and_one_to_two(ranks2, data_dir, tmp_path):
    ranks2.run(_train, data_dir, str(tmp_path / "two"), [], 4, 0)   # preempted at step 4
    ref = ranks2.run(_train, data_dir, str(tmp_path / "ref"), [])
    # 2 -> 1: the same global batch (micro 2 x accum 2 x 1 rank == micro 2 x accum 1 x 2 ranks).
    one = _train_single(data_dir, str(tmp_path / "two"), ["checkpoint.resume=auto", "train.grad_accum=2"])
    for name, v in ref[0]["values"].items():
        assert torch.equal(ref[0]["codes"][name], one["codes"][name]), name
        torch.testing.assert_close(v, one["values"][name], rtol=1e-4, atol=1e-5)
    la, lb = _losses(tmp_path / "ref"), _losses(tmp_path / "two")
    for s in range(5, 9):
        assert abs(la[s] - lb[s]) <= 1e-5 * abs(la[s]), (s, la[s], lb[s])
    # 1 -> 2: a one-rank run saved at step 4 continues on two ranks like the one-rank run itself.
    single = _train_single(data_dir, str(tmp_path / "one"), ["train.grad_accum=2", "checkpoint.interval=4"])
    resumed = ranks2.run(_train, data_dir, str(tmp_path / "one_to_two"),
                         [f"checkpoint.resume={tmp_path / 'one' / 'checkpoints' / 'step00000004'}"])
    for name, v in single["values"].items():
        assert torch.equal(single["codes"][name], resumed[0]["codes"][name]), name
        torch.testing.assert_close(v, resumed[0]["values"][name], rtol=1e-4, atol=1e-5)
    la, lb = _losses(tmp_path / "one"), _losses(tmp_path / "one_to_two")
    for s in range(5, 9):
        assert abs(la[s] - lb[s]) <= 1e-5 * abs(la[s]), (s, la[s], lb[s])


def _train_single(data_dir, out_dir, overrides):
    """One process: a fresh world of one through the launcher's own single-process path."""
    import subprocess
    import sys
    script = "import sys; from distsparse.cli.pretrain import main; sys.exit(main(sys.argv[1:]))"
    args = [sys.executable, "-c", script, "--ds_config", "configs/ds/zero2.json"] + BASE + [
        f"data.dir={data_dir}", f"train.out_dir={out_dir}"] + overrides
    # A world of one even inside a multi-task SLURM allocation (launch_env would refuse an unplaceable launch).
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_", "TORCHELASTIC_"))}
    env.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    subprocess.run(args, check=True, env=env, cwd=Path(__file__).resolve().parent.parent)
    from safetensors.torch import load_file
    ckpt = Path(out_dir) / "checkpoints" / (Path(out_dir) / "checkpoints" / "latest").read_text()
    flat = load_file(str(ckpt / "backbone" / "rank00000.safetensors"))
    return {"values": {k.split("::")[0]: v for k, v in flat.items() if k.endswith("::master")},
            "codes": {k.split("::")[0]: v for k, v in flat.items() if k.endswith("::codes")}}


def test_truncated_file_is_refused_by_name_and_auto_falls_back(tmp_path):
    root = tmp_path / "ck"
    for step in (2, 4):
        d = root / f"step{step:08d}"
        (d / "backbone").mkdir(parents=True)
        (d / "backbone" / "rank00000.safetensors").write_bytes(b"x" * 100)
        from distsparse.checkpoint.files import sha256_file
        files = {"backbone/rank00000.safetensors": {"bytes": 100, "sha256": sha256_file(d / "backbone/rank00000.safetensors")}}
        (d / "manifest.json").write_text(json.dumps({"format_version": 1, "step": step, "world_size": 1,
                                                     "files": files, "owners": {}}))
    (root / "latest").write_text("step00000004")
    bad = root / "step00000004" / "backbone" / "rank00000.safetensors"
    bad.write_bytes(b"x" * 50)
    mgr = CheckpointManager(root)
    with pytest.raises(CheckpointError, match="rank00000.safetensors is truncated or corrupt"):
        mgr.find(str(root / "step00000004"))
    assert mgr.find("auto").path.name == "step00000002"


def test_a_save_killed_midway_leaves_the_previous_checkpoint(ranks2, data_dir, tmp_path):
    ranks2.run(_crash_second_save, data_dir, str(tmp_path))
    root = tmp_path / "checkpoints"
    assert (root / "latest").read_text() == "step00000002"
    assert CheckpointManager(root).find("auto").path.name == "step00000002"
    assert not (root / "step00000004").exists()


def _crash_second_save(rank, world_size, data_dir, out_dir):
    from distsparse.checkpoint.parts import BackbonePart
    from distsparse.train.trainer import Trainer
    cfg = load_config(None, BASE + [f"data.dir={data_dir}", f"train.out_dir={out_dir}", "checkpoint.interval=2",
                                    "train.steps=6", "checkpoint.save_at_end=false"])
    trainer = Trainer(cfg, build_ds_config("configs/ds/zero2.json", cfg))
    original = BackbonePart.save

    def failing(self, folder):
        if "step00000004" in str(folder):
            raise OSError("injected failure: disk full")
        return original(self, folder)
    BackbonePart.save = failing
    try:
        with pytest.raises(OSError, match="injected"):
            trainer.train()
    finally:
        BackbonePart.save = original
        trainer.close()


class _FakeDeepSpeed:
    """What deepspeed_files asks of DeepSpeed's engine (0.19's file names and writer flags); it also writes a file
    no rank claims, as a newer DeepSpeed might."""
    save_non_zero_checkpoint = save_zero_checkpoint = True

    def _get_ckpt_name(self, root, tag):
        return os.path.join(root, tag, "mp_rank_00_model_states.pt")

    def _get_zero_ckpt_name(self, root, tag):
        return os.path.join(root, tag, "zero_pp_rank_0_mp_rank_00_optim_states.pt")

    def save_checkpoint(self, root, tag, save_latest):
        for name in (self._get_ckpt_name(root, tag), self._get_zero_ckpt_name(root, tag),
                     os.path.join(root, tag, "extra", "unclaimed.bin")):
            Path(name).parent.mkdir(parents=True, exist_ok=True)
            Path(name).write_bytes(tag.encode())


class _FakeDeepSpeedPart(Part):
    """The dense side's part with DeepSpeed's file writing alone (no dense state to gather)."""

    def save(self, folder):
        from distsparse.train.deepspeed.checkpoint import deepspeed_files
        engine = _FakeDeepSpeed()
        engine.save_checkpoint(str(folder.parent), tag=folder.name, save_latest=False)
        return deepspeed_files(engine, folder.parent, folder.name)


class _FakeMatrix:
    owners = {"w": 0}

    def state_dict(self):
        return {"w": {"master": torch.arange(4.0)}}


def _manager(root, keep_last=3):
    manager = CheckpointManager(root, keep_last=keep_last)
    manager.register(dense=_FakeDeepSpeedPart(), backbone=BackbonePart(_FakeMatrix()), rng=RngPart())
    return manager


def test_keep_last_checkpoints_remain_and_every_file_written_is_in_the_manifest(tmp_path):
    manager = _manager(tmp_path, keep_last=2)
    for step in (1, 2, 3):
        manager.save(step)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step00000002", "step00000003"]
    found = manager.find("auto")
    assert found.path.name == "step00000003"
    files = found.manifest["files"]
    assert sorted(files) == [
        "backbone/rank00000.safetensors", "extra/unclaimed.bin", "mp_rank_00_model_states.pt", "rng/rank00000.json",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    assert files["mp_rank_00_model_states.pt"]["rank"] == 0 and found.manifest["owners"] == {"w": 0}


def test_save_and_load_walk_the_registered_parts_in_one_order(tmp_path):
    """Each part's files and manifest entries come back to it in load, in the order the parts were registered."""
    calls = []

    class Recorder(Part):
        def __init__(self, name):
            self.name = name

        def manifest(self):
            return {f"{self.name}_entry": self.name.upper()}

        def save(self, folder):
            calls.append(("save", self.name))
            (folder / f"{self.name}.json").write_text(self.name)
            return [f"{self.name}.json"]

        def load(self, ckpt):
            calls.append(("load", self.name, (ckpt.path / f"{self.name}.json").read_text(),
                          ckpt.manifest[f"{self.name}_entry"]))

    class NoBackbone(Part):
        def manifest(self):
            return {"owners": {}}   # every manifest has an owner map

    manager = CheckpointManager(tmp_path)
    manager.register(first=Recorder("first"), owners=NoBackbone(), second=Recorder("second"))
    manager.save(5)
    manager.load(manager.find("auto"))
    assert calls == [("save", "first"), ("save", "second"),
                     ("load", "first", "first", "FIRST"), ("load", "second", "second", "SECOND")]
    with pytest.raises(AssertionError, match="registered twice"):
        manager.register(first=Recorder("again"))


def test_a_copy_named_like_a_checkpoint_is_never_resumed_counted_or_pruned(tmp_path):
    """`step00000002.bak` sorts after `step00000002` and before `step00000003`: matched by `step*` it would be tried
    by `auto` before the real newest-but-one, count against keep_last, and be deleted by pruning."""
    manager = _manager(tmp_path, keep_last=2)
    for step in (1, 2):
        manager.save(step)
    import shutil
    shutil.copytree(tmp_path / "step00000002", tmp_path / "step00000002.bak")
    shutil.copytree(tmp_path / "step00000002", tmp_path / "step99999999x")
    (tmp_path / "latest").unlink()   # auto then goes by name: the newest real checkpoint
    assert manager.find("auto").path.name == "step00000002"
    manager.save(3)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "latest", "step00000002", "step00000002.bak", "step00000003", "step99999999x"]


def test_the_rank_rng_file_carries_the_cuda_generator_once_cuda_is_initialized(monkeypatch):
    """On a GPU a resumed run must draw what the uninterrupted one would: the CUDA generator is saved with the
    others and restored where CUDA exists; a CPU resume of a GPU checkpoint skips it. (CUDA faked on CPU; the GPU
    test below runs the real generator.)"""
    from distsparse.checkpoint.files import rng_state, set_rng_state
    cuda_state = torch.arange(16, dtype=torch.uint8)
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda: cuda_state.clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda t: restored.append(t))
    state = json.loads(json.dumps(rng_state()))
    assert state["cuda"] == list(range(16))
    expected = torch.rand(3)
    set_rng_state(state)
    assert torch.equal(restored[0], cuda_state) and restored[0].dtype == torch.uint8
    assert torch.equal(torch.rand(3), expected)   # the CPU generator came back too
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    set_rng_state(state)                           # no CUDA here: the GPU's state is dropped, nothing raises
    assert len(restored) == 1
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert "cuda" not in rng_state()               # asking would initialize CUDA; it has drawn nothing yet


@pytest.mark.gpu
def test_a_restored_cuda_generator_draws_what_it_would_have_drawn():
    from distsparse.checkpoint.files import rng_state, set_rng_state
    torch.rand(1, device="cuda")
    state = json.loads(json.dumps(rng_state()))
    expected = torch.rand(1000, device="cuda")
    torch.rand(77, device="cuda")
    set_rng_state(state)
    assert torch.equal(torch.rand(1000, device="cuda"), expected)


def test_a_finished_run_resumed_saves_its_final_checkpoint_again_with_the_same_dense_state(ranks2, data_dir,
                                                                                          tmp_path):
    """A requeue after the final save: the resumed run takes no step and saves at once (save_at_end), so the dense
    state it gathers is the one DeepSpeed just loaded, not yet linked to the parameters by a step."""
    from safetensors.torch import load_file
    overrides = ["train.steps=2", "checkpoint.interval=1"]
    ranks2.run(_train, data_dir, str(tmp_path), overrides)
    final = tmp_path / "checkpoints" / "step00000002"
    saved = load_file(final / "dense_state.safetensors")
    resumed = ranks2.run(_train, data_dir, str(tmp_path), overrides + ["checkpoint.resume=auto"])
    assert all(r["result"].step == 2 for r in resumed)
    again = load_file(final / "dense_state.safetensors")
    assert saved.keys() == again.keys() and any("exp_avg" in k for k in saved)
    assert all(torch.equal(saved[k], again[k]) for k in saved)


def test_a_resume_on_the_saved_world_size_draws_what_the_saved_run_would_have_drawn_another_keeps_its_own(
        tmp_path):
    """RngPart: python, numpy and torch generators come back on the world size they were saved on (the bit-for-bit
    resume above passes without them: its run draws nothing the seeds do not fix); on another, the ranks are other processes and
    keep their fresh generators."""
    import random
    import numpy as np
    from distsparse.checkpoint import LoadedCheckpoint
    manager = CheckpointManager(tmp_path)
    manager.register(rng=RngPart())
    ckpt = LoadedCheckpoint(manager.save(1), {"world_size": 1})   # the only entry RngPart reads

    def draws():
        return random.random(), float(np.random.rand()), torch.rand(3).tolist()

    expected = draws()
    manager.load(ckpt)
    assert draws() == expected
    fresh = torch.get_rng_state()
    manager.load(LoadedCheckpoint(ckpt.path, {"world_size": 2}))
    assert torch.equal(torch.get_rng_state(), fresh)
