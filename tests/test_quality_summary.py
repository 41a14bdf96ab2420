"""bench/quality_summary.py on run directories laid out as bench_quality leaves them, with PPLs chosen so the best
pair, its interiority, the seed statistics and the orderings are known by hand."""

import json
import math
import re

import pytest

from bench import quality_summary

STEPS = 1500


@pytest.fixture
def tool():
    return quality_summary


def write_run(root, method, seed, b, d, ppl, *, steps=STEPS, finished_step=None, preset=None, r=None):
    """One run directory; ppl None leaves config.json without result.json (a run in flight). Without r the config
    has no method.branch_lr (a run recorded before it existed); with r, method.branch_lr = 3e-3 r."""
    run = root / f"seed{seed}" / method / (f"sweep_b{b:g}_d{d:g}" + ("" if r is None else f"_r{r:g}"))
    run.mkdir(parents=True)
    config = {"model": {"preset": "small_tied"}, "data": {"dir": "data/pydocs4k", "seq_len": 64},
              "method": {"preset": preset or method, "lr": 1e-3 * b},
              "train": {"steps": steps, "lr": 3e-3 * d, "seed": seed, "out_dir": str(run), "warmup_steps": 150}}
    if r is not None:
        config["method"].update(branch_lr=3e-3 * r, branch_weight_decay=None)
    (run / "config.json").write_text(json.dumps(config))
    if ppl is not None:
        step = steps if finished_step is None else finished_step
        (run / "result.json").write_text(json.dumps({"step": step, "final/val_ppl": ppl}))
    return run


def edit_config(run, section, **values):
    """Change `values` in one section of the run's config.json, as a run under other settings would have left it."""
    config = json.loads((run / "config.json").read_text())
    config[section].update(values)
    (run / "config.json").write_text(json.dumps(config))


def bowl(b, d, b0, d0, floor):
    """A PPL surface with its minimum `floor` at (b0, d0) in log-scale."""
    return floor + (math.log2(b / b0)) ** 2 + 0.5 * (math.log2(d / d0)) ** 2


def test_best_pair_interior_seeds_and_orderings(tool, tmp_path, capsys):
    for b in (0.5, 1, 2):
        for d in (1, 2, 4):
            write_run(tmp_path, "a", 0, b, d, bowl(b, d, 1, 2, 20.0))    # optimum inside the grid
            write_run(tmp_path, "c", 0, b, d, bowl(b, d, 4, 2, 30.0))    # optimum beyond b2: on the edge
    write_run(tmp_path, "a", 1, 1, 2, 21.0)
    write_run(tmp_path, "a", 2, 1, 2, 19.5)
    write_run(tmp_path, "a", 1, 2, 4, 99.0)    # another seed off the best pair: not one of the best pair's seeds
    write_run(tmp_path, "c", 1, 2, 2, 20.5)    # below a on seed 1, and c has no seed 2: not every seed
    write_run(tmp_path, "a", 2, 0.5, 1, None)   # in flight

    summary = tool.summarize(tmp_path)
    a, c = summary["methods"]["a"], summary["methods"]["c"]
    assert (a["best"]["b"], a["best"]["d"]) == (1, 2) and a["best_interior"] is True
    assert a["best"]["lr"] == pytest.approx(1e-3) and a["best"]["dense_lr"] == pytest.approx(6e-3)
    assert a["seeds"] == {"0": 20.0, "1": 21.0, "2": 19.5}
    assert (a["mean"], a["min"], a["max"]) == (pytest.approx((20.0 + 21.0 + 19.5) / 3), 19.5, 21.0)
    assert a["missing"] == ["seed2 b0.5 d1"] and a["off_pair"] == ["seed1 b2 d4"] and c["off_pair"] == []
    assert len(a["grid"]) == 9   # seed 0 only
    assert (c["best"]["b"], c["best"]["d"]) == (2, 2) and c["best_interior"] is False
    assert c["seeds"] == {"0": 31.0, "1": 20.5}
    [order] = summary["orderings"]
    assert (order["lower"], order["higher"]) == ("a", "c")
    assert order["ratio"] == pytest.approx(a["mean"] / ((31.0 + 20.5) / 2))
    assert order["every_seed"] is None and order["ranges_apart"] is False and order["seeds"] == [3, 2]

    assert tool.main(["--root", str(tmp_path)]) == 0
    out = capsys.readouterr().out   # means 60.5 / 3 and 51.5 / 2, their ratio 0.783
    assert re.search(r"^a +b1 d2 +yes +3 +20\.167 +19\.500 +21\.000$", out, re.M)
    assert re.search(r"^c +b2 d2 +no \(edge\) +2 +25\.750 +20\.500 +31\.000$", out, re.M)
    assert re.search(r"^a +c +0\.783 +- +no +3/2$", out, re.M)
    assert "unfinished: seed2 b0.5 d1" in out and "not at the best pair (not used): seed1 b2 d4" in out


