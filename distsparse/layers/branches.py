"""Auxiliary residual branches around a sparse projection (CHTsNM paper s3.3, s4.4, App. D.5; DESIGN s5).

Shape legend: T tokens (any leading dims), I in_features, O out_features, R rank, H controller hidden width.

One interface for every kind: `forward(x [T, I], y_sparse [T, O]) -> y [T, O]` returns the layer output given the
layer input and the sparse backbone's output; `aux_loss()` returns the extra loss term of the last forward, or None.
The paper's family (s4.4) is  y = p(x) * y_s + 1_delta * (alpha / r) (q(x) * x A^T) B^T:

    none       y = y_s
    add        y = y_s + (alpha/r) (x A^T) B^T                                       LoRA
    add_align  add, plus aux loss lambda * mean_t(1 - cos(y_s, delta))               RECONSTRUCTION (below)
    prod_gate  y = (1 + gamma tanh(G_out(x))) * y_s                                  RECONSTRUCTION (below)
    como       y = y_s + (alpha/r) (m(x) * x A^T) B^T,  m(x) = 1 + gamma tanh(G(x))  CoMoLoRA, App. D.5

G(x) = W2 SiLU(W1 x + b1) + b2 with W2 and b2 zero-initialized, so m(x) = 1 and p(x) = 1 at initialization and
CoMoLoRA starts exactly as LoRA (App. D.5). alpha defaults to r (scale 1: App. D.5 has no factor).

LoRA init: the seed gives none beyond "starts exactly as standard LoRA", so A takes nn.Linear's default
(kaiming_uniform, a = sqrt(5)) and B = 0, as standard LoRA and the sparse-plus-low-rank pre-training code SLTrain
(`splora/splora_linear.py`) do: every branch adds nothing at step 0.

App. K (the exact Add+Align and Prod-Gate formulas) is not in our text:
- add_align follows research/cht_topology.md s8 (CHTsL's alignment loss, whose formula was not found either):
  L_align = lambda * mean over tokens of (1 - cos(y_s, delta)), gradients reaching both the branch and the
  backbone. Where the branch output is exactly zero (B = 0 at step 0) the cosine is undefined; it is taken as 0
  with no gradient there, instead of an eps-regularized cosine whose gradient would be |y_s| / eps.
- prod_gate is the product-only member of the s4.4 family: p(x) = 1 + gamma tanh(G_out(x)) with G_out an MLP to
  O outputs, zero-initialized last layer (DESIGN s5).

Budget (DESIGN s5, decision 19): a percentage of the whole dense model's parameter count at reference vocab 32000.
The budget buys the size knob `rank`: the rank of A and B for add / add_align / como, and G_out's hidden width for
prod_gate (its only size, so for prod_gate `rank` is that width and `hidden` is unused). What the budget counts:
- `all` (default): every trainable parameter of the branch, CoMoLoRA's controller included, so a budget means the
  same parameter count for every kind (up to one rank step).
- `low_rank`: A and B only, the controller on top: the paper's rank convention (App. H.5 lists "budget 1%, rank 7,
  hidden 2"; LLaMA-60M at 1% gives r = 7 this way, 1.066% with the controller, and r = 6 with `all`).
  prod_gate has nothing outside its gate, so both rules count the whole gate.
tests/test_branches.py has the arithmetic.

Branch parameters are dense and train on the DeepSpeed side with AdamW (DESIGN decision 10). Plain LoRA folds into
the weight for export; como and prod_gate are input-dependent and do not (DESIGN decision 13).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

BRANCH_KINDS = ("none", "add", "add_align", "prod_gate", "como")
BUDGET_COUNTS = ("all", "low_rank")
FOLDABLE_KINDS = ("none", "add", "add_align")
ALIGN_WEIGHT = 0.1   # lambda of add_align; research/cht_topology.md s8 gives no value ("tune lambda")


def _check_kind(kind: str) -> None:
    if kind not in BRANCH_KINDS:
        raise ValueError(f"branch kind: got {kind!r}; allowed: {', '.join(BRANCH_KINDS)}")


def _check_size(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"branch {name}: got {value!r}; allowed: an integer >= 1")


def _linear_default_init(weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    """nn.Linear's default init (kaiming_uniform with a = sqrt(5), bias U(-1/sqrt(fan_in), 1/sqrt(fan_in)))."""
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    if bias is not None:
        bound = 1.0 / math.sqrt(weight.shape[1])
        nn.init.uniform_(bias, -bound, bound)


class GateMLP(nn.Module):
    """G(x) = W2 SiLU(W1 x + b1) + b2: [T, I] -> [T, P], with W2 and b2 zero-initialized (G = 0 at init).

    Raw parameters rather than nn.Linear children, so that materializing from the meta device by calling every
    module's `reset_parameters` cannot re-randomize the zero last layer after this module zeroed it.
    """

    def __init__(self, in_features: int, hidden: int, out_features: int,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.w1 = nn.Parameter(torch.empty(hidden, in_features, **kw))     # [H, I]
        self.b1 = nn.Parameter(torch.empty(hidden, **kw))                  # [H]
        self.w2 = nn.Parameter(torch.empty(out_features, hidden, **kw))    # [P, H]
        self.b2 = nn.Parameter(torch.empty(out_features, **kw))            # [P]
        if self.w1.device.type != "meta":
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        _linear_default_init(self.w1, self.b1)
        self.w2.zero_()
        self.b2.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.silu(F.linear(x, self.w1, self.b1)), self.w2, self.b2)


