"""Weights & Biases beside TensorBoard (issue 26 item 4): the trainer against a stand-in `wandb` module that records
every call, and for real in offline mode (wandb is an optional extra of the package and in the locked dev extra),
where every scalar TensorBoard holds is in the W&B run at the same step."""

import json
import struct
import sys
import types
from pathlib import Path

import pytest

from distsparse.config import load_config
from distsparse.train.deepspeed.config import build_ds_config
from distsparse.train.metrics import WANDB_ID_FILE, FanOut, NullWriter, TensorBoardWriter, build_writer
from distsparse.train.validate import validate
from synthetic_data import make_data_dir

BASE = ["model.preset=tiny", "data.seq_len=32", "train.dtype=fp32", "train.eval_interval=1000",
        "train.log_interval=1", "train.warmup_steps=0", "train.eval_samples=16", "method.preset=chtsnm_1of4_row"]
WANDB = ["logging.wandb.mode=offline", "logging.wandb.project=proj", "logging.wandb.name=run-a"]


def fake_wandb(record: Path) -> types.ModuleType:
    """A module with wandb's calls the writer makes; each call appends one JSON line to `record`."""
    def note(**entry):
        with record.open("a") as f:
            f.write(json.dumps(entry) + "\n")

    class Run:
        summary = types.SimpleNamespace(update=lambda metrics: note(call="summary", metrics=metrics))

        def log(self, metrics, step):
            note(call="log", step=step, keys=sorted(metrics))

        def finish(self):
            note(call="finish")

    def init(**kwargs):
        note(call="init", **{k: v for k, v in kwargs.items() if k != "config"}, config_keys=len(kwargs["config"]))
        return Run()

    return types.SimpleNamespace(init=init)


def calls(record: Path) -> list[dict]:
    return [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return make_data_dir(tmp_path_factory.mktemp("data"))


def _train_with_fake(rank, world_size, data_dir, out_dir, steps, overrides=()):
    from distsparse.train.trainer import Trainer
    record = Path(out_dir) / f"wandb_calls_rank{rank}.jsonl"
    sys.modules["wandb"] = fake_wandb(record)
    try:
        cfg = load_config(None, BASE + WANDB + [f"data.dir={data_dir}", f"train.out_dir={out_dir}",
                                                f"train.steps={steps}", *overrides])
        trainer = Trainer(cfg, build_ds_config("configs/ds/zero2.json", cfg))
        trainer.train()
        trainer.close()
    finally:
        del sys.modules["wandb"]
    return calls(record)


def test_rank_zero_logs_every_log_step_to_wandb_beside_tensorboard(ranks2, data_dir, tmp_path):
    r0, r1 = ranks2.run(_train_with_fake, data_dir, str(tmp_path), 3)
    assert r1 == [], "only rank 0 writes"
    init = r0[0]
    assert (init["call"], init["project"], init["name"], init["mode"], init["resume"]) == \
        ("init", "proj", "run-a", "offline", "allow")
    assert init["id"] == (tmp_path / WANDB_ID_FILE).read_text() and init["dir"] == str(tmp_path)
    assert init["config_keys"] > 50, "the flattened run config goes to wandb.init"
    logs = [c for c in r0 if c["call"] == "log"]
    assert [c["step"] for c in logs] == [1, 2, 3]
    assert all({"loss/train", "lr/dense", "time/tokens_per_s"} <= set(c["keys"]) for c in logs), logs
    assert [c["call"] for c in r0[-2:]] == ["summary", "finish"]
    assert "final/val_ppl" in r0[-2]["metrics"]
    assert list((tmp_path / "tb").glob("events.out.tfevents.*")), "TensorBoard still written"


def test_a_resumed_trainer_logs_into_the_wandb_run_it_resumes(ranks2, data_dir, tmp_path):
    ranks2.run(_train_with_fake, data_dir, str(tmp_path), 2, ["checkpoint.interval=2"])
    r0, _ = ranks2.run(_train_with_fake, data_dir, str(tmp_path), 3, ["checkpoint.resume=auto"])
    inits = [c for c in r0 if c["call"] == "init"]   # the record holds both runs
    assert len(inits) == 2 and inits[0]["id"] == inits[1]["id"]
    assert [c["step"] for c in r0 if c["call"] == "log"] == [1, 2, 3]


def test_a_resume_in_the_same_out_dir_continues_the_wandb_run_and_a_fresh_start_does_not(tmp_path, monkeypatch):
    record = tmp_path / "calls.jsonl"
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(record))
    cfg = load_config(None, WANDB + [f"train.out_dir={tmp_path / 'out'}"])
    first = build_writer(cfg, 0, resumed=False)
    assert isinstance(first, FanOut) and isinstance(first.writers[0], TensorBoardWriter)
    first.close()
    build_writer(cfg, 0, resumed=True).close()
    build_writer(cfg, 0, resumed=False).close()   # from step 0 again: the old run's steps would go backwards
    ids = [c["id"] for c in calls(record) if c["call"] == "init"]
    assert len(ids) == 3 and ids[0] == ids[1] != ids[2] == (tmp_path / "out" / WANDB_ID_FILE).read_text()
    assert isinstance(build_writer(cfg, 1, resumed=False), NullWriter)
    off = build_writer(load_config(None, [f"train.out_dir={tmp_path / 'off'}"]), 0, resumed=False)
    assert isinstance(off, TensorBoardWriter), "mode disabled (the default): TensorBoard only"
    off.close()


