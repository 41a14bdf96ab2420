"""Prepared data in training (issue 30): a tiny HF `tokenizer.json` (trained here with `tokenizers`) prepares
multi-shard data that trains, evaluates and exports; the shards train with the same sample order on 1 and 2
ranks; a vocabulary above 65,536 ids gives 4-byte shards; a hub name that is not cached fails saying what to do."""

import importlib
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from data_prep.prepare import PrepConfig, prepare
from distsparse.config import load_config
from distsparse.data import TokenDataset
from distsparse.data.shards import read_index
from distsparse.train.deepspeed.config import build_ds_config
from rankpool import import_tool

ROOT = Path(__file__).resolve().parent.parent
BASE = ["model.preset=tiny", "data.seq_len=32", "train.dtype=fp32", "train.eval_interval=1000", "train.log_interval=1",
        "train.warmup_steps=1", "train.eval_samples=16", "train.micro_batch=2", "train.steps=4",
        "method.preset=chtsnm_nobranch_1of4_row", "checkpoint.interval=100"]
WORDS = "the a sparse model learns weights from data and each layer keeps one of four values per group".split()


def _documents(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 40))) + "." for _ in range(count)]


def _hf_tokenizer(folder: Path, texts: list[str]) -> Path:
    """A byte-level BPE tokenizer.json trained here, saved as transformers saves one (with its special tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=350, special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                            pad_token="<pad>").save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def hf_data(tmp_path_factory):
    """Three jsonl files (three parts, so every split has three shards) prepared with the HF tokenizer."""
    root = tmp_path_factory.mktemp("hfdata")
    (root / "src").mkdir()
    texts = []
    for f in range(3):
        docs = _documents(f, 150)
        (root / "src" / f"{f}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
        texts += docs
    tokenizer = _hf_tokenizer(root / "hf_tokenizer", texts)
    meta = prepare(PrepConfig(source=f"files:{root / 'src'}/*.jsonl", out=root / "data", tokenizer=str(tokenizer),
                              seq_len=32, val_fraction=0.1, num_proc=1))
    return {"dir": str(root / "data"), "meta": meta, "texts": texts}


def test_an_hf_tokenizer_prepares_shards_that_transformers_reads_back(hf_data):
    from transformers import AutoTokenizer
    meta, data = hf_data["meta"], Path(hf_data["dir"])
    hf = AutoTokenizer.from_pretrained(data / "tokenizer")
    assert meta["tokenizer_kind"] == "hf" and len(meta["shards"]["train"]) == len(meta["shards"]["val"]) == 3
    assert (meta["bos_id"], meta["eos_id"], meta["pad_id"], meta["unk_id"]) == (
        hf.bos_token_id, hf.eos_token_id, hf.pad_token_id, hf.unk_token_id) == (1, 2, 3, 0)
    assert meta["vocab_size"] == len(hf)
    assert meta["tokenizer_check"]["checked"] > 0 and meta["tokenizer_check"]["lossy"] == 0
    expected = {tuple(hf(text, add_special_tokens=False)["input_ids"]) + (hf.eos_token_id,) for text in hf_data["texts"]}
    found = []
    for split in ("train", "val"):
        for entry in meta["shards"][split]:
            tokens = np.fromfile(data / entry["file"], dtype=np.uint16)
            ends = np.cumsum(read_index((data / entry["file"]).with_suffix(".idx"))[1])
            found += [tuple(doc.tolist()) for doc in np.split(tokens, ends[:-1])]
    assert len(found) == len(hf_data["texts"]) and set(found) <= expected


def _train(rank, world_size, data_dir, out_dir, overrides):
    from distsparse.train.trainer import Trainer
    cfg = load_config(None, BASE + [f"data.dir={data_dir}", f"train.out_dir={out_dir}"] + overrides)
    trainer = Trainer(cfg, build_ds_config(str(ROOT / "configs/ds/zero2.json"), cfg))
    result = trainer.train()
    trainer.close()
    ckpt = Path(out_dir) / "checkpoints"
    return {"result": result, "ckpt": str(ckpt / (ckpt / "latest").read_text())}


def _losses(out_dir) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    ea = EventAccumulator(str(Path(out_dir) / "tb"))
    ea.Reload()
    return {e.step: e.value for e in ea.Scalars("loss/train")}


def _train_one_rank(data_dir, out_dir, overrides):
    """A world of one through the launcher's single-process path."""
    script = "import sys; from distsparse.cli.pretrain import main; sys.exit(main(sys.argv[1:]))"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_", "TORCHELASTIC_"))}
    env.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    subprocess.run([sys.executable, "-c", script, "--ds_config", "configs/ds/zero2.json", *BASE,
                    f"data.dir={data_dir}", f"train.out_dir={out_dir}", *overrides], check=True, env=env, cwd=ROOT)


