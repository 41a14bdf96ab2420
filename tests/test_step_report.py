"""The step reports itself (issue 25 item 4): StepTimer's phase arithmetic, and a logging step's `timings` through
the real Trainer on 2 gloo ranks, present only on logging steps and written to TensorBoard under time/."""

from pathlib import Path

import pytest

from distsparse import step_timer
from distsparse.config import load_config
from distsparse.step_timer import PHASES, StepTimer
from distsparse.train.deepspeed.config import build_ds_config
from synthetic_data import make_data_dir

ROOT = Path(__file__).resolve().parents[1]
KEYS = {f"time/{p}" for p in PHASES}


def test_marks_charge_each_interval_to_its_phase_summed_over_repeats(monkeypatch):
    clock = iter([10.0, 10.5, 11.0, 13.0, 13.25, 14.0, 20.0])
    monkeypatch.setattr(step_timer.time, "perf_counter", lambda: next(clock))
    timer = StepTimer("cpu")
    timer.start(True)              # 10.0
    timer.mark("data")             # 10.5
    timer.mark("forward")          # 11.0
    timer.mark("backward")         # 13.0
    timer.mark("forward")          # 13.25
    timer.mark(None)               # 14.0: no phase
    timer.mark("gather")           # 20.0
    got = timer.read()
    assert set(got) == KEYS
    assert got["time/data"] == 0.5 and got["time/forward"] == 0.5 + 0.25 and got["time/backward"] == 2.0
    assert got["time/gather"] == 6.0 and got["time/refresh"] == 0.0
    assert timer.read() == {}      # read ends the measurement


def test_a_disabled_timer_reads_no_clock_and_reports_nothing(monkeypatch):
    monkeypatch.setattr(step_timer.time, "perf_counter", lambda: pytest.fail("clock read while disabled"))
    timer = StepTimer("cpu")
    timer.start(False)
    timer.mark("forward")
    assert timer.read() == {}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return make_data_dir(tmp_path_factory.mktemp("data"))


def _timed_steps(rank, world_size, data_dir, out_dir):
    import time
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from distsparse.train.trainer import Trainer
    cfg = load_config(None, ["model.preset=tiny", "data.seq_len=32", "train.dtype=fp32", "train.warmup_steps=0",
                             "train.eval_interval=1000", "train.log_interval=2", "train.steps=4",
                             "train.grad_accum=2", "train.micro_batch=1", "method.preset=chtsnm_nobranch_1of4_row",
                             "method.topology.update_interval=2", f"data.dir={data_dir}", f"train.out_dir={out_dir}"])
    trainer = Trainer(cfg, build_ds_config(ROOT / "configs/ds/zero2.json", cfg))
    out = {}
    for step in (1, 2):   # 1: not a logging step; 2: logging and refresh step
        t0 = time.perf_counter()
        report = trainer.step_once()
        out[step] = {"wall": time.perf_counter() - t0, "timings": dict(report.timings),
                     "refreshed": any(k.startswith("topology/") for k in report.metrics)}
    trainer.train()       # steps 3 (not logged) and 4 (logged)
    out["sampled"] = trainer.sampler.consumed_samples   # nothing prefetched past the last step
    trainer.close()
    if rank == 0:
        ea = EventAccumulator(str(Path(out_dir) / "tb"))
        ea.Reload()
        out["tb"] = {key: [e.step for e in ea.Scalars(key)] for key in KEYS}
    return out


def test_a_logging_step_reports_every_phase_time_and_they_add_up_to_its_wall_time(ranks2, data_dir, tmp_path):
    results = ranks2.run(_timed_steps, data_dir, str(tmp_path))
    for out in results:
        assert out[1]["timings"] == {}, "a non-logging step measures nothing"
        logged = out[2]
        assert logged["refreshed"]
        assert set(logged["timings"]) == KEYS
        assert all(v >= 0 for v in logged["timings"].values())
        assert logged["timings"]["time/forward"] > 0 and logged["timings"]["time/backward"] > 0
        assert logged["timings"]["time/refresh"] > 0 and logged["timings"]["time/gather"] > 0
        total = sum(logged["timings"].values())
        assert 0.5 * logged["wall"] <= total <= logged["wall"] + 1e-3, (total, logged["wall"])
    assert results[0]["tb"] == {key: [4] for key in KEYS}
    assert [out["sampled"] for out in results] == [4 * 2 * 1 * 2] * 2   # steps x grad_accum x micro_batch x ranks