class NoBranch(nn.Module):
    """kind `none`: y = y_s. Lets the model hold a branch slot uniformly."""

    def forward(self, x: torch.Tensor, y_sparse: torch.Tensor) -> torch.Tensor:
        return y_sparse

    def aux_loss(self) -> torch.Tensor | None:
        return None


class LoRABranch(nn.Module):
    """kind `add`: y = y_s + (alpha/r) (x A^T) B^T, A [R, I], B [O, R]."""

    def __init__(self, in_features: int, out_features: int, rank: int, alpha: float | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        _check_size("rank", rank)
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        self.alpha = float(rank if alpha is None else alpha)
        self.scaling = self.alpha / rank
        self.lora_A = nn.Parameter(torch.empty(rank, in_features, device=device, dtype=dtype))    # [R, I]
        self.lora_B = nn.Parameter(torch.empty(out_features, rank, device=device, dtype=dtype))   # [O, R]
        if self.lora_A.device.type != "meta":
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        _linear_default_init(self.lora_A)
        self.lora_B.zero_()

    def rank_features(self, x: torch.Tensor) -> torch.Tensor:
        """z = x A^T [T, R], the rank-space coefficients."""
        return F.linear(x, self.lora_A)

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """The additive residual [T, O]. The scale is applied in rank space, where it costs R, not O, per token."""
        return F.linear(self.rank_features(x) * self.scaling, self.lora_B)

    def forward(self, x: torch.Tensor, y_sparse: torch.Tensor) -> torch.Tensor:
        return y_sparse + self.delta(x)

    def aux_loss(self) -> torch.Tensor | None:
        return None

    def delta_weight(self) -> torch.Tensor:
        """(alpha/r) B A [O, I]: what folds into the backbone weight on export (x W^T + delta == x (W + BA)^T)."""
        return (self.lora_B @ self.lora_A) * self.scaling

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}, alpha={self.alpha}"


