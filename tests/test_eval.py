"""Evaluation (issue 9 items 1, 2): token-weighted perplexity against per-token loops, the perplexity command on a
Hugging Face folder and on a project checkpoint (values, codes and dense side loaded), and lm-evaluation-harness end to
end on local tasks against hand-computed log-likelihoods."""

import importlib
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn

from distsparse.config import config_to_dict, load_config
from distsparse.data import TokenDataset, collate, validation_batches
from distsparse.eval import perplexity as ppl_module
from distsparse.eval.load import load_model
from distsparse.eval.loss import loss_sums, perplexity
from distsparse.layers import NMSparseLinear
from distsparse.models import backbone_modules, backbone_param, build_model
from distsparse.nm import encode, random_mask
from distsparse.optim.engine import MatrixEngine
from distsparse.optim.rules import get_rule
from distsparse.checkpoint import CheckpointManager, Part
from distsparse.checkpoint.files import save_safetensors
from distsparse.checkpoint.parts import DENSE_STATE, BackbonePart, RngPart
from distsparse.checkpoint.manifest import DIGEST_KEY, sealed_text
from synthetic_data import make_data_dir
from rankpool import import_tool

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 97                 # make_data_dir's vocabulary; the char tokenizer below fits inside it
TRAIN_SEQ_LEN = 24         # the checkpoint's data.seq_len, hence lm-eval's max_length
CHARS = "abcdefghijklmnopqrstuvwxyz ?.,"


# ---- helpers ---------------------------------------------------------------------------------------------------

def write_truncate_pad_data(path: Path, rows: list[list[int]], seq_len: int, pad_id: int = 3) -> str:
    """A prepared truncate_pad directory: one row per document, padded at the end with pad_id."""
    path.mkdir(parents=True, exist_ok=True)
    tokens = np.full((len(rows), seq_len), pad_id, dtype=np.uint16)
    for i, row in enumerate(rows):
        tokens[i, :len(row)] = row
    for split in ("train", "val"):
        tokens.tofile(path / f"{split}.bin")
    meta = {"vocab_size": VOCAB, "dtype": "uint16", "mode": "truncate_pad", "seq_len": seq_len,
            "num_tokens": {"train": tokens.size, "val": tokens.size}, "bos_id": 1, "eos_id": 2, "pad_id": pad_id,
            "tokenizer_sha256": ""}
    (path / "meta.json").write_text(json.dumps(meta))
    return str(path)


def reference_mean_loss(logits_of, samples: list[np.ndarray], pad_id: int | None) -> tuple[float, int]:
    """Explicit loop over tokens: -log softmax(logits[t])[x[t+1]] in float64, summed over every target that is not a
    pad, divided by their number."""
    total, count = 0.0, 0
    for x in samples:
        logits = logits_of(x)
        for t in range(len(x) - 1):
            target = int(x[t + 1])
            if pad_id is not None and target == pad_id:
                continue
            row = [float(v) for v in logits[t]]
            top = max(row)
            log_z = top + math.log(sum(math.exp(v - top) for v in row))
            total += log_z - row[target]
            count += 1
    return total / count, count


def model_logits(model: nn.Module):
    def logits_of(x: np.ndarray) -> torch.Tensor:
        with torch.no_grad():
            return model(input_ids=torch.from_numpy(x.astype(np.int64))[None]).logits[0].double()
    return logits_of


