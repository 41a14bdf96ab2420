"""requirements/lock.txt against pyproject.toml (DESIGN decision 20): every requirement of the project and of the
extras scripts/setup.sh installs is pinned exactly, at a version its specifier admits."""

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
LOCKED_EXTRAS = ("dev", "eval")          # what setup.sh installs; `gpu` is added by hand on GPU machines
TORCH = "2.13.0"                          # the release the suite is tested on


def lock_pins() -> dict[str, str]:
    pins = {}
    for number, line in enumerate((ROOT / "requirements" / "lock.txt").read_text().splitlines(), start=1):
        if not line.strip() or line.startswith("#"):
            continue
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([0-9][A-Za-z0-9.!]*)", line)
        assert match, f"lock line {number}: {line!r} is not an exact pin name==version (no local label)"
        name = canonicalize_name(match.group(1))
        assert name not in pins, f"lock line {number}: {name} pinned twice"
        pins[name] = match.group(2)
    return pins


def project_requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    texts = project["dependencies"] + [r for extra in LOCKED_EXTRAS for r in project["optional-dependencies"][extra]]
    return [Requirement(text) for text in texts]


@pytest.mark.parametrize("requirement", project_requirements(), ids=str)
def test_every_pyproject_requirement_is_locked_at_a_version_it_admits(requirement):
    pins = lock_pins()
    name = canonicalize_name(requirement.name)
    assert name in pins, f"{requirement} is not in requirements/lock.txt (rerun scripts/refresh_lock.py)"
    assert requirement.specifier.contains(pins[name], prereleases=True), \
        f"requirements/lock.txt pins {name}=={pins[name]}, which {requirement} does not admit"


def test_the_lock_pins_the_tested_torch():
    assert lock_pins()["torch"] == TORCH
