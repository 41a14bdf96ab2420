"""The CPU-side parts of the one-call GPU check (issue 15 item 3): the wheel collection's plan, the steps the check
would run, the packaging of what comes back (at most 8 files of at most 16 MiB, a summary, gpu_h200.json in
docs/results shape), and the trainer check's bit-identical-resume logic, run for real at tiny size on gloo.
"""

import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from rankpool import import_tool

ROOT = Path(__file__).resolve().parent.parent
MIB = 1024 * 1024


@pytest.fixture(scope="module")
def gpu_check():
    return import_tool("gpu_check")


def test_plan_lists_every_step_with_its_command_and_the_limits_fit_in_eight_minutes(gpu_check, tmp_path, capsys):
    out = tmp_path / "out"
    assert gpu_check.main(["--plan", str(out)]) == 0
    printed = capsys.readouterr().out
    lines = {line.split()[0]: line for line in printed.splitlines() if re.match(r"^\w+\s+\d+s\s", line)}
    assert list(lines) == ["install_wheels", "install_target", "environment", "pytest_gpu", "train_check",
                           "bench_layer", "bench_inference", "bench_train_60m", "bench_train_350m"]
    limits = {name: int(re.search(r"\s(\d+)s\s", line).group(1)) for name, line in lines.items()}
    assert sum(limits.values()) + gpu_check.CUDA_PROBE_S + gpu_check.PACKAGING_S <= 8 * 60
    # Each limit keeps its margin over the step's expected seconds; the 350m bench (two 350m Trainers, warm-up,
    # 16 timed steps, a refresh) gets the most.
    for name, limit in limits.items():
        assert limit >= 1.5 * gpu_check.BUDGET[name][0], name
    assert max(limits, key=limits.get) == "bench_train_350m" and limits["bench_train_350m"] >= 90
    install = lines["install_wheels"]
    assert "-m pip install --no-index --find-links" in install and str(ROOT / ".gpu_wheels") in install
    assert all(p in install for p in ("deepspeed==0.19.8", "submitit", "nvidia-ml-py"))
    assert "--no-index --no-deps --target" in lines["install_target"]
    assert "tests/test_gpu_tans.py" in lines["pytest_gpu"] and "-m gpu" in lines["pytest_gpu"]
    train = lines["train_check"]
    assert all(a in train for a in ("tools/gpu_train_check.py", "--model 60m", "--steps 30", "--save-at 15",
                                    "engine.force_collectives=true"))
    assert "-m bench.layer device=cuda dtype=bf16" in lines["bench_layer"]
    assert "skip_csr=true" in lines["bench_inference"] and "models=60m,350m" in lines["bench_inference"]
    for size in ("60m", "350m"):
        assert f"model={size}" in lines[f"bench_train_{size}"]
        assert "rows=dense_adamw,chtsnm_nobranch_1of4_row" in lines[f"bench_train_{size}"]
    assert not out.exists()   # a plan writes nothing


def test_the_wheel_plan_builds_deepspeed_without_ops_and_downloads_for_cpython_312_manylinux():
    dry = subprocess.run(["bash", str(ROOT / "tools/gpu_wheels.sh"), "--dry-run"], capture_output=True, text=True,
                         env={**os.environ, "PYTHON": sys.executable}, timeout=60)
    assert dry.returncode == 0, dry.stderr
    build, download = dry.stdout.splitlines()[:2]
    assert build.startswith("DS_BUILD_OPS=0 ") and "pip wheel --no-deps --no-binary deepspeed deepspeed==0.19.8" \
        in build and build.endswith("-w .gpu_wheels")
    assert "pip download --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --platform " \
           "manylinux2014_x86_64 -d .gpu_wheels" in download
    assert "minus: torch numpy" in download and download.endswith("submitit nvidia-ml-py")
    # What the check installs is what the collection gathers, in the folder git ignores.
    gpu_check = import_tool("gpu_check")
    assert gpu_check.WHEELS == ROOT / ".gpu_wheels" and gpu_check.PACKAGES[0] in build
    assert all(p in download for p in gpu_check.PACKAGES[1:])
    ignored = subprocess.run(["git", "check-ignore", ".gpu_wheels/x.whl", ".gpu_site/x"], cwd=ROOT,
                             capture_output=True, text=True)
    assert ignored.stdout.split() == [".gpu_wheels/x.whl", ".gpu_site/x"]