def test_an_ordering_holds_on_every_seed_when_each_seed_is_ordered_the_same_way(tool, tmp_path):
    """Paired by seed: the seed ranges may overlap (low's seed 1 is above high's seed 0), each seed is ordered."""
    for method, values in (("low", (10.0, 10.6)), ("high", (10.5, 11.0))):
        for seed, ppl in enumerate(values):
            write_run(tmp_path, method, seed, 1, 1, ppl)
    [order] = tool.summarize(tmp_path)["orderings"]
    assert (order["lower"], order["every_seed"], order["seeds"]) == ("low", True, [2, 2])
    assert order["ranges_apart"] is False
    write_run(tmp_path, "low", 2, 1, 1, 10.2)   # a seed that `high` has not run: not paired
    [order] = tool.summarize(tmp_path)["orderings"]
    assert (order["lower"], order["every_seed"], order["seeds"]) == ("low", None, [3, 2])
    write_run(tmp_path, "high", 2, 1, 1, 10.2)   # a tie on seed 2 (means 10.267 and 10.567): not lower on it
    [order] = tool.summarize(tmp_path)["orderings"]
    assert (order["lower"], order["every_seed"]) == ("low", False)


def test_an_ordering_of_the_means_can_be_reversed_on_one_seed(tool, tmp_path):
    for method, values in (("low", (10.0, 12.0)), ("high", (11.0, 11.5))):   # means 11.0 and 11.25
        for seed, ppl in enumerate(values):
            write_run(tmp_path, method, seed, 1, 1, ppl)
    [order] = tool.summarize(tmp_path)["orderings"]
    assert (order["lower"], order["higher"], order["every_seed"]) == ("low", "high", False)
    assert order["ratio"] == pytest.approx(11.0 / 11.25)


def test_interior_needs_points_on_both_sides_of_both_axes(tool):
    grid = [{"b": b, "d": d} for b, d in ((0.5, 2), (1, 2), (2, 2), (1, 1))]
    assert tool.interior({"b": 1, "d": 2}, grid) is False   # nothing above d2 at b1
    assert tool.interior({"b": 1, "d": 2}, grid + [{"b": 1, "d": 4}]) is True
    assert tool.interior({"b": 1, "d": 2}, [{"b": 1, "d": 1}, {"b": 1, "d": 2}, {"b": 1, "d": 4},
                                             {"b": 2, "d": 2}]) is False   # nothing below b1 at d2


def test_an_axis_with_one_value_is_not_swept_and_not_checked(tool):
    """bench_quality --plan runs the dense side at its preset's rate only (d1): a best b inside the b sweep is
    interior, one at the b sweep's edge is not."""
    line = [{"b": b, "d": 1} for b in (0.25, 0.5, 1, 2)]
    assert tool.interior({"b": 0.5, "d": 1}, line) is True
    assert tool.interior({"b": 2, "d": 1}, line) is False
    # The plan's branch sweep beside the coupled point (no r): that point is no value of the r axis.
    branch = [{"b": 1, "d": 1, "r": r} for r in (None, 0.5, 1, 3)]
    assert tool.interior({"b": 1, "d": 1, "r": 1}, branch) is True
    assert tool.interior({"b": 1, "d": 1, "r": 3}, branch) is False


