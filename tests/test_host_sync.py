"""No host sync per micro-batch and at most one per optimizer step in steady training (issue 25 item 3), counted
device-independently: OpCounter (distsparse/op_count.py) sees every scalar read, data-dependent shape and
device-to-host copy whatever the device. Also the DeepSpeed timing keys that synchronize, and the step inputs'
pinning decision and prefetch accounting."""

import json
import logging
from pathlib import Path

import pytest
import torch

from distsparse.config import load_config
from distsparse.data import GlobalBatchSampler, TokenDataset, collate
from distsparse.train.deepspeed.config import build_ds_config, complete_ds_config, warn_syncing_keys
from distsparse.train.step_inputs import StepInputs, should_pin
from synthetic_data import make_data_dir

ROOT = Path(__file__).resolve().parents[1]
BASE = ["model.preset=tiny", "data.seq_len=32", "train.dtype=fp32", "train.eval_interval=1000",
        "train.log_interval=1000", "train.warmup_steps=0", "train.steps=100", "train.micro_batch=1",
        "method.preset=chtsnm_nobranch_1of4_row"]   # refreshes every 100 steps: none in the counted steps
WARM, COUNTED = 2, 3


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return make_data_dir(tmp_path_factory.mktemp("data"))


@pytest.mark.parametrize("name", ["zero1", "zero2"])
def test_shipped_deepspeed_jsons_turn_the_throughput_timer_off(name):
    source = json.loads((ROOT / "configs/ds" / f"{name}.json").read_text())
    assert source["timers"]["throughput"]["enabled"] is False
    assert warn_syncing_keys(source) == []


def test_a_deepspeed_json_without_timers_is_completed_with_the_throughput_timer_off():
    ds = complete_ds_config({"zero_optimization": {"stage": 2}}, load_config(None, ["train.dtype=fp32"]),
                            cuda_available=False)
    assert ds["timers"]["throughput"]["enabled"] is False


def test_a_named_throughput_timer_keeps_deepspeeds_default_as_its_warning_says():
    cfg = load_config(None, ["train.dtype=fp32"])
    zero2 = {"zero_optimization": {"stage": 2}}
    ds = complete_ds_config({**zero2, "timers": {"throughput": {"synchronized": True}}}, cfg, cuda_available=False)
    assert ds["timers"]["throughput"] == {"synchronized": True}   # DeepSpeed's default: enabled
    assert warn_syncing_keys(ds) == ["timers.throughput.enabled"]
    ds = complete_ds_config({**zero2, "timers": {}}, cfg, cuda_available=False)
    assert ds["timers"]["throughput"] == {"enabled": False} and warn_syncing_keys(ds) == []


@pytest.mark.parametrize("source, keys", [
    ({"timers": {"throughput": {}}}, ["timers.throughput.enabled"]),   # DeepSpeed's default: on, synchronized
    ({"timers": {"throughput": {"enabled": True}}}, ["timers.throughput.enabled"]),
    ({"timers": {"throughput": {"enabled": True, "synchronized": False}}}, []),
    ({"wall_clock_breakdown": True, "flops_profiler": {"enabled": True}}, ["wall_clock_breakdown",
                                                                          "flops_profiler.enabled"]),
    ({"wall_clock_breakdown": False}, []),
])
def test_a_deepspeed_json_that_turns_a_syncing_timer_on_is_warned_about_by_key(caplog, source, keys):
    with caplog.at_level(logging.WARNING, logger="distsparse"):
        complete_ds_config({"zero_optimization": {"stage": 2}, **source}, load_config(None, ["train.dtype=fp32"]),
                           cuda_available=False)
    warned = [r.getMessage() for r in caplog.records if "synchronizes the device" in r.getMessage()]
    assert len(warned) == len(keys)
    for key, message in zip(keys, warned):
        assert message.startswith(f"--ds_config {key}: on")


def test_inputs_are_pinned_only_for_a_cuda_device():
    assert should_pin(torch.device("cuda", 0)) and should_pin(torch.device("cuda"))
    assert not should_pin(torch.device("cpu")) and not should_pin(torch.device("meta"))