def _writer(path: Path, payload) -> str:
    return f"import json, pathlib; pathlib.Path({str(path)!r}).write_text(json.dumps({payload!r}))"


def test_steps_are_run_under_their_limits_and_everything_comes_back_as_three_small_files(gpu_check, tmp_path,
                                                                                         monkeypatch, capsys):
    """A CPU step set in the real orchestrator: a timed-out step ends with its children, a huge log is cut, the
    figures come from the benchmarks' JSON, the summary names every step."""
    bench = json.loads((ROOT / "docs/results/train_60m.json").read_text())   # a real bench_train JSON
    check = {"resume_bit_identical": True, "losses_identical": True, "val_loss_identical": True,
             "state_hash_identical": True, "refreshes_identical": True, "max_abs_loss_diff": 0.0,
             "refreshes_a": [10, 20], "refreshes_b": [20], "seconds_a": 1.0, "seconds_b": 0.5, "config": {}}
    grandchild = tmp_path / "grandchild.pid"
    py = sys.executable

    def fake_plan(_py, work):
        step = gpu_check.Step
        return [
            step("install_wheels", 10, [py, "-c", "pass"], "ok", needs_cuda=False),
            step("install_target", 10, [py, "-c", "raise SystemExit(3)"], "not needed", needs_cuda=False),
            step("train_check", 20, [py, "-c", _writer(work / "train_check.json", check)], "json",
                 json="train_check.json", needs_cuda=False),
            step("bench_train_350m", 20, [py, "-c", _writer(work / "bench_train_350m.json", bench)], "json",
                 json="bench_train_350m.json", needs_cuda=False),
            step("noisy", 20, [py, "-c", "print('x' * (3 * 1024 * 1024))"], "big log", needs_cuda=False),
            step("hangs", 2, [py, "-c", f"import subprocess, sys, time, pathlib; p = subprocess.Popen([sys.executable,"
                                         f" '-c', 'import time; time.sleep(300)']); pathlib.Path({str(grandchild)!r})"
                                         f".write_text(str(p.pid)); time.sleep(300)"], "timeout", needs_cuda=False),
            step("bench_layer", 20, [py, "-c", "pass"], "needs a GPU"),
        ]

    monkeypatch.setattr(gpu_check, "plan", fake_plan)
    out = tmp_path / "out"
    assert gpu_check.main([str(out)]) == 1   # the timed-out step and the GPU step skipped without a GPU
    printed = capsys.readouterr().out

    files = sorted(p.name for p in out.iterdir())
    assert files == ["gpu_check.tar.gz", "gpu_h200.json", "summary.txt"]
    assert all((out / f).stat().st_size <= 16 * MIB for f in files)
    pid = int(grandchild.read_text())
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]

    with tarfile.open(out / "gpu_check.tar.gz") as tar:
        members = {m.name: m for m in tar.getmembers()}
        assert {"gpu_check/train_check.json", "gpu_check/bench_train_350m.json", "gpu_check/summary.txt",
                "gpu_check/noisy.log", "gpu_check/hangs.log", "gpu_check/install_wheels.log"} <= set(members)
        assert "gpu_check/install_target.log" not in members   # not needed: not run
        assert 2 * MIB < members["gpu_check/noisy.log"].size <= 2 * MIB + 100
        assert json.loads(tar.extractfile("gpu_check/bench_train_350m.json").read()) == bench

    fig = json.loads((out / "gpu_h200.json").read_text())
    assert fig["chts_1of4_tans_over_dense_adamw"] == bench["chts_1of4_tans_over_dense_adamw"]
    phases = bench["phases_s"]["chtsnm_nobranch_1of4_row"]
    assert fig["tans_share_of_step_350m"] == pytest.approx(phases["backbone_step"] / phases["step"])
    assert fig["train_350m"]["dense_adamw"]["optimizer_share_of_step"] == pytest.approx(
        bench["phases_s"]["dense_adamw"]["optimizer"] / bench["phases_s"]["dense_adamw"]["step"])
    assert fig["train_350m"]["dense_adamw"]["mfu"] == bench["mfu"]["dense_adamw"]
    assert fig["resume_bit_identical"] is True and fig["machine"] == bench["machine"] and "config" in fig
    assert fig["steps"]["hangs"]["rc"] == 124 and fig["steps"]["install_target"]["rc"] is None
    assert fig["steps"]["bench_layer"]["note"] == "skipped: no CUDA device"

    summary = (out / "summary.txt").read_text()
    assert summary in printed
    for name in ("install_wheels", "install_target", "train_check", "noisy", "hangs", "bench_layer"):
        assert re.search(rf"^{name}\s", summary, re.M), name
    assert "timed out after 2s" in summary and "chts_1of4_tans_over_dense_adamw = " in summary


