"""When learned permutations harden and how much their penalty weighs (ShuffleSparse s3.2, App. E; DESIGN s5).

The loss gains lambda_t * sum of the soft blocks' l1 - l2 penalties, lambda_t ramped linearly to lambda_max over
T_perm; every `check_interval` steps a block whose per-row penalty is below delta hardens by Hungarian matching,
and all remaining blocks harden at T_perm. Every rank holds the same theta (DeepSpeed keeps dense parameters
in sync) and the matching is deterministic, so ranks harden the same blocks without communication.
"""

from __future__ import annotations

import torch

from distsparse.config import PermutationConfig
from distsparse.layers.permutation import BlockPermutation
from distsparse.layers.permutation_math import perm_lambda
from distsparse.models.build import PERMUTATION_GROUPS


class PermutationPolicy:
    def __init__(self, cfg: PermutationConfig, model: torch.nn.Module, total_steps: int):
        self.cfg = cfg
        seen: dict[int, tuple[str, BlockPermutation]] = {}
        for name, module in model.named_modules():
            if isinstance(module, BlockPermutation) and module.mode == "learned":
                seen.setdefault(id(module), (name, module))
        self.perms = sorted(seen.values(), key=lambda item: item[0])
        self.t_perm = max(1, int(cfg.t_perm_fraction * total_steps))

    @property
    def active(self) -> bool:
        return bool(self.perms)

    def penalty(self, step: int) -> torch.Tensor | None:
        """lambda_t * sum of penalties of the soft blocks, or None when nothing is soft or lambda_t is 0."""
        lam = perm_lambda(step, self.cfg.lambda_max, self.t_perm)
        soft = [p for _, p in self.perms if not p.all_hard()]
        if lam == 0 or not soft:
            return None
        return lam * torch.stack([p.penalty() for p in soft]).sum()

    @torch.no_grad()
    def after_step(self, step: int) -> dict[str, float]:
        """Harden what is ready (everything at T_perm); metrics per permutation group."""
        for _, perm in self.perms:
            if perm.all_hard():
                continue
            if step >= self.t_perm:
                perm.harden_all()
            elif step % self.cfg.check_interval == 0:
                perm.harden(perm.harden_ready(self.cfg.delta))
        if not self.perms or step % self.cfg.check_interval and step != self.t_perm:
            return {}
        sums: dict[str, list[float]] = {}
        for name, perm in self.perms:
            group = PERMUTATION_GROUPS[name.rsplit(".", 2)[-2]]
            m = perm.metrics()
            for key in ("penalty", "fraction_hardened", "distance_from_identity"):
                sums.setdefault(f"permutation/{group}/{key}", []).append(m[key])
        return {key: sum(v) / len(v) for key, v in sums.items()}
