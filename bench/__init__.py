"""The project's benchmarks (DESIGN s6): one harness, one module per measurement.

    python -m bench.<name> [--quick] [key=value ...] [--json PATH]

Core modules: `core` (settings with quick/full presets, `Figure`, paired timing, the report), `ranks` (the one way to
start ranks, which the test suite's rank pool uses too), `memory` (byte counts and peak RSS), `synthetic` (the data
writer) and `trainers` (the real Trainer from overrides). Every other module measures one thing; what each measures
and how is in docs/benchmarks.md.
"""