def test_scales_in_directory_names_as_bench_quality_writes_them(tool, tmp_path):
    """f"{scale:g}": 0.25 -> b0.25, 1e-05 -> d1e-05, 1.5 -> d1.5."""
    write_run(tmp_path, "a", 0, 0.25, 1e-05, 7.0)
    write_run(tmp_path, "a", 0, 0.25, 1.5, 8.0)
    write_run(tmp_path, "a", 1, 0.25, 1e-05, 9.0)
    assert (tmp_path / "seed0" / "a" / "sweep_b0.25_d1e-05").is_dir()
    entry = tool.summarize(tmp_path)["methods"]["a"]
    assert [(p["b"], p["d"]) for p in entry["grid"]] == [(0.25, 1e-05), (0.25, 1.5)]
    assert (entry["best"]["b"], entry["best"]["d"]) == (0.25, 1e-05) and entry["seeds"] == {"0": 7.0, "1": 9.0}


def test_an_unfinished_result_is_missing_not_ranked(tool, tmp_path):
    write_run(tmp_path, "a", 0, 1, 1, 5.0, finished_step=700)   # result.json of a run cut short
    write_run(tmp_path, "a", 0, 1, 2, 9.0)
    entry = tool.summarize(tmp_path)["methods"]["a"]
    assert [p["ppl"] for p in entry["grid"]] == [9.0] and entry["missing"] == ["seed0 b1 d1"]


def test_a_diverged_run_is_listed_not_ranked(tool, tmp_path, capsys):
    write_run(tmp_path, "a", 0, 0.5, 1, float("nan"))   # the trainer's json.dumps writes NaN; first in path order
    write_run(tmp_path, "a", 0, 1, 1, 20.0)
    write_run(tmp_path, "a", 1, 1, 1, float("nan"))     # a seed at the best pair that diverged
    write_run(tmp_path, "a", 2, 1, 1, 22.0)
    entry = tool.summarize(tmp_path)["methods"]["a"]
    assert (entry["best"]["b"], entry["best"]["d"]) == (1, 1) and entry["grid"] == [
        {"b": 1, "d": 1, "lr": pytest.approx(1e-3), "dense_lr": pytest.approx(3e-3), "ppl": 20.0}]
    assert entry["seeds"] == {"0": 20.0, "2": 22.0} and entry["mean"] == 21.0
    assert entry["diverged"] == ["seed0 b0.5 d1", "seed1 b1 d1"] and entry["missing"] == []
    assert tool.main(["--root", str(tmp_path)]) == 0
    assert "diverged (non-finite PPL, not ranked): seed0 b0.5 d1, seed1 b1 d1" in capsys.readouterr().out


def test_runs_of_another_protocol_are_refused_by_name(tool, tmp_path, capsys):
    first = write_run(tmp_path, "a", 0, 1, 1, 9.0)
    other = write_run(tmp_path, "b", 0, 1, 1, 8.0, steps=300)
    with pytest.raises(ValueError, match=f"{other}: another protocol than {first} \\(differ: train.steps\\)"):
        tool.summarize(tmp_path)
    assert tool.main(["--root", str(tmp_path)]) == 2
    assert str(other) in capsys.readouterr().err


def test_methods_with_their_own_method_settings_and_seeds_are_one_protocol(tool, tmp_path):
    """Different methods differ in their whole method section (as CHTs24 and STE do), seeds in train.seed and the
    output directory: one comparison, and its protocol is what they share."""
    edit_config(write_run(tmp_path, "a", 0, 1, 1, 9.0), "method", rule="adam", topology={"enabled": True})
    edit_config(write_run(tmp_path, "a", 1, 1, 1, 9.5), "method", rule="adam", topology={"enabled": True})
    edit_config(write_run(tmp_path, "c", 0, 1, 1, 8.0), "method", rule="tans", topology={"enabled": False})
    summary = tool.summarize(tmp_path)
    assert summary["methods"]["a"]["seeds"] == {"0": 9.0, "1": 9.5}
    assert summary["config"]["protocol"] == {"model": {"preset": "small_tied"},
                                             "data": {"dir": "data/pydocs4k", "seq_len": 64},
                                             # a run recorded before train.global_batch_size reads as it at 0,
                                             # one before the optim section as eager (config.ADDED_KEYS)
                                             "train": {"steps": STEPS, "warmup_steps": 150, "global_batch_size": 0},
                                             "optim": {"compile": False}}


