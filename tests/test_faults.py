"""Fault injection (issue 18): every fault that was found, so none comes back.

A 2-rank run saves checkpoints at steps 2 and 4; each test damages a copy of them (or the input of a command) and
checks that nothing damaged is loaded: `resume=auto` falls back past a damaged checkpoint naming the file, an
explicit path is refused naming it, a resume that does not match the saved run is refused by key before any
process group starts, config files and values that escaped the clean path end in one `config error:` line, and
data preparation refuses input that is not text. Also kept here: kill -9 in the middle of a save, a truncated
backbone shard. Files each rank writes are hashed by that rank, and on resume each rank hashes only those (#16).
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from distsparse.config import load_config
from synthetic_data import make_data_dir

ROOT = Path(__file__).resolve().parent.parent
BASE = ["model.preset=tiny", "data.seq_len=32", "train.dtype=fp32", "train.eval_interval=1000", "train.eval_samples=8",
        "train.log_interval=1", "train.warmup_steps=1", "train.micro_batch=2", "method.preset=chts24_1of4_row",
        "train.steps=4", "checkpoint.interval=2"]
STEP2, STEP4 = "step00000002", "step00000004"
ZERO_RANK1 = "zero_pp_rank_1_mp_rank_00_optim_states.pt"   # DeepSpeed 0.19's name of rank 1's ZeRO partition
MODULE_FILE = "mp_rank_00_model_states.pt"


def _overrides(data_dir, out_dir, extra=()):
    return BASE + [f"data.dir={data_dir}", f"train.out_dir={out_dir}", *extra]


def _train(rank, world_size, data_dir, out_dir, extra=()):
    """A Trainer as launch/pretrain.py builds one; returns the step it starts at (after any resume) or trains to."""
    from distsparse.train.deepspeed.config import build_ds_config
    from distsparse.train.trainer import Trainer
    cfg = load_config(None, _overrides(data_dir, out_dir, extra))
    trainer = Trainer(cfg, build_ds_config(str(ROOT / "configs/ds/zero2.json"), cfg))
    start = trainer.step
    if cfg.checkpoint.resume == "":
        trainer.train()
    trainer.close()
    return start


def _find(rank, world_size, root, resume):
    """Every rank's answer of CheckpointManager.find, and the files this rank hashed while finding it."""
    from distsparse.checkpoint import CheckpointError, CheckpointManager, manifest
    hashed, original = [], manifest.sha256_file

    def recording(path):
        hashed.append(Path(*Path(path).relative_to(root).parts[1:]).as_posix())   # relative to its checkpoint
        return original(path)
    manifest.sha256_file = recording
    try:
        found = CheckpointManager(root).find(resume)
        return {"found": found.path.name if found else None, "hashed": hashed}
    except CheckpointError as err:
        return {"error": str(err), "hashed": hashed}
    finally:
        manifest.sha256_file = original


@pytest.fixture(scope="module")
def saved(ranks2, tmp_path_factory):
    """A data directory and a 2-rank run with checkpoints at steps 2 and 4 (rule adam)."""
    work = tmp_path_factory.mktemp("faults")
    data_dir = make_data_dir(work / "data")
    ranks2.run(_train, data_dir, str(work / "run"))
    return {"data": data_dir, "run": work / "run"}


@pytest.fixture
def run(saved, tmp_path):
    """A private copy of the saved run directory, to damage."""
    copy = tmp_path / "run"
    shutil.copytree(saved["run"], copy)
    return copy


def _checkpoints(run_dir):
    return run_dir / "checkpoints"


# ---- what is in the manifest, and who hashes what ----------------------------------------------------------

def test_every_file_of_a_checkpoint_is_in_its_manifest_with_the_rank_that_wrote_it(saved):
    path = _checkpoints(saved["run"]) / STEP4
    files = json.loads((path / "manifest.json").read_text())["files"]
    on_disk = {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()} - {"manifest.json"}
    assert set(files) == on_disk
    writers = {rel: info["rank"] for rel, info in files.items()}
    assert writers[MODULE_FILE] == 0 and writers["zero_pp_rank_0_mp_rank_00_optim_states.pt"] == 0
    assert writers[ZERO_RANK1] == 1 and writers["backbone/rank00001.safetensors"] == 1
    assert writers["rng/rank00001.json"] == 1 and writers["dense_state.safetensors"] == 0
    for rel, info in files.items():
        assert info["bytes"] == (path / rel).stat().st_size


