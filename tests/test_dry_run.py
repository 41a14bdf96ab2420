"""`--dry-run`'s memory plan (distsparse/memory_estimate.py): the tiny model's parts against a hand computation and
the codes its real layers hold, the 350m plan on 2 ranks against the parts bench/scale_check.py measured
(docs/results/scale_350m.json), and the CLI's table at 350m and 1b on 2, 8 and 64 ranks without a process
group."""

import json
import math
import re
from pathlib import Path

import pytest
import torch
from synthetic_data import make_data_dir

from distsparse.config import load_config
from distsparse.layers import NMSparseLinear
from distsparse.memory_estimate import estimate_run, format_estimate
from distsparse.models import build_model, build_on_meta
from distsparse.train.deepspeed.config import build_ds_config

ROOT = Path(__file__).resolve().parents[1]
METHOD = "chtsnm_nobranch_1of4_row"
# The tiny model (configs/model/tiny.yaml): 2 layers of q, k, v, o [64, 64], gate, up [176, 64], down [64, 176].
LAYERS, HIDDEN, HEADS, FFN, MATRICES = 2, 64, 4, 176, 14
DENSE = LAYERS * (4 * HIDDEN * HIDDEN + 3 * HIDDEN * FFN)
KEPT = DENSE // 4                                             # 1:4
VOCAB = 512
DENSE_SIDE = 2 * VOCAB * HIDDEN + (2 * LAYERS + 1) * HIDDEN   # untied embedding and head, RMSNorm weights
ALIGN = 128
MiB = 2**20
REL = 0.01   # the brief asks 10%; the plan is exact but for 2 KiB of padding in DeepSpeed's flat gradient buffer


def _plan(world_size, *overrides, ds="zero2"):
    cfg = load_config(None, [f"method.preset={METHOD}", *overrides])
    ds_config = build_ds_config(ROOT / f"configs/ds/{ds}.json", cfg)
    model = build_on_meta(cfg.model, cfg.method, cfg.model.vocab_size, cfg.train.seed)
    return estimate_run(model, cfg, ds_config, world_size), cfg


def _tiny(world_size, *overrides, ds="zero2"):
    return _plan(world_size, "model.preset=tiny", f"model.vocab_size={VOCAB}", "train.dtype=fp32", "data.seq_len=64",
                 "train.micro_batch=3", *overrides, ds=ds)


