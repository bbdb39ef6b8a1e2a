"""The pinned test environment: CI runs the README's own test command, and .ci/constraints.txt pins every
dependency pyproject.toml names, within its bounds, so a fresh clone installs what the suite was tested on."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]


def _readme_test_command() -> str:
    commands = [line.strip() for line in (ROOT / "README.md").read_text().splitlines()
                if line.strip().startswith("python -m pip install") and "pytest" in line]
    assert len(commands) == 1, commands
    return commands[0]


def _pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / ".ci" / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version
    return pins


def _requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    return [Requirement(spec) for spec in [*project["dependencies"], *extras["test"], *extras["demo"]]]


def test_ci_installs_as_the_readme_does_and_runs_the_full_suite():
    """The README's command installs from the constraints and runs the quick tier; CI installs the same way and
    runs every test."""
    install, tests = (part.strip() for part in _readme_test_command().split("&&"))
    assert "-c .ci/constraints.txt" in install
    assert tests.startswith("python -m pytest") and '-m "not slow"' in tests
    run = (ROOT / ".ci" / "run").read_text()
    assert f"timed install {install}\n" in run
    assert "timed \"full suite\" python -m pytest -n 2\n" in run


def test_every_dependency_pinned_within_its_bounds():
    pins = _pins()
    torch_wheel = re.search(r'"torch==([\d.]+)"', _readme_test_command()).group(1)
    for requirement in _requirements():
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue
        name = canonicalize_name(requirement.name)
        version = torch_wheel if name == "torch" else pins.get(name)
        assert version is not None, f"{name} is not pinned in .ci/constraints.txt"
        assert requirement.specifier.contains(version, prereleases=True), (name, version, str(requirement.specifier))
        assert requirement.specifier and "<" in str(requirement.specifier), f"{name} has no upper bound"
