"""The global batch as the truth (issue 26 item 1): resolve_batch's accumulation and refusals with numbers, the
legacy form and its resume, the DeepSpeed file, the launcher's refusal before any process group, and a 2-rank run
resumed on 1 rank that keeps its global batch and continues its loss curve."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from distsparse.config import TrainConfig, load_config
from distsparse.train.batch import BatchPlan, SavedBatch, describe_resume, resolve_batch, saved_batch
from distsparse.train.deepspeed.config import complete_ds_config
from preempt import signal_during_step
from synthetic_data import make_data_dir

ROOT = Path(__file__).resolve().parent.parent


def _train(**kw) -> TrainConfig:
    return TrainConfig(**kw)


# ---- resolve_batch -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("global_batch, micro, world", [(512, 16, 16), (512, 16, 8), (512, 64, 8), (16, 2, 1),
                                                        (16, 2, 2), (12, 3, 4), (7, 7, 1), (60, 5, 3)])
def test_accumulation_is_the_one_integer_that_makes_micro_x_world_x_accum_the_global_batch(global_batch, micro,
                                                                                          world):
    plan = resolve_batch(_train(global_batch_size=global_batch, micro_batch=micro), world)
    brute = [a for a in range(1, global_batch + 1) if micro * world * a == global_batch]   # independent search
    assert brute == [plan.grad_accum]
    assert plan == BatchPlan(global_batch, micro, brute[0], world)


def test_paper_figures_512_on_16_8_and_4_ranks():
    t = _train(global_batch_size=512, micro_batch=16)
    assert [resolve_batch(t, w).grad_accum for w in (16, 8, 4, 32)] == [2, 4, 8, 1]


@pytest.mark.parametrize("global_batch, micro, world, per_micro_step", [(12, 2, 4, 8), (16, 3, 1, 3),
                                                                        (512, 16, 64, 1024)])
def test_a_global_batch_that_does_not_divide_is_refused_naming_the_three_numbers(global_batch, micro, world,
                                                                                per_micro_step):
    with pytest.raises(ValueError) as err:
        resolve_batch(_train(global_batch_size=global_batch, micro_batch=micro), world)
    message = str(err.value)
    assert message.startswith(f"train.global_batch_size: got {global_batch}, not a multiple of "
                              f"train.micro_batch ({micro}) x {world} rank(s) = {per_micro_step}"), message
    assert f"allowed: a global batch divisible by {per_micro_step}" in message


def test_a_stated_grad_accum_must_agree_with_the_global_batch_or_stay_at_1():
    assert resolve_batch(_train(global_batch_size=16, micro_batch=2, grad_accum=4), 2).grad_accum == 4
    assert resolve_batch(_train(global_batch_size=16, micro_batch=2, grad_accum=1), 2).grad_accum == 4
    with pytest.raises(ValueError, match=r"train.grad_accum: got 3, but train.global_batch_size 16 / "
                                         r"\(train.micro_batch 2 x 2 rank\(s\)\) gives 4; allowed: 4, or leave"):
        resolve_batch(_train(global_batch_size=16, micro_batch=2, grad_accum=3), 2)


def test_legacy_form_is_micro_x_accum_x_world_and_its_resume_keeps_the_checkpoints_global_batch():
    legacy = _train(micro_batch=2, grad_accum=3)
    assert resolve_batch(legacy, 2) == BatchPlan(12, 2, 3, 2)
    saved = SavedBatch(global_batch=12, micro_batch=2, grad_accum=3, world_size=2)
    assert resolve_batch(legacy, 1, saved) == BatchPlan(12, 2, 6, 1)     # elastic: accumulation 3 -> 6
    assert resolve_batch(legacy, 6, saved) == BatchPlan(12, 2, 1, 6)
    # the user changed the split: the legacy product, a new global batch
    assert resolve_batch(_train(micro_batch=2, grad_accum=1), 1, saved) == BatchPlan(2, 2, 1, 1)
    # a global batch set in the config wins over the checkpoint's
    assert resolve_batch(_train(global_batch_size=24, micro_batch=2), 1, saved) == BatchPlan(24, 2, 12, 1)
    with pytest.raises(ValueError, match=r"checkpoint.resume: the checkpoint's global batch \(saved on 2 rank\(s\); "
                                         r".*\) is 12, not a multiple of train.micro_batch \(2\) x 4 rank\(s\) = 8"):
        resolve_batch(legacy, 4, saved)


def test_saved_batch_reads_new_manifests_and_gives_the_product_for_older_ones():
    old = {"world_size": 2, "config": {"train": {"micro_batch": 4, "grad_accum": 3}}}
    assert saved_batch(old) == SavedBatch(24, 4, 3, 2)
    # an elastic legacy resume: the config still says grad_accum 1, the manifest the accumulation used
    new = {"world_size": 1, "global_batch_size": 16, "grad_accum": 8,
           "config": {"train": {"micro_batch": 2, "grad_accum": 1, "global_batch_size": 0}}}
    assert saved_batch(new) == SavedBatch(16, 2, 1, 1)
    assert resolve_batch(_train(micro_batch=2), 1, saved_batch(new)) == BatchPlan(16, 2, 8, 1)


def test_the_resume_log_names_the_accumulation_change_or_the_new_global_batch():
    saved = SavedBatch(8, 2, 2, 2)                    # accumulation 2 on 2 ranks
    assert describe_resume(BatchPlan(8, 2, 4, 1), saved) == \
        "accumulation 2 -> 4 to keep the global batch 8 (2 -> 1 rank(s))"
    assert describe_resume(BatchPlan(8, 2, 2, 2), saved) is None
    assert describe_resume(BatchPlan(16, 2, 4, 2), saved).startswith("global batch 8 -> 16 (accumulation 4 on 2")


# ---- the DeepSpeed file --------------------------------------------------------------------------------------

def test_with_a_global_batch_the_deepspeed_file_may_not_set_accumulation_and_the_trainer_sets_it():
    cfg = load_config(None, ["train.global_batch_size=16", "train.micro_batch=2"])
    ds = complete_ds_config({"zero_optimization": {"stage": 2}}, cfg, cuda_available=False)
    assert "gradient_accumulation_steps" not in ds and "train_batch_size" not in ds
    assert complete_ds_config({"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": "auto"}, cfg,
                              cuda_available=False)["train_micro_batch_size_per_gpu"] == 2
    with pytest.raises(ValueError, match=r"--ds_config gradient_accumulation_steps: got 4 with "
                                         r"train.global_batch_size 16; the trainer derives it"):
        complete_ds_config({"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 4}, cfg,
                           cuda_available=False)
    legacy = load_config(None, ["train.grad_accum=3"])
    assert complete_ds_config({"zero_optimization": {"stage": 2}}, legacy,
                              cuda_available=False)["gradient_accumulation_steps"] == 3


# ---- before any process group ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return make_data_dir(tmp_path_factory.mktemp("data"))


def test_the_launcher_refuses_a_non_dividing_global_batch_in_one_line_before_any_process_group(data_dir, capsys,
                                                                                              monkeypatch):
    from distsparse.cli.pretrain import main
    for key in [k for k in os.environ if k.startswith(("SLURM_", "SUBMITIT_", "TORCHELASTIC_"))]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")   # what `torchrun --nproc-per-node 4` leaves: 4 ranks
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29555")
    rc = main(["--ds_config", str(ROOT / "configs/ds/zero2.json"), f"data.dir={data_dir}", "data.seq_len=32",
               "train.global_batch_size=12", "train.micro_batch=2"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith("config error: train.global_batch_size: got 12, not a multiple of "
                               "train.micro_batch (2) x 4 rank(s) = 8"), lines
    assert not torch.distributed.is_initialized()


# ---- a 2-rank run resumed on 1 rank --------------------------------------------------------------------------

BASE = ["model.preset=tiny", "data.seq_len=32", "train.dtype=fp32", "train.eval_interval=1000",
        "train.log_interval=1", "train.warmup_steps=2", "train.eval_samples=16", "train.micro_batch=2",
        "train.global_batch_size=4", "method.preset=chtsnm_nobranch_1of4_row", "method.topology.update_interval=2",
        "train.steps=8", "checkpoint.interval=1", "checkpoint.keep_last=10"]


def _two_ranks(rank, world_size, data_dir, out_dir, stop_after=None):
    """8 steps, or preempted (a real SIGUSR1 to rank 0) during step `stop_after`: the schedule stays 8 steps."""
    from distsparse.train.deepspeed.config import build_ds_config
    from distsparse.train.trainer import Trainer
    cfg = load_config(None, BASE + [f"data.dir={data_dir}", f"train.out_dir={out_dir}"])
    trainer = Trainer(cfg, build_ds_config("configs/ds/zero2.json", cfg))
    plan = trainer.plan
    if stop_after is not None:
        signal_during_step(trainer, stop_after, rank == 0)
    trainer.train()
    trainer.close()
    return plan


def _one_rank(data_dir, out_dir, overrides) -> str:
    """The launcher's single-process path; returns its log (stderr)."""
    script = "import sys; from distsparse.cli.pretrain import main; sys.exit(main(sys.argv[1:]))"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_", "TORCHELASTIC_"))}
    env.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, "-c", script, "--ds_config", "configs/ds/zero2.json", *BASE,
                           f"data.dir={data_dir}", f"train.out_dir={out_dir}", *overrides],
                          env=env, cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stderr


