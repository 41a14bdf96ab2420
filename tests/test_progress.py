"""Progress that stays true (issue 26 item 2): the window rate and ETA with numbers, the FLOPs convention against a
hand count, MFU of the trainer equal to bench/train.py's for the same step time, and a 2-rank run preempted
at step 2 and resumed to step 4: tokens seen from the data state, rate and ETA from the resumed process's own
steps, the names in TensorBoard."""

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from preempt import signal_during_step
from bench import train as bench

from distsparse.config import load_config
from distsparse.models import build_model
from distsparse.perf.flops import device_peak_flops, model_step_flops, peak_flops
from distsparse.train.deepspeed.config import build_ds_config
from distsparse.train.progress import StepWindow, progress_metrics
from synthetic_data import make_data_dir

# The tiny model (configs/model/tiny.yaml): 2 layers, hidden 64, FFN 176, untied head; test data vocab 97.
LAYERS, HIDDEN, FFN, VOCAB = 2, 64, 176, 97
MICRO, RANKS, SEQ = 2, 2, 32
GLOBAL_BATCH = MICRO * 1 * RANKS   # micro-batch x accumulation x ranks
H200 = 989e12
BASE = ["model.preset=tiny", f"data.seq_len={SEQ}", "train.dtype=fp32", "train.eval_interval=1000",
        "train.log_interval=1", "train.warmup_steps=0", "train.eval_samples=16", f"train.micro_batch={MICRO}",
        "method.preset=chtsnm_nobranch_1of4_row", "method.topology.update_interval=100", "train.steps=4"]
NAMES = {"progress/tokens_seen", "time/tokens_per_s", "progress/eta_s", "perf/mfu_dense_equiv", "perf/mfu_active"}


def test_window_rate_covers_the_last_n_steps_and_eta_this_process_steps():
    w = StepWindow(3, start_time=100.0)
    for step_s, tokens, now in ((1.0, 10, 101.5), (2.0, 20, 104.0), (3.0, 30, 107.5), (4.0, 40, 112.0)):
        w.add(step_s, tokens, now)
    assert w.tokens_per_s == pytest.approx((20 + 30 + 40) / (2.0 + 3.0 + 4.0))   # the first step left the window
    assert w.mean_step_s == pytest.approx(3.0)
    assert w.steps_done == 4
    # 12 s of wall time (evaluation between steps included) over this process's 4 steps, 6 steps left.
    assert w.eta_s(6) == pytest.approx(12.0 / 4 * 6)
    assert w.eta_s(0) == 0.0
    with pytest.raises(ValueError, match=r"window: got 0; allowed: >= 1"):
        StepWindow(0, start_time=0.0)


def test_progress_metrics_leave_mfu_out_without_a_peak_and_divide_by_peak_times_ranks():
    w = StepWindow(2, start_time=0.0)
    w.add(0.5, 1000, 0.5)
    w.add(1.5, 1000, 2.0)
    flops = SimpleNamespace(dense_equivalent=8e12, active=2e12)
    got = progress_metrics(w, tokens_seen=123456, remaining_steps=3, flops=flops, peak_flops=None, world_size=2)
    assert got == {"progress/tokens_seen": 123456.0, "time/tokens_per_s": 1000.0, "progress/eta_s": 3.0}
    got = progress_metrics(w, tokens_seen=0, remaining_steps=3, flops=flops, peak_flops=1e12, world_size=2)
    assert got["perf/mfu_dense_equiv"] == pytest.approx(8e12 / 1.0 / 2e12)   # mean step 1.0 s, 2 x 1e12 FLOP/s
    assert got["perf/mfu_active"] == pytest.approx(2e12 / 1.0 / 2e12)


def _model(method: str):
    cfg = load_config(None, ["model.preset=tiny", f"method.preset={method}", "train.dtype=fp32"])
    return build_model(cfg.model, cfg.method, VOCAB, 0)


