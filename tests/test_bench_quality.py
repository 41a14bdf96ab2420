"""bench/bench_quality.py and bench/quality_runs.py: an end-to-end comparison on a tiny prepared corpus (JSON shape, equal token counts,
plot, resumability), and its LR sweep, failure handling and reference ratios with the trainer replaced by a
stand-in whose PPL is a known function of the learning rate."""

import io
import json
import math
import shutil
from pathlib import Path

import pytest
import yaml

from bench import bench_quality, quality_runs

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TRAIN_LR = 3e-3   # TrainConfig.lr, the dense-side default that no preset overrides


@pytest.fixture
def bench():
    return bench_quality


def preset_lr(method):
    return float(yaml.safe_load((ROOT / "configs" / "method" / f"{method}.yaml").read_text())["lr"])


def test_two_methods_share_token_counts_and_a_second_run_skips_both(bench, quality_corpus, tmp_path, capsys):
    out_json, out_png, runs = tmp_path / "q.json", tmp_path / "q.png", tmp_path / "runs"
    argv = ["--data", str(quality_corpus), "--methods", "dense_adamw,chts24_1of4_row", "--model", "tiny",
            "--steps", "4",
            "--eval-points", "2", "--micro-batch", "2", "--seq-len", "32", "--eval-samples", "4",
            "--json", str(out_json), "--plot", str(out_png), "--out-root", str(runs)]
    assert bench.main(argv) == 0
    payload = json.loads(out_json.read_text())

    assert set(payload) == {"machine", "config", "methods"}
    assert payload["config"]["tokens_per_step"] == 2 * 32 and payload["config"]["eval_interval"] == 2
    assert list(payload["methods"]) == ["dense_adamw", "chts24_1of4_row"]
    for name, entry in payload["methods"].items():
        assert entry["skipped"] is None
        # Evaluations after steps 2 and 4 of 2 x 32 tokens each.
        assert [t for t, _ in entry["curve"]] == [128, 256]
        result = json.loads((runs / name / "full" / "result.json").read_text())
        # The curve comes from the logged scalars, the final PPL from result.json: two paths to the same number.
        assert entry["curve"][-1][1] == pytest.approx(entry["final_ppl"], rel=1e-5)
        assert entry["final_ppl"] == pytest.approx(math.exp(result["final/val_loss"]), rel=1e-5)
        assert 1.0 < entry["final_ppl"] < 400.0   # below a uniform guess over 300 pieces (+ slack for 4 steps)
        assert entry["lr"] == pytest.approx(preset_lr(name)) and entry["dense_lr"] == pytest.approx(DEFAULT_TRAIN_LR)
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    capsys.readouterr()

    mtimes = {p: p.stat().st_mtime_ns for p in runs.rglob("result.json")}
    assert bench.main(argv) == 0
    log = capsys.readouterr().out
    assert log.count("already (final PPL") == 2 and ": training" not in log
    assert {p: p.stat().st_mtime_ns for p in runs.rglob("result.json")} == mtimes
    assert json.loads(out_json.read_text())["methods"] == payload["methods"]

    # Without the JSON the finished run directories are read back, not retrained: same numbers, no wall time.
    out_json.unlink()
    assert bench.main(argv) == 0
    assert capsys.readouterr().out.count("with the same config; read back") == 2
    assert {p: p.stat().st_mtime_ns for p in runs.rglob("result.json")} == mtimes
    for name, entry in json.loads(out_json.read_text())["methods"].items():
        assert entry["wall_s"] is None
        assert {k: v for k, v in entry.items() if k != "wall_s"} == \
            {k: v for k, v in payload["methods"][name].items() if k != "wall_s"}

    # Each run keeps its curves as CSV beside result.json, the TensorBoard scalars at every logged step; a run
    # directory without its event files (as docs/results keeps it) is read back from the CSV alone.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    run_dir = runs / "chts24_1of4_row" / "full"
    events = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0}).Reload()
    lines = (run_dir / "curves.csv").read_text().splitlines()
    assert lines[0] == "step,loss/train,loss/val,loss/val_ppl,optim/grad_norm"
    assert [int(line.split(",")[0]) for line in lines[1:]] == [e.step for e in events.Scalars("loss/train")]
    assert [float(line.split(",")[1]) for line in lines[1:]] == [e.value for e in events.Scalars("loss/train")]
    assert [float(line.split(",")[2]) for line in lines[1:] if line.split(",")[2]] == \
        [e.value for e in events.Scalars("loss/val")]
    shutil.rmtree(run_dir / "tb")
    out_json.unlink()
    assert bench.main(argv) == 0
    assert json.loads(out_json.read_text())["methods"]["chts24_1of4_row"]["curve"] == \
        payload["methods"]["chts24_1of4_row"]["curve"]

    # A run is read back only under its own config, and never with --force.
    args = quality_runs.parse_args(argv)
    lr, dense_lr = quality_runs.preset_lrs("dense_adamw", quality_runs.base_overrides(args))
    spec = quality_runs.RunSpec("dense_adamw", "dense_adamw", 4, 2, lr, dense_lr, runs / "dense_adamw" / "full")
    assert quality_runs.finished_earlier(args, spec)
    assert not quality_runs.finished_earlier(args, quality_runs.RunSpec(**{**vars(spec), "lr": 2 * lr}))
    assert not quality_runs.finished_earlier(args, quality_runs.RunSpec(**{**vars(spec), "steps": 5}))
    assert not quality_runs.finished_earlier(quality_runs.parse_args(argv + ["--seed", "1"]), spec)
    assert not quality_runs.finished_earlier(quality_runs.parse_args(argv + ["--force"]), spec)