def _manifests(out_dir) -> dict[int, dict]:
    root = Path(out_dir) / "checkpoints"
    return {int(p.name[4:]): json.loads((p / "manifest.json").read_text()) for p in root.glob("step*")}


def _losses(out_dir) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    ea = EventAccumulator(str(Path(out_dir) / "tb"))
    ea.Reload()
    return {e.step: e.value for e in ea.Scalars("loss/train")}


def test_a_two_rank_run_resumed_on_one_rank_keeps_the_global_batch_and_its_loss_curve(ranks2, data_dir, tmp_path):
    ref, part = str(tmp_path / "ref"), str(tmp_path / "part")
    plans = ranks2.run(_two_ranks, data_dir, ref)
    assert plans == [BatchPlan(4, 2, 1, 2)] * 2
    ranks2.run(_two_ranks, data_dir, part, 4)
    log = _one_rank(data_dir, part, ["checkpoint.resume=auto"])
    assert "accumulation 1 -> 2 to keep the global batch 4 (2 -> 1 rank(s))" in log, log[-3000:]
    a, b = _manifests(ref), _manifests(part)
    assert sorted(a) == sorted(b) == list(range(1, 9))
    # the sampler's consumed samples advance by the same global batch per step on 1 rank as on 2
    assert [a[s]["consumed_samples"] for s in a] == [b[s]["consumed_samples"] for s in a] == [4 * s for s in a]
    assert [(b[s]["world_size"], b[s]["global_batch_size"], b[s]["grad_accum"]) for s in (4, 5, 8)] == [
        (2, 4, 1), (1, 4, 2), (1, 4, 2)]
    la, lb = _losses(ref), _losses(part)
    for s in range(5, 9):   # the same samples per step, summed in another order: float32 rounding only
        assert abs(la[s] - lb[s]) <= 1e-3 * abs(la[s]), (s, la[s], lb[s])