def _cosine_per_token(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """cos(a_t, b_t) over the last dim, in fp32; 0 (with no gradient) where either vector is exactly zero."""
    a, b = a.float(), b.float()
    dot = (a * b).sum(-1)
    norms = torch.linalg.vector_norm(a, dim=-1) * torch.linalg.vector_norm(b, dim=-1)
    defined = norms > 0
    return torch.where(defined, dot / torch.where(defined, norms, torch.ones_like(norms)), torch.zeros_like(dot))


class AddAlignBranch(LoRABranch):
    """kind `add_align`: LoRA plus lambda * mean_t(1 - cos(y_s, delta)) as aux loss.

    RECONSTRUCTION of CHTsL's alignment term (research/cht_topology.md s8; the paper's App. K is not in our text).
    The loss of the last forward is kept for the trainer to add; under activation checkpointing use the
    non-reentrant variant, since a re-entrant first forward runs without autograd.
    """

    def __init__(self, in_features: int, out_features: int, rank: int, alpha: float | None = None,
                 align_weight: float = ALIGN_WEIGHT,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__(in_features, out_features, rank, alpha, device, dtype)
        if align_weight < 0:
            raise ValueError(f"branch align_weight: got {align_weight!r}; allowed: a number >= 0")
        self.align_weight = float(align_weight)
        self._aux: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, y_sparse: torch.Tensor) -> torch.Tensor:
        delta = self.delta(x)
        self._aux = self.align_weight * (1.0 - _cosine_per_token(y_sparse, delta)).mean()
        return y_sparse + delta

    def aux_loss(self) -> torch.Tensor | None:
        return self._aux


class ProdGateBranch(nn.Module):
    """kind `prod_gate`: y = p(x) * y_s, p(x) = 1 + gamma tanh(G_out(x)), G_out: [T, I] -> H -> [T, O].

    RECONSTRUCTION (App. K is not in our text): the product-only member of the s4.4 family, DESIGN s5.
    """

    def __init__(self, in_features: int, out_features: int, hidden: int, gamma: float,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        _check_size("prod_gate hidden width", hidden)
        self.gamma = float(gamma)
        self.gate = GateMLP(in_features, hidden, out_features, device, dtype)

    def modulation(self, x: torch.Tensor) -> torch.Tensor:
        """p(x) [T, O]."""
        return 1.0 + self.gamma * torch.tanh(self.gate(x))

    def forward(self, x: torch.Tensor, y_sparse: torch.Tensor) -> torch.Tensor:
        return self.modulation(x) * y_sparse

    def aux_loss(self) -> torch.Tensor | None:
        return None


class CoMoLoRABranch(LoRABranch):
    """kind `como`: y = y_s + (alpha/r) (m(x) * x A^T) B^T, m(x) = 1 + gamma tanh(W2 SiLU(W1 x + b1) + b2) [T, R].

    The gate reads the layer input x, not z (App. D.5), and modulates rank space, not output channels (App. D.6).
    """

    def __init__(self, in_features: int, out_features: int, rank: int, hidden: int, gamma: float,
                 alpha: float | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__(in_features, out_features, rank, alpha, device, dtype)
        _check_size("hidden", hidden)
        self.gamma = float(gamma)
        self.gate = GateMLP(in_features, hidden, rank, device, dtype)

    def modulation(self, x: torch.Tensor) -> torch.Tensor:
        """m(x) [T, R]."""
        return 1.0 + self.gamma * torch.tanh(self.gate(x))

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.modulation(x) * self.rank_features(x) * self.scaling, self.lora_B)


Branch = NoBranch | LoRABranch | ProdGateBranch


def build_branch(kind: str, in_features: int, out_features: int, *, rank: int, hidden: int, gamma: float,
                 alpha: float | None = None, align_weight: float = ALIGN_WEIGHT,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> nn.Module:
    """The branch of `kind` for one projection. `rank` is the budget-sized width (prod_gate: G_out's hidden width);
    `hidden` and `gamma` are CoMoLoRA's controller width and strength (gamma is also prod_gate's strength)."""
    _check_kind(kind)
    if kind == "none":
        return NoBranch()
    if kind == "add":
        return LoRABranch(in_features, out_features, rank, alpha, device, dtype)
    if kind == "add_align":
        return AddAlignBranch(in_features, out_features, rank, alpha, align_weight, device, dtype)
    if kind == "prod_gate":
        return ProdGateBranch(in_features, out_features, rank, gamma, device, dtype)
    return CoMoLoRABranch(in_features, out_features, rank, hidden, gamma, alpha, device, dtype)


def _gate_params(in_features: int, hidden: int, out_features: int) -> int:
    return hidden * (in_features + 1) + out_features * (hidden + 1)


def branch_params(kind: str, in_features: int, out_features: int, rank: int, hidden: int) -> int:
    """Parameter count of `build_branch(kind, in_features, out_features, rank=rank, hidden=hidden, ...)`."""
    _check_kind(kind)
    if kind == "none":
        return 0
    if kind == "prod_gate":
        return _gate_params(in_features, rank, out_features)
    lora = rank * (in_features + out_features)
    return lora + _gate_params(in_features, hidden, rank) if kind == "como" else lora


def budgeted_params(kind: str, in_features: int, out_features: int, rank: int, hidden: int, counts: str) -> int:
    """The parameters of one branch that its budget pays for (module docstring): all of them, or A and B only."""
    if counts not in BUDGET_COUNTS:
        raise ValueError(f"branch budget_counts: got {counts!r}; allowed: {', '.join(BUDGET_COUNTS)}")
    if counts == "all" or kind == "prod_gate":
        return branch_params(kind, in_features, out_features, rank, hidden)
    return rank * (in_features + out_features)


def rank_for_budget(kind: str, budget_percent: float, dense_model_params: int,
                    projection_shapes: list[tuple[int, int]], hidden: int, counts: str = "all") -> int:
    """Largest `rank` whose budgeted branch parameters (`counts`: all | low_rank), summed over every sparse
    projection (in, out), stay within budget_percent of the whole dense model's parameter count (reference vocab
    32000). 0 for kind `none`. Both counts are affine in the rank, so the rank is solved for, not searched."""
    _check_kind(kind)
    if kind == "none":
        return 0
    if not budget_percent > 0:
        raise ValueError(f"branch budget_percent: got {budget_percent!r}; allowed: a number > 0")
    budget = budget_percent / 100.0 * dense_model_params
    fixed = sum(budgeted_params(kind, i, o, 0, hidden, counts) for i, o in projection_shapes)
    slope = sum(budgeted_params(kind, i, o, 1, hidden, counts) for i, o in projection_shapes) - fixed
    rank = int((budget - fixed) // slope)
    if rank < 1:
        raise ValueError(
            f"branch budget_percent: got {budget_percent!r} ({budget:.0f} of {dense_model_params} parameters); "
            f"a rank-1 {kind} branch needs {fixed + slope} ({counts} counted), i.e. "
            f"{100.0 * (fixed + slope) / dense_model_params:.4f}%")
    return rank


def foldable(kind: str) -> bool:
    """True when the trained branch folds into the backbone weight (plain LoRA; the alignment is training-only)."""
    _check_kind(kind)
    return kind in FOLDABLE_KINDS


def mean_aux_loss(model: nn.Module) -> torch.Tensor | None:
    """Mean of the aux losses the branches in `model` kept from their last forward, or None if none has one.

    A mean, not a sum, so lambda means the same at every depth."""
    losses = [loss for m in model.modules() if isinstance(m, Branch) and (loss := m.aux_loss()) is not None]
    return torch.stack(losses).mean() if losses else None
