"""The training-numerics benchmark: its metrics on known cases, and the CPU smoke run (every variant, tiny GPT,
a few steps) filling the record with finite deviations, where a rerun deviates by exactly nothing and another
seed by something."""

from __future__ import annotations

import json
import math

import pytest
import torch

from benchmarks import numerics_training as nt


def test_wasserstein1_is_the_mean_gap_between_order_statistics():
    a = torch.tensor([3.0, 1.0, 2.0])
    assert nt.wasserstein1(a, a[torch.randperm(3)]) == 0.0  # a distribution, not a sequence
    assert nt.wasserstein1(a, a + 0.5) == pytest.approx(0.5)  # a shift moves every quantile by the shift
    assert nt.wasserstein1(torch.tensor([0.0, 1.0]), torch.tensor([0.0, 3.0])) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="equal sizes"):
        nt.wasserstein1(a, a[:2])


def test_weights_deviation_summarizes_per_tensor_metrics():
    ref = {"w": torch.ones(4), "b": torch.zeros(2)}
    moved = {"w": torch.tensor([1.0, 1.0, 1.0, 3.0]), "b": torch.zeros(2)}
    deviation = nt.weights_deviation(moved, ref)
    assert deviation["tensors"]["w"] == pytest.approx({"max_abs": 2.0, "w1": 0.5, "rel_fro": 1.0})
    assert deviation["tensors"]["b"]["max_abs"] == 0.0
    assert deviation["summary"]["max_abs"] == 2.0
    assert deviation["summary"]["w1"] == pytest.approx(0.5 * 4 / 6)  # weighted by the tensors' sizes
    assert deviation["summary"]["rel_fro"] == pytest.approx(1.0)  # ‖Δ‖ = 2 over ‖ref‖ = 2


def test_checkpoints_start_early_and_end_at_the_last_step():
    assert nt.checkpoint_steps(2000, 100)[:6] == [1, 3, 10, 30, 100, 200]
    assert nt.checkpoint_steps(2000, 100)[-1] == 2000
    assert nt.checkpoint_steps(5, 2) == [1, 2, 4, 5]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("numerics_training")
    nt.main(["--smoke", "--out", str(out)])
    return out, json.loads((out / "numerics_training.json").read_text())


@pytest.mark.slow
def test_smoke_run_records_every_variant_with_finite_deviations(smoke):
    out, record = smoke
    runs = record["runs"]
    assert list(runs) == list(nt.VARIANTS)
    for key, run in runs.items():
        assert run["status"] == "done", (key, run.get("error"))
        assert len(run["losses"]) == 5 and all(math.isfinite(loss) for loss in run["losses"])
        assert [point["step"] for point in run["checkpoints"]] == record["checkpoints"]
        for point in run["checkpoints"]:
            expected = {"a", "f"} - {key}
            assert set(point["vs"]) == expected, (key, point["step"])
            for deviation in point["vs"].values():
                values = [*deviation["summary"].values()]
                values += [v for tensor in deviation["tensors"].values() for v in tensor.values()]
                assert all(math.isfinite(v) and v >= 0 for v in values), key
    assert runs["b"]["rewrites"].keys() >= {"cce", "attention"}
    assert runs["c"]["rewrites"].get("wta_crs", 0) > 0
    assert "CUDA-only" in runs["d"]["note"]  # the filter does not run on a CPU: the record says so
    report = (out / "numerics_training.md").read_text()
    assert "(f) vs (a)" in report and "| (d0) " in report


@pytest.mark.slow
def test_a_rerun_deviates_by_nothing_and_another_seed_or_precision_by_something(smoke):
    _, record = smoke
    runs = record["runs"]

    def final(key: str, ref: str) -> dict[str, float]:
        return runs[key]["checkpoints"][-1]["vs"][ref]["summary"]

    assert final("a2", "a") == {"max_abs": 0.0, "w1": 0.0, "rel_fro": 0.0}  # the CPU is deterministic
    assert final("a2", "f") == final("a", "f")
    for key in ("e", "f", "b"):  # another data order, fp32 training, the rewrites: each moves the weights
        assert all(value > 0 for value in final(key, "a").values()), key
    assert final("d", "a") == final("d0", "a")  # on a CPU the filter is off: (d) is its exact control
