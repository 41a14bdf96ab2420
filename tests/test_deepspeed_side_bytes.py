"""DeepSpeedSide.state_bytes on a tiny ZeRO-2 model over two gloo ranks, against a count from the shapes."""

import torch

W1, B1, W2 = 5 * 7, 7, 7 * 3   # Linear(5, 7) and Linear(7, 3, bias=False): 63 parameters
FP32 = 4


def _side_bytes(rank, world_size):
    import deepspeed

    from distsparse.train.deepspeed.side import DeepSpeedSide
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3, bias=False))
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
              "zero_optimization": {"stage": 2}, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config)
    side = DeepSpeedSide(engine, 1.0)
    out = {}
    for step in range(2):   # the second step's backward has the Adam state of the first
        engine.backward(engine(torch.randn(1, 5)).square().sum())
        out[f"held{step}"] = side.state_bytes(set())
        grads = [g for group in engine.optimizer.averaged_gradients.values() if group for g in group]
        out[f"grad_storages{step}"] = sum({g.untyped_storage().data_ptr(): g.untyped_storage().nbytes()
                                           for g in grads}.values())
        seen = set()
        out[f"first{step}"], out[f"again{step}"] = side.state_bytes(seen), side.state_bytes(seen)
        engine.step()
    out["after_step"] = side.state_bytes(set())
    # The module's parameters already counted by another part of the same count: not again.
    seen = {(p.device, p.untyped_storage().data_ptr()) for p in model.parameters()}
    out["module_counted_before"] = side.state_bytes(seen)
    return out


def test_state_bytes_counts_each_dense_storage_once_as_the_shapes_say(ranks2):
    # ZeRO pads the flat group to a multiple of 2 x world size elements (nccl_start_alignment_factor): 63 -> 64,
    # 32 per rank. fp32 module: the module's flat copy holds all 64, the fp32 partition and each moment 32.
    padded = -(-(W1 + B1 + W2) // (2 * 2)) * (2 * 2)
    partition = padded // 2
    for rank, out in enumerate(ranks2.run(_side_bytes)):
        for step in range(2):
            held = out[f"held{step}"]
            moments = 0 if step == 0 else 2 * partition * FP32 + FP32   # exp_avg, exp_avg_sq, a 0-dim step
            assert {k: held[k] for k in ("module_copy", "fp32_partition", "moments")} == {
                "module_copy": padded * FP32, "fp32_partition": partition * FP32, "moments": moments}, (rank, step)
            # The reduced gradients sit in views of DeepSpeed's buffers: their storages, each once, cover at
            # least this rank's partition.
            assert held["grad_partition"] == out[f"grad_storages{step}"] >= partition * FP32, (rank, step)
            assert out[f"first{step}"] == held
            assert out[f"again{step}"] == dict.fromkeys(held, 0)   # every storage already in `seen`
        assert out["after_step"]["grad_partition"] == 0            # the step released the partition
        assert out["after_step"]["moments"] == 2 * partition * FP32 + FP32
        assert out["module_counted_before"] == {**out["after_step"], "module_copy": 0}