@pytest.fixture(scope="module")
def trained(ranks2, hf_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    two = ranks2.run(_train, hf_data["dir"], str(out / "two"), [])[0]
    _train_one_rank(hf_data["dir"], str(out / "one"), ["train.grad_accum=2"])
    return {"two": two, "out": out}


def test_multi_shard_data_trains_with_the_same_sample_order_on_one_and_two_ranks(trained, hf_data):
    # 2 ranks x micro 2 and 1 rank x micro 2 x accum 2: the same global batches, so the same losses; samples of 32
    # tokens run across the three train shards (a shard's tokens are not a multiple of 32)
    sizes = [e["num_tokens"] for e in hf_data["meta"]["shards"]["train"]]
    assert any(size % 32 for size in sizes)
    two, one = _losses(trained["out"] / "two"), _losses(trained["out"] / "one")
    assert sorted(two) == sorted(one) == [1, 2, 3, 4]
    for step in two:
        assert abs(two[step] - one[step]) <= 1e-5 * abs(two[step]), (step, two[step], one[step])
    assert len({round(v, 4) for v in two.values()}) == 4   # four different batches, not one batch four times


def test_hf_tokenized_data_evaluates_and_exports_with_its_tokenizer(trained, hf_data, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from distsparse.eval.perplexity import main as perplexity
    report = tmp_path / "ppl.json"
    assert perplexity([trained["two"]["ckpt"], "--data", hf_data["dir"], "--json", str(report)]) == 0
    result = json.loads(report.read_text())
    assert result["ppl"] == pytest.approx(np.exp(result["loss"]), rel=1e-6) and result["tokens"] > 0
    assert result["ppl"] < hf_data["meta"]["vocab_size"]
    out = importlib.import_module("distsparse.cli.export_hf").export(trained["two"]["ckpt"], tmp_path / "hf")
    exported, data_tok = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(Path(hf_data["dir"]) /
                                                                                           "tokenizer")
    text = hf_data["texts"][0]
    assert exported(text)["input_ids"] == data_tok(text)["input_ids"] and exported.decode(
        exported(text, add_special_tokens=False)["input_ids"]) == text
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert (model.config.eos_token_id, model.config.pad_token_id) == (2, 3)
    assert model.config.vocab_size == hf_data["meta"]["vocab_size"]
    # a tokenizer without a pad token (meta.json pad_id -1, fine for packed data) exports pad_token_id None
    no_pad = tmp_path / "no_pad"
    shutil.copytree(Path(hf_data["dir"]) / "tokenizer", no_pad / "tokenizer")
    (no_pad / "meta.json").write_text(json.dumps({**hf_data["meta"], "pad_id": -1}))
    out = importlib.import_module("distsparse.cli.export_hf").export(trained["two"]["ckpt"], tmp_path / "hf_no_pad", no_pad)
    assert json.loads((out / "config.json").read_text())["pad_token_id"] is None


def test_a_vocabulary_above_65536_ids_gives_int32_shards(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3, **{f"w{i}": i for i in range(4, 70_000)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                            pad_token="<pad>").save_pretrained(str(tmp_path / "tok"))
    rng = np.random.default_rng(0)
    docs = [" ".join(f"w{i}" for i in rng.integers(4, 70_000, size=rng.integers(5, 30))) for _ in range(200)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    meta = prepare(PrepConfig(source=f"files:{tmp_path / 'docs.jsonl'}", out=tmp_path / "out", seq_len=8,
                              tokenizer=str(tmp_path / "tok"), val_fraction=0.2, num_proc=1))
    assert meta["dtype"] == "int32" and meta["vocab_size"] == 70_000 and meta["max_token_id"] > 65_535
    train = meta["shards"]["train"][0]
    assert read_index((tmp_path / "out" / train["file"]).with_suffix(".idx"))[0] == np.dtype(np.int32)
    ids = [int(word[1:]) for doc in docs for word in doc.split()]
    stream = np.fromfile(tmp_path / "out" / train["file"], dtype=np.int32)
    assert set(stream.tolist()) - {2} <= set(ids) and stream.max() > 65_535
    assert TokenDataset(tmp_path / "out", "train", 8)[0]["input_ids"].tolist() == stream[:8].tolist()


def test_a_hub_name_not_in_the_cache_fails_offline_saying_how_to_fetch_it(tmp_path, monkeypatch):
    import huggingface_hub.constants
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty_cache"))
    (tmp_path / "doc.txt").write_text("one paragraph\n\nanother one\n")
    with pytest.raises(ValueError, match=r"--tokenizer: got 'someorg/not-cached-tokenizer': not a file or directory "
                                         r"here, and not in the Hugging Face cache .*huggingface-cli download "
                                         r"someorg/not-cached-tokenizer"):
        prepare(PrepConfig(source=f"files:{tmp_path / 'doc.txt'}", out=tmp_path / "out",
                           tokenizer="someorg/not-cached-tokenizer", num_proc=1))
    assert not (tmp_path / "out" / "shards").exists() or not any((tmp_path / "out" / "shards").iterdir())