def test_a_seed_under_other_method_settings_is_refused(tool, tmp_path):
    first = write_run(tmp_path, "a", 0, 1, 1, 9.0)
    edit_config(first, "method", topology={"update_interval": 100})
    other = write_run(tmp_path, "a", 1, 1, 1, 9.5)
    edit_config(other, "method", topology={"update_interval": 50})
    with pytest.raises(ValueError, match=f"{other}: other method settings than {first} "
                                         "\\(differ: method.topology.update_interval\\)"):
        tool.summarize(tmp_path)


@pytest.mark.parametrize("section, key", [("train", "lr"), ("method", "lr")])
def test_a_seed_at_the_pair_under_other_learning_rates_is_refused(tool, tmp_path, section, key):
    """The pair is named by scale factors; a seed run with another base rate (e.g. --set train.lr=...) has the same
    directory name but is not at the pair."""
    first = write_run(tmp_path, "a", 0, 1, 2, 9.0)
    other = write_run(tmp_path, "a", 1, 1, 2, 9.5)
    edit_config(other, section, **{key: 1e-2})
    with pytest.raises(ValueError, match=f"{other}: other learning rates at b1 d2 than {first} "
                                         f"\\(differ: {section}.{key}\\)"):
        tool.summarize(tmp_path)


def test_an_unfinished_run_of_another_protocol_is_missing_not_refused(tool, tmp_path):
    """A run in flight may be an earlier protocol's leftover that bench_quality will replace."""
    write_run(tmp_path, "a", 0, 1, 1, 9.0)
    write_run(tmp_path, "a", 0, 2, 1, None, steps=300)
    write_run(tmp_path, "a", 0, 4, 1, 8.0, steps=300, finished_step=150)   # cut short, of another budget too
    assert tool.summarize(tmp_path)["methods"]["a"]["missing"] == ["seed0 b2 d1", "seed0 b4 d1"]


@pytest.mark.parametrize("seed, preset, held", [(1, "a", "train.seed 1 and method.preset 'a'"),
                                                (0, "b", "train.seed 0 and method.preset 'b'")])
def test_a_run_whose_config_is_not_its_path_is_refused(tool, tmp_path, seed, preset, held):
    run = write_run(tmp_path, "a", 0, 1, 1, 9.0, preset=preset)
    edit_config(run, "train", seed=seed)
    with pytest.raises(ValueError, match=f"{run}: config.json holds {held}; allowed"):
        tool.summarize(tmp_path)


def test_main_prints_the_tables_and_writes_json(tool, tmp_path, capsys):
    write_run(tmp_path / "r", "a", 0, 1, 1, 9.0)
    write_run(tmp_path / "r", "b", 0, 1, 1, 12.0)
    assert tool.main(["--root", str(tmp_path / "r"), "--json", str(tmp_path / "s.json")]) == 0
    out = capsys.readouterr().out
    assert "a: seed-0 final val PPL" in out and "9.000" in out
    saved = json.loads((tmp_path / "s.json").read_text())
    assert saved["machine"]["cpu"] and saved["methods"]["b"]["mean"] == 12.0
    assert saved["orderings"][0]["ratio"] == pytest.approx(0.75)
    assert tool.main(["--root", str(tmp_path / "empty")]) == 2


def test_ranges_apart_when_the_lower_methods_worst_seed_is_below_the_others_best(tool, tmp_path):
    for method, values in (("low", (10.0, 10.4)), ("high", (10.5, 11.0))):
        for seed, ppl in enumerate(values):
            write_run(tmp_path, method, seed, 1, 1, ppl)
    write_run(tmp_path, "one", 0, 1, 1, 10.45)   # a one-seed baseline between them
    by_pair = {(o["lower"], o["higher"]): o for o in tool.summarize(tmp_path)["orderings"]}
    assert [(k, o["ranges_apart"], o["every_seed"]) for k, o in by_pair.items()] == [
        (("low", "one"), True, None), (("low", "high"), True, True), (("one", "high"), True, None)]


