"""bench/update_readme_results.py on two small fake benchmark files and a fake README: the section is appended
when the markers are missing, replaced in place otherwise, leaves the rest of the README alone, names each
file's machine and prints every figure."""

import json

import pytest
from bench import update_readme_results

CPU = {"cpu": "Fake CPU 9000", "cores": 2, "torch": "2.13.0", "deepspeed": "0.19.8", "gpu": None}
GPU = {"cpu": "Other CPU", "cores": 16, "torch": "2.13.0", "deepspeed": "0.19.8", "gpu": "NVIDIA H200", "cuda": "12.8"}


@pytest.fixture
def tool():
    return update_readme_results


@pytest.fixture
def files(tmp_path):
    bench = tmp_path / "runs" / "bench"
    bench.mkdir(parents=True)
    (bench / "train.json").write_text(json.dumps({
        "tokens_per_s": {"dense_adamw": 1234.4, "chts": 987.0},
        "over_dense_adamw": {"dense_adamw": 1.0, "chts": 0.79951},
        "chts_1of4_tans_over_dense_adamw": 0.79951,
        "phases_s": {"dense_adamw": {"forward": 0.5, "backward": 1.25}, "chts": {"forward": 0.625, "refresh": 0.02}},
        "joules_per_token": {"skipped": "CPU run | no NVML"},
        "machine": CPU, "config": {"model": "60m", "steps": 5}}))
    (bench / "scale.json").write_text(json.dumps({
        "peak_rss_gb_per_rank": [7.5, 7.25],
        "model_state_bytes_per_rank": {"rank0": {"backbone": {"values": 1200000000, "codes": 75000000}}},
        "ratio_nested": {"a": {"b": 0.3}, "c": 2},
        "per_shape": {"60m": {f"shape{i}": i for i in range(15)}},
        "details": {"raw_seconds": 123.0},
        "machine": GPU, "config": {}}))
    (bench / "result.json").write_text(json.dumps({"step": 100, "final/val_ppl": 40.0}))   # a training run's file
    quality = tmp_path / "runs" / "q"
    quality.mkdir()
    (quality / "quality.json").write_text(json.dumps({
        "methods": {"dense_adamw": {"final_ppl": 30.5, "curve": [[100, 50.0]]}, "chts": {"final_ppl": 33.25}},
        "machine": CPU, "config": {}}))
    (quality / "a.json").write_text(json.dumps({"methods": {"other": {"final_ppl": 1.0}}, "machine": CPU,
                                                "config": {}}))   # not a default source
    readme = tmp_path / "README.md"
    readme.write_text("# Project\n\nSome text.\n")
    return tmp_path, readme


def test_missing_markers_are_appended_with_every_figure_and_each_files_machine(tool, files, monkeypatch, capsys):
    root, readme = files
    monkeypatch.chdir(root)
    assert tool.main(["--readme", str(readme)]) == 0   # defaults: runs/bench/*.json, runs/q/quality.json
    text = readme.read_text()

    assert text.startswith("# Project\n\nSome text.\n\n## Results\n\n<!-- results:start -->")
    assert text.endswith("<!-- results:end -->\n")
    assert "result.json: skipped (no top-level 'machine' and 'config'" in capsys.readouterr().err
    assert "final/val_ppl" not in text
    # Files in path order, each under its own machine.
    assert text.index("### scale (`runs/bench/scale.json`)") < text.index("### train (`runs/bench/train.json`)") \
        < text.index("### quality (`runs/q/quality.json`)")
    section = text[text.index("### scale"):text.index("### train")]
    train = text[text.index("### train"):text.index("### quality")]
    assert "Machine: Other CPU (16 cores), GPU NVIDIA H200, torch 2.13.0, deepspeed 0.19.8, CUDA 12.8." in section
    assert "Machine: Fake CPU 9000 (2 cores), GPU none, torch 2.13.0, deepspeed 0.19.8." in train
    # Scalars, grouped objects (one column each), a 2-D table, text cells without table breakers.
    assert "| chts_1of4_tans_over_dense_adamw | 0.7995 |" in train
    assert "|  | tokens_per_s | over_dense_adamw |" in train
    assert "| chts | 987 | 0.7995 |" in train and "| dense_adamw | 1234 | 1 |" in train
    assert "|  | forward | backward | refresh |" in train
    assert "| chts | 0.625 | - | 0.02 |" in train and "| dense_adamw | 0.5 | 1.25 | - |" in train
    assert "| skipped | CPU run / no NVML |" in train
    assert "| peak_rss_gb_per_rank | 7.5, 7.25 |" in section
    assert "| rank0 | 1,200,000,000 | 75,000,000 |" in section
    assert "| ratio_nested.a.b | 0.3 |" in section and "| ratio_nested.c | 2 |" in section
    assert "per_shape: 1 rows x 15 columns, in the JSON file." in section and "shape14" not in section
    assert "raw_seconds" not in section
    # The quality table from runs/q/quality.json (curves left out); other files under runs/q are not defaults.
    quality = text[text.index("### quality (`runs/q/quality.json`)"):]
    assert "| chts | 33.25 |" in quality and "| dense_adamw | 30.5 |" in quality and "100" not in quality
    assert "### a (" not in text and "other" not in text


def test_a_second_run_replaces_the_section_in_place_and_keeps_the_text_around_it(tool, files, monkeypatch):
    root, readme = files
    monkeypatch.chdir(root)
    assert tool.main(["--readme", str(readme)]) == 0
    first = readme.read_text()
    readme.write_text(first + "\n## License\n\nMIT\n")
    assert tool.main(["--readme", str(readme)]) == 0
    assert readme.read_text() == first + "\n## License\n\nMIT\n"

    # Explicit paths: only that file's figures remain in the section; the License text stays after it.
    assert tool.main(["--readme", str(readme), "runs/bench/train.json"]) == 0
    text = readme.read_text()
    assert "### train" in text and "### scale" not in text and "from 1 benchmark file(s)" in text
    assert text.count("<!-- results:start -->") == 1 and text.endswith("<!-- results:end -->\n\n## License\n\nMIT\n")


def test_a_readme_with_only_the_end_marker_is_refused_unchanged(tool, files, monkeypatch, capsys):
    root, readme = files
    monkeypatch.chdir(root)
    readme.write_text("# Project\n<!-- results:end -->\n")
    assert tool.main(["--readme", str(readme)]) == 2
    assert "found only <!-- results:end -->" in capsys.readouterr().err
    assert readme.read_text() == "# Project\n<!-- results:end -->\n"
