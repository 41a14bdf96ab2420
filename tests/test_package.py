"""distsparse as a user installs it (issue 26 item 3): the wheel built from pyproject.toml, installed outside the
checkout, holds the configs as package data, the console scripts, no top-level `launch`, and its `distsparse-train`
trains the tiny model from another working directory with the shipped configs found by name."""

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from distsparse.config import shipped_or_given
from synthetic_data import make_data_dir

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = {"distsparse-train", "distsparse-slurm", "distsparse-prepare", "distsparse-export", "distsparse-eval"}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(wheel, install folder): the wheel built without network (this venv's setuptools) and installed with
    `pip install --target`, so that the checkout is nowhere on the path of what runs from it."""
    tmp = tmp_path_factory.mktemp("pkg")
    source = tmp / "source"   # a copy: setuptools writes build/ and *.egg-info beside the sources it builds
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source)
    for name in ("distsparse", "data_prep", "launch", "tools"):   # all a build could pick up
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp / "dist"), str(source)], check=True, capture_output=True, text=True)
    wheel = next((tmp / "dist").glob("distsparse-*.whl"))
    target = tmp / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, text=True)
    return wheel, target


def _env(target: Path) -> dict:
    return {**os.environ, "PYTHONPATH": str(target), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}


def test_the_wheel_holds_every_config_and_the_console_scripts_and_no_launch_package(installed):
    wheel, _ = installed
    names = zipfile.ZipFile(wheel).namelist()
    shipped = {p.relative_to(ROOT / "distsparse").as_posix() for p in (ROOT / "distsparse/configs").rglob("*")
               if p.is_file()}
    assert shipped and {f"distsparse/{n}" for n in shipped} <= set(names), "configs missing from the wheel"
    assert not [n for n in names if n.split("/")[0] in ("launch", "tools", "tests")], names
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert SCRIPTS <= {line.split("=")[0].strip() for line in text.splitlines() if "=" in line}, text


def test_the_installed_console_script_trains_from_outside_the_checkout(installed, tmp_path):
    _, target = installed
    where = subprocess.run([sys.executable, "-c", "import distsparse; print(distsparse.__file__)"], cwd=tmp_path,
                           env=_env(target), check=True, capture_output=True, text=True).stdout.strip()
    assert Path(where).is_relative_to(target), f"distsparse imported from {where}, not from the installed wheel"
    data = make_data_dir(tmp_path / "data")
    run = tmp_path / "run"
    # The README's relative config paths, given from a folder that has no configs/: found in the package.
    proc = subprocess.run([str(target / "bin" / "distsparse-train"), "--config", "configs/experiments/quickstart.yaml",
                           "--ds_config", "configs/ds/zero2.json", "model.preset=tiny", "method.preset=chtsnm_1of4_row",
                           f"data.dir={data}", "data.seq_len=32", "train.steps=3", "train.micro_batch=2",
                           "train.eval_interval=3", "train.eval_samples=8", "train.log_interval=1",
                           f"train.out_dir={run}"],
                          cwd=tmp_path, env=_env(target), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((run / "result.json").read_text())
    assert result["step"] == 3 and result["final/val_loss"] > 0, result


def test_shipped_configs_are_found_by_name_or_documented_path_and_other_missing_paths_are_refused(tmp_path,
                                                                                                monkeypatch):
    monkeypatch.chdir(tmp_path)   # no configs/ here
    zero2 = ROOT / "distsparse/configs/ds/zero2.json"
    for given in ("zero2", "zero2.json", "configs/ds/zero2.json"):
        assert shipped_or_given(given, "ds", ".json", "--ds_config").resolve() == zero2.resolve(), given
    mine = tmp_path / "mine.json"
    mine.write_text("{}")
    assert shipped_or_given(str(mine), "ds", ".json", "--ds_config") == mine
    for missing in ("elsewhere/zero2.json", "zero9"):
        with pytest.raises(ValueError, match=r"--ds_config: got '.*'; the file does not exist; allowed: .*zero1, zero2"):
            shipped_or_given(missing, "ds", ".json", "--ds_config")
