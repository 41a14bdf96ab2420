"""The dispatch counter (distsparse/op_count.py) on known sequences, and what it shows of the matrix engine: a
steady step's ops grow with the number of shape groups, not of matrices, with no host sync; counts on the meta device
(how bench/optimizer.py counts at 350m shapes) equal the CPU counts."""

import pytest
import torch
from transformers import LlamaForCausalLM

from distsparse.config import load_config
from distsparse.models import backbone_modules, build_model
from distsparse.models.build import branch_rank, llama_config, sparsify
from distsparse.op_count import OpCounter, count_ops
from distsparse.optim.engine import MatrixEngine
from distsparse.optim.rules import get_rule


def test_ops_views_and_syncs_of_a_known_sequence():
    a = torch.arange(12.0)
    with OpCounter() as counter:
        b = a.view(3, 4)          # a view
        c = b * 2 + 1             # two kernels
        float(c.sum())            # a kernel and a scalar read
        torch.nonzero(c > 5)      # a kernel and a data-sized output
    counts = counter.counts
    assert (counts.ops, counts.views, counts.syncs) == (7, 1, 2), counts.as_dict()
    assert counts.sync_ops == {"_local_scalar_dense": 1, "nonzero": 1}
    meta = torch.empty(4, device="meta")
    with OpCounter() as counter, pytest.raises(NotImplementedError):
        meta.to("cpu")            # a device-to-host copy: a sync wherever the tensor is not on the CPU
    assert counter.counts.sync_ops == {"_to_copy": 1}
    assert count_ops(lambda: a.tolist())[0].ops == 0, "a CPU .tolist() reads memory without an aten op"


def _engine(method: str, layers: int, device: str = "cpu", rule_args: dict | None = None):
    cfg = load_config(None, ["model.preset=tiny", f"method.preset={method}", f"model.num_hidden_layers={layers}"])
    if device == "meta":
        with torch.device("meta"):
            model = LlamaForCausalLM(llama_config(cfg.model, 97))
            sparsify(model, cfg.method, 0, branch_rank(cfg.model, cfg.method))
    else:
        model = build_model(cfg.model, cfg.method, 97, seed=0)
    hp = get_rule(cfg.method.rule).hparams(**{"lr": 1e-3, **(rule_args or {})})
    engine = MatrixEngine(backbone_modules(model), rule=cfg.method.rule, hparams=hp, grad_accum_mode="full",
                          device=device)
    engine.grad_buffer.normal_()
    return engine


def _steady_step(engine) -> "OpCounter":
    engine.step(1e-3)   # first step: the kept-index cache is built
    engine.grad_buffer.normal_()

    def step():   # the backbone's part of a joint step with clipping on (engine.py phases 1-5, no refresh)
        engine.reduce_gradients()
        engine.local_grad_sq_norm()
        engine.step(1e-3, 0.5)
        engine.zero_grad()
    return count_ops(step)[0]


@pytest.mark.parametrize("method,rule_args", [("chtsnm_nobranch_1of4_row", {"ramp_steps": 0}),
                                              ("chtsnm_nobranch_2of4_block", {}), ("chts24_1of4_row", {}),
                                              ("dense_muon", {})])
def test_a_steady_step_costs_the_same_ops_with_four_times_the_matrices_and_syncs_nothing(method, rule_args):
    one, four = (_steady_step(_engine(method, layers, rule_args=rule_args)) for layers in (1, 4))
    assert one.ops == four.ops and one.views == four.views, (one.as_dict(), four.as_dict())
    assert one.syncs == four.syncs == 0, four.sync_ops
    assert four.ops <= 3 * 70, "about 60 ops per TANS group, 3 groups"


def test_counts_on_the_meta_device_equal_the_cpu_counts():
    cpu = _steady_step(_engine("chtsnm_nobranch_1of4_row", 2, rule_args={"ramp_steps": 0}))
    meta = _steady_step(_engine("chtsnm_nobranch_1of4_row", 2, "meta", {"ramp_steps": 0}))
    assert meta.by_op == cpu.by_op and meta.ops > 100


def test_scalar_reads_of_named_host_tensors_and_of_what_they_alone_compute_are_ops_but_not_syncs():
    host, other = torch.zeros(3), torch.ones(())
    with OpCounter(host_tensors=[host]) as counter:
        host[1].item()                          # a view of a host tensor
        bool((~torch.isfinite(host)).any())     # computed from host tensors alone
        (host.sum() + other).item()             # mixed with another tensor: a sync
        other.item()
    assert counter.counts.syncs == 2 and counter.counts.sync_ops == {"_local_scalar_dense": 2}
    assert counter.counts.by_op["aten._local_scalar_dense.default"] == 4


def test_a_host_tensor_copied_to_a_device_is_no_longer_a_host_tensor():
    """`.to(device)` of a host tensor leaves the host: reading it back waits for the device (the meta device stands
    in for a GPU on CPU runs; its scalar read is counted, then fails)."""
    host = torch.zeros(())
    with OpCounter(host_tensors=[host]) as counter, pytest.raises(RuntimeError, match="meta"):
        host.to("meta").item()
    assert counter.counts.sync_ops == {"_local_scalar_dense": 1}