def test_bad_wandb_settings_are_refused_before_any_process_group(data_dir, monkeypatch):
    with pytest.raises(ValueError, match=r"logging.wandb.mode: got 'cloud'; allowed: disabled, online, offline"):
        load_config(None, ["logging.wandb.mode=cloud"])
    with pytest.raises(ValueError, match=r"logging.wandb.project: got ''; allowed: a project name"):
        load_config(None, ["logging.wandb.mode=online"])
    real_find_spec = __import__("importlib.util").util.find_spec
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None if name == "wandb" else real_find_spec(name))
    cfg = load_config(None, BASE + WANDB + [f"data.dir={data_dir}"])
    with pytest.raises(ValueError, match=r"logging.wandb.mode: got 'offline', but wandb is not installed"):
        validate(cfg)


def _train_real(rank, world_size, data_dir, out_dir, steps):
    from distsparse.train.trainer import Trainer
    cfg = load_config(None, BASE + WANDB + [f"data.dir={data_dir}", f"train.out_dir={out_dir}", f"train.steps={steps}"])
    trainer = Trainer(cfg, build_ds_config("configs/ds/zero2.json", cfg))
    trainer.train()
    trainer.close()


def wandb_history(path: Path) -> dict[int, dict[str, float]]:
    """step -> logged scalars, read from an offline run's `.wandb` file: a 7-byte W&B header, then LevelDB log
    records (32 KiB blocks; 7-byte record headers: crc32c, length, type FULL/FIRST/MIDDLE/LAST) holding protobuf
    `Record`s (wandb.proto, the locked wandb's). No reader of the format ships with wandb 0.31's Python side."""
    from wandb.proto import wandb_internal_pb2 as pb
    data, pos, pending, history = path.read_bytes(), 7, b"", {}
    while pos + 7 <= len(data):
        if (left := 32768 - pos % 32768) < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):   # FULL or LAST: a record is complete
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                history[record.history.step.num] = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                                    for item in record.history.item}
        elif kind == 0 and length == 0:   # zero padding at the end of the last block
            break
    return history


def test_wandb_offline_holds_the_scalars_tensorboard_holds(ranks2, data_dir, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    ranks2.run(_train_real, data_dir, str(tmp_path), 3)
    run_id = (tmp_path / WANDB_ID_FILE).read_text()
    history = wandb_history(next((tmp_path / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")))
    assert sorted(history) == [1, 2, 3], sorted(history)
    tb = EventAccumulator(str(tmp_path / "tb")).Reload()
    keys = tb.Tags()["scalars"]
    assert {"loss/train", "lr/dense", "time/tokens_per_s", "loss/val_ppl"} <= set(keys), keys
    for key in keys:
        if key.startswith("final/"):   # TensorBoard's hparams view (step 0); W&B's run summary
            continue
        for event in tb.Scalars(key):
            assert history[event.step][key] == pytest.approx(event.value, rel=1e-6), (key, event.step)