def char_tokenizer():
    """A character-level fast tokenizer (BPE without merges): one token per character, ids 4.. (< VOCAB)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3, **{c: i + 4 for i, c in enumerate(CHARS)}}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>")),
                                   bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>")


class _ProjectFiles(Part):
    """What the trainer's parts keep for evaluation: the run's manifest entries and the dense state by name (the
    evaluation loader never reads DeepSpeed's files)."""

    def __init__(self, manifest: dict, dense_state: dict):
        self.entries, self.dense_state = manifest, dense_state

    def manifest(self):
        return self.entries

    def save(self, folder):
        save_safetensors(self.dense_state, folder / DENSE_STATE)
        return [DENSE_STATE]


@torch.no_grad()
def save_project_checkpoint(root: Path, cfg) -> tuple[Path, nn.Module]:
    """The model of `cfg` with every tensor moved away from its seeded init (new masks and values, noisy dense side),
    saved by the real CheckpointManager. Returns the step directory and that model."""
    model = build_model(cfg.model, cfg.method, VOCAB, cfg.train.seed)
    gen = torch.Generator().manual_seed(123)
    backbone = backbone_modules(model)
    for core in backbone.values():
        core.set_codes(encode(random_mask(core.out_features, core.in_features, core.spec, gen), core.spec).codes)
        core.values.copy_(torch.randn(core.values.shape, generator=gen) * 0.3)
    backbone_ids = {id(backbone_param(core)) for core in backbone.values()}
    for p in model.parameters():
        if id(p) not in backbone_ids:
            p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    rule = get_rule(cfg.method.rule)
    engine = MatrixEngine(backbone, rule=cfg.method.rule, hparams=rule.hparams(lr=cfg.method.lr),
                          initial_values={n: backbone_param(m).detach().float().clone() for n, m in backbone.items()})
    dense_state = {f"{n}::master": p.detach().float().clone() for n, p in model.named_parameters()
                   if id(p) not in backbone_ids}
    manifest = {"consumed_samples": 0, "config": config_to_dict(cfg), "tokenizer_sha256": ""}
    manager = CheckpointManager(root)
    manager.register(files=_ProjectFiles(manifest, dense_state), backbone=BackbonePart(engine), rng=RngPart())
    path = manager.save(7)
    return path, model.eval()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A CHTsNM 1:4 checkpoint (TANS backbone + CoMoLoRA, an input-dependent branch) of the tiny model, its data
    directory (packed, vocab 97, with a char tokenizer) and the saved model."""
    root = tmp_path_factory.mktemp("ckpt")
    data_dir = make_data_dir(root / "data", vocab_size=VOCAB, train_tokens=2000, val_tokens=600)
    char_tokenizer().save_pretrained(str(Path(data_dir) / "tokenizer"))
    cfg = load_config(None, ["model.preset=tiny", "method.preset=chtsnm_1of4_row", f"data.dir={data_dir}",
                             f"data.seq_len={TRAIN_SEQ_LEN}"])
    path, model = save_project_checkpoint(root / "checkpoints", cfg)
    return {"path": path, "root": root / "checkpoints", "data": data_dir, "model": model, "cfg": cfg}


# ---- perplexity ------------------------------------------------------------------------------------------------

class BigramLM(nn.Module):
    """logits[t] = table[x[t]]: a toy causal LM whose per-token losses the reference can recompute exactly."""

    def __init__(self, vocab: int):
        super().__init__()
        self.table = nn.Parameter(torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(0)) * 2)

    def forward(self, input_ids):
        return type("Out", (), {"logits": self.table[input_ids]})()


def test_perplexity_is_exp_of_the_token_weighted_mean_over_every_unpadded_token(tmp_path):
    rng = np.random.default_rng(0)
    lengths = [12, 3, 7, 12, 5, 9, 2]          # very different pad counts: per-batch means would weight them wrongly
    rows = [list(rng.integers(4, VOCAB, size=n)) for n in lengths]
    data_dir = write_truncate_pad_data(tmp_path / "tp", rows, seq_len=12)
    model = BigramLM(VOCAB)
    dataset = TokenDataset(data_dir, "val", 12)
    batches = validation_batches(len(dataset), 3, world_size=1, rank=0)
    total, count = loss_sums(model, (collate(dataset, b) for b in batches))
    mean, ppl = perplexity(total, count)

    samples = [np.fromfile(Path(data_dir) / "val.bin", dtype=np.uint16).reshape(-1, 12)[i] for i in range(len(rows))]
    table = model.table.detach().double()
    ref_mean, ref_count = reference_mean_loss(lambda x: table[torch.from_numpy(x.astype(np.int64))], samples, pad_id=3)
    assert count == ref_count == sum(n - 1 for n in lengths)
    assert mean == pytest.approx(ref_mean, rel=1e-6)
    assert ppl == pytest.approx(math.exp(ref_mean), rel=1e-6)
    # The mean of per-batch means (GaLore's evaluator) is a different number on this data.
    per_batch = []
    for b in batches:
        t, c = loss_sums(model, [collate(dataset, b)])
        per_batch.append(t / c)
    assert abs(sum(per_batch) / len(per_batch) - ref_mean) > 1e-3


def test_perplexity_command_on_a_hugging_face_folder_matches_a_per_token_loop(tmp_path, capsys):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(str(tmp_path / "hf"))
    data_dir = make_data_dir(tmp_path / "data", vocab_size=VOCAB, train_tokens=500, val_tokens=300)
    out = tmp_path / "ppl.json"
    rc = ppl_module.main([str(tmp_path / "hf"), "--data", data_dir, "--seq-len", "16", "--max-samples", "5",
                          "--batch-size", "2", "--device", "cpu", "--json", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())

    stream = np.fromfile(Path(data_dir) / "val.bin", dtype=np.uint16)
    samples = [stream[i * 16:(i + 1) * 16] for i in range(5)]   # packed: consecutive windows of seq_len tokens
    ref_mean, ref_count = reference_mean_loss(model_logits(model), samples, pad_id=None)
    assert (result["source"], result["mode"], result["samples"], result["tokens"]) == ("hf", "packed", 5, ref_count)
    assert result["loss"] == pytest.approx(ref_mean, rel=1e-5)
    assert result["ppl"] == pytest.approx(math.exp(ref_mean), rel=1e-5)
    assert "ppl" in capsys.readouterr().out


def test_checkpoint_loads_as_the_saved_model_with_its_codes_values_branch_and_dense_side(checkpoint):
    loaded = load_model(checkpoint["root"])      # a checkpoint root: its newest complete step
    assert loaded.source == "checkpoint" and loaded.path == checkpoint["path"]
    assert loaded.seq_len == TRAIN_SEQ_LEN and loaded.tokenizer_dir == Path(checkpoint["data"]) / "tokenizer"
    saved = checkpoint["model"]
    cfg = checkpoint["cfg"]
    fresh = build_model(cfg.model, cfg.method, VOCAB, cfg.train.seed)   # what the seed alone gives
    name = "model.layers.1.mlp.down_proj"
    core, saved_core = backbone_modules(loaded.model)[name], backbone_modules(saved)[name]
    assert isinstance(core, NMSparseLinear)
    assert torch.equal(core.codes, saved_core.codes)
    assert not torch.equal(core.codes, backbone_modules(fresh)[name].codes)
    ids = torch.randint(4, VOCAB, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded.model(input_ids=ids).logits, saved(input_ids=ids).logits)
        assert not torch.allclose(fresh.eval()(input_ids=ids).logits, saved(input_ids=ids).logits)


def test_perplexity_command_on_a_checkpoint_skips_pad_targets_in_truncate_pad_data(checkpoint, tmp_path):
    rng = np.random.default_rng(1)
    rows = [list(rng.integers(4, VOCAB, size=n)) for n in (TRAIN_SEQ_LEN, 5, 17, 9)]
    data_dir = write_truncate_pad_data(tmp_path / "tp", rows, seq_len=TRAIN_SEQ_LEN)
    out = tmp_path / "ppl.json"
    assert ppl_module.main([str(checkpoint["path"]), "--data", data_dir, "--batch-size", "3", "--device", "cpu",
                            "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    samples = list(np.fromfile(Path(data_dir) / "val.bin", dtype=np.uint16).reshape(-1, TRAIN_SEQ_LEN))
    ref_mean, ref_count = reference_mean_loss(model_logits(checkpoint["model"]), samples, pad_id=3)
    assert (result["mode"], result["seq_len"], result["tokens"]) == ("truncate_pad", TRAIN_SEQ_LEN, ref_count)
    assert result["ppl"] == pytest.approx(math.exp(ref_mean), rel=1e-5)


def test_checkpoint_that_does_not_match_its_manifest_is_refused_naming_the_file(checkpoint, tmp_path, capsys):
    import shutil
    copy = tmp_path / checkpoint["path"].name
    shutil.copytree(checkpoint["path"], copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest.pop(DIGEST_KEY)
    manifest["config"]["method"]["permutation"].update(mode="learned", block_size=16)
    (copy / "manifest.json").write_text(sealed_text(manifest))   # an intact manifest of another model
    assert ppl_module.main([str(copy), "--data", checkpoint["data"]]) == 2
    err = capsys.readouterr().err   # the manifest now asks for permutations the saved files do not hold
    assert "dense_state.safetensors" in err and "permutation.theta::master" in err and "does not match" in err


# ---- zero-shot (lm-evaluation-harness) -------------------------------------------------------------------------

MC_DOCS = [{"question": "is ice cold", "choices": ["yes", "no"], "label": 0},
           {"question": "a cat is", "choices": ["an animal", "a rock", "blue"], "label": 0},
           {"question": "two plus two", "choices": ["four", "five"], "label": 1},
           {"question": "the sky is", "choices": ["up", "down", "green", "wet"], "label": 2},
           {"question": "fish can", "choices": ["swim", "fly"], "label": 0},
           {"question": "snow is", "choices": ["white", "hot"], "label": 1}]
ROLLING_DOC = "the quick brown fox jumps over a lazy dog, twice"   # 2 x TRAIN_SEQ_LEN characters


def write_local_tasks(path: Path) -> Path:
    """Two lm-eval tasks over local jsonl files: multiple choice (acc) and rolling log-likelihood (word PPL)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in MC_DOCS))
    (path / "rolling.jsonl").write_text(json.dumps({"text": ROLLING_DOC}) + "\n")
    (path / "toy_mc.yaml").write_text(
        f"task: toy_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {path / 'mc.jsonl'}\n"
        "output_type: multiple_choice\ntest_split: test\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: label\nmetric_list:\n  - metric: acc\n")
    (path / "toy_rolling.yaml").write_text(
        f"task: toy_rolling\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {path / 'rolling.jsonl'}\n"
        "output_type: loglikelihood_rolling\ntest_split: test\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: word_perplexity\n")
    return path