def test_train_check_runs_the_real_trainer_and_its_resumed_run_continues_bit_identically(tmp_path):
    out = tmp_path / "check.json"
    # A world of one, also when the suite itself runs inside a SLURM job or under torchrun.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_", "TORCHELASTIC_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=str(ROOT), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, str(ROOT / "tools/gpu_train_check.py"), "--out", str(tmp_path / "runs"),
                          "--json", str(out), "--model", "tiny", "--vocab", "512", "--steps", "8", "--save-at", "4",
                          "--refresh-interval", "3", "--micro-batch", "2", "--seq-len", "32"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["resume_bit_identical"] and result["state_hash_a"] == result["state_hash_b"]
    # Refreshes on both sides of the checkpoint (T_end = 0.75 x 8 = 6): B ran the one after it.
    assert result["refreshes_a"] == [3, 6] and result["refreshes_b"] == [6]
    assert sorted(map(int, result["losses_b"])) == [5, 6, 7, 8]
    assert result["config"]["launch"] == "single" and result["config"]["world_size"] == 1


def test_train_check_runs_attention_on_the_deterministic_math_backend():
    """Flash and memory-efficient attention keep a non-deterministic backward under warn_only determinism: the
    check would compare two runs that may differ in their last bits for no resume defect."""
    check = import_tool("gpu_train_check")
    cuda = torch.backends.cuda
    flags = (cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(), cuda.cudnn_sdp_enabled(),
             cuda.math_sdp_enabled())
    mode = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
            torch.utils.deterministic.fill_uninitialized_memory)
    try:
        check.deterministic_kernels()
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
        assert not (cuda.flash_sdp_enabled() or cuda.mem_efficient_sdp_enabled() or cuda.cudnn_sdp_enabled())
        assert cuda.math_sdp_enabled()
    finally:
        for enable, flag in zip((cuda.enable_flash_sdp, cuda.enable_mem_efficient_sdp, cuda.enable_cudnn_sdp,
                                 cuda.enable_math_sdp), flags):
            enable(flag)
        torch.use_deterministic_algorithms(mode[0], warn_only=mode[1])
        torch.utils.deterministic.fill_uninitialized_memory = mode[2]


def test_the_resume_comparison_flags_any_difference():
    compare = import_tool("gpu_train_check").compare
    a = {"losses": {1: 5.0, 2: 4.5, 3: 4.25, 4: 4.0}, "val_loss": 4.1, "hash": "h", "refreshes": [2, 4]}
    same = {"losses": {3: 4.25, 4: 4.0}, "val_loss": 4.1, "hash": "h", "refreshes": [4]}
    assert compare(a, same, save_at=2)["resume_bit_identical"]
    for key, value, flag in (("losses", {3: 4.25, 4: 4.000000000000001}, "losses_identical"),
                             ("losses", {4: 4.0}, "losses_identical"),          # a step missing
                             ("val_loss", 4.1 + 1e-12, "val_loss_identical"),
                             ("hash", "other", "state_hash_identical"),
                             ("refreshes", [], "refreshes_identical")):
        verdict = compare(a, {**same, key: value}, save_at=2)
        assert not verdict[flag] and not verdict["resume_bit_identical"], key


def test_bench_train_rows_select_the_compared_methods_and_keep_the_reference():
    from bench.core import parse
    from bench.train import TrainSettings

    assert parse(TrainSettings, [], "")[0].row_list == ["dense_adamw", "dense_muon", "dense_tans",
                                                        "chtsnm_nobranch_1of4_row", "chts_muon_1of4_row",
                                                        "chtsnm_nobranch_2of4_row"]
    chosen = parse(TrainSettings, ["rows=dense_adamw,chtsnm_nobranch_1of4_row"], "")[0]
    assert chosen.row_list == ["dense_adamw", "chtsnm_nobranch_1of4_row"]
    for bad in ("chtsnm_nobranch_1of4_row", "dense_adamw", "dense_adamw,chtsnm_nobranch_1of4_row,nope"):
        with pytest.raises(SystemExit):
            parse(TrainSettings, [f"rows={bad}"], "")


