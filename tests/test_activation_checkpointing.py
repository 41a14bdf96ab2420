"""`model.activation_checkpointing=true` through the API the installed transformers has (issue 25 item 6): the
locked version's `activation_checkpointing_enable` really recomputes the decoder layers and gives the plain
loss and gradients; a transformers without that name (5.17, on the GPU machine) is reached through
`gradient_checkpointing_enable`."""

import warnings

import pytest
import torch

from distsparse.config import load_config
from distsparse.models import build_model
from distsparse.models.build import enable_activation_checkpointing

VOCAB = 97


def model_cfg(checkpointing: bool):
    return load_config(None, ["model.preset=tiny", "method.preset=chtsnm_nobranch_1of4_row",
                              f"model.activation_checkpointing={str(checkpointing).lower()}"])


def loss_grads_and_mlp_calls(model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    """One training forward+backward on a fixed batch; how often layer 0's (sparse) q projection ran: twice when
    the backward recomputed it (not the MLP's down projection, whose output the non-reentrant recompute never
    needs, so it stops before it)."""
    calls = []
    hook = model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda *_: calls.append(1))
    model.train()
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(5))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    hook.remove()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, len(calls)


def test_checkpointing_with_the_locked_transformers_recomputes_and_gives_the_plain_loss_and_grads():
    plain_cfg, ckpt_cfg = model_cfg(False), model_cfg(True)
    plain = build_model(plain_cfg.model, plain_cfg.method, VOCAB, seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)   # the deprecated alias is not what the locked version runs
        ckpt = build_model(ckpt_cfg.model, ckpt_cfg.method, VOCAB, seed=0)
    assert all(layer.gradient_checkpointing for layer in ckpt.model.layers)
    assert not any(layer.gradient_checkpointing for layer in plain.model.layers)
    loss_plain, grads_plain, calls_plain = loss_grads_and_mlp_calls(plain)
    loss_ckpt, grads_ckpt, calls_ckpt = loss_grads_and_mlp_calls(ckpt)
    assert (calls_plain, calls_ckpt) == (1, 2)   # the backward re-ran the layer's forward
    assert torch.equal(loss_plain, loss_ckpt)
    assert grads_plain.keys() == grads_ckpt.keys() and len(grads_plain) > 10
    for name, grad in grads_plain.items():
        torch.testing.assert_close(grads_ckpt[name], grad, rtol=1e-6, atol=1e-8, msg=name)


class Transformers517Model:
    """A model as transformers 5.17 offers it: `gradient_checkpointing_enable` and no `activation_...` name; it
    hands the call on to a real model, so the effect is checked too."""

    def __init__(self, model):
        self.inner, self.calls = model, []

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
        self.calls.append(gradient_checkpointing_kwargs)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            self.inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs=gradient_checkpointing_kwargs)


def test_a_transformers_without_activation_checkpointing_enable_is_reached_through_the_older_name():
    cfg = model_cfg(False)
    inner = build_model(cfg.model, cfg.method, VOCAB, seed=0)
    old = Transformers517Model(inner)
    assert not hasattr(old, "activation_checkpointing_enable")
    enable_activation_checkpointing(old)
    assert old.calls == [{"use_reentrant": False}]
    assert loss_grads_and_mlp_calls(inner)[2] == 2


def test_the_newer_name_is_preferred_where_both_exist():
    class Both:
        def __init__(self):
            self.calls = []

        def activation_checkpointing_enable(self, activation_checkpointing_kwargs=None):
            self.calls.append(("activation", activation_checkpointing_kwargs))

        def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
            pytest.fail("the deprecated alias was called")

    both = Both()
    enable_activation_checkpointing(both)
    assert both.calls == [("activation", {"use_reentrant": False})]