def reference_zero_shot(model: nn.Module, tokenizer, max_length: int) -> dict[str, float]:
    """acc: argmax over choices of sum_j log p(cont_j | question, cont_<j), continuation = " " + choice.
    word PPL: the document scored in consecutive chunks of max_length tokens, each chunk conditioned only on the
    token before it (BOS for the first), so the model never sees more than max_length tokens;
    exp(-sum log p / number of words)."""
    def log_probs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(input_ids=torch.tensor([ids])).logits[0].double().log_softmax(-1)

    correct = 0
    for doc in MC_DOCS:
        ctx = tokenizer.encode(doc["question"], add_special_tokens=False)
        scores = []
        for choice in doc["choices"]:
            cont = tokenizer.encode(" " + choice, add_special_tokens=False)
            lp = log_probs(ctx + cont)
            scores.append(sum(float(lp[len(ctx) + j - 1, tok]) for j, tok in enumerate(cont)))
        correct += int(max(range(len(scores)), key=scores.__getitem__) == doc["label"])
    tokens = tokenizer.encode(ROLLING_DOC, add_special_tokens=False)
    assert len(tokens) == 2 * max_length
    windowed = 0.0
    for start in range(0, len(tokens), max_length):
        prev = tokenizer.bos_token_id if start == 0 else tokens[start - 1]
        chunk = tokens[start:start + max_length]
        lp = log_probs([prev] + chunk[:-1])
        windowed += sum(float(lp[j, tok]) for j, tok in enumerate(chunk))
    lp = log_probs([tokenizer.bos_token_id] + tokens[:-1])
    unwindowed = sum(float(lp[j, tok]) for j, tok in enumerate(tokens))
    words = len(ROLLING_DOC.split())
    return {"acc": correct / len(MC_DOCS), "word_perplexity": math.exp(-windowed / words),
            "word_perplexity_one_window": math.exp(-unwindowed / words)}