def test_the_branch_rate_is_a_third_axis_with_its_best_point_and_interiority(tool, tmp_path, capsys):
    """PPL bowls over (b, d, r): method "in" has its optimum at b1 d2 r0.5, inside; "edge" at r beyond 2."""
    for b in (0.5, 1, 2):
        for d in (1, 2, 4):
            for r in (0.25, 0.5, 1, 2):
                write_run(tmp_path, "in", 0, b, d, bowl(b, d, 1, 2, 20.0) + math.log2(r / 0.5) ** 2, r=r)
                write_run(tmp_path, "edge", 0, b, d, bowl(b, d, 1, 2, 25.0) + math.log2(r / 8) ** 2, r=r)
    write_run(tmp_path, "in", 1, 1, 2, 21.0, r=0.5)
    write_run(tmp_path, "in", 1, 1, 2, 99.0, r=1)   # another seed off the best point
    summary = tool.summarize(tmp_path)
    inside, edge = summary["methods"]["in"], summary["methods"]["edge"]
    assert len(inside["grid"]) == 36 and inside["grid"][0]["r"] == 0.25
    assert inside["best"] == {"b": 1, "d": 2, "lr": pytest.approx(1e-3), "dense_lr": pytest.approx(6e-3), "r": 0.5,
                              "branch_lr": pytest.approx(1.5e-3)}
    assert inside["best_interior"] is True and inside["seeds"] == {"0": 20.0, "1": 21.0}
    assert inside["off_pair"] == ["seed1 b1 d2 r1"]
    assert (edge["best"]["r"], edge["best_interior"]) == (2, False)   # interior in b and d, on the edge of r
    assert tool.interior({"b": 1, "d": 2, "r": 0.5}, [{"b": 1, "d": 2, "r": 0.25}, {"b": 1, "d": 2, "r": 1},
                                                       {"b": 0.5, "d": 2, "r": 0.5}, {"b": 2, "d": 2, "r": 0.5},
                                                       {"b": 1, "d": 1, "r": 0.5}]) is False   # nothing above d2
    assert tool.main(["--root", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "in: seed-0 final val PPL, rows backbone scale b, columns dense-side scale d, branch scale r0.5" in out
    assert re.search(r"^in +b1 d2 r0\.5 +yes +2 +20\.500 +20\.000 +21\.000$", out, re.M)


def test_runs_without_a_branch_axis_and_with_one_are_points_of_one_method(tool, tmp_path):
    """Runs recorded before method.branch_lr existed (no key, the branch on train.lr) sit beside runs with r."""
    write_run(tmp_path, "m", 0, 1, 1, 30.0)
    write_run(tmp_path, "m", 0, 1, 1, 28.0, r=0.5)
    write_run(tmp_path, "m", 1, 1, 1, 31.0)
    entry = tool.summarize(tmp_path)["methods"]["m"]
    assert [p.get("r") for p in entry["grid"]] == [None, 0.5]
    assert entry["best"]["r"] == 0.5 and entry["seeds"] == {"0": 28.0}
    assert entry["off_pair"] == ["seed1 b1 d1"]


def test_a_seed_at_the_point_under_another_branch_rate_is_refused(tool, tmp_path):
    write_run(tmp_path, "m", 0, 1, 2, 20.0, r=0.5)
    edit_config(write_run(tmp_path, "m", 1, 1, 2, 21.0, r=0.5), "method", branch_lr=9e-3)
    with pytest.raises(ValueError, match=r"other learning rates at b1 d2 r0.5 .*differ: method.branch_lr"):
        tool.summarize(tmp_path)


def test_the_fixed_rate_point_is_the_presets_own_rates_at_seed_0(tool, tmp_path, capsys):
    write_run(tmp_path, "a", 0, 1, 1, 30.0)
    write_run(tmp_path, "a", 0, 2, 1, 25.0)
    write_run(tmp_path, "a", 1, 1, 1, 31.0)     # another seed at b1 d1: not the fixed-rate table's number
    write_run(tmp_path, "c", 0, 1, 1, 45.0)
    write_run(tmp_path, "c", 0, 0.5, 1, 27.0)
    write_run(tmp_path, "e", 0, 1, 2, 26.0)     # no b1 d1 point
    write_run(tmp_path, "f", 0, 1, 1, 28.0, r=1)   # b1 d1 with its own branch rate: not the preset's rates
    methods = tool.summarize(tmp_path)["methods"]
    assert {m: e["fixed_rate_ppl"] for m, e in methods.items()} == {"a": 30.0, "c": 45.0, "e": None, "f": None}
    assert tool.main(["--root", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^a +30\.000 +1\.000$", out, re.M) and re.search(r"^c +45\.000 +1\.500$", out, re.M)
