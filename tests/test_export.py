"""HF export and consolidation (issue 7 item 6): exported models give the training model's logits through
AutoModelForCausalLM; input-dependent branches are refused by name; the consolidated file loads strictly into a
LlamaForCausalLM; files get the mode the umask gives; an export records the run's sequence length (issue 18 item 6)."""

import importlib
import json
import os
import random
import stat
from pathlib import Path

import pytest
import torch

from distsparse.config import load_config
from distsparse.nm import NMMeta, NMSpec, decode
from distsparse.train.deepspeed.config import build_ds_config
from rankpool import import_tool

ROOT = Path(__file__).resolve().parent.parent
BASE = ["model.preset=tiny", "data.seq_len=32", "train.dtype=fp32", "train.eval_interval=1000", "train.eval_samples=8",
        "train.micro_batch=2", "train.warmup_steps=1", "train.lr=1e-2", "method.preset=chtsnm_nobranch_1of4_row",
        "method.topology.update_interval=2", "train.steps=3", "checkpoint.interval=100"]
LORA = ["method.branch.kind=add", "method.branch.rank=4"]
PROBE = torch.Generator().manual_seed(0)
PROBE_IDS = torch.randint(4, 300, (2, 24), generator=PROBE)


@pytest.fixture(scope="module")
def tok_data(tmp_path_factory):
    """A prepared data dir with a real SentencePiece tokenizer (tests/synthetic_data.py writes none)."""
    from data_prep.prepare import main as prepare
    root = tmp_path_factory.mktemp("tokdata")
    rng = random.Random(0)
    words = "the a sparse model learns weights from data and each layer keeps one of four values per group".split()
    (root / "corpus").mkdir()
    for i in range(3):
        docs = [" ".join(rng.choice(words) for _ in range(rng.randint(20, 80))) + "." for _ in range(60)]
        (root / "corpus" / f"doc{i}.txt").write_text("\n\n".join(docs))
    prepare(["--source", f"files:{root / 'corpus'}/*.txt", "--out", str(root / "data"), "--vocab-size", "300",
             "--num-proc", "1"])
    return str(root / "data")


@pytest.fixture(scope="module")
def tools():
    return importlib.import_module("distsparse.cli.export_hf"), import_tool("consolidate")


def _train_and_probe(rank, world_size, data_dir, out_dir, overrides):
    """Train on the ranks, save; rank 0 returns the checkpoint, the model's logits on PROBE_IDS and its tensors."""
    from distsparse.train.trainer import Trainer
    cfg = load_config(None, BASE + [f"data.dir={data_dir}", f"train.out_dir={out_dir}"] + overrides)
    trainer = Trainer(cfg, build_ds_config(str(ROOT / "configs/ds/zero2.json"), cfg))
    trainer.train()
    trainer.model.eval()
    with torch.no_grad():
        logits = trainer.model(input_ids=PROBE_IDS).logits.float()
    tensors = {n: t.detach().clone() for n, t in trainer.model.state_dict().items()}
    trainer.close()
    ckpt = Path(out_dir) / "checkpoints"
    return {"ckpt": str(ckpt / (ckpt / "latest").read_text()), "logits": logits, "tensors": tensors}


