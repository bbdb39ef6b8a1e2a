"""Every kernel configuration memopt launches compiles for sm_90 (H100/H200), checked without a GPU.

``sm90_compile.py`` runs in a subprocess without Triton's interpreter, behind a stand-in driver that reports
an sm_90 device and launches nothing; each case returns its compile error or none. On a machine with a GPU
the CUDA tests compile and run the same kernels for real, so this is skipped there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.lowerings import sm90_compile

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA tests compile and run these kernels"),
]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict]:
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-m", "tests.lowerings.sm90_compile"], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=1800,
    )
    results = {}
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            found = json.loads(line)
            results[found["case"]] = found
    assert results, done.stderr[-3000:]
    return results


@pytest.mark.parametrize("case", list(sm90_compile.cases()))
def test_compiles_for_sm90(compiled, case):
    assert compiled[case]["error"] is None, compiled[case]["error"]


@pytest.mark.parametrize("case", list(sm90_compile.expected_failures()))
def test_the_device_limits_are_enforced(compiled, case):
    """The same message the H200 gave for these tiles (docs/tuning.md, the d256 sweep)."""
    _, message = sm90_compile.expected_failures()[case]
    assert compiled[case]["error"] is not None and message in compiled[case]["error"]


@pytest.mark.parametrize("case", list(sm90_compile.precompile_cases()))
def test_precompile_leaves_the_launches_nothing_to_compile(compiled, case):
    """``lowerings/precompile.py`` warms the specializations the op's launches then ask for: the same launches
    compile kernels without the warm-up (the control), none after it."""
    found = compiled[case]
    assert found["error"] is None, found["error"]
    assert found["warmed"] >= 1
    assert found["compiled_cold"], "the control: these launches compile kernels when nothing was warmed"
    assert found["recompiled"] == []