def test_a_step_json_in_another_shape_still_brings_every_file_back_and_fails_the_check(gpu_check, tmp_path,
                                                                                      monkeypatch, capsys):
    py = sys.executable

    def fake_plan(_py, work):
        step = gpu_check.Step
        return [step("install_wheels", 10, [py, "-c", "pass"], "ok", needs_cuda=False),
                step("bench_train_350m", 20, [py, "-c", _writer(work / "bench_train_350m.json", {"machine": {}})],
                     "a JSON without the figures", json="bench_train_350m.json", needs_cuda=False)]

    monkeypatch.setattr(gpu_check, "plan", fake_plan)
    out = tmp_path / "out"
    assert gpu_check.main([str(out)]) == 1
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.tar.gz", "gpu_h200.json", "summary.txt"]
    with tarfile.open(out / "gpu_check.tar.gz") as tar:
        assert {"gpu_check/bench_train_350m.json", "gpu_check/bench_train_350m.log"} <= set(tar.getnames())
    fig = json.loads((out / "gpu_h200.json").read_text())
    assert fig["figures_error"].startswith("KeyError: 'phases_s'") and fig["steps"]["bench_train_350m"]["rc"] == 0
    assert "figures_error = KeyError" in (out / "summary.txt").read_text()


def test_without_carried_wheels_or_deepspeed_the_check_stops_before_any_step(gpu_check, tmp_path, monkeypatch,
                                                                             capsys):
    """A call on the GPU machine that forgot to carry .gpu_wheels ends at once with how to fix it, instead of
    spending device time on steps that can only fail."""
    ran = []
    monkeypatch.setattr(gpu_check, "WHEELS", tmp_path / "no_wheels")
    monkeypatch.setattr(gpu_check.importlib.util, "find_spec",
                        lambda name, *a: None if name == "deepspeed" else object())
    monkeypatch.setattr(gpu_check, "run_all", lambda steps, work: ran.append(steps) or [])
    out = tmp_path / "out"
    assert gpu_check.main([str(out)]) == 2 and ran == []
    summary = (out / "summary.txt").read_text()
    assert "no wheels in" in summary and "tools/gpu_wheels.sh" in summary and 'carry=[".gpu_wheels"]' in summary
    assert "tools/gpu_wheels.sh" in capsys.readouterr().err
    # One wheel there (or deepspeed installed) and the check goes on.
    (tmp_path / "no_wheels").mkdir()
    (tmp_path / "no_wheels" / "deepspeed-0.19.8-py3-none-any.whl").write_bytes(b"")
    assert gpu_check.missing_packages(tmp_path / "no_wheels") is None


def test_gpu_steps_name_the_cuda_accelerator_for_deepspeed(gpu_check, tmp_path, monkeypatch):
    """tests/conftest.py defaults DS_ACCELERATOR to cpu; the check's steps must not inherit that default."""
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    seen = tmp_path / "accelerator.txt"
    step = gpu_check.Step("probe", 20, [sys.executable, "-c", f"import os, pathlib; pathlib.Path({str(seen)!r})"
                                        f".write_text(os.environ.get('DS_ACCELERATOR', 'unset'))"], "probe",
                          needs_cuda=False)
    [outcome] = gpu_check.run_all([step], tmp_path)
    assert outcome.rc == 0 and seen.read_text() == "cuda"


def test_limits_over_eight_minutes_are_refused_before_anything_runs(gpu_check, tmp_path, monkeypatch):
    ran = []
    monkeypatch.setitem(gpu_check.BUDGET, "bench_train_350m", (200, "a slower bench"))
    monkeypatch.setattr(gpu_check, "run_all", lambda steps, work, outcomes=None: ran.append(steps) or [])
    for argv in (["--plan", str(tmp_path / "plan")], [str(tmp_path / "out")]):
        with pytest.raises(ValueError, match=r"step limits: got 6\d\ds in all .*bench_train_350m 300s.*at most 480s"):
            gpu_check.main(argv)
    assert ran == []


def _only_step(gpu_check, step):
    return lambda _py, work: [gpu_check.Step("install_wheels", 10, [sys.executable, "-c", "pass"], "ok",
                                             needs_cuda=False), step]


