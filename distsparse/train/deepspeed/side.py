"""The dense side of the joint step: DeepSpeed's ZeRO-1/2 optimizer, driven through the few internals of
deepspeed==0.19.8 the joint step needs (DESIGN decisions 4, 15, 18). Nothing else in the project touches them.

What the joint step needs from DeepSpeed, and where 0.19.8's `DeepSpeedZeroOptimizer.step` (runtime/zero/
stage_1_and_2.py) offers it:

    local squared norm   `averaged_gradients[group]`: the reduced gradient partition this rank owns after the
                         boundary backward (padding views are flagged `_zero_padding`). The sum of their squared
                         norms is what `get_grad_norm_direct` computes before its own all-reduce; here it joins the
                         joint step's one all-reduce instead.
    one coefficient      `step` takes its norm from `scaled_global_norm()` and scales the partition by
                         clip_grad / (norm + 1e-6) when that is below 1. Handing it the joint norm makes it apply
                         the joint coefficient with its threshold left at train.grad_clip: nothing to restore.
    both sides skip      `step` skips (zero_grad, no Adam update, no scheduler step, `was_step_applied()` False)
                         when `check_overflow()` sets `overflow`; with `check_grad_overflow` on it is called in fp32
                         and bf16 alike. The joint step decides and `check_overflow` reports that decision, so a
                         non-finite backbone gradient skips the dense side and nothing non-finite reaches Adam. The
                         LR scheduler is then stepped here: the schedule follows the step index on both sides.

`step` swaps `scaled_global_norm`, `check_overflow` and `check_grad_overflow` on the optimizer instance for the one
call and restores them in `finally`, where it also sets the clip threshold to train.grad_clip (as it does before
the call). `hold_threshold` does the same after a checkpoint load: DeepSpeed's `load_checkpoint` restores the saved
threshold, which a resume may have changed (train.grad_clip) or a checkpoint written before the joint step existed
holds rescaled; a save before the next step would write it again. The norm it hands over
is a CPU tensor: DeepSpeed's own validity check of it (`is_invalid_grad_norm`, a bool()) then costs no device sync.

Linking the Adam state by parameter (what dense_state.py reads through `safe_get_full_optimizer_state`): 0.19.8's
`_optimizer_step(i)` steps one parameter group at a time and calls `_lazy_init_hp_params_optimizer_state` right
after group 0's first step. That links every group to its Adam state once (a flag), but torch's AdamW and
DeepSpeed's FusedAdam create a group's state in its own first step, so groups 1.. are linked to empty state for
good ("exp_avg not found" at the next save) whenever the dense side has more than one group (method.branch_lr).
`step` links again after the first applied step, when every group's state exists. A checkpoint load links on the
next step with every group's state already loaded (or dense_state._ensure_optimizer_state links it).

Model-state bytes (`state_bytes`, DESIGN s6) read the same internals: the module's parameters (`bit16_groups`,
views of DeepSpeed's flat buffers), the fp32 partition (`single_partition_of_fp32_groups`), Adam's state
(`optimizer.state`) and the gradient partition (`averaged_gradients`, held from the boundary backward to the step).
"""

from __future__ import annotations

import torch

from distsparse.utils import storage_bytes

CPU = torch.device("cpu")


