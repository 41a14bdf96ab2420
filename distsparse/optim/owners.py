"""Who owns which backbone matrix: greedy LPT on per-rule cost, identical on every rank (DESIGN decision 2, 10)."""

from __future__ import annotations

from distsparse.optim.newton_schulz import ns_flops
from distsparse.optim.rules import get_rule

ELEMENTWISE_COST = 50   # about 50 flops per value for Adam-like rules (DESIGN decision 10)


def matrix_cost(rule: str, shape: tuple[int, int], numel: int, ns_steps: int = 5) -> float:
    """NS FLOPs for rules that declare Newton-Schulz, ~50 x numel for element-wise ones."""
    if get_rule(rule).newton_schulz:
        return float(ns_flops(shape[0], shape[1], ns_steps)) + ELEMENTWISE_COST * numel
    return float(ELEMENTWISE_COST * numel)


def assign_owners(costs: dict[str, float], world_size: int) -> dict[str, int]:
    """Greedy LPT: heaviest first (ties by name), each to the least-loaded rank (ties by rank id).

    Depends only on the sorted names and costs, so every rank derives the same map without communication.
    """
    load = [0.0] * world_size
    owners = {}
    for name in sorted(costs, key=lambda n: (-costs[n], n)):
        r = min(range(world_size), key=lambda i: (load[i], i))
        owners[name] = r
        load[r] += costs[name]
    return owners


def rank_loads(costs: dict[str, float], owners: dict[str, int], world_size: int) -> list[float]:
    load = [0.0] * world_size
    for name, r in owners.items():
        load[r] += costs[name]
    return load
