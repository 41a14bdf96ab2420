"""bench/quality_plan.py (bench_quality --plan): the shipped 60M plan's stages and refusals, the stage logic on
known PPLs, and the whole plan end to end on tiny through submitit's local executor, read back on a second call."""

import json
import math
from pathlib import Path

import pytest

from bench import bench_quality, quality_plan, quality_runs

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def plan_tool():
    return quality_plan



def test_the_paper_plan_is_the_issues_protocol(plan_tool, fake_data, tmp_path):
    plan = plan_tool.load_plan("paper_60m")
    assert (plan.model, plan.seq_len, plan.global_batch, plan.steps, plan.warmup_steps) == \
        ("60m", 256, 512, 10000, 1000)
    first = plan_tool.stage_runs(plan, str(fake_data), tmp_path, 0, {})
    assert len(first) == 6 * 4
    run = first[0]
    cfg = quality_runs._resolved_config(run.args, run.spec)
    # One GPU per run: micro-batch x accumulation = the global batch, full length, seed 0.
    assert cfg["train"]["micro_batch"] * cfg["train"]["grad_accum"] == 512
    assert (cfg["train"]["steps"], cfg["train"]["warmup_steps"], cfg["train"]["seed"]) == (10000, 1000, 0)
    assert cfg["train"]["eval_interval"] == 500 and cfg["model"]["preset"] == "60m"
    # Factor 1 of every method is the paper's fixed-rate protocol: the preset's own rates.
    fixed = [r for r in first if r.point == (1.0, 1.0)]
    assert {r.spec.method for r in fixed} == set(plan.methods)
    rates = {r.spec.method: (r.spec.lr, r.spec.dense_lr) for r in fixed}
    assert rates["chtsnm_1of4_row"] == (1e-3, 3e-3) and rates["chts24_1of4_row"] == (3e-3, 3e-3)
    assert all(str(r.spec.out_dir).startswith(str(tmp_path / "seed0")) for r in first)


def test_stages_follow_the_best_seed0_point(plan_tool, fake_data, tmp_path):
    plan = plan_tool.load_plan("paper_60m", ["methods=[chts24_1of4_row, chtsnm_1of4_row]", "seeds=[1, 2]"])
    first = plan_tool.stage_runs(plan, str(fake_data), tmp_path, 0, {})
    bq = quality_runs
    # PPL 50 + |log2(b / 0.5)| for chts24, 40 + |log2(b / 2)| for chtsnm; one diverged point is never best.
    def outcome(run, best_b, base):
        b = run.point[0]
        ppl = math.nan if b == 0.25 else base + abs(math.log2(b / best_b))
        return bq.RunOutcome(None if math.isnan(ppl) else ppl, None, None, [], None, None)
    outcomes = [outcome(r, 0.5, 50.0) if r.spec.method == "chts24_1of4_row" else outcome(r, 2.0, 40.0)
                for r in first]
    scores = {}
    best = plan_tool.record_seed0(scores, first, outcomes)
    assert best == {"chts24_1of4_row": (0.5, 1.0), "chtsnm_1of4_row": (2.0, 1.0)}
    second = plan_tool.stage_runs(plan, str(fake_data), tmp_path, 1, best)
    # Only the method with a branch, at its best backbone factor, each branch factor of the plan.
    assert [(r.spec.method, r.point) for r in second] == [("chtsnm_1of4_row", (2.0, 1.0, s))
                                                         for s in plan.branch_lr_scales]
    assert [r.spec.branch_lr for r in second] == [s * 3e-3 for s in plan.branch_lr_scales]
    branch_ppl = {0.5: 41.0, 1.0: 39.5, 3.0: 40.5}   # r 1 beats the coupled branch (40.0)
    best = plan_tool.record_seed0(scores, second, [bq.RunOutcome(branch_ppl[r.point[2]], None, None, [], None, None)
                                                   for r in second])
    assert best == {"chts24_1of4_row": (0.5, 1.0), "chtsnm_1of4_row": (2.0, 1.0, 1.0)}
    third = plan_tool.stage_runs(plan, str(fake_data), tmp_path, 2, best)
    assert sorted((r.args.seed, r.spec.method, r.point) for r in third) == [
        (s, m, p) for s in (1, 2) for m, p in sorted(best.items())]
    assert {r.spec.out_dir.relative_to(tmp_path).as_posix() for r in third} == {
        f"seed{s}/{n}" for s in (1, 2) for n in ("chts24_1of4_row/sweep_b0.5_d1", "chtsnm_1of4_row/sweep_b2_d1_r1")}


@pytest.mark.parametrize("change, named", [
    ("backbone_lr_scales=[0.5, 2]", "plan.backbone_lr_scales"),
    ("global_batch=500", "plan.global_batch"),
    ("seeds=[0, 1]", "plan.seeds"),
    ("methods=[dense_adamw, dense_adamw]", "plan.methods"),
    ("branch_lr_scales=[-1]", "plan.branch_lr_scales"),
])
def test_a_bad_plan_is_refused_naming_the_key(plan_tool, change, named):
    with pytest.raises(ValueError, match=named.split(".")[1]) as err:
        plan_tool.load_plan("paper_60m", [change])
    assert "allowed" in str(err.value)


def test_an_unknown_plan_key_is_refused(plan_tool):
    with pytest.raises(ValueError, match="unknown key 'batch'"):
        plan_tool.load_plan("paper_60m", ["batch=3"])