def test_tiny_plan_matches_a_hand_computation_and_the_real_layers():
    plan, cfg = _tiny(2)
    assert plan["grad_accum_mode"] == "sharded" and plan["dtype"] == "fp32" and plan["zero_stage"] == 2
    # The codes the materialized layers hold, byte for byte.
    real = build_model(cfg.model, cfg.method, VOCAB, cfg.train.seed)
    held = sum(m.codes.untyped_storage().nbytes() for m in real.modules() if isinstance(m, NMSparseLinear))
    assert held == KEPT // 4                                   # 2-bit codes of 1 kept value per group of 4
    for rank in plan["ranks"]:
        assert rank["dense_side"] == {"module_copy": 4 * DENSE_SIDE, "fp32_partition": 4 * DENSE_SIDE // 2,
                                      "moments": 8 * DENSE_SIDE // 2 + 4, "grad_partition": 4 * DENSE_SIDE // 2}
        backbone = rank["backbone"]
        assert backbone["values"] == 4 * KEPT and backbone["codes"] == held and backbone["index_cache"] == 0
        assert rank["transient"]["reduce_bucket"] == 4 * DENSE_SIDE       # 5e8-element bucket, touched to n
        # Korthikanti et al.: s*b*h*(34 + 5*a*s/h) per layer, bf16; fp32 doubles it. s = 64, b = 3, h = 64, a = 4.
        assert rank["activations"]["activations"] == 2 * LAYERS * (64 * 3 * 64 * 34 + 5 * 4 * 64 * 64 * 3)
        # The forward's dense W of every sparse projection, held for backward (fp32 here), and its int32 key (one
        # per kept value).
        assert rank["activations"]["decompressed_weights"] == 4 * DENSE + 4 * KEPT
    backbone = [r["backbone"] for r in plan["ranks"]]
    # Masters, V and P of each owned value, plus int64 tau and step counters per owned matrix, split over 2 ranks.
    assert sum(b["optimizer_state"] for b in backbone) == 12 * KEPT + 2 * 8 * MATRICES
    assert all(b["optimizer_state"] > 0 for b in backbone)
    # Sharded: each rank its own gradients, in one bucket padded to 128 values; staging = the bucket + own segment.
    assert all(b["grad_buffer"] % (4 * ALIGN) == 0 for b in backbone)
    assert 4 * KEPT <= sum(b["grad_buffer"] for b in backbone) < 4 * (KEPT + 2 * ALIGN)
    staging = sum(b["grad_buffer"] for b in backbone)
    assert [r["transient"]["grad_staging"] for r in plan["ranks"]] == [staging + b["grad_buffer"] for b in backbone]
    # Value all-gather: send one shard, receive two (fp32), the shard being the larger rank's aligned values.
    gather = plan["ranks"][0]["transient"]["value_gather"]
    assert gather % (3 * 4 * ALIGN) == 0 and 3 * 4 * KEPT / 2 <= gather < 3 * 4 * (KEPT + ALIGN)


def test_tiny_plan_follows_dtype_world_size_stage_and_checkpointing():
    plan, _ = _tiny(8, "train.dtype=bf16", "model.activation_checkpointing=true", "engine.grad_accum_mode=full",
                    "engine.num_buckets=1")
    assert plan["dtype"] == "bf16" and plan["grad_accum_mode"] == "full"
    part = math.ceil(DENSE_SIDE / 8)
    for rank in plan["ranks"]:
        assert rank["dense_side"] == {"module_copy": 2 * DENSE_SIDE, "fp32_partition": 4 * part,
                                      "moments": 8 * part + 4, "grad_partition": 2 * part}
        assert rank["backbone"]["values"] == 2 * KEPT
        # Full mode: 8 equal fp32 shards on every rank, each the largest rank's. By LPT the six MLP matrices (2816
        # kept values) go to ranks 0-5, the eight attention ones (1024) to 6, 7, 6, 7, 6, 7, then 0 and 1: 3840.
        assert rank["backbone"]["grad_buffer"] == 4 * 8 * (2816 + 1024)
        assert rank["activations"]["activations"] == LAYERS * 2 * 64 * 3 * 64   # checkpointed: 2*s*b*h per layer
        # one recomputed layer's W and int32 key
        assert rank["activations"]["decompressed_weights"] == (2 * DENSE + 4 * KEPT) // LAYERS
    assert sum(r["backbone"]["optimizer_state"] for r in plan["ranks"]) == 12 * KEPT + 2 * 8 * MATRICES
    zero1, _ = _tiny(2, ds="zero1")
    assert zero1["zero_stage"] == 1
    assert zero1["ranks"][0]["dense_side"]["grad_partition"] == 4 * DENSE_SIDE      # ZeRO-1: every gradient
    single, _ = _tiny(1)
    assert single["grad_accum_mode"] == "full"
    assert single["ranks"][0]["transient"]["value_gather"] == 0                     # no collectives in one process
    assert single["ranks"][0]["backbone"]["optimizer_state"] == 12 * KEPT + 2 * 8 * MATRICES


def test_350m_plan_on_2_ranks_is_within_10_percent_of_the_measured_parts():
    """docs/results/scale_350m.json: bench/scale_check.py model=350m, measured (not rerun here)."""
    measured = json.loads((ROOT / "docs/results/scale_350m.json").read_text())
    run = measured["config"]
    plan, _ = _plan(run["world_size"], "model.preset=350m", f"model.vocab_size={run['vocab_size']}", "train.dtype=fp32",
                    f"data.seq_len={run['seq_len']}", f"train.micro_batch={run['micro_batch_per_rank']}",
                    "train.grad_accum=1", *run["overrides"])
    assert run["grad_accum_mode"].endswith(f"(ran as {plan['grad_accum_mode']})")
    for r, rank in enumerate(plan["ranks"]):
        parts = measured["model_state_bytes_per_rank"][f"rank{r}"]
        for side in ("dense_side", "backbone"):
            # origin_codes (issue 28) is newer than the measurement: tests/test_mechanism_metrics.py checks it
            assert set(rank[side]) - {"origin_codes"} == set(parts[side])
            for part, value in parts[side].items():
                assert abs(rank[side][part] - value) <= REL * value, (r, side, part, rank[side][part], value)
        staging = measured["backbone_grad_transient_peak_bytes_per_rank"][r]
        assert abs(rank["transient"]["grad_staging"] - staging) <= REL * staging


def _table(out: str) -> dict[str, list[float]]:
    rows = {}
    for line in out.splitlines():
        m = re.fullmatch(r"(\S+/\S+|total)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)", line.strip())
        if m:
            rows[m[1]] = [float(x) for x in m.groups()[1:]]
    return rows


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return make_data_dir(tmp_path_factory.mktemp("data"), train_tokens=80 * 256)


@pytest.mark.parametrize("model", ["350m", "1b"])
def test_dry_run_prints_the_table_at_2_8_and_64_ranks_and_starts_no_process_group(model, data_dir, capsys,
                                                                                   monkeypatch):
    from distsparse.cli import launch_env
    from distsparse.cli.pretrain import main

    def refuse(*_):
        raise AssertionError("--dry-run started the process group")
    monkeypatch.setattr(launch_env, "start", refuse)
    full = {}
    for w in (2, 8, 64):
        rc = main(["--dry-run", "--dry-run-world-size", str(w), f"model.preset={model}", f"method.preset={METHOD}",
                   "model.vocab_size=32000", f"data.dir={data_dir}", "train.dtype=bf16", "train.micro_batch=1",
                   "train.grad_accum=1", "data.seq_len=256", "engine.grad_accum_mode=full",
                   "engine.num_buckets=1"])
        out = capsys.readouterr().out
        assert rc == 0 and not torch.distributed.is_initialized()
        assert f"memory per rank at W = {w} (bf16, ZeRO-2 dense side, engine sharded, gradients full" in out
        dense = int(re.search(r"dense_side\s+([\d,]+)", out)[1].replace(",", ""))
        active = int(re.search(r"backbone_active\s+([\d,]+)", out)[1].replace(",", ""))
        rows = _table(out)
        assert set(rows) >= {"dense_side/fp32_partition", "backbone/values", "backbone/codes",
                             "backbone/optimizer_state", "backbone/grad_buffer", "transient/grad_staging",
                             "activations/activations", "activations/decompressed_weights", "total"}
        # The printed figures against the printed parameter counts (MiB to one decimal).
        assert rows["dense_side/module_copy"][0] == pytest.approx(2 * dense / MiB, abs=0.06)
        assert rows["dense_side/fp32_partition"][0] == pytest.approx(4 * math.ceil(dense / w) / MiB, abs=0.06)
        assert rows["backbone/values"][0] == pytest.approx(2 * active / MiB, abs=0.06)
        # Masters and two fp32 slots of 1/W of the values, give or take the owner map's balance.
        assert 12 * active / w / MiB * 0.9 < rows["backbone/optimizer_state"][2] < 12 * active / w / MiB * 1.25
        assert rows["total"][0] == rows["total"][2] >= rows["total"][1]
        full[w] = rows["backbone/grad_buffer"][0]
    # Full mode: every gradient on every rank whatever W (padding to the largest shard grows with W).
    assert full[2] <= full[8] <= full[64] <= 1.3 * full[2]


def test_dry_run_world_size_is_refused_below_1_and_without_dry_run(data_dir, capsys):
    from distsparse.cli.pretrain import main

    for args, words in ((["--dry-run", "--dry-run-world-size", "0"], ["--dry-run-world-size: got 0", ">= 1"]),
                        (["--dry-run-world-size", "8"], ["--dry-run-world-size: got 8 without --dry-run"])):
        with pytest.raises(SystemExit) as exit_:
            main([*args, "model.preset=tiny", f"data.dir={data_dir}"])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and all(w in err for w in words), err


def test_format_estimate_names_the_largest_rank_and_the_spread():
    plan, _ = _tiny(2)
    rows = _table(format_estimate(plan))
    totals = [sum(sum(side.values()) for side in r.values()) for r in plan["ranks"]]
    assert rows["total"] == [round(max(totals) / MiB, 1), round(min(totals) / MiB, 1), round(max(totals) / MiB, 1)]
    grads = [r["backbone"]["grad_buffer"] / MiB for r in plan["ranks"]]
    assert rows["backbone/grad_buffer"][1:] == [round(min(grads), 1), round(max(grads), 1)]


def test_activation_formula_against_the_tensors_autograd_saves_in_the_decoder_layers():
    """bf16 on CPU, a 2-layer LLaMA of hidden 256 (4 heads, SwiGLU 688), s = 256, b = 2: the bytes of the tensors
    saved for backward while a decoder layer runs (parameters and the logits excluded). Checkpointed: each layer
    saves its input, 2*s*b*h exactly. Not checkpointed: Korthikanti's GPT formula (4h MLP, dropout masks) is
    within 25% of LLaMA's (measured 0.85 of it)."""
    from distsparse.memory_estimate import activation_bytes
    from distsparse.models.causal_attention import use_causal_sdpa

    s, b = 256, 2
    for checkpointing in (False, True):
        cfg = load_config(None, ["model.preset=tiny", "method.preset=dense_adamw", "model.hidden_size=256",
                                 "model.intermediate_size=688", f"model.activation_checkpointing={checkpointing}"])
        model = build_model(cfg.model, cfg.method, VOCAB, 0).to(torch.bfloat16)
        use_causal_sdpa(model)
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        seen, depth = set(), [0]

        def pack(t):
            if depth[0] and t.untyped_storage().data_ptr() not in params:
                seen.add((t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()))
            return t
        for layer in model.model.layers:
            layer.register_forward_pre_hook(lambda *_: depth.__setitem__(0, depth[0] + 1))
            layer.register_forward_hook(lambda *_: depth.__setitem__(0, depth[0] - 1))
        tokens = torch.randint(0, VOCAB, (b, s))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(input_ids=tokens, labels=tokens)
        measured = sum(nbytes for _, nbytes in seen)
        m = cfg.model
        formula = activation_bytes(s, b, m.hidden_size, m.num_attention_heads, m.num_hidden_layers, checkpointing)
        if checkpointing:
            assert measured == formula == 2 * 2 * s * b * 256
        else:
            assert 0.75 * formula <= measured <= 1.25 * formula, (measured, formula)


def test_dry_run_checks_the_global_batch_of_the_planned_world(data_dir, capsys):
    """80 x 256 tokens hold 80 samples of 256: 64 ranks x 1 fit, 128 do not (one config error line, exit 2)."""
    from distsparse.cli.pretrain import main

    args = ["--dry-run", "model.preset=tiny", f"data.dir={data_dir}", "train.micro_batch=1", "train.grad_accum=1",
            "data.seq_len=256"]
    assert main([*args, "--dry-run-world-size", "64"]) == 0
    capsys.readouterr()
    assert main([*args, "--dry-run-world-size", "128"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("config error: train.micro_batch") and "x 128 rank(s)" in lines[0]


@pytest.mark.parametrize("global_batch, world, accum, mode", [(16, 1, 8, "full"), (16, 2, 4, "full"),
                                                              (4, 2, 1, "sharded"), (16, 8, 1, "sharded")])
def test_plan_accumulation_follows_the_global_batch_at_the_planned_world(global_batch, world, accum, mode):
    """global = micro-batch 2 x W x accumulation. Engine `auto` (grad_buckets.resolve_grad_accum_mode): one process
    is full; one micro-batch per step on W > 1 is sharded; several on W = 2 stay full. A sharded buffer holds about
    1/W of the gradients, a full one all of them."""
    plan, _ = _tiny(world, "train.micro_batch=2", f"train.global_batch_size={global_batch}")
    assert plan["grad_accum"] == accum == global_batch // (2 * world)
    assert plan["grad_accum_mode"] == mode
    assert f"micro-batch 2 x seq 64, accumulation {accum}," in format_estimate(plan)
    grads = max(r["backbone"]["grad_buffer"] for r in plan["ranks"])
    full_grads = 4 * KEPT   # every kept value's fp32 gradient (a full buffer also pads to W x the largest shard)
    assert grads >= full_grads if mode == "full" else grads < 0.75 * full_grads


def test_dry_run_is_checked_at_the_planned_world_only(data_dir, capsys, monkeypatch):
    """train.grad_accum 2 agrees with global 64 / (micro-batch 4 x 8 planned ranks); on this 1-process machine it
    would be 16: the dry run for 8 ranks is not refused for the world it is not planning."""
    from distsparse.cli.pretrain import main
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    args = ["--dry-run", "model.preset=tiny", f"data.dir={data_dir}", "data.seq_len=256", "train.micro_batch=4",
            "train.global_batch_size=64", "train.grad_accum=2"]
    assert main([*args, "--dry-run-world-size", "8"]) == 0, capsys.readouterr().err
    assert "memory per rank at W = 8" in capsys.readouterr().out
    assert main([*args, "--dry-run-world-size", "4"]) == 2   # there the global batch gives 4
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("config error: train.grad_accum: got 2, but train.global_batch_size "
                                               "64 / (train.micro_batch 4 x 4 rank(s)) gives 4"), err


def test_a_dry_run_plans_a_run_whose_data_is_not_here_from_the_config_alone(tmp_path, capsys, monkeypatch):
    """A laptop planning a 64-rank cluster run: no data.dir here, the vocabulary stated; the batch plan is still
    checked at the planned world, and without a vocabulary the plan is refused naming model.vocab_size."""
    from distsparse.cli import launch_env
    from distsparse.cli.pretrain import main

    monkeypatch.setattr(launch_env, "start", lambda *_: pytest.fail("--dry-run started the process group"))
    args = ["--dry-run", "--config", "paper_350m_chtsnm_1of4_row", f"data.dir={tmp_path / 'on_the_cluster'}"]
    # 512 sequences = micro-batch 32 x accumulation 1 x 16 ranks; overrides may follow the options
    assert main([*args, "--dry-run-world-size", "16", "model.vocab_size=32000"]) == 0
    out = capsys.readouterr().out
    assert "data checks skipped, vocabulary 32000 from model.vocab_size" in out
    assert "memory per rank at W = 16" in out and "accumulation 1," in out
    assert main([*args, "--dry-run-world-size", "64", "model.vocab_size=32000"]) == 2   # 512 / (32 x 64)
    assert "train.global_batch_size: got 512, not a multiple of" in capsys.readouterr().err
    assert main([*args, "--dry-run-world-size", "16", "model.vocab_size=0"]) == 2
    assert "model.vocab_size: got 0" in capsys.readouterr().err
