"""The branch in its own DeepSpeed parameter group (method.branch_lr, issue 28): its own peak rate and weight decay
on the dense side's schedule, and its Adam state saved and resumed by name on one and two ranks.

The schedule reference is the formula of distsparse/train/schedule.py written again in float64; the saved state is
checked against DeepSpeed's flat ZeRO partitions (a second code path: no parameter names, no hp links)."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from distsparse.config import load_config
from distsparse.train.deepspeed.config import build_ds_config
from synthetic_data import make_data_dir

ROOT = Path(__file__).resolve().parent.parent
TRAIN_LR, BRANCH_LR, BRANCH_WD, WARMUP, STEPS, MIN_RATIO = 3e-3, 7e-4, 0.05, 2, 4, 0.1
BASE = ["model.preset=tiny", "data.seq_len=32", "train.dtype=fp32", "train.eval_interval=1000", "train.log_interval=1",
        f"train.warmup_steps={WARMUP}", "train.eval_samples=16", "train.micro_batch=2", f"train.steps={STEPS}",
        f"train.lr={TRAIN_LR}", f"train.min_lr_ratio={MIN_RATIO}", "train.weight_decay=0.0",
        "method.preset=chtsnm_1of4_row", "method.topology.update_interval=2", "checkpoint.interval=2",
        f"method.branch_lr={BRANCH_LR}", f"method.branch_weight_decay={BRANCH_WD}"]
MOMENTS = ("exp_avg", "exp_avg_sq")


def reference_factor(step: int) -> float:
    """Linear warmup over WARMUP steps ((step + 1) / WARMUP), then cosine from 1 down to MIN_RATIO at STEPS."""
    if step < WARMUP:
        return (step + 1) / WARMUP
    progress = min(1.0, (step - WARMUP) / (STEPS - WARMUP))
    return MIN_RATIO + (1.0 - MIN_RATIO) * (1.0 + math.cos(math.pi * progress)) / 2.0


def _flat_moment_sums(trainer) -> dict[str, dict[str, float]]:
    """Per DeepSpeed group name: float64 sums of squares of this rank's flat Adam moments (padding is zero)."""
    opt = trainer.engine.optimizer
    out = {}
    for group, flat in zip(opt.optimizer.param_groups, opt.single_partition_of_fp32_groups):
        state = opt.optimizer.state[flat]
        out[group["name"]] = {k: float(state[k].double().square().sum()) for k in MOMENTS}
    return out


def _train(rank, world_size, data_dir, out_dir, overrides):
    from distsparse.train.trainer import Trainer, branch_parameter_names
    cfg = load_config(None, BASE + [f"data.dir={data_dir}", f"train.out_dir={out_dir}"] + overrides)
    trainer = Trainer(cfg, build_ds_config("configs/ds/zero2.json", cfg))
    groups = trainer.engine.optimizer.param_groups
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    members = {g["name"]: sorted(names[id(p)] for p in bit16)
               for g, bit16 in zip(groups, trainer.engine.optimizer.bit16_groups)}
    lrs = {}   # optimizer step taken -> {group name: lr DeepSpeed's AdamW used in it}
    original = trainer.train_step

    def recording_step(batches):
        lrs[trainer.step] = {g["name"]: g["lr"] for g in groups}   # the lr of the step about to be taken
        return original(batches)
    trainer.train_step = recording_step
    trainer.train()
    out = {"lrs": lrs, "members": members, "branch_names": sorted(branch_parameter_names(trainer.model)),
           "weight_decay": {g["name"]: g["weight_decay"] for g in groups}, "flat": _flat_moment_sums(trainer)}
    trainer.close()
    return out


def _resume_and_save(rank, world_size, data_dir, out_dir, checkpoint, overrides=()):
    """Resume from `checkpoint` (train.steps = its step: no step is taken) and save again under out_dir."""
    from distsparse.train.trainer import Trainer
    cfg = load_config(None, BASE + [f"data.dir={data_dir}", f"train.out_dir={out_dir}", "train.steps=2",
                                    f"checkpoint.resume={checkpoint}", *overrides])
    trainer = Trainer(cfg, build_ds_config("configs/ds/zero2.json", cfg))
    assert trainer.step == 2
    lrs = {g.get("name", "one group"): g["lr"] for g in trainer.engine.optimizer.param_groups}
    trainer.train()
    trainer.close()
    return lrs