def test_on_resume_each_rank_hashes_only_the_files_it_wrote(ranks2, saved):
    root = _checkpoints(saved["run"])
    answers = ranks2.run(_find, str(root), "auto")
    assert [a["found"] for a in answers] == [STEP4, STEP4]
    files = json.loads((root / STEP4 / "manifest.json").read_text())["files"]
    for rank, answer in enumerate(answers):
        assert sorted(answer["hashed"]) == sorted(rel for rel, info in files.items() if info["rank"] == rank)


# ---- damaged files: auto falls back, an explicit path is refused, both name the file -----------------------

@pytest.mark.parametrize("rel", [ZERO_RANK1, MODULE_FILE, "backbone/rank00001.safetensors"])
def test_a_truncated_file_is_skipped_by_auto_and_refused_by_path_with_the_file_named(ranks2, run, rel):
    damaged = _checkpoints(run) / STEP4 / rel
    damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 2])
    assert [a["found"] for a in ranks2.run(_find, str(_checkpoints(run)), "auto")] == [STEP2, STEP2]
    for answer in ranks2.run(_find, str(_checkpoints(run)), str(_checkpoints(run) / STEP4)):
        assert f"{damaged} is truncated or corrupt" in answer["error"]


def test_a_flipped_byte_in_one_rank_s_deepspeed_file_makes_every_rank_resume_from_the_previous_checkpoint(
        ranks2, saved, run):
    damaged = _checkpoints(run) / STEP4 / ZERO_RANK1
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF                  # same size: only the digest, which rank 1 alone checks, differs
    damaged.write_bytes(bytes(data))
    explicit = ranks2.run(_find, str(_checkpoints(run)), str(_checkpoints(run) / STEP4))
    assert all(f"{damaged} is corrupt" in a["error"] for a in explicit)
    starts = ranks2.run(_train, saved["data"], str(run), ["checkpoint.resume=auto"])
    assert starts == [2, 2]


def test_the_command_refuses_an_explicit_checkpoint_that_fails_its_digest_in_one_line(saved, run):
    """Digests are checked by the ranks after the process group starts (validate checks sizes only): the command
    still ends in one `checkpoint error:` line naming the file, not a traceback. One process resuming the 2-rank
    run hashes every file itself."""
    damaged = _checkpoints(run) / STEP4 / ZERO_RANK1
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONPATH=str(ROOT))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, "launch/pretrain.py", *_overrides(saved["data"], run),
                           f"checkpoint.resume={damaged.parent}"], env=env, cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (f"checkpoint error: checkpoint file {damaged} is corrupt (its "
                                                    f"sha256 is not the manifest's)")