# ---- the comparison logic with a stand-in trainer -----------------------------------------------------------


def fake_trainer(bench, calls, best_lr_scale, failing=(), best_dense_scale=1.0):
    """PPL = 50 + 10 |log2(b / best_lr_scale)| + 4 |log2(d / best_dense_scale)| at every evaluation, b and d the
    backbone and dense-side LRs over the preset's, so the best pair is known."""
    def train(args, run):
        calls.append(run)
        if run.method in failing:
            return quality_runs.RunOutcome(None, None, None, [], "exit code 1: boom", 0.1)
        b, d = run.lr / preset_lr(run.method), run.dense_lr / DEFAULT_TRAIN_LR
        ppl = 50.0 + 10.0 * abs(math.log2(b / best_lr_scale)) + 4.0 * abs(math.log2(d / best_dense_scale))
        tokens = args.micro_batch * args.seq_len
        curve = [[s * tokens, ppl] for s in range(run.eval_interval, run.steps + 1, run.eval_interval)]
        return quality_runs.RunOutcome(ppl, math.log(ppl), math.log(ppl), curve, None, 0.1)
    return train


def test_lr_sweep_runs_a_grid_of_both_rates_on_a_quarter_of_the_steps_and_trains_at_the_best_pair(
        bench, fake_data, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(bench, "train", fake_trainer(bench, calls, best_lr_scale=0.5, best_dense_scale=4.0))
    out = tmp_path / "q.json"
    assert bench.main(["--data", str(fake_data), "--methods", "dense_adamw,chtsnm_1of4_row", "--steps", "40",
                       "--lr-sweep", "chtsnm_1of4_row", "--lr-scales", "0.5,1", "--dense-lr-scales", "1,2,4",
                       "--json", str(out), "--out-root", str(tmp_path)]) == 0
    base = preset_lr("chtsnm_1of4_row")

    assert [(c.method, c.steps) for c in calls] == [("dense_adamw", 40)] + [("chtsnm_1of4_row", 10)] * 6 + \
        [("chtsnm_1of4_row", 40)]
    grid = [(b, d) for b in (0.5, 1.0) for d in (1.0, 2.0, 4.0)]
    assert [c.lr for c in calls[1:7]] == pytest.approx([b * base for b, _ in grid])
    assert [c.dense_lr for c in calls[1:7]] == pytest.approx([d * DEFAULT_TRAIN_LR for _, d in grid])
    assert [c.out_dir.name for c in calls[1:4]] == ["sweep_b0.5_d1", "sweep_b0.5_d2", "sweep_b0.5_d4"]
    assert calls[7].lr == pytest.approx(0.5 * base) and calls[7].dense_lr == pytest.approx(4 * DEFAULT_TRAIN_LR)
    entry = json.loads(out.read_text())["methods"]["chtsnm_1of4_row"]
    assert entry["lr"] == pytest.approx(0.5 * base) and entry["dense_lr"] == pytest.approx(4 * DEFAULT_TRAIN_LR)
    sweep = entry["lr_sweep"]
    assert sweep["chosen_scales"] == [0.5, 4.0] and sweep["steps"] == 10
    assert sweep["chosen_on_edge"]                 # 0.5 and 4 are both ends of their axes
    assert [p["final_ppl"] for p in sweep["points"]] == pytest.approx([58.0, 54.0, 50.0, 68.0, 64.0, 60.0])
    assert "lr_sweep" not in json.loads(out.read_text())["methods"]["dense_adamw"]


def test_a_full_length_sweep_takes_its_best_point_as_the_result_without_another_run(bench, fake_data, tmp_path,
                                                                                    monkeypatch):
    calls = []
    monkeypatch.setattr(bench, "train", fake_trainer(bench, calls, best_lr_scale=0.5, best_dense_scale=2.0))
    out = tmp_path / "q.json"
    assert bench.main(["--data", str(fake_data), "--methods", "chts24_1of4_row", "--steps", "40", "--eval-points",
                       "4", "--lr-sweep", "chts24_1of4_row", "--lr-scales", "1,0.25,0.5", "--dense-lr-scales",
                       "1,2,4", "--sweep-steps", "40", "--json", str(out), "--out-root", str(tmp_path)]) == 0
    base = preset_lr("chts24_1of4_row")

    # Nine runs, all full length and evaluated at the comparison's points; the (0.5, 2) one is the result.
    assert [(c.steps, c.eval_interval) for c in calls] == [(40, 10)] * 9
    assert [c.lr for c in calls] == pytest.approx([b * base for b in (1, 0.25, 0.5) for _ in range(3)])
    payload = json.loads(out.read_text())
    entry = payload["methods"]["chts24_1of4_row"]
    sweep = entry["lr_sweep"]
    assert sweep["chosen_scales"] == [0.5, 2.0] and sweep["steps"] == 40
    assert not sweep["chosen_on_edge"]             # inside both axes
    assert entry["lr"] == pytest.approx(0.5 * base) and entry["dense_lr"] == pytest.approx(2 * DEFAULT_TRAIN_LR)
    assert entry["final_ppl"] == pytest.approx(50.0)
    assert [t for t, _ in entry["curve"]] == [s * 8 * 256 for s in (10, 20, 30, 40)]
    assert entry["run_dir"] == str(tmp_path / "chts24_1of4_row" / "sweep_b0.5_d2")
    assert [(p["lr_scale"], p["dense_lr_scale"]) for p in sweep["points"]] == \
        [(b, d) for b in (1.0, 0.25, 0.5) for d in (1.0, 2.0, 4.0)]
    assert "lr_sweep" not in payload["config"]   # recorded per method
    assert bench.sweep_note(entry) == ("sweep (40 steps) b1: d1 64.00 d2 60.00 d4 64.00; "
                                       "b0.25: d1 64.00 d2 60.00 d4 64.00; b0.5: d1 54.00 d2 50.00 d4 54.00 "
                                       "| best b0.5 d2")


def test_the_branch_rate_is_a_third_sweep_axis_for_methods_with_a_branch_only(bench, fake_data, tmp_path,
                                                                              monkeypatch):
    """PPL = 50 + 10 |log2 b| + 4 |log2(d / 2)| + 3 |log2(r / 0.25)|, r = method.branch_lr / the preset's train.lr
    (r = d when the run leaves the branch on train.lr): the best triple is b1 d2 r0.25, inside all three axes."""
    calls = []

    def train(args, run):
        calls.append(run)
        b, d = run.lr / preset_lr(run.method), run.dense_lr / DEFAULT_TRAIN_LR
        r = d if run.branch_lr is None else run.branch_lr / DEFAULT_TRAIN_LR
        ppl = 50.0 + 10.0 * abs(math.log2(b)) + 4.0 * abs(math.log2(d / 2)) + 3.0 * abs(math.log2(r / 0.25))
        tokens = args.micro_batch * args.seq_len
        curve = [[s * tokens, ppl] for s in range(run.eval_interval, run.steps + 1, run.eval_interval)]
        return quality_runs.RunOutcome(ppl, math.log(ppl), math.log(ppl), curve, None, 0.1)
    monkeypatch.setattr(bench, "train", train)
    out = tmp_path / "q.json"
    assert bench.main(["--data", str(fake_data), "--methods", "chtsnm_nobranch_1of4_row,chtsnm_1of4_row",
                       "--steps", "40", "--eval-points", "4", "--lr-sweep", "chtsnm_nobranch_1of4_row,chtsnm_1of4_row",
                       "--lr-scales", "0.5,1,2", "--dense-lr-scales", "1,2,4", "--branch-lr-scales", "0.125,0.25,0.5",
                       "--sweep-steps", "40", "--json", str(out), "--out-root", str(tmp_path)]) == 0
    plain = [c for c in calls if c.method == "chtsnm_nobranch_1of4_row"]
    branch = [c for c in calls if c.method == "chtsnm_1of4_row"]
    assert len(plain) == 9 and all(c.branch_lr is None for c in plain)         # no branch: no third axis
    assert "method.branch_lr" not in " ".join(quality_runs.run_overrides(quality_runs.parse_args(
        ["--data", str(fake_data), "--methods", "chtsnm_1of4_row", "--steps", "40", "--json", str(out)]),
        plain[0]))
    assert len(branch) == 27
    assert [c.branch_lr for c in branch[:3]] == pytest.approx([r * DEFAULT_TRAIN_LR for r in (0.125, 0.25, 0.5)])
    assert [c.out_dir.name for c in branch[:3]] == ["sweep_b0.5_d1_r0.125", "sweep_b0.5_d1_r0.25",
                                                     "sweep_b0.5_d1_r0.5"]
    # Independent of the point's dense rate: the same three branch rates at d4.
    assert {c.branch_lr for c in branch if c.dense_lr == pytest.approx(4 * DEFAULT_TRAIN_LR)} == \
        {c.branch_lr for c in branch[:3]}
    assert f"method.branch_lr={branch[1].branch_lr!r}" in quality_runs.run_overrides(quality_runs.parse_args(
        ["--data", str(fake_data), "--methods", "chtsnm_1of4_row", "--steps", "40", "--json", str(out)]), branch[1])
    entry = json.loads(out.read_text())["methods"]["chtsnm_1of4_row"]
    sweep = entry["lr_sweep"]
    assert sweep["chosen_scales"] == [1.0, 2.0, 0.25] and not sweep["chosen_on_edge"]
    assert entry["final_ppl"] == pytest.approx(50.0) and entry["branch_lr"] == pytest.approx(0.25 * DEFAULT_TRAIN_LR)
    assert entry["run_dir"] == str(tmp_path / "chtsnm_1of4_row" / "sweep_b1_d2_r0.25")
    point = next(p for p in sweep["points"] if (p["lr_scale"], p["dense_lr_scale"], p["branch_lr_scale"]) ==
                 (2.0, 4.0, 0.5))
    assert point["final_ppl"] == pytest.approx(50 + 10 + 4 + 3)
    assert "best b1 d2 r0.25" in bench.sweep_note(entry) and "d4r0.5 67.00" in bench.sweep_note(entry)
    plain_entry = json.loads(out.read_text())["methods"]["chtsnm_nobranch_1of4_row"]
    assert len(plain_entry["lr_sweep"]["chosen_scales"]) == 2 and "branch_lr" not in plain_entry


def test_branch_lr_scales_without_a_sweep_are_refused(bench, fake_data, tmp_path, capsys):
    assert bench.main(["--data", str(fake_data), "--methods", "chtsnm_1of4_row", "--steps", "40",
                       "--branch-lr-scales", "0.5,1", "--json", str(tmp_path / "q.json")]) == 2
    err = capsys.readouterr().err
    assert "--branch-lr-scales: got 0.5,1" in err and "with --lr-sweep" in err


@pytest.mark.parametrize("flag, value, allowed", [("--lr-scales", "0.5,-1", "distinct positive numbers"),
                                                  ("--lr-scales", "1,1", "distinct positive numbers"),
                                                  ("--lr-scales", "x", "distinct positive numbers"),
                                                  ("--dense-lr-scales", "2,0", "distinct positive numbers"),
                                                  ("--branch-lr-scales", "1,-2", "distinct positive numbers"),
                                                  ("--sweep-steps", "41", "1 to --steps"),
                                                  ("--sweep-steps", "0", "1 to --steps")])
def test_a_bad_sweep_setting_is_refused_naming_it(bench, fake_data, tmp_path, monkeypatch, capsys, flag, value,
                                                  allowed):
    calls = []
    monkeypatch.setattr(bench, "train", fake_trainer(bench, calls, 1.0))
    assert bench.main(["--data", str(fake_data), "--methods", "dense_adamw", "--steps", "40", "--lr-sweep",
                       "dense_adamw", flag, value, "--json", str(tmp_path / "q.json"),
                       "--out-root", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert calls == [] and f"{flag}: got" in err and value in err and allowed in err


def test_a_failed_method_is_recorded_the_rest_runs_and_the_next_invocation_retries_only_it(bench, fake_data,
                                                                                          tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(bench, "train", fake_trainer(bench, calls, 1.0, failing={"ste_1of4_row"}))
    out = tmp_path / "q.json"
    argv = ["--data", str(fake_data), "--methods", "ste_1of4_row,dense_adamw", "--steps", "20", "--json", str(out),
            "--out-root", str(tmp_path)]
    assert bench.main(argv) == 0
    methods = json.loads(out.read_text())["methods"]
    assert methods["ste_1of4_row"]["skipped"] == "exit code 1: boom" and methods["ste_1of4_row"]["final_ppl"] is None
    assert methods["dense_adamw"]["skipped"] is None and methods["dense_adamw"]["final_ppl"] == 50.0
    # Ten evaluation points at the same token counts: every 2 steps of 8 x 256 tokens.
    assert [t for t, _ in methods["dense_adamw"]["curve"]] == [2 * k * 8 * 256 for k in range(1, 11)]

    calls.clear()
    assert bench.main(argv) == 0
    assert [c.method for c in calls] == ["ste_1of4_row"]
    calls.clear()
    assert bench.main(argv + ["--force"]) == 0
    assert [c.method for c in calls] == ["ste_1of4_row", "dense_adamw"]


def test_a_json_of_another_comparison_is_refused_naming_the_setting(bench, fake_data, tmp_path, monkeypatch,
                                                                    capsys):
    monkeypatch.setattr(bench, "train", fake_trainer(bench, [], 1.0))
    argv = ["--data", str(fake_data), "--methods", "dense_adamw", "--json", str(tmp_path / "q.json"),
            "--out-root", str(tmp_path)]
    assert bench.main(argv + ["--steps", "20"]) == 0
    assert bench.main(argv + ["--steps", "30"]) == 2
    assert "steps (20 there, 30 now)" in capsys.readouterr().err


def record_finished_run(bench, args, spec):
    """Leave in spec.out_dir what a finished run of `spec` leaves: its resolved config and a result."""
    from distsparse.config import config_to_dict, load_config
    spec.out_dir.mkdir(parents=True)
    config = config_to_dict(load_config(None, quality_runs.run_overrides(args, spec)))
    (spec.out_dir / "config.json").write_text(json.dumps(config))
    (spec.out_dir / "result.json").write_text(json.dumps({"step": spec.steps, "final/val_ppl": 42.0}))


def test_a_finished_run_of_another_config_is_refused_before_any_training_naming_the_keys(bench, fake_data,
                                                                                         tmp_path, monkeypatch,
                                                                                         capsys):
    calls, real_train = [], bench.train
    monkeypatch.setattr(bench, "train", fake_trainer(bench, calls, 1.0))
    argv = ["--data", str(fake_data), "--methods", "dense_adamw,chts24_1of4_row", "--steps", "40",
            "--lr-sweep", "chts24_1of4_row", "--lr-scales", "1", "--dense-lr-scales", "1,2", "--sweep-steps", "40",
            "--json", str(tmp_path / "q.json"), "--out-root", str(tmp_path)]
    args = quality_runs.parse_args(argv)
    specs = quality_runs.sweep_specs(args, "chts24_1of4_row")
    # The b1 d2 directory holds a finished run at another dense-side rate and seed; b1 d1 one at its own config,
    # and dense_adamw's an interrupted attempt (no result.json): neither of those two is in the way.
    other = specs[(1.0, 2.0)]
    record_finished_run(bench, quality_runs.parse_args(argv + ["--seed", "7"]),
                        quality_runs.RunSpec(**{**vars(other), "dense_lr": 3 * other.dense_lr}))
    record_finished_run(bench, args, specs[(1.0, 1.0)])
    interrupted = quality_runs.full_spec(args, "dense_adamw", 1.0, 1.0).out_dir
    interrupted.mkdir(parents=True)
    (interrupted / "config.json").write_text("{}")

    assert bench.main(argv) == 2
    err = capsys.readouterr().err
    assert calls == [] and not (tmp_path / "q.json").exists()
    assert str(other.out_dir) in err and "--force" in err
    assert f"train.lr: {3 * other.dense_lr!r} there, {other.dense_lr!r} here" in err
    assert "train.seed: 7 there, 0 here" in err and "method.lr" not in err
    assert json.loads((other.out_dir / "result.json").read_text())["final/val_ppl"] == 42.0

    # The trainer itself refuses too (the full run after a short sweep is known only then), keeping the run.
    with pytest.raises(ValueError, match="train.seed: 7 there, 0 here"):
        real_train(args, other)
    assert (other.out_dir / "result.json").is_file()

    assert bench.main(argv + ["--force"]) == 0
    assert [c.out_dir for c in calls] == [interrupted, specs[(1.0, 1.0)].out_dir, other.out_dir]


def fake_popen(bench, launched):
    """A Popen stand-in for the real train(): it writes what a finished run writes (its resolved config and a
    result whose PPL grows with train.lr), after checking that no earlier attempt's file is left."""
    from distsparse.config import config_to_dict, load_config

    class Finished:
        def __init__(self, cmd, **kwargs):
            config = config_to_dict(load_config(None, [a for a in cmd if "=" in a and not a.startswith("-")]))
            out = Path(config["train"]["out_dir"])
            launched.append(out)
            assert not (out / "stale").exists(), "an interrupted attempt's files are left in the run directory"
            out.mkdir(parents=True, exist_ok=True)
            (out / "config.json").write_text(json.dumps(config))
            (out / "result.json").write_text(json.dumps({"final/val_ppl": 50.0 + 1000 * config["train"]["lr"],
                                                         "final/val_loss": 1.0, "final/train_loss": 1.0}))
            self.stdout = io.StringIO("ok\n")

        def wait(self, timeout=None):
            return 0

        def poll(self):
            return 0
    return Finished


def test_the_trainer_removes_an_interrupted_attempt_reads_back_its_own_config_and_refuses_another(
        bench, fake_data, tmp_path, monkeypatch, capsys):
    launched = []
    monkeypatch.setattr(quality_runs.subprocess, "Popen", fake_popen(bench, launched))
    argv = ["--data", str(fake_data), "--methods", "dense_adamw,chts24_1of4_row", "--steps", "40",
            "--json", str(tmp_path / "q.json"), "--out-root", str(tmp_path / "runs")]
    interrupted = quality_runs.full_spec(quality_runs.parse_args(argv), "dense_adamw", 1.0, 1.0).out_dir
    interrupted.mkdir(parents=True)
    (interrupted / "stale").write_text("event file of a killed attempt")
    (interrupted / "config.json").write_text("{}")
    assert bench.main(argv) == 0
    assert len(launched) == 2 and not (interrupted / "stale").exists()

    (tmp_path / "q.json").unlink()
    launched.clear()
    assert bench.main(argv) == 0
    assert launched == [] and capsys.readouterr().out.count("with the same config; read back") == 2

    (tmp_path / "q.json").unlink()
    assert bench.main(argv + ["--seed", "3"]) == 2
    err = capsys.readouterr().err
    assert launched == [] and "train.seed: 0 there, 3 here" in err and str(interrupted) in err
    assert bench.main(argv + ["--force"]) == 0 and len(launched) == 2   # --force retrains, not reads back


def test_the_full_run_after_a_short_sweep_is_refused_when_its_rates_are_known_keeping_the_json(
        bench, fake_data, tmp_path, monkeypatch, capsys):
    launched = []
    monkeypatch.setattr(quality_runs.subprocess, "Popen", fake_popen(bench, launched))
    argv = ["--data", str(fake_data), "--methods", "dense_adamw,chts24_1of4_row", "--steps", "40",
            "--lr-sweep", "chts24_1of4_row", "--lr-scales", "1", "--dense-lr-scales", "0.5,1", "--sweep-steps", "10",
            "--json", str(tmp_path / "q.json"), "--out-root", str(tmp_path / "runs")]
    args = quality_runs.parse_args(argv)
    full = quality_runs.full_spec(args, "chts24_1of4_row", 1.0, 1.0)   # the sweep picks d0.5 (lower train.lr, lower PPL)
    record_finished_run(bench, args, full)
    assert bench.main(argv) == 2
    assert str(full.out_dir) in capsys.readouterr().err and len(launched) == 3   # dense, then the two points
    assert json.loads((tmp_path / "q.json").read_text())["methods"].keys() == {"dense_adamw"}
    assert (full.out_dir / "result.json").is_file()


def test_a_key_one_config_lacks_is_named_even_against_none(bench, fake_data, tmp_path):
    args = quality_runs.parse_args(["--data", str(fake_data), "--methods", "dense_adamw", "--steps", "40",
                             "--json", str(tmp_path / "q.json"), "--out-root", str(tmp_path)])
    spec = quality_runs.full_spec(args, "dense_adamw", 1.0, 1.0)
    record_finished_run(bench, args, spec)
    config = json.loads((spec.out_dir / "config.json").read_text())
    config["train"]["new_option"] = None   # a run of a checkout with one more config field
    (spec.out_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(quality_runs.RunInTheWay, match="train.new_option: None there, '<absent>' here"):
        quality_runs.refuse_to_replace(args, spec)


@pytest.mark.parametrize("recorded, reused", [(None, True), (3e-3, False)])
def test_a_run_recorded_before_the_branch_rate_existed_reads_as_one_on_train_lr(bench, fake_data, tmp_path,
                                                                               recorded, reused):
    """config.json of a checkout without method.branch_lr / branch_weight_decay (issue 28) is the same config as
    these keys at null (one dense group); a run that had its own branch rate is another config."""
    args = quality_runs.parse_args(["--data", str(fake_data), "--methods", "chtsnm_1of4_row", "--steps", "40",
                             "--json", str(tmp_path / "q.json"), "--out-root", str(tmp_path)])
    spec = quality_runs.full_spec(args, "chtsnm_1of4_row", 1.0, 1.0)
    record_finished_run(bench, args, spec)
    config = json.loads((spec.out_dir / "config.json").read_text())
    del config["method"]["branch_lr"], config["method"]["branch_weight_decay"]
    if recorded is not None:
        config["method"]["branch_lr"] = recorded
    (spec.out_dir / "config.json").write_text(json.dumps(config))
    assert quality_runs.finished_earlier(args, spec) is reused
    if not reused:
        with pytest.raises(quality_runs.RunInTheWay, match="method.branch_lr: 0.003 there, None here"):
            quality_runs.refuse_to_replace(args, spec)


def test_only_methods_still_to_train_are_checked_and_other_errors_are_not_swallowed(bench, fake_data, tmp_path,
                                                                                     monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(bench, "train", fake_trainer(bench, calls, 1.0))
    argv = ["--data", str(fake_data), "--methods", "chts24_1of4_row,dense_adamw", "--steps", "40",
            "--json", str(tmp_path / "q.json"), "--out-root", str(tmp_path)]
    assert bench.main(argv + ["--methods", "chts24_1of4_row"]) == 0
    # dense_adamw's full run is in the way: refused before chts24 (done) or anything else runs ...
    full = quality_runs.full_spec(quality_runs.parse_args(argv), "dense_adamw", 1.0, 1.0)
    record_finished_run(bench, quality_runs.parse_args(argv + ["--seed", "7"]), full)
    calls.clear()
    assert bench.main(argv) == 2
    assert calls == [] and str(full.out_dir) in capsys.readouterr().err
    # ... while another config in chts24's directory does not block chts24, which is in the JSON already.
    (full.out_dir / "result.json").unlink()
    chts24 = quality_runs.full_spec(quality_runs.parse_args(argv), "chts24_1of4_row", 1.0, 1.0)
    record_finished_run(bench, quality_runs.parse_args(argv + ["--seed", "7"]), chts24)
    assert bench.main(argv) == 0 and [c.method for c in calls] == ["dense_adamw"]

    def broken(args, run):
        raise ValueError("a bug in the trainer")
    monkeypatch.setattr(bench, "train", broken)
    with pytest.raises(ValueError, match="a bug in the trainer"):
        bench.main(argv + ["--force"])


def test_a_sweep_with_no_finished_point_records_the_preset_rates(bench, fake_data, tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "train", fake_trainer(bench, [], 1.0, failing={"dense_adamw"}))
    assert bench.main(["--data", str(fake_data), "--methods", "dense_adamw", "--steps", "40", "--lr-sweep",
                       "dense_adamw", "--json", str(tmp_path / "q.json"), "--out-root", str(tmp_path)]) == 0
    entry = json.loads((tmp_path / "q.json").read_text())["methods"]["dense_adamw"]
    assert entry["skipped"] == "LR sweep: no sweep run finished" and entry["final_ppl"] is None
    assert entry["lr"] == pytest.approx(preset_lr("dense_adamw")) and entry["dense_lr"] == DEFAULT_TRAIN_LR


def test_an_unknown_preset_fails_before_any_training(bench, fake_data, tmp_path, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(bench, "train", fake_trainer(bench, calls, 1.0))
    assert bench.main(["--data", str(fake_data), "--methods", "dense_adamw,nope_1of4_row", "--steps", "20",
                       "--json", str(tmp_path / "q.json"), "--out-root", str(tmp_path)]) == 2
    assert calls == [] and "'nope_1of4_row'" in capsys.readouterr().err


def test_ratios_divide_by_dense_and_by_chts24_of_the_same_sparsity_and_layout(bench):
    def entry(ppl):
        return {"final_ppl": ppl}
    ratios = bench.reference_ratios({"dense_adamw": entry(100.0), "chts24_1of4_row": entry(150.0),
                                     "chtsnm_1of4_row": entry(120.0), "ste_2of4_row": entry(130.0),
                                     "cast_1of4_row": entry(None)})
    assert ratios["chtsnm_1of4_row"] == pytest.approx({"vs_dense": 1.2, "vs_chts24": 0.8})
    assert ratios["chts24_1of4_row"] == pytest.approx({"vs_dense": 1.5, "vs_chts24": 1.0})
    assert ratios["ste_2of4_row"] == {"vs_dense": pytest.approx(1.3), "vs_chts24": None}
    assert ratios["dense_adamw"] == {"vs_dense": pytest.approx(1.0), "vs_chts24": None}
    assert ratios["cast_1of4_row"] == {"vs_dense": None, "vs_chts24": None}


def test_runs_record_data_inside_the_checkout_relative_to_it_so_another_checkout_reads_them_back(bench, tmp_path,
                                                                                                  monkeypatch):
    """Finished runs committed from one clone must match the configs another clone resolves (the runs' working
    directory is the repository root, so the relative path names the same data)."""
    inside = quality_runs.ROOT / "data" / "some_corpus"
    args = quality_runs.argparse.Namespace(data=str(inside))
    assert quality_runs.data_dir(args) == "data/some_corpus"
    monkeypatch.chdir(quality_runs.ROOT / "bench")
    assert quality_runs.data_dir(quality_runs.argparse.Namespace(data="../data/some_corpus")) == "data/some_corpus"
    assert quality_runs.data_dir(quality_runs.argparse.Namespace(data=str(tmp_path))) == str(tmp_path.resolve())
    overrides = quality_runs.base_overrides(quality_runs.argparse.Namespace(
        data=str(inside), model="tiny", seq_len=8, micro_batch=2, nproc=1, seed=0, eval_samples=0,
        warmup_steps=None, overrides=[]))
    assert "data.dir=data/some_corpus" in overrides


def test_keep_checkpoint_keeps_the_final_checkpoint_and_a_run_is_read_back_with_or_without_it(
        bench, quality_corpus, tmp_path, capsys):
    runs = tmp_path / "runs"
    argv = ["--data", str(quality_corpus), "--methods", "chts24_1of4_row", "--model", "tiny", "--steps", "2",
            "--eval-points", "1", "--micro-batch", "2", "--seq-len", "32", "--eval-samples", "4",
            "--out-root", str(runs)]
    assert bench.main([*argv, "--json", str(tmp_path / "a.json"), "--keep-checkpoint"]) == 0
    run_dir = runs / "chts24_1of4_row" / "full"
    saved = [p for p in (run_dir / "checkpoints").iterdir() if p.is_dir()]
    assert len(saved) == 1 and any(saved[0].iterdir())
    capsys.readouterr()
    # The checkpoint settings change no number: the finished run is read back, not retrained, without the flag.
    assert bench.main([*argv, "--json", str(tmp_path / "b.json")]) == 0
    assert "finished earlier" in capsys.readouterr().out
    assert json.loads((tmp_path / "b.json").read_text())["methods"]["chts24_1of4_row"]["final_ppl"] == \
        json.loads((tmp_path / "a.json").read_text())["methods"]["chts24_1of4_row"]["final_ppl"]


def test_a_run_recorded_before_the_logging_section_existed_is_read_back(bench, fake_data, tmp_path):
    """Checkpoint and logging settings change no number: a config.json without `logging` (before W&B) or with
    other checkpoint settings is the same run; a change in a section that does change numbers is not."""
    args = quality_runs.parse_args(["--data", str(fake_data), "--methods", "chts24_1of4_row", "--steps", "40",
                             "--json", str(tmp_path / "q.json"), "--out-root", str(tmp_path)])
    spec = quality_runs.full_spec(args, "chts24_1of4_row", 1.0, 1.0)
    record_finished_run(bench, args, spec)
    config = json.loads((spec.out_dir / "config.json").read_text())
    del config["logging"]
    config["checkpoint"]["interval"] = 7
    (spec.out_dir / "config.json").write_text(json.dumps(config))
    assert quality_runs.finished_earlier(args, spec)
    config["data"]["seq_len"] += 1
    (spec.out_dir / "config.json").write_text(json.dumps(config))
    assert not quality_runs.finished_earlier(args, spec)


def test_curves_csv_keeps_every_logged_step_exactly_and_a_diverged_value_reads_as_none(tmp_path):
    """The CSV against the values written to TensorBoard by hand: the steps each tag logged (validation at fewer
    steps than training), their float32 values exactly, a NaN kept as NaN and read into the JSON curve as None."""
    import numpy as np
    from torch.utils.tensorboard import SummaryWriter
    run_dir = tmp_path / "run"
    writer = SummaryWriter(str(run_dir / "tb"))
    train_loss = {1: 5.25, 2: 4.1, 3: float("nan")}
    for step, value in train_loss.items():
        writer.add_scalar("loss/train", value, step)
        writer.add_scalar("time/step_s", 0.5, step)   # not a curve tag: left out
    writer.add_scalar("loss/val_ppl", 80.5, 2)
    writer.add_scalar("loss/val_ppl", float("nan"), 3)
    writer.close()
    by_tag = quality_runs.read_curves(run_dir)
    assert (run_dir / "curves.csv").read_text().splitlines()[0] == "step,loss/train,loss/val_ppl"
    assert set(by_tag) == {"loss/train", "loss/val_ppl"}
    assert by_tag["loss/train"][1] == float(np.float32(5.25)) and by_tag["loss/train"][2] == float(np.float32(4.1))
    assert math.isnan(by_tag["loss/train"][3]) and list(by_tag["loss/val_ppl"]) == [2, 3]
    shutil.rmtree(run_dir / "tb")   # as docs/results keeps a run: the CSV alone
    args = quality_runs.argparse.Namespace(micro_batch=2, seq_len=8)
    spec = quality_runs.RunSpec("x", "dense_adamw", 3, 1, 1e-3, 3e-3, run_dir)
    outcome = quality_runs.read_outcome(args, spec, 1, ["boom"], None)
    assert outcome.curve == [[2 * 16, float(np.float32(80.5))], [3 * 16, None]]


def test_a_finished_run_moved_to_another_out_root_is_read_back_there(bench, fake_data, tmp_path):
    """train.out_dir is no part of a run's config: runs copied into docs/results, or from another clone, match."""
    argv = ["--data", str(fake_data), "--methods", "chts24_1of4_row", "--steps", "40", "--json", str(tmp_path / "q")]
    spec = quality_runs.full_spec(quality_runs.parse_args([*argv, "--out-root", str(tmp_path / "a")]),
                                  "chts24_1of4_row", 1.0, 1.0)
    record_finished_run(bench, quality_runs.parse_args([*argv, "--out-root", str(tmp_path / "a")]), spec)
    moved = quality_runs.parse_args([*argv, "--out-root", str(tmp_path / "b")])
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    assert quality_runs.finished_earlier(moved, quality_runs.full_spec(moved, "chts24_1of4_row", 1.0, 1.0))


def test_help_names_the_module_and_the_plan_mode_whose_help_lists_its_own_options(capsys):
    from bench import quality_summary, update_readme_results
    for main, argv in ((bench_quality.main, ["--help"]), (quality_summary.parse_args, ["--help"]),
                       (update_readme_results.parse_args, ["--help"])):
        with pytest.raises(SystemExit):
            main(argv)
        assert capsys.readouterr().out.startswith(f"usage: python -m bench.{main.__module__.split('.')[-1]}")
    with pytest.raises(SystemExit):
        bench_quality.main(["--help"])
    assert "--plan NAME" in " ".join(capsys.readouterr().out.split())
    with pytest.raises(SystemExit):
        bench_quality.main(["--plan", "paper_60m", "--help"])
    assert "--executor" in capsys.readouterr().out