TINY_PLAN = ["model=tiny", "seq_len=16", "global_batch=4", "micro_batch_per_gpu=2", "steps=4", "warmup_steps=1",
             "eval_points=2", "eval_samples=8", "methods=[chtsnm_1of4_row]", "backbone_lr_scales=[1, 2]",
             "branch_lr_scales=[2]", "seeds=[1]", "overrides=[method.topology.update_interval=2]"]


def test_the_plan_runs_end_to_end_on_tiny_and_a_second_call_trains_nothing(plan_tool, quality_corpus, tmp_path,
                                                                             capsys):
    root = tmp_path / "plan"
    argv = ["--plan", "paper_60m", "--data", str(quality_corpus), "--root", str(root), "--executor", "local",
            "--time", "20", *[a for s in TINY_PLAN for a in ("--plan-set", s)]]
    bench = bench_quality
    assert bench.main(argv) == 0, capsys.readouterr().err
    results = {p.parent.relative_to(root).as_posix(): json.loads(p.read_text())["final/val_ppl"]
               for p in root.glob("seed*/*/*/result.json")}
    seed0 = {k.split("/")[-1]: v for k, v in results.items() if k.startswith("seed0/chtsnm_1of4_row/")}
    stage1_best = min(("sweep_b1_d1", "sweep_b2_d1"), key=seed0.get)
    assert set(seed0) == {"sweep_b1_d1", "sweep_b2_d1", f"{stage1_best}_r2"}   # the branch at the best backbone rate
    best = min(seed0, key=seed0.get)
    assert set(results) - {f"seed0/chtsnm_1of4_row/{k}" for k in seed0} == {f"seed1/chtsnm_1of4_row/{best}"}
    config = json.loads((root / f"seed1/chtsnm_1of4_row/{best}/config.json").read_text())
    assert config["train"]["micro_batch"] * config["train"]["grad_accum"] == 4 and config["train"]["seed"] == 1
    assert not list(root.glob("seed*/*/*/checkpoints/*"))   # no --keep-checkpoint: none written
    summary = json.loads((root / "summary.json").read_text())
    assert set(summary["methods"]["chtsnm_1of4_row"]["seeds"]) == {"0", "1"}
    capsys.readouterr()
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    assert "0 to train" in out and "submitted" not in out


def test_slurm_tasks_are_one_gpu_each_with_the_cluster_options(plan_tool, fake_data, tmp_path, fake_srun):
    args = plan_tool.parse_args(["--plan", "paper_60m", "--data", str(fake_data), "--root", str(tmp_path),
                                 "--executor", "slurm", "--partition", "gpu", "--account", "proj", "--time", "3:00:00"])
    text = plan_tool.make_executor(args)._executor._make_submission_file_text("CMD", "uid")
    for line in ("--nodes=1", "--ntasks-per-node=1", "--gpus-per-node=1", "--partition=gpu", "--account=proj",
                 "--time=180", "--cpus-per-task=8", "--job-name=quality_paper_60m"):
        assert f"#SBATCH {line}\n" in text, (line, text)


def test_a_slurm_task_runs_in_the_environment_slurm_gives_it(plan_tool, fake_data, tmp_path, fake_srun, monkeypatch):
    """The GPU SLURM assigns a task arrives in the task's environment (CUDA_VISIBLE_DEVICES); the run must see it,
    not the submitting host's environment captured at submission."""
    import sys
    args = plan_tool.parse_args(["--plan", "paper_60m", "--data", str(fake_data), "--root", str(tmp_path),
                                 "--executor", "slurm"])
    executor = plan_tool.make_executor(args)
    assert "export PYTHONUNBUFFERED=1\n" in executor._executor._make_submission_file_text("CMD", "uid")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    probe = [sys.executable, "-c", "import os; print(os.environ.get('CUDA_VISIBLE_DEVICES'))"]
    task = plan_tool.task_function(probe, executor)          # built on the submitting host
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")          # what SLURM sets inside the task
    assert task().strip() == "3"
    local = plan_tool.make_executor(plan_tool.parse_args(["--plan", "paper_60m", "--data", str(fake_data), "--root",
                                                          str(tmp_path / "local"), "--executor", "local"]))
    monkeypatch.setenv("SLURM_NTASKS", "4")                  # an salloc shell: not passed to a local run
    slurm_probe = [sys.executable, "-c", "import os; print(os.environ.get('SLURM_NTASKS'))"]
    assert plan_tool.task_function(slurm_probe, local)().strip() == "None"


def test_an_unfinished_attempt_is_cleared_before_its_run_is_submitted_again(plan_tool, fake_data, tmp_path):
    """A cancelled task leaves event files in its run directory; the retrained run must not append its curve to
    them (curves.csv is written from every event file under tb/)."""
    import contextlib
    plan = plan_tool.load_plan("paper_60m", ["methods=[chts24_1of4_row]", "backbone_lr_scales=[1]"])
    runs = plan_tool.stage_runs(plan, str(fake_data), tmp_path, 0, {})
    stale = runs[0].spec.out_dir / "tb" / "events.out.tfevents.cancelled"
    stale.parent.mkdir(parents=True)
    stale.write_text("")
    seen = []

    class Job:
        job_id, paths = "7_0", None

        def result(self):
            return ""

    class Executor:
        cluster = "slurm"

        @contextlib.contextmanager
        def batch(self):
            yield

        def submit(self, fn):
            seen.append(stale.exists())
            return Job()
    outcomes = plan_tool.run_stage(runs, Executor(), 0)
    assert seen == [False] and outcomes[0].final_ppl is None   # cleared before submission; no result yet