def test_a_manifest_that_is_not_utf8_is_skipped_by_auto_and_refused_by_path(run, capsys):
    from distsparse.checkpoint import CheckpointError, CheckpointManager
    manifest = _checkpoints(run) / STEP4 / "manifest.json"
    data = bytearray(manifest.read_bytes())
    data[len(data) // 2] = 0xFF
    manifest.write_bytes(bytes(data))
    assert CheckpointManager(_checkpoints(run)).find("auto").path.name == STEP2
    with pytest.raises(CheckpointError, match=re.escape(f"{manifest} is corrupt: not valid UTF-8")):
        CheckpointManager(_checkpoints(run)).find(str(manifest.parent))


def test_a_manifest_whose_step_was_edited_is_refused_naming_its_directory(run):
    from distsparse.checkpoint import CheckpointError, CheckpointManager
    manifest = _checkpoints(run) / STEP4 / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"step": 4,', '"step": 44,'))
    with pytest.raises(CheckpointError, match=re.escape(f"{manifest} is corrupt: step 44 but its tag is {STEP4}")):
        CheckpointManager(_checkpoints(run)).find(str(manifest.parent))
    assert CheckpointManager(_checkpoints(run)).find("auto").path.name == STEP2


def test_a_checkpoint_directory_renamed_away_from_its_step_is_refused_naming_both(run):
    """An intact checkpoint moved to another step's directory (its manifest and digest untouched): only the
    directory-against-step check tells, so auto would otherwise resume it as the newest."""
    from distsparse.checkpoint import CheckpointError, CheckpointManager
    moved = _checkpoints(run) / "step00000040"
    (_checkpoints(run) / STEP4).rename(moved)
    with pytest.raises(CheckpointError, match=re.escape(f"{moved / 'manifest.json'} is corrupt: step 4 but its "
                                                        f"directory is step00000040 (step 40)")):
        CheckpointManager(_checkpoints(run)).find(str(moved))
    assert CheckpointManager(_checkpoints(run)).find("auto").path.name == STEP2


def test_a_manifest_edited_where_its_step_still_matches_is_refused_by_its_own_digest(run):
    from distsparse.checkpoint import CheckpointError, CheckpointManager
    manifest = _checkpoints(run) / STEP4 / "manifest.json"
    text = manifest.read_text()
    edited = re.sub(r'"consumed_samples": (\d+)', lambda m: f'"consumed_samples": {int(m.group(1)) + 1}', text)
    assert edited != text
    manifest.write_text(edited)   # valid UTF-8 JSON, step 4 in step00000004: only the digest tells
    with pytest.raises(CheckpointError, match=re.escape(f"{manifest} is corrupt: its content does not match its "
                                                        f"digest")):
        CheckpointManager(_checkpoints(run)).find(str(manifest.parent))
    assert CheckpointManager(_checkpoints(run)).find("auto").path.name == STEP2


def test_auto_refuses_to_start_over_when_every_checkpoint_is_damaged_naming_each(ranks2, saved, run):
    from distsparse.checkpoint import CheckpointError, CheckpointManager
    damaged = []
    for step in (STEP2, STEP4):
        file = _checkpoints(run) / step / ZERO_RANK1
        data = bytearray(file.read_bytes())
        data[len(data) // 2] ^= 0xFF          # same size: found by rank 1's digest, not by the manifest checks
        file.write_bytes(bytes(data))
        damaged.append(file)
    for answer in ranks2.run(_find, str(_checkpoints(run)), "auto"):
        assert answer["error"].startswith(f"resume auto: no checkpoint under {_checkpoints(run)} is intact")
        assert all(f"{file} is corrupt" in answer["error"] for file in damaged), answer
    (_checkpoints(run) / STEP4 / "manifest.json").write_text("{")
    (_checkpoints(run) / STEP2 / ZERO_RANK1).write_bytes(b"")
    with pytest.raises(ValueError, match=r"checkpoint.resume: auto, but no checkpoint under .* is intact: .*"
                                         rf"{STEP4}/manifest.json is corrupt.*{STEP2}/{ZERO_RANK1} is truncated"):
        _validate(saved, run, ["checkpoint.resume=auto"])   # before any process group
    with pytest.raises(CheckpointError, match="no checkpoint under .* is intact"):
        CheckpointManager(_checkpoints(run)).find("auto")


def test_a_fresh_start_where_checkpoints_are_is_refused_before_any_process_starts(saved, run):
    with pytest.raises(ValueError, match=re.escape(f"checkpoint.resume: got '' (start fresh), but "
                                                   f"{_checkpoints(run)} holds checkpoints ({STEP4}, {STEP2}); "
                                                   f"allowed: auto")):
        _validate(saved, run, [])
    _validate(saved, run, ["checkpoint.resume=auto"])


def test_a_save_killed_by_sigkill_leaves_the_previous_checkpoint_as_the_one_resumed(saved, tmp_path):
    """A real kill -9 of the process halfway through its second save (DeepSpeed's files written, the project's
    not yet): the temp directory is left behind, `latest` and auto still name step 2."""
    from distsparse.checkpoint import CheckpointManager
    script = ("import os, signal, sys\n"
              "from distsparse.checkpoint.parts import BackbonePart\n"
              "write = BackbonePart.save\n"
              "def killed(self, folder):\n"
              "    if folder.name.endswith('step00000004'):\n"
              "        os.kill(os.getpid(), signal.SIGKILL)\n"
              "    return write(self, folder)\n"
              "BackbonePart.save = killed\n"
              "from distsparse.cli.pretrain import main\n"
              "sys.exit(main(sys.argv[1:]))\n")
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONPATH=str(ROOT))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    out = tmp_path / "killed"
    proc = subprocess.run([sys.executable, "-c", script, *_overrides(saved["data"], out)],
                          env=env, cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    root = _checkpoints(out)
    assert (root / f".tmp-{STEP4}").is_dir() and not (root / STEP4).exists()
    assert (root / "latest").read_text() == STEP2
    assert CheckpointManager(root).find("auto").path.name == STEP2


# ---- resume compatibility, before any process group -------------------------------------------------------

def _validate(saved, run_dir, extra):
    from distsparse.train.validate import validate
    return validate(load_config(None, _overrides(saved["data"], run_dir, extra)))


@pytest.mark.parametrize("extra, words", [
    (["model.hidden_size=128"], ["model.hidden_size saved 64, run 128"]),
    (["method.rule=tans"], ["method.rule saved 'adam' (state exp_avg, exp_avg_sq, step), run 'tans' (state V, P"]),
    (["method.sparsity=2:4", "model.num_hidden_layers=3"],
     ["method.sparsity saved '1:4', run '2:4'", "model.num_hidden_layers saved 2, run 3"]),
    (["method.branch.kind=add", "method.branch.rank=4"], ["method.branch.kind saved 'none', run 'add'"]),
    (["model.vocab_size=128"], ["vocabulary size saved 97, run 128"]),   # a config key that may change alone
])
def test_resuming_another_model_or_method_is_refused_by_name_before_any_process_starts(saved, extra, words):
    with pytest.raises(ValueError) as err:
        _validate(saved, saved["run"], ["checkpoint.resume=auto", *extra])
    message = str(err.value)
    assert message.startswith(f"checkpoint.resume: {_checkpoints(saved['run']) / STEP4} does not match this run")
    for word in words:
        assert word in message, (word, message)


def test_schedule_length_intervals_and_batch_split_may_change_and_are_reported(saved):
    from distsparse.checkpoint import resume_changes
    from distsparse.checkpoint.manifest import read_manifest
    from distsparse.data import load_meta
    extra = ["checkpoint.resume=auto", "train.steps=10", "train.eval_interval=5", "train.grad_accum=2"]
    _validate(saved, saved["run"], extra)   # no error
    path = _checkpoints(saved["run"]) / STEP4
    cfg = load_config(None, _overrides(saved["data"], saved["run"], extra))
    assert resume_changes(read_manifest(path), path, cfg, load_meta(saved["data"])) == [
        "train.eval_interval 1000 -> 5", "train.grad_accum 1 -> 2", "train.steps 4 -> 10"]


# ---- config files and values: one `config error:` line -----------------------------------------------------

def _launch(args, capsys):
    from distsparse.cli.pretrain import main
    rc = main(args)
    return rc, capsys.readouterr().err.strip().splitlines()


def test_config_problems_end_in_one_config_error_line_naming_file_key_and_value(tmp_path, capsys):
    ds, data = ["--ds_config", str(ROOT / "configs/ds/zero2.json")], f"data.dir={make_data_dir(tmp_path / 'data')}"
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("model:\n  hidden_size: 64\n train: {steps: 3\n")
    ds_list = tmp_path / "ds.json"
    ds_list.write_text("[1, 2]")
    missing = tmp_path / "no_such_checkpoint"
    cut_data = make_data_dir(tmp_path / "cut")
    (Path(cut_data) / "train.bin").write_bytes((Path(cut_data) / "train.bin").read_bytes()[:1001])
    cases = [
        ([*ds, "--config", str(bad_yaml), data], [str(bad_yaml), "not valid YAML at line 3"]),
        (["--ds_config", str(ds_list), data], [str(ds_list), "JSON list", "allowed: a JSON object"]),
        ([*ds, "model.hidden_size=68", data], ["model.hidden_size: got 68", "head dimension of 17", "even"]),
        ([*ds, f"checkpoint.resume={missing}", data], ["checkpoint.resume", str(missing), "not a directory",
                                                       "allowed: auto"]),
        # the quickstart's model (small: FFN width 688) with a permutation at its default block size 64
        ([*ds, "--dry-run", "--config", str(ROOT / "configs/experiments/quickstart.yaml"), data,
          "method.permutation.mode=learned"],
         ["method.permutation.block_size: got 64", "FFN width 688", "allowed: a divisor of", "e.g. 16"]),
        ([*ds, "--dry-run", "train.lr=nan", data], ["train.lr: got nan", "allowed: a finite number > 0"]),
        ([*ds, "--dry-run", "method.lr=inf", data], ["method.lr: got inf", "allowed: a finite number > 0"]),
        ([*ds, "--dry-run", "model.rms_norm_eps=-1e-6", data], ["model.rms_norm_eps: got -1e-06", ">= 0"]),
        ([*ds, "--dry-run", f"data.dir={cut_data}"], [f"{Path(cut_data) / 'train.bin'} holds 1001 bytes"]),
    ]
    for args, words in cases:
        rc, lines = _launch(args, capsys)
        assert rc == 2 and len(lines) == 1 and lines[0].startswith("config error: "), (args, lines)
        for word in words:
            assert word in lines[0], (word, lines[0])


# ---- data preparation refuses what is not text -------------------------------------------------------------

def _prepare(tmp_path, source, *extra):
    """One output directory per source and options: a directory holding a preparation of other settings is
    refused (data_prep continues a preparation only with the same command)."""
    from data_prep.prepare import main
    out = tmp_path / ("out_" + "_".join([Path(source).name, *extra]).replace("-", ""))
    return main(["--source", f"files:{source}", "--out", str(out), "--vocab-size", "300", "--num-proc", "1", *extra])


def test_random_bytes_are_refused_as_not_text_whatever_errors_says(tmp_path):
    noise = tmp_path / "noise.txt"
    noise.write_bytes(os.urandom(200_000))
    with pytest.raises(ValueError, match=rf"{noise}: byte \d+ is not valid utf-8"):
        _prepare(tmp_path, noise)
    with pytest.raises(ValueError, match=rf"{noise}: not text: .*undecodable bytes.*allowed: at most 1%"):
        _prepare(tmp_path, noise, "--errors", "replace")


def test_random_bytes_read_as_latin1_are_refused_by_their_control_characters(tmp_path):
    """latin-1 decodes every byte, so nothing is undecodable: the control characters alone (58 of 256 byte
    values) make random bytes not text."""
    noise = tmp_path / "noise.txt"
    noise.write_bytes(os.urandom(200_000))
    with pytest.raises(ValueError, match=rf"{noise}: not text: 2\d\.\d% .*undecodable bytes \(0, as latin-1\) or "
                                         rf"control characters \(\d+\); allowed: at most 1%"):
        _prepare(tmp_path, noise, "--encoding", "latin-1")


def test_damaged_or_empty_inputs_are_refused_naming_the_file(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n  \n")
    with pytest.raises(ValueError, match=f"no documents in {empty}"):
        _prepare(tmp_path, empty)
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"text": "fine"}\n{"text": oops}\n')
    with pytest.raises(ValueError, match=f"{bad_json}:2: not valid JSON"):
        _prepare(tmp_path, bad_json)
    not_gzip = tmp_path / "plain.txt.gz"
    not_gzip.write_text("plain text, not gzip")
    with pytest.raises(ValueError, match=f"{not_gzip}: not a gzip-compressed file"):
        _prepare(tmp_path, not_gzip)


@pytest.mark.parametrize("keep", [1001, 1000])   # an odd byte count (no whole token), a whole number of tokens
def test_a_truncated_token_shard_is_refused_naming_the_file(tmp_path, keep):
    """The shards' sizes against meta.json's token counts: numpy's memmap refused an odd size without naming the
    file, and a shard cut at a token boundary was read as a shorter split."""
    from distsparse.data import TokenDataset
    data_dir = make_data_dir(tmp_path / "data")
    shard = Path(data_dir) / "train.bin"
    tokens = json.loads((Path(data_dir) / "meta.json").read_text())["num_tokens"]["train"]
    shard.write_bytes(shard.read_bytes()[:keep])
    with pytest.raises(ValueError, match=re.escape(f"{shard} holds {keep} bytes; its meta.json says {tokens} uint16 "
                                                   f"tokens ({2 * tokens} bytes)")):
        TokenDataset(data_dir, "train", 32)
    assert len(TokenDataset(data_dir, "val", 32)) > 0


def test_undecodable_bytes_are_refused_by_default_and_replaced_only_when_asked(tmp_path):
    from data_prep.readers import TextOptions, read_file_documents
    text = tmp_path / "latin1.txt"
    text.write_bytes(("caf\u00e9 au lait. " * 200 + "\n\nsecond paragraph " * 50).encode("latin-1"))
    with pytest.raises(ValueError, match=rf"{text}: byte 3 is not valid utf-8"):
        read_file_documents(str(text))
    assert read_file_documents(str(text), TextOptions("latin-1"))[0].startswith("caf\u00e9 au lait.")
    with pytest.raises(ValueError, match="not text"):   # 1 byte in 15 undecodable as UTF-8: wrong encoding
        read_file_documents(str(text), TextOptions(errors="replace"))


@pytest.mark.parametrize("text_chars, refused", [(985, True), (990, False)])
def test_the_not_text_share_counts_each_undecodable_byte_once_whether_replaced_or_dropped(tmp_path, text_chars,
                                                                                          refused):
    """share = undecodable / (decoded characters + dropped bytes): 10 bad bytes in 985 text characters are 1.005%
    (over MAX_NOT_TEXT_SHARE), in 990 exactly 1%, under both --errors replace and ignore."""
    from data_prep.readers import MAX_NOT_TEXT_SHARE, TextOptions, read_file_documents
    assert MAX_NOT_TEXT_SHARE == 0.01
    path = tmp_path / "mostly.txt"
    words = ("plain text " * 100)[:text_chars - 10]
    path.write_bytes(words.encode() + b"".join(b" \xff" for _ in range(10)))   # 10 spaces, 10 bad bytes
    for errors in ("replace", "ignore"):
        if refused:
            with pytest.raises(ValueError, match=rf"{path}: not text: 1\.0% .*undecodable bytes \(10"):
                read_file_documents(str(path), TextOptions(errors=errors))
        else:
            assert len(read_file_documents(str(path), TextOptions(errors=errors))) == 1


def test_a_trainer_built_with_another_batch_plan_is_refused_before_its_step_is_set(saved):
    """RunPart's check: a Trainer built without checkpoint.resume has the batch plan of its config (here 2 x 1 on
    one rank); the 2-rank checkpoint keeps its global batch 4, so it needs accumulation 2, which DeepSpeed was not
    built with. The plan the checkpoint asks for is accepted and sets the step."""
    from types import SimpleNamespace
    from distsparse.checkpoint import CheckpointError, LoadedCheckpoint
    from distsparse.checkpoint.manifest import read_manifest
    from distsparse.data import load_meta
    from distsparse.train.batch import BatchPlan
    from distsparse.train.run_state import RunPart
    path = _checkpoints(saved["run"]) / STEP4
    ckpt = LoadedCheckpoint(path, read_manifest(path))
    cfg = load_config(None, _overrides(saved["data"], saved["run"]))
    trainer = SimpleNamespace(cfg=cfg, meta=load_meta(saved["data"]), world_size=1, step=0,
                              plan=BatchPlan(global_batch=2, micro_batch=2, grad_accum=1, world_size=1))
    with pytest.raises(CheckpointError, match=re.escape("needs the batch plan BatchPlan(global_batch=4, "
                                                        "micro_batch=2, grad_accum=2, world_size=1)")):
        RunPart(trainer).load(ckpt)
    assert trainer.step == 0
    trainer.plan = BatchPlan(global_batch=4, micro_batch=2, grad_accum=2, world_size=1)
    RunPart(trainer).load(ckpt)
    assert trainer.step == 4