def test_step_flops_dense_equivalent_and_active_against_a_hand_count():
    tokens = 3 * SEQ
    attention = 12 * LAYERS * HIDDEN * SEQ * tokens
    backbone = LAYERS * (4 * HIDDEN * HIDDEN + 3 * HIDDEN * FFN)
    head = VOCAB * HIDDEN
    sparse = model_step_flops(_model("chtsnm_nobranch_1of4_row"), SEQ, tokens)
    assert sparse.dense_equivalent == 6 * (backbone + head) * tokens + attention
    assert sparse.active == 6 * (backbone // 4 + head) * tokens + attention   # 1:4 keeps a quarter
    dense = model_step_flops(_model("dense_adamw"), SEQ, tokens)
    assert dense.active == dense.dense_equivalent == sparse.dense_equivalent
    # A residual branch's weights are active FLOPs, not dense-equivalent ones (counted here by parameter name).
    with_branch = _model("chtsnm_1of4_row")
    branch = sum(p.numel() for n, p in with_branch.named_parameters() if ".branch." in n)
    assert branch > 0
    got = model_step_flops(with_branch, SEQ, tokens)
    assert got.dense_equivalent == sparse.dense_equivalent
    assert got.active == sparse.active + 6 * branch * tokens


def test_peak_table_matches_device_names_and_assumes_none_elsewhere():
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12       # SXM
    assert peak_flops("NVIDIA H200") == 989e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops("NVIDIA H100 PCIe") is None              # another peak: not assumed
    assert peak_flops("Tesla V100-SXM2-32GB") is None
    peak, note = device_peak_flops(torch.device("cpu"))
    assert peak is None and "MFU left out" in note


def test_trainer_and_bench_train_give_the_same_mfu_for_the_same_step_time():
    model = _model("chtsnm_nobranch_1of4_row")
    tokens = GLOBAL_BATCH * SEQ
    w = StepWindow(20, start_time=0.0)
    w.add(0.25, tokens, 0.25)
    ours = progress_metrics(w, tokens_seen=tokens, remaining_steps=1, flops=model_step_flops(model, SEQ, tokens),
                            peak_flops=H200, world_size=RANKS)
    theirs = bench.mfu_by_row({"row": {"effective_step_s": 0.25}},
                              bench.flops_per_step(SimpleNamespace(model=model), SEQ, tokens), H200, RANKS)
    assert ours["perf/mfu_dense_equiv"] == theirs["row"]
    backbone, head = LAYERS * (4 * HIDDEN * HIDDEN + 3 * HIDDEN * FFN), VOCAB * HIDDEN
    hand = (6 * (backbone + head) * tokens + 12 * LAYERS * HIDDEN * SEQ * tokens) / 0.25 / (H200 * RANKS)
    assert theirs["row"] == pytest.approx(hand, rel=1e-12)


# ---- a run preempted at step 2, resumed to step 4, on 2 ranks ------------------------------------------------

class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _train(rank, world_size, data_dir, out_dir, overrides, stop_after=None, peak=None):
    import distsparse.train.trainer as trainer_module
    cfg = load_config(None, BASE + [f"data.dir={data_dir}", f"train.out_dir={out_dir}"] + overrides)
    lines, logger = _Lines(), logging.getLogger("distsparse")
    level = logger.level
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    real_peak = trainer_module.device_peak_flops
    if peak is not None:   # a GPU's peak on this CPU run: the MFU figures are written
        trainer_module.device_peak_flops = lambda device: (peak, "test peak")
    try:
        trainer = trainer_module.Trainer(cfg, build_ds_config("configs/ds/zero2.json", cfg))
        if stop_after is not None:   # SIGUSR1 during step `stop_after`: every rank saves there and stops
            signal_during_step(trainer, stop_after, rank == 1)
        result = trainer.train()
        flops = bench.flops_per_step(trainer, SEQ, trainer.plan.global_batch * SEQ)
        trainer.close()
    finally:
        trainer_module.device_peak_flops = real_peak
        logger.removeHandler(lines)
        logger.setLevel(level)
    return {"step": result.step, "preempted": result.preempted, "lines": lines.lines, "bench_flops": flops}


def _scalars(out_dir) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    ea = EventAccumulator(str(Path(out_dir) / "tb"))
    ea.Reload()
    return {tag: {e.step: e.value for e in ea.Scalars(tag)} for tag in ea.Tags()["scalars"]}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return make_data_dir(tmp_path_factory.mktemp("data"))


def test_resumed_run_counts_tokens_from_the_data_state_and_times_its_own_steps(ranks2, data_dir, tmp_path):
    first = ranks2.run(_train, data_dir, str(tmp_path), [], 2)
    assert all(r["preempted"] and r["step"] == 2 for r in first)
    resumed = ranks2.run(_train, data_dir, str(tmp_path), ["checkpoint.resume=auto"], None, H200)
    assert all(r["step"] == 4 and not r["preempted"] for r in resumed)
    s = _scalars(tmp_path)
    assert NAMES <= set(s), sorted(s)

    # Tokens seen: global batch x seq_len per step, the first process's steps included after the resume.
    assert s["progress/tokens_seen"] == {k: k * GLOBAL_BATCH * SEQ for k in (1, 2, 3, 4)}
    assert s["progress/tokens_seen"][4] == 4 * GLOBAL_BATCH * SEQ
    step_s = s["time/step_s"]
    tokens = GLOBAL_BATCH * SEQ
    # The rate over the window of each process's own steps: the resumed one starts anew at step 3.
    assert s["time/tokens_per_s"][2] == pytest.approx(2 * tokens / (step_s[1] + step_s[2]), rel=1e-5)
    assert s["time/tokens_per_s"][3] == pytest.approx(tokens / step_s[3], rel=1e-5)
    assert s["time/tokens_per_s"][4] == pytest.approx(2 * tokens / (step_s[3] + step_s[4]), rel=1e-5)
    # ETA: this process's wall time per step x steps left. After step 3 the resumed process has taken one step in
    # about step_s[3] of wall time and has one left; dividing by all 3 steps would give a third of it.
    eta = s["progress/eta_s"]
    assert eta[1] >= 3 * step_s[1] and eta[2] >= step_s[1] + step_s[2]
    assert step_s[3] <= eta[3] <= 1.05 * step_s[3] + 0.01, (eta[3], step_s[3])
    assert eta[4] == 0.0

    # MFU only where a peak is known (the resumed process here), equal to bench_train's for the same step time.
    assert set(s["perf/mfu_dense_equiv"]) == set(s["perf/mfu_active"]) == {3, 4}
    for k, window in ((3, [3]), (4, [3, 4])):
        mean_s = sum(step_s[j] for j in window) / len(window)
        theirs = bench.mfu_by_row({"row": {"effective_step_s": mean_s}}, resumed[0]["bench_flops"], H200, RANKS)
        assert s["perf/mfu_dense_equiv"][k] == pytest.approx(theirs["row"], rel=1e-5)
        # 1:4 keeps a quarter of the backbone: active FLOPs are fewer, the same attention term and head.
        assert 0 < s["perf/mfu_active"][k] < s["perf/mfu_dense_equiv"][k]

    # The log: MFU's absence said once per process; every step line has tokens seen and the ETA.
    first_lines, resumed_lines = first[0]["lines"], resumed[0]["lines"]
    assert sum("MFU" in line and "left out" in line for line in first_lines) == 1, first_lines
    assert not any("left out" in line for line in resumed_lines)
    step3 = next(line for line in resumed_lines if line.startswith("step 3/4"))
    assert f"tokens {3 * tokens}" in step3 and "mfu_dense_equiv" in step3 and "mfu_active" in step3
    assert f"eta {eta[3]:.0f}s" in step3
    assert not any(line.startswith("step") for line in first[1]["lines"] + resumed[1]["lines"]), "rank 0 logs"