class DeepSpeedSide:
    """Wraps a DeepSpeedEngine whose optimizer is ZeRO-1/2 (`DeepSpeedZeroOptimizer`), without offload or fp16."""

    def __init__(self, engine, grad_clip: float):
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

        opt = engine.optimizer
        if not isinstance(opt, DeepSpeedZeroOptimizer):
            raise ValueError(f"DeepSpeed optimizer: got {type(opt).__name__}; allowed: DeepSpeedZeroOptimizer "
                             f"(zero_optimization.stage 1 or 2; the joint step drives its internals)")
        if opt.cpu_offload:
            raise ValueError("zero_optimization.offload_optimizer: got a device; allowed: none (the joint step reads "
                             "the reduced gradient partition on the device)")
        if float(opt.loss_scale) != 1.0:
            raise ValueError(f"DeepSpeed loss scale: got {opt.loss_scale}; allowed: 1 (fp32 or bf16, no fp16)")
        if opt.clip_grad != grad_clip:
            raise ValueError(f"DeepSpeed gradient_clipping: got {opt.clip_grad}; allowed: train.grad_clip "
                             f"({grad_clip}), so that both sides apply one coefficient")
        self.engine, self.optimizer, self.grad_clip = engine, opt, grad_clip
        # The norm handed to DeepSpeed: one host tensor, refilled every step (its reads are host reads on any device)
        self.host_norm = torch.zeros((), dtype=torch.float32, device=CPU)

    def state_bytes(self, seen: set) -> dict[str, int]:
        """This rank's dense-side model state in bytes, each storage counted once across the calls sharing `seen`
        (DESIGN s6). Call it between the boundary backward and the step to count the gradient partition."""
        opt = self.optimizer
        params = [p for group in opt.bit16_groups for p in group]
        moments = [v for state in opt.optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
        grads = [g for group in opt.averaged_gradients.values() if group for g in group]   # {group index: [grads]}
        return {"module_copy": storage_bytes(params, seen),
                "fp32_partition": storage_bytes(opt.single_partition_of_fp32_groups, seen),
                "moments": storage_bytes(moments, seen),
                "grad_partition": storage_bytes(grads, seen)}

    def host_tensors(self) -> list[torch.Tensor]:
        """Tensors that stay on the host on every device: the norm handed to DeepSpeed and torch Adam's step
        counters (capturable off)."""
        state = self.optimizer.optimizer.state.values()
        return [self.host_norm] + [s["step"] for s in state if torch.is_tensor(s.get("step"))]

    def backward(self, loss: torch.Tensor, *, boundary: bool) -> None:
        """DeepSpeed's backward; off the boundary also its step bookkeeping (no update happens there)."""
        assert self.engine.is_gradient_accumulation_boundary() == boundary, \
            (self.engine.is_gradient_accumulation_boundary(), boundary)
        self.engine.backward(loss)
        if not boundary:
            self.engine.step()

    def _partition_grads(self) -> list[torch.Tensor]:
        return [g for group in self.optimizer.averaged_gradients.values() for g in (group or ())
                if not getattr(g, "_zero_padding", False)]

    def local_sq_norm(self) -> torch.Tensor:
        """Sum of squared gradients of this rank's partition: float64 0-dim (inf or nan when a gradient is)."""
        grads = self._partition_grads()
        if not grads:
            return torch.zeros((), dtype=torch.float64, device=self.engine.device)
        norms = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads])
        return norms.double().square().sum()

    def local_nonfinite(self) -> torch.Tensor:
        """0 when this rank's partition is finite, inf otherwise (float64 0-dim): finiteness without a norm."""
        grads = self._partition_grads()
        if not grads:
            return torch.zeros((), dtype=torch.float64, device=self.engine.device)
        ok = torch.stack([torch.isfinite(g).all() for g in grads]).all()
        return torch.where(ok, 0.0, float("inf")).double()

    def hold_threshold(self) -> None:
        """DeepSpeed's clip threshold back to train.grad_clip (before and after every step, after every load)."""
        self.optimizer.clip_grad = self.grad_clip

    def step(self, joint_norm: float, skip: bool) -> None:
        """DeepSpeed's boundary step with the joint norm (its clip coefficient becomes the joint one), or its own
        skip path when `skip` (the norm is then not read). Raises if DeepSpeed disagrees about having applied the
        step."""
        opt = self.optimizer
        norm = self.host_norm.fill_(joint_norm)

        def check_overflow(partition_gradients: bool = True) -> None:
            opt.overflow = skip

        saved_check = opt.check_grad_overflow
        opt.scaled_global_norm = lambda norm_type=2: norm
        opt.check_overflow = check_overflow
        opt.check_grad_overflow = True
        self.hold_threshold()
        first_link = not opt._hp_optimizer_states_linked
        try:
            self.engine.step()
        finally:
            del opt.scaled_global_norm, opt.check_overflow   # the class methods again
            opt.check_grad_overflow = saved_check
            self.hold_threshold()
        if first_link and opt._hp_optimizer_states_linked:   # linked after group 0's step only (docstring)
            opt._hp_optimizer_states_linked = False
            opt._lazy_init_hp_params_optimizer_state()
        applied = self.engine.was_step_applied()
        if applied == skip:
            raise RuntimeError(f"DeepSpeed step applied: {applied}, joint step asked to skip: {skip} "
                               f"(deepspeed internals differ from 0.19.8?)")
        if skip and self.engine.lr_scheduler is not None:
            # DeepSpeed holds its schedule on a skipped step; the backbone's LR is a function of the step index, as
            # is the dense side's after an elastic resume (dense_state.restore_dense_state): keep both on one step.
            self.engine.lr_scheduler.step()
