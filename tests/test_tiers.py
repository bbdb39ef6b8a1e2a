"""The quick tier keeps covering the product: every rule, op and integration, and the demo.

The README's Quickstart runs the quick tier (``pytest -m "not slow"``) and CI the whole suite. A test marked
``slow`` leaves the quick tier, so marking the last quick test of a module slow would let a newcomer's run pass
without ever touching that module. This check fails then: each module of ``fxpass`` and ``lowerings`` that has a
test module mirroring it (``fxpass/rules/cce.py`` ↔ ``tests/fxpass/rules/test_cce.py``) keeps at least one quick
CPU test there, and so do the modules that must have one: every rule, every module that defines a ``memopt::`` op,
every integration and the demo (``examples/train_gpt.py``).
"""

from __future__ import annotations

import ast
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("fxpass", "lowerings")
DEMO = ROOT / "examples" / "train_gpt.py"


def quick_marker_expression() -> str:
    """The ``-m`` expression of the README's quick test command."""
    commands = [line.strip() for line in (ROOT / "README.md").read_text().splitlines()
                if line.strip().startswith("python -m pip install") and "pytest" in line]
    assert len(commands) == 1, commands
    words = shlex.split(commands[0].split("&&")[-1])
    assert words[:3] == ["python", "-m", "pytest"] and "-m" in words[3:], commands[0]
    return words[words.index("-m", 3) + 1]


def mirror(source: Path) -> Path:
    """The test module that mirrors a source module: ``a/b/c.py`` → ``tests/a/b/test_c.py``."""
    relative = source.relative_to(ROOT)
    return ROOT / "tests" / relative.parent / f"test_{relative.name}"


def defines_ops(source: Path) -> bool:
    """Whether the module defines a ``memopt::`` op (``@device_op(...)`` or ``@reference_op(...)``)."""
    tree = ast.parse(source.read_text())
    return any(
        isinstance(decorator, ast.Call) and getattr(decorator.func, "id", None) in {"device_op", "reference_op"}
        for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) for decorator in node.decorator_list
    )


def required_sources() -> list[Path]:
    """The modules the quick tier must cover whether or not their mirror exists yet."""
    rules = [p for p in (ROOT / "fxpass" / "rules").glob("*.py") if p.stem not in {"__init__", "base"}]
    ops = [p for p in (ROOT / "lowerings").rglob("*.py") if defines_ops(p)]
    integrations = [p for p in (ROOT / "fxpass" / "integrations").glob("*.py") if p.stem != "__init__"]
    return sorted({*rules, *ops, *integrations, DEMO})


def mirrored_sources() -> list[Path]:
    """Every module of the packages whose test module exists."""
    sources = [p for package in PACKAGES for p in (ROOT / package).rglob("*.py") if not p.stem.startswith("_")]
    return sorted(p for p in sources if mirror(p).exists())


def collect(marker_expression: str) -> set[str]:
    """The test files of the ids pytest collects for a marker expression (GPU tests left out: they skip on
    CPU)."""
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
               "-m", f"({marker_expression}) and not gpu", "tests"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {line.split("::")[0] for line in done.stdout.splitlines() if "::" in line}


def uncovered(sources: list[Path], collected_files: set[str]) -> list[str]:
    """The sources whose mirror has no collected test."""
    return [str(s.relative_to(ROOT)) for s in sources
            if str(mirror(s).relative_to(ROOT)) not in collected_files]


def test_required_modules_have_test_modules():
    missing = [str(s.relative_to(ROOT)) for s in required_sources() if not mirror(s).exists()]
    assert not missing, f"no test module mirrors: {missing}"
    names = {p.stem for p in required_sources()}
    assert {"cce", "attention", "wta_crs", "embedding", "op", "with_logits", "rowwise", "transformers",
            "train_gpt"} <= names, names


def test_the_readme_runs_a_quick_tier():
    assert quick_marker_expression() == "not slow"


@pytest.mark.slow
def test_quick_tier_covers_every_rule_op_integration_and_the_demo():
    quick = collect(quick_marker_expression())
    assert not uncovered(required_sources(), quick), "the quick tier runs no test of these (un-mark one as slow)"
    assert not uncovered(mirrored_sources(), quick), "the quick tier runs no test of these (un-mark one as slow)"


def test_uncovered_names_a_module_whose_tests_are_all_left_out():
    sources = [ROOT / "fxpass" / "rules" / "cce.py", DEMO]
    assert uncovered(sources, {"tests/fxpass/rules/test_cce.py"}) == ["examples/train_gpt.py"]
    assert uncovered(sources, set()) == ["fxpass/rules/cce.py", "examples/train_gpt.py"]


def test_op_modules_are_found_by_their_decorators():
    found = {str(p.relative_to(ROOT)) for p in required_sources() if defines_ops(p)}
    assert {"lowerings/cce/op.py", "lowerings/flash_attention/op.py", "lowerings/wta_crs/op.py",
            "lowerings/embedding/op.py"} <= found, found
    assert not any(re.search(r"kernels?\.py$", f) for f in found), found