def test_step_inputs_pin_prefetch_one_step_and_count_only_the_steps_handed_out(data_dir, monkeypatch):
    pinned = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: pinned.append(self.shape) or self.clone())
    data = TokenDataset(data_dir, "train", 32)
    sampler = GlobalBatchSampler(len(data), micro_batch=2, grad_accum=3, world_size=2, rank=1, seed=5)
    inputs = StepInputs(data, sampler, torch.device("cpu"), pin=True)   # the CUDA path's pinning, on CPU
    reference = iter(GlobalBatchSampler(len(data), micro_batch=2, grad_accum=3, world_size=2, rank=1, seed=5))
    for step in range(1, 4):
        batches = inputs.next()
        assert inputs.consumed_samples == step * sampler.global_batch
        inputs.prefetch()
        inputs.prefetch()   # one step ahead at most
        assert sampler.consumed_samples == (step + 1) * sampler.global_batch
        assert inputs.consumed_samples == step * sampler.global_batch
        assert len(batches) == 3
        for batch in batches:
            expected = collate(data, next(reference))
            for key in ("input_ids", "labels"):
                assert torch.equal(batch[key], expected[key])
    assert len(pinned) == 4 * 3 * 2   # 3 steps handed out + 1 prefetched, 3 micro-batches, 2 tensors each
    assert not StepInputs(data, sampler, torch.device("cpu")).pin


def _steady_syncs(rank, world_size, data_dir, out_dir, grad_accum):
    from distsparse.op_count import OpCounter
    from distsparse.train.trainer import Trainer
    cfg = load_config(None, BASE + [f"data.dir={data_dir}", f"train.out_dir={out_dir}",
                                    f"train.grad_accum={grad_accum}"])
    trainer = Trainer(cfg, build_ds_config(ROOT / "configs/ds/zero2.json", cfg))
    for _ in range(WARM):   # lazy optimizer state and DeepSpeed's first-step bookkeeping
        trainer.step_once()
    host = trainer.host_tensors()   # torch AdamW's step counters and the norm handed to DeepSpeed
    assert len(host) > 1
    with OpCounter(host_tensors=host) as counter:
        for _ in range(COUNTED):
            report = trainer.step_once()
            assert report.applied and not report.timings   # not a logging step
    trainer.close()
    return {"syncs": counter.counts.syncs, "sync_ops": dict(counter.counts.sync_ops), "ops": counter.counts.ops,
            "top": counter.counts.as_dict(40)["top_ops"]}


def test_steady_steps_make_at_most_one_host_sync_per_step_and_none_per_micro_batch(ranks2, data_dir, tmp_path):
    two = ranks2.run(_steady_syncs, data_dir, str(tmp_path / "ga2"), 2)
    four = ranks2.run(_steady_syncs, data_dir, str(tmp_path / "ga4"), 4)
    for rank in (0, 1):
        assert two[rank]["ops"] > 1000, "the counter saw the steps"
        assert two[rank]["syncs"] <= COUNTED, two[rank]["sync_ops"]
        # Two more micro-batches per step, not one more sync: none comes from a micro-batch.
        assert four[rank]["syncs"] == two[rank]["syncs"], (two[rank]["sync_ops"], four[rank]["sync_ops"])


def test_the_mask_free_causal_sdpa_gives_the_logits_of_sdpa():
    from distsparse.models import build_model
    from distsparse.models.causal_attention import NAME, use_causal_sdpa
    cfg = load_config(None, ["model.preset=tiny", "train.dtype=fp32"])
    model = build_model(cfg.model, cfg.method, 97, 0).eval()
    x = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model(input_ids=x).logits
        use_causal_sdpa(model)
        assert model.config._attn_implementation == NAME
        got = model(input_ids=x).logits
        x_cut = x[:, :12]   # causal: a prefix's logits do not see the tokens after it
        prefix = model(input_ids=x_cut).logits
    assert torch.equal(got, expected)
    torch.testing.assert_close(prefix, got[:, :12], rtol=1e-5, atol=1e-5)
    for key, value in (("attention_mask", torch.ones_like(x)), ("position_ids", torch.arange(24).expand(2, 24))):
        with pytest.raises(ValueError, match=f"{key}: got a tensor; allowed: None with the mask-free causal"):
            model(input_ids=x, **{key: value})   # would be ignored: refused instead
