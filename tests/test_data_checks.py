"""Data checks before any process group starts (issue 30 item 2): the model vocabulary against the shards'
largest token id, the global batch against the dataset, a negative seed; through validate() and the launcher."""

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from distsparse.config import load_config
from distsparse.train.data_checks import largest_token_id
from distsparse.train.validate import validate
from synthetic_data import make_data_dir

ROOT = Path(__file__).resolve().parent.parent
SEQ = ["data.seq_len=32"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return make_data_dir(tmp_path_factory.mktemp("data"))   # vocab 97, ids 4..96, no max_token_id in meta.json


def _with_meta(data_dir, tmp_path, **changes):
    """A copy of the data directory whose meta.json has `changes`."""
    out = tmp_path / "copy"
    out.mkdir()
    for name in ("train.bin", "val.bin"):
        (out / name).write_bytes((Path(data_dir) / name).read_bytes())
    meta = {**json.loads((Path(data_dir) / "meta.json").read_text()), **changes}
    (out / "meta.json").write_text(json.dumps(meta))
    return str(out)


def test_the_largest_token_id_of_an_older_preparation_is_read_from_its_shards(data_dir):
    meta = json.loads((Path(data_dir) / "meta.json").read_text())
    expected = max(int(np.fromfile(Path(data_dir) / f"{s}.bin", dtype=np.uint16).max()) for s in ("train", "val"))
    assert "max_token_id" not in meta and largest_token_id(data_dir, meta) == expected == 96
    assert largest_token_id(data_dir, {**meta, "max_token_id": 41}) == 41   # recorded: not scanned


def test_a_meta_vocabulary_at_or_below_the_largest_token_id_is_refused_naming_the_data(data_dir, tmp_path):
    broken = _with_meta(data_dir, tmp_path, vocab_size=96)   # id 96 needs 97 rows
    with pytest.raises(ValueError, match=rf"data.dir: {broken}/meta.json says vocab_size 96, but its shards hold "
                                         r"token id 96"):
        validate(load_config(None, SEQ + [f"data.dir={broken}"]))


def test_a_model_vocabulary_at_or_below_the_largest_token_id_is_refused_naming_the_key(data_dir, tmp_path):
    broken = _with_meta(data_dir, tmp_path, vocab_size=50, max_token_id=96)
    with pytest.raises(ValueError, match=r"model.vocab_size: got 80; the data in .* holds token id 96; allowed: >= 97"):
        validate(load_config(None, SEQ + [f"data.dir={broken}", "model.vocab_size=80"]))


def test_a_model_vocabulary_above_the_largest_id_is_warned_about_with_the_unused_rows(data_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="distsparse.train.data_checks"):
        validate(load_config(None, SEQ + [f"data.dir={data_dir}", "model.vocab_size=128"]))
    assert "model vocabulary 128 is above the data's largest token id 96 + 1: 31 embedding rows" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="distsparse.train.data_checks"):
        validate(load_config(None, SEQ + [f"data.dir={data_dir}"]))   # 97 = 96 + 1: no warning
    assert "embedding rows" not in caplog.text


def test_a_global_batch_larger_than_the_dataset_is_refused_naming_the_micro_batch(data_dir):
    samples = 20000 // 32   # make_data_dir: 20000 train tokens, 625 samples of 32
    validate(load_config(None, SEQ + [f"data.dir={data_dir}", "train.micro_batch=156", "train.grad_accum=2"]),
             world_size=2)   # 624 sequences: allowed
    cfg = load_config(None, SEQ + [f"data.dir={data_dir}", "train.micro_batch=157", "train.grad_accum=2"])
    with pytest.raises(ValueError, match=rf"train.micro_batch: got 157, a global batch of .* x "
                                         rf"accumulation \(2\) x 2 rank\(s\) = 628 sequences, more than "
                                         rf"the {samples} training samples .* allowed: a global batch <= {samples}"):
        validate(cfg, world_size=2)
    validate(cfg, world_size=1)   # the same settings on one rank fit


def test_a_negative_seed_is_refused(data_dir):
    with pytest.raises(ValueError, match=r"train.seed: got -1; allowed: an integer >= 0"):
        validate(load_config(None, SEQ + [f"data.dir={data_dir}", "train.seed=-1"]))


@pytest.mark.parametrize("override, words", [
    ("train.micro_batch=100000000", ["train.micro_batch: got 100000000", "more than the 625 training samples"]),
    ("train.seed=-1", ["train.seed: got -1"]),
])
def test_the_launcher_refuses_them_in_one_line_before_any_process_group(data_dir, capsys, override, words):
    from distsparse.cli.pretrain import main
    rc = main(["--ds_config", str(ROOT / "configs/ds/zero2.json"), f"data.dir={data_dir}", *SEQ, override])
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("config error: "), lines
    for word in words:
        assert word in lines[0], (word, lines[0])
    assert not torch.distributed.is_initialized()
