"""bench/'s harness against hand-worked cases: Figure verdicts (scalar, per case, nested, both senses), settings from
the quick preset and strict key=value overrides, the JSON `finish` writes with the figures table printed last, the
byte counter's deduplication, and the rank pool's results and errors."""

import json
from dataclasses import dataclass

import pytest
import torch

from bench.core import Figure, Settings, finish, paired_cpu_and_wall, parse
from bench.memory import storage_bytes


def test_a_figure_judges_its_value_or_its_worst_case_against_the_target():
    assert Figure("r", 0.5, 0.6).verdict() == "met" and Figure("r", 0.7, 0.6).verdict() == "MISSED"
    assert Figure("r", 0.6, 0.6).verdict() == Figure("r", 0.6, 0.6, ">=").verdict() == "met"   # a target is met at it
    assert Figure("r", 0.7, 0.6, ">=").verdict() == "met" and Figure("r", None, 0.6).verdict() == ""
    # Per-case targets: 0.3 of 0.29 is worse (1.03) than 0.5 of 0.57 (0.88).
    mem = Figure("m", {"1:4": 0.3, "2:4": 0.5}, {"1:4": 0.29, "2:4": 0.57})
    assert mem.worst() == ("1:4", 0.3, 0.29) and mem.verdict() == "MISSED"
    assert mem.row() == ["m (worst: 1:4)", 0.3, "<= 0.29", "MISSED"]
    # Nested cases, a target only for some: the judged ones decide, higher is better.
    nested = Figure("t", {"350m": {"1": 0.8, "8": 0.95}, "1b": {"1": 0.5}}, {"350m": {"1": 0.85, "8": 0.9}}, ">=")
    assert nested.worst() == ("350m/1", 0.8, 0.85) and nested.verdict() == "MISSED"
    assert Figure("c", {"a": 1.0, "b": 2.0}).row() == ["c", "a 1, b 2", "", ""]


@dataclass
class _Settings(Settings):
    model: str = "60m"
    steps: int = 5
    rows: str = "a,b"
    QUICK = {"model": "tiny", "steps": 2}

    def __post_init__(self) -> None:
        self.at_least(steps=1)


def test_settings_take_the_quick_preset_then_the_overrides_and_refuse_bad_keys_and_types(capsys):
    assert parse(_Settings, [], "")[0] == _Settings()
    s, path = parse(_Settings, ["--quick", "steps=3", "--json", "out.json", "rows=8"], "")
    assert (s.quick, s.model, s.steps, s.rows, path) == (True, "tiny", 3, "8", "out.json")   # text taken as given
    for argv, words in ((["stepz=3"], "unknown config key 'stepz'"), (["steps=many"], "steps: got 'many'"),
                        (["steps=0"], "steps: got 0; allowed: >= 1"), (["quick=true"], "allowed: --quick")):
        with pytest.raises(SystemExit):
            parse(_Settings, argv, "")
        assert words in capsys.readouterr().err, argv


def test_finish_writes_the_figures_as_top_level_keys_and_prints_them_last(tmp_path, capsys):
    out = tmp_path / "r.json"
    payload = finish(str(out), [Figure("ratio", 0.5, 0.7)], {"detail": [1, 2]}, {"model": "tiny"},
                     [(["row", "s"], [["a", 1.0]])], "head line")
    assert json.loads(out.read_text()) == payload
    assert list(payload) == ["ratio", "detail", "machine", "config"] and payload["config"] == {"model": "tiny"}
    lines = capsys.readouterr().out.rstrip().splitlines()
    assert lines[1] == "head line" and lines[-1].split() == ["ratio", "0.500", "<=", "0.7", "met"]
    assert "config" not in finish(None, [], {}, None)


def test_paired_rounds_alternate_and_pair_the_same_calls():
    order = []
    r = paired_cpu_and_wall(lambda: order.append("a"), lambda: order.append("b"), warmup=1, repeats=3)
    assert order == ["a", "b", "a", "b", "b", "a", "a", "b"] and len(r["ratios"]) == 3


def test_storage_bytes_count_each_storage_once_across_views_and_calls():
    t = torch.zeros(10)
    seen: set = set()
    assert storage_bytes([t, t[:5], None, torch.empty(3, device="meta")], seen) == 40
    assert storage_bytes([t.view(2, 5)], seen) == 0 and storage_bytes([t]) == 40


def _rank_value(rank, world_size, offset):
    if offset < 0:
        raise ValueError(f"rank {rank} refuses")
    return rank * 10 + world_size + offset


def test_the_rank_pool_returns_every_rank_in_order_and_reports_a_failing_rank(ranks2):
    assert ranks2.run(_rank_value, 1) == [3, 13]
    with pytest.raises(RuntimeError) as failed:
        ranks2.run(_rank_value, -1)
    assert {"ValueError: rank 0 refuses", "ValueError: rank 1 refuses"} <= set(str(failed.value).splitlines())
    assert ranks2.run(_rank_value, 0) == [2, 12]   # the pool survives
