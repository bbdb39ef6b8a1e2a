"""The first-call benchmark on a tiny model: a variant runs cold then warm in its own process, and the warm run is
served by the AOTAutograd cache."""

from __future__ import annotations

import pytest

from benchmarks import first_call

pytestmark = pytest.mark.slow


def test_tiny_run_cold_then_warm(tmp_path):
    rows = first_call.main(["--tiny", "--seq", "32", "--variants", "memopt", "--out", str(tmp_path)])
    assert [(row["phase"], row["variant"]) for row in rows] == [("cold", "memopt"), ("warm", "memopt")]
    assert all(row.get("first_call_s", 0) > 0 for row in rows), [row.get("error") for row in rows]
    assert all("autograd_cache_hit" in row["aot_autograd_cache"] for row in rows if row["phase"] == "warm")
    assert (tmp_path / "first_call.md").read_text().count("| warm |") == 1
    # timed from the torch.compile call, whose own seconds are part of the first step's
    assert all(0 <= row["torch_compile_call_s"] < row["first_call_s"] for row in rows), rows
    cold = rows[0]
    assert cold["kernels_generated"] > 0 and "_compile.compile_inner" in cold["phases_s"], cold
    assert list(cold["phases_s"].values()) == sorted(cold["phases_s"].values(), reverse=True)  # longest first