def _saved_dense_state(out_dir: Path, step: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(out_dir / "checkpoints" / f"step{step:08d}" / "dense_state.safetensors")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return make_data_dir(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def trained(ranks2, data_dir, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("two")
    return out_dir, ranks2.run(_train, data_dir, str(out_dir), [])


def test_the_branch_group_holds_the_branch_parameters_and_follows_the_schedule_at_its_own_rate(trained):
    _, results = trained
    r = results[0]
    assert r["branch_names"] and all(".branch." in n for n in r["branch_names"])
    assert r["members"]["branch"] == r["branch_names"]
    assert not any(".branch." in n for n in r["members"]["dense"])
    assert any("embed" in n for n in r["members"]["dense"])
    assert r["weight_decay"] == {"dense": 0.0, "branch": BRANCH_WD}
    assert sorted(r["lrs"]) == list(range(STEPS))
    for step, lrs in r["lrs"].items():
        factor = reference_factor(step)
        assert lrs["branch"] == pytest.approx(BRANCH_LR * factor, rel=1e-12, abs=0), step
        assert lrs["dense"] == pytest.approx(TRAIN_LR * factor, rel=1e-12, abs=0), step
    assert results[1]["lrs"] == r["lrs"]


def test_every_save_holds_the_branch_adam_state_by_name_equal_to_deepspeeds_partitions(trained):
    out_dir, results = trained
    saved = _saved_dense_state(out_dir, STEPS)   # the final save, which failed with "exp_avg not found"
    assert _saved_dense_state(out_dir, 2).keys() == saved.keys()
    for group, names in results[0]["members"].items():
        for key in MOMENTS:
            by_name = sum(float(saved[f"{n}::{key}"].double().square().sum()) for n in names)
            flat = sum(r["flat"][group][key] for r in results)   # both ranks' partitions
            assert flat > 0, (group, key)
            assert by_name == pytest.approx(flat, rel=1e-9), (group, key)


def _resume_single(data_dir: str, out_dir: Path, checkpoint: Path) -> None:
    """One process, a world of one through the launcher's single-process path."""
    script = "import sys; from distsparse.cli.pretrain import main; sys.exit(main(sys.argv[1:]))"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "SUBMITIT_", "TORCHELASTIC_")) and
           k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    args = [sys.executable, "-c", script, "--ds_config", "configs/ds/zero2.json", *BASE, f"data.dir={data_dir}",
            f"train.out_dir={out_dir}", "train.steps=2", "train.grad_accum=2", f"checkpoint.resume={checkpoint}"]
    subprocess.run(args, check=True, env=env, cwd=ROOT)


def test_the_branch_adam_state_resumes_equal_by_name_on_two_ranks_and_on_one(ranks2, trained, data_dir, tmp_path):
    out_dir, _ = trained
    checkpoint = out_dir / "checkpoints" / "step00000002"
    saved = _saved_dense_state(out_dir, 2)
    branch_keys = [k for k in saved if ".branch." in k and k.endswith(MOMENTS)]
    assert branch_keys
    lrs = ranks2.run(_resume_and_save, data_dir, str(tmp_path / "two"), str(checkpoint))   # DeepSpeed's own load
    assert lrs[0] == pytest.approx({"dense": TRAIN_LR * reference_factor(2), "branch": BRANCH_LR * reference_factor(2)},
                                   rel=1e-12)
    _resume_single(data_dir, tmp_path / "one", checkpoint)                                # by name (elastic)
    for where in ("two", "one"):
        again = _saved_dense_state(tmp_path / where, 2)
        assert again.keys() == saved.keys(), where
        for key in saved:
            assert torch.equal(again[key], saved[key]), (where, key)


def test_a_resume_that_switches_the_branch_group_off_restores_the_state_by_name(ranks2, trained, data_dir, tmp_path):
    """Saved with the branch in its own group, resumed on as many ranks with method.branch_lr/branch_weight_decay
    null: DeepSpeed's own load would need the saved group layout (it failed after the process group had started),
    so the dense state is restored by name, as on another world size."""
    out_dir, _ = trained
    checkpoint = out_dir / "checkpoints" / "step00000002"
    lrs = ranks2.run(_resume_and_save, data_dir, str(tmp_path / "off"), str(checkpoint),
                     ["method.branch_lr=null", "method.branch_weight_decay=null"])
    assert lrs[0] == pytest.approx({"one group": TRAIN_LR * reference_factor(2)}, rel=1e-12)
    saved, again = _saved_dense_state(out_dir, 2), _saved_dense_state(tmp_path / "off", 2)
    assert again.keys() == saved.keys()
    for key in saved:
        assert torch.equal(again[key], saved[key]), key