@pytest.fixture(scope="module")
def eval_zeroshot():
    pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed: pip install -e '.[eval]'")
    pytest.importorskip("accelerate", reason="lm-eval's HFLM needs accelerate: pip install 'lm-eval[hf]'")
    return importlib.import_module("distsparse.cli.eval_zeroshot")


def test_zero_shot_on_a_checkpoint_in_memory_matches_hand_computed_log_likelihoods(checkpoint, eval_zeroshot,
                                                                                  tmp_path):
    tasks = write_local_tasks(tmp_path / "tasks")
    out = tmp_path / "zs.json"
    rc = eval_zeroshot.main([str(checkpoint["path"]), "--tasks", "toy_mc,toy_rolling", "--include-path", str(tasks),
                             "--batch-size", "4", "--device", "cpu", "--bootstrap-iters", "0", "--json", str(out)])
    assert rc == 0
    payload = json.loads(out.read_text())
    assert payload["config"]["max_length"] == TRAIN_SEQ_LEN and payload["config"]["source"] == "checkpoint"
    ref = reference_zero_shot(checkpoint["model"], char_tokenizer(), TRAIN_SEQ_LEN)
    # The test can tell the training-length window from lm-eval's default one.
    assert abs(math.log(ref["word_perplexity"]) - math.log(ref["word_perplexity_one_window"])) > 1e-3
    assert payload["results"]["toy_mc"]["acc"] == pytest.approx(ref["acc"], abs=1e-12)
    assert payload["results"]["toy_rolling"]["word_perplexity"] == pytest.approx(ref["word_perplexity"], rel=1e-4)