def test_a_resume_whose_global_batch_does_not_divide_the_consumed_samples_is_refused_before_any_process_group(
        data_dir, monkeypatch):
    """The sampler continues at a whole global batch: 12 consumed samples (3 steps of 4) continue under a global
    batch of 6 or 12, not of 8, which validate refuses naming both numbers (after launch it was a traceback)."""
    import distsparse.train.validate as validate_module
    manifest = {"world_size": 1, "global_batch_size": 4, "grad_accum": 2, "consumed_samples": 12,
                "config": {"train": {"micro_batch": 2, "grad_accum": 1, "global_batch_size": 4}}}
    monkeypatch.setattr(validate_module, "check_resume", lambda cfg, meta: manifest)
    base = [f"data.dir={data_dir}", "data.seq_len=32", "train.micro_batch=2", "checkpoint.resume=auto"]
    for ok in (6, 12, 4):
        validate_module.validate(load_config(None, base + [f"train.global_batch_size={ok}"]), world_size=1)
    with pytest.raises(ValueError, match=r"^train.global_batch_size: got 8, but the checkpoint resumed has consumed "
                                         r"12 samples, not a multiple of it; allowed: a global batch that divides 12 "
                                         r"\(the checkpoint's is 4\)"):
        validate_module.validate(load_config(None, base + ["train.global_batch_size=8"]), world_size=1)
    # the legacy form: micro-batch 2 x grad_accum 5 is a new global batch of 10
    with pytest.raises(ValueError, match=r"^train.micro_batch: got 2, a global batch of train.micro_batch x "
                                         r"train.grad_accum \(5\) x 1 rank\(s\) = 10, but the checkpoint resumed"):
        validate_module.validate(load_config(None, base + ["train.grad_accum=5"]), world_size=1)