def test_a_hanging_cuda_probe_skips_the_gpu_steps_and_still_packages_everything(gpu_check, tmp_path, monkeypatch):
    """subprocess.TimeoutExpired from the probe used to end the check with nothing packaged."""
    monkeypatch.setattr(gpu_check, "CUDA_PROBE", ("import time; time.sleep(30)",))
    monkeypatch.setattr(gpu_check, "CUDA_PROBE_S", 1)
    monkeypatch.setattr(gpu_check, "plan", _only_step(gpu_check, gpu_check.Step(
        "bench_layer", 20, [sys.executable, "-c", "pass"], "needs a GPU")))
    out = tmp_path / "out"
    assert gpu_check.main([str(out)]) == 1
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.tar.gz", "gpu_h200.json", "summary.txt"]
    fig = json.loads((out / "gpu_h200.json").read_text())
    assert fig["steps"]["bench_layer"]["note"] == "skipped: the CUDA probe timed out after 1s"
    assert fig["steps"]["install_wheels"]["rc"] == 0
    assert "skipped: the CUDA probe timed out after 1s" in (out / "summary.txt").read_text()


def test_an_error_in_the_orchestrator_or_a_step_that_cannot_start_still_packages_the_steps_that_ran(
        gpu_check, tmp_path, monkeypatch, capsys):
    steps = [gpu_check.Step("install_wheels", 10, [sys.executable, "-c", "print('installed')"], "ok",
                            needs_cuda=False),
             gpu_check.Step("environment", 10, [str(tmp_path / "no_such_python"), "-c", "pass"], "cannot start",
                            needs_cuda=False),
             gpu_check.Step("bench_layer", 10, [sys.executable, "-c", "pass"], "never reached", needs_cuda=False)]
    monkeypatch.setattr(gpu_check, "plan", lambda _py, work: steps)
    real_run_step = gpu_check.run_step

    def run_step(step, *args):
        if step.name == "bench_layer":
            raise RuntimeError("the orchestrator broke")
        return real_run_step(step, *args)

    monkeypatch.setattr(gpu_check, "run_step", run_step)
    out = tmp_path / "out"
    assert gpu_check.main([str(out)]) == 1
    fig = json.loads((out / "gpu_h200.json").read_text())
    assert fig["check_error"] == "RuntimeError: the orchestrator broke"
    assert fig["steps"]["install_wheels"]["rc"] == 0 and fig["steps"]["environment"]["rc"] == 127
    assert fig["steps"]["environment"]["note"].startswith("could not start: ")
    summary = (out / "summary.txt").read_text()
    assert "check_error = RuntimeError: the orchestrator broke" in summary and re.search(r"^environment\s+127",
                                                                                         summary, re.M)
    with tarfile.open(out / "gpu_check.tar.gz") as tar:
        assert "installed" in tar.extractfile("gpu_check/install_wheels.log").read().decode()
        assert "could not start" in tar.extractfile("gpu_check/environment.log").read().decode()


def test_a_sigterm_of_the_check_ends_the_running_step_and_still_packages(gpu_check, tmp_path, monkeypatch):
    child = tmp_path / "child.pid"
    code = (f"import os, pathlib, signal, time; pathlib.Path({str(child)!r}).write_text(str(os.getpid())); "
            f"os.kill(os.getppid(), signal.SIGTERM); time.sleep(60)")
    monkeypatch.setattr(gpu_check, "plan", _only_step(gpu_check, gpu_check.Step(
        "train_check", 30, [sys.executable, "-c", code], "signals the check", needs_cuda=False)))
    out = tmp_path / "out"
    assert gpu_check.main([str(out)]) == 1
    fig = json.loads((out / "gpu_h200.json").read_text())
    assert fig["check_error"] == "Terminated: signal 15" and "train_check" not in fig["steps"]
    pid = int(child.read_text())
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


def test_gpu_steps_run_with_nccl_debug_warn_unless_the_caller_set_it(gpu_check, tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "_cuda_here", lambda env: True)
    seen = tmp_path / "nccl.txt"
    probe = [sys.executable, "-c", f"import os, pathlib; pathlib.Path({str(seen)!r})"
                                   f".write_text(os.environ.get('NCCL_DEBUG', 'unset'))"]
    monkeypatch.delenv("NCCL_DEBUG", raising=False)
    for needs_cuda, caller, want in ((True, None, "WARN"), (False, None, "unset"), (True, "INFO", "INFO")):
        if caller:
            monkeypatch.setenv("NCCL_DEBUG", caller)
        [outcome] = gpu_check.run_all([gpu_check.Step("probe", 20, probe, "probe", needs_cuda=needs_cuda)], tmp_path)
        assert outcome.rc == 0 and seen.read_text() == want, (needs_cuda, caller)