@pytest.fixture(scope="module")
def runs(ranks2, tok_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    return {name: ranks2.run(_train_and_probe, tok_data, str(out / name), overrides)[0]
            for name, overrides in (("backbone", []), ("lora", LORA))}


def _hf_logits(folder):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert type(model).__name__ == "LlamaForCausalLM"
    with torch.no_grad():
        return model(input_ids=PROBE_IDS).logits.float(), model


def _reference_dense(values, codes, spec):
    """Brute force: the kept positions of the decoded mask, filled row-major with the values."""
    shape = (values.shape[0], values.shape[1] * spec.m // spec.n)
    dense = torch.zeros(shape, dtype=torch.float64)
    dense[decode(NMMeta(codes, spec, shape))] = values.double().reshape(-1)
    return dense


def test_exported_backbone_only_model_gives_the_training_logits(runs, tok_data, tools, tmp_path):
    export_hf, _ = tools
    run = runs["backbone"]
    out = export_hf.export(run["ckpt"], tmp_path / "hf")
    logits, model = _hf_logits(out)
    assert (logits - run["logits"]).abs().max() < 1e-5
    # The HF weights are the trained 1:4 backbone: one nonzero per group of 4, at the trained positions.
    name = "model.layers.1.mlp.down_proj"
    weight = model.get_submodule(name).weight.detach().double()
    values, codes = run["tensors"][f"{name}.values"], run["tensors"][f"{name}.codes"]
    expected = _reference_dense(values, codes, NMSpec.parse("1:4", "row"))
    torch.testing.assert_close(weight, expected, rtol=0, atol=0)
    assert ((weight.view(weight.shape[0], -1, 4) != 0).sum(-1) <= 1).all()
    from safetensors.torch import load_file
    side = load_file(str(out / "backbone_compressed.safetensors"))
    assert torch.equal(side[f"{name}.values"], values) and torch.equal(side[f"{name}.codes"], codes)


def test_exported_tokenizer_encodes_like_sentencepiece(runs, tok_data, tools, tmp_path):
    import sentencepiece as spm
    from transformers import AutoTokenizer
    export_hf, _ = tools
    out = export_hf.export(runs["backbone"]["ckpt"], tmp_path / "hf", tok_data)
    text = "each sparse layer keeps one of four values"
    sp = spm.SentencePieceProcessor(model_file=str(Path(tok_data) / "tokenizer" / "tokenizer.model"))
    assert AutoTokenizer.from_pretrained(out)(text, add_special_tokens=False)["input_ids"] == sp.encode(text)


def test_exported_lora_model_folds_the_branch_and_gives_the_training_logits(runs, tools, tmp_path):
    export_hf, _ = tools
    run = runs["lora"]
    lora_b = run["tensors"]["model.layers.0.self_attn.q_proj.branch.lora_B"]
    assert lora_b.abs().max() > 1e-4   # the branch trained, so folding it matters
    logits, _ = _hf_logits(export_hf.export(run["ckpt"], tmp_path / "hf"))
    assert (logits - run["logits"]).abs().max() < 1e-5


def test_como_branch_is_refused_with_the_branch_named(ranks2, tok_data, tools, tmp_path):
    export_hf, _ = tools
    run = ranks2.run(_train_and_probe, tok_data, str(tmp_path / "como"),
                     ["method.branch.kind=como", "method.branch.rank=4", "train.steps=1"])[0]
    with pytest.raises(ValueError, match="method.branch.kind: got 'como'.*input-dependent"):
        export_hf.export(run["ckpt"], tmp_path / "hf")
    assert export_hf.main([run["ckpt"], str(tmp_path / "hf")]) == 2


def _llama_from_checkpoint(ckpt):
    """An empty LlamaForCausalLM of the checkpoint's shape, built from its manifest alone."""
    from transformers import LlamaForCausalLM
    from distsparse.checkpoint.manifest import read_manifest
    from distsparse.config import Config
    from distsparse.models import llama_config
    from distsparse.strict_config import build_dataclass
    manifest = read_manifest(Path(ckpt))
    cfg = build_dataclass(Config, manifest["config"], "")
    return LlamaForCausalLM(llama_config(cfg.model, manifest["vocab_size"])).eval()


def test_consolidated_file_loads_strictly_into_llama_with_the_n_m_backbone_and_the_training_logits(runs, tools,
                                                                                                  tmp_path):
    from safetensors.torch import load_file
    _, consolidate = tools
    run = runs["backbone"]
    assert consolidate.main([run["ckpt"], str(tmp_path / "all.safetensors")]) == 0
    model = _llama_from_checkpoint(run["ckpt"])
    model.load_state_dict(load_file(str(tmp_path / "all.safetensors")), strict=True)
    spec = NMSpec.parse("1:4", "row")
    for key in (k for k in run["tensors"] if k.endswith(".codes")):
        name = key.removesuffix(".codes")
        expected = _reference_dense(run["tensors"][f"{name}.values"], run["tensors"][key], spec)
        torch.testing.assert_close(model.get_submodule(name).weight.double(), expected, rtol=0, atol=0)
    with torch.no_grad():
        assert (model(input_ids=PROBE_IDS).logits - run["logits"]).abs().max() < 1e-5


def test_consolidated_lora_model_folds_the_branch_and_its_training_state_holds_every_parameter(runs, tools,
                                                                                              tmp_path):
    from safetensors.torch import load_file
    _, consolidate = tools
    run = runs["lora"]
    assert consolidate.main([run["ckpt"], str(tmp_path / "all.safetensors"), "--training-state",
                             str(tmp_path / "training.safetensors")]) == 0
    model = _llama_from_checkpoint(run["ckpt"])
    model.load_state_dict(load_file(str(tmp_path / "all.safetensors")), strict=True)
    with torch.no_grad():
        assert (model(input_ids=PROBE_IDS).logits - run["logits"]).abs().max() < 1e-5
    training = load_file(str(tmp_path / "training.safetensors"))
    assert training.keys() == run["tensors"].keys()
    assert all(torch.equal(training[k], run["tensors"][k]) for k in training)


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_exported_and_consolidated_files_get_the_mode_the_umask_gives(runs, tools, tmp_path, umask):
    export_hf, consolidate = tools
    previous = os.umask(umask)
    try:
        out = export_hf.export(runs["backbone"]["ckpt"], tmp_path / "hf")
        assert consolidate.main([runs["backbone"]["ckpt"], str(tmp_path / "all.safetensors")]) == 0
    finally:
        os.umask(previous)
    for path in (out / "model.safetensors", out / "backbone_compressed.safetensors", out / "config.json",
                 tmp_path / "all.safetensors"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask, path


def test_perplexity_of_an_export_uses_the_run_sequence_length_recorded_in_its_config(runs, tok_data, tools,
                                                                                    tmp_path):
    from distsparse.eval import perplexity as ppl_module
    export_hf, _ = tools
    out = export_hf.export(runs["backbone"]["ckpt"], tmp_path / "hf")
    args = ["--data", tok_data, "--max-samples", "4", "--device", "cpu"]
    assert ppl_module.main([str(out), *args, "--json", str(tmp_path / "hf.json")]) == 0
    assert ppl_module.main([runs["backbone"]["ckpt"], *args, "--json", str(tmp_path / "ckpt.json")]) == 0
    from_hf, from_ckpt = (json.loads((tmp_path / f).read_text()) for f in ("hf.json", "ckpt.json"))
    assert from_hf["seq_len"] == from_ckpt["seq_len"] == 32   # BASE's data.seq_len, not the data's prepared 256
    assert from_hf["ppl"] == pytest.approx(from_ckpt["ppl"], rel=1e-5)


def test_exported_shuffled_model_folds_its_permutations_and_gives_the_training_logits(ranks2, tok_data, tools,
                                                                                     tmp_path):
    from safetensors.torch import load_file
    export_hf, _ = tools
    run = ranks2.run(_train_and_probe, tok_data, str(tmp_path / "shuffle"),
                     ["method.permutation.mode=random", "method.permutation.block_size=16", "train.steps=1"])[0]
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.gate_proj: .*residual stream.*--require-nm"):
        export_hf.export(run["ckpt"], tmp_path / "strict", require_nm=True)
    assert export_hf.main([run["ckpt"], str(tmp_path / "strict"), "--require-nm"]) == 2
    out = export_hf.export(run["ckpt"], tmp_path / "hf")
    logits, model = _hf_logits(out)
    assert (logits - run["logits"]).abs().max() < 1e-5

    side = load_file(str(out / "backbone_compressed.safetensors"))
    permuted = {k.removesuffix(".input_perm") for k in side if k.endswith(".input_perm")}
    # down_proj's and o_proj's gathers folded into gate/up and v rows (head_dim 16 = block size); the rest stay.
    assert permuted == {f"model.layers.{i}.{p}" for i in range(2) for p in
                        ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")}
    spec = NMSpec.parse("1:4", "row")
    for key in (k for k in side if k.endswith(".values")):
        name = key.removesuffix(".values")
        weight = model.get_submodule(name).weight.detach().double()
        if name in permuted:
            weight = weight[:, side[f"{name}.input_perm"]]    # the HF weight is W[:, inv]
        torch.testing.assert_close(weight, _reference_dense(side[key], side[f"{name}.codes"], spec), rtol=0, atol=0)