def test_zero_shot_on_a_hugging_face_folder_requires_and_uses_the_training_max_length(eval_zeroshot, tmp_path,
                                                                                      capsys):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=1,
                         eos_token_id=2, pad_token_id=3)
    model = LlamaForCausalLM(config).eval()
    folder = tmp_path / "hf"
    model.save_pretrained(str(folder))
    char_tokenizer().save_pretrained(str(folder))
    tasks = write_local_tasks(tmp_path / "tasks")
    args = [str(folder), "--tasks", "toy_mc,toy_rolling", "--include-path", str(tasks), "--batch-size", "4",
            "--device", "cpu", "--bootstrap-iters", "0"]
    assert eval_zeroshot.main(args) == 2
    assert "--max-length: required for the Hugging Face folder" in capsys.readouterr().err
    out = tmp_path / "zs.json"
    assert eval_zeroshot.main(args + ["--max-length", str(TRAIN_SEQ_LEN), "--json", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert payload["config"]["source"] == "hf" and payload["config"]["max_length"] == TRAIN_SEQ_LEN
    ref = reference_zero_shot(model, char_tokenizer(), TRAIN_SEQ_LEN)
    assert payload["results"]["toy_mc"]["acc"] == pytest.approx(ref["acc"], abs=1e-12)
    assert payload["results"]["toy_rolling"]["word_perplexity"] == pytest.approx(ref["word_perplexity"], rel=1e-4)


def test_zero_shot_fails_before_loading_the_model_listing_every_missing_dataset(checkpoint, eval_zeroshot, tmp_path,
                                                                               monkeypatch, capsys):
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    for name in ("absent_a", "absent_b"):
        (tasks / f"{name}.yaml").write_text(f"task: {name}\ndataset_path: distsparse-tests/{name}-data\n"
                                            "output_type: loglikelihood_rolling\ntest_split: test\n"
                                            "doc_to_text: ''\ndoc_to_target: '{{text}}'\n")

    def no_model(path):
        raise AssertionError("the model was loaded before the datasets were checked")
    monkeypatch.setattr(eval_zeroshot, "load_model", no_model)
    rc = eval_zeroshot.main([str(checkpoint["path"]), "--tasks", "absent_a,absent_b", "--include-path", str(tasks)])
    err = capsys.readouterr().err
    assert rc == 2
    assert "missing from the local Hugging Face cache" in err
    assert "absent_a: distsparse-tests/absent_a-data" in err and "absent_b: distsparse-tests/absent_b-data" in err
