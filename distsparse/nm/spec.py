"""What an N:M sparsity is: N kept of M = 4, and the layout (row-wise groups or transposable 4x4 blocks)."""

from __future__ import annotations

from dataclasses import dataclass

LAYOUTS = ("row", "block")
ALLOWED_SPARSITIES = ("1:4", "2:4", "3:4")


@dataclass(frozen=True)
class NMSpec:
    n: int
    m: int = 4
    layout: str = "row"

    def __post_init__(self) -> None:
        if self.m != 4:
            raise ValueError(f"sparsity M: got {self.m}; allowed: 4 (N:4 patterns only)")
        if not isinstance(self.n, int) or not 1 <= self.n < self.m:
            raise ValueError(f"sparsity N: got {self.n!r} for M={self.m}; allowed: 1, 2, 3 (N < M)")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout: got {self.layout!r}; allowed: {', '.join(LAYOUTS)}")

    @classmethod
    def parse(cls, sparsity: str, layout: str = "row") -> "NMSpec":
        """`'1:4'` -> NMSpec(1, 4, layout)."""
        parts = str(sparsity).split(":")
        if len(parts) != 2 or not all(p.isdigit() for p in parts):
            raise ValueError(f"sparsity: got {sparsity!r}; allowed: {', '.join(ALLOWED_SPARSITIES)}")
        n, m = int(parts[0]), int(parts[1])
        if f"{n}:{m}" not in ALLOWED_SPARSITIES:
            raise ValueError(f"sparsity: got {sparsity!r}; allowed: {', '.join(ALLOWED_SPARSITIES)}")
        return cls(n, m, layout)

    @property
    def density(self) -> float:
        return self.n / self.m

    def __str__(self) -> str:
        return f"{self.n}:{self.m}-{self.layout}"

    def check_shape(self, out_features: int, in_features: int, name: str = "weight") -> None:
        """Raise if [out, in] cannot hold this pattern: row-wise needs in % 4 == 0, block-wise both."""
        if in_features % self.m:
            raise ValueError(
                f"{name}: in_features={in_features} is not divisible by {self.m}; "
                f"{self} sparsity needs the reduction width to be a multiple of {self.m}")
        if self.layout == "block" and out_features % self.m:
            raise ValueError(
                f"{name}: out_features={out_features} is not divisible by {self.m}; "
                f"block-wise {self.n}:{self.m} needs both widths to be multiples of {self.m}")

    def kept_per_row(self, in_features: int) -> int:
        return in_features * self.n // self.m
