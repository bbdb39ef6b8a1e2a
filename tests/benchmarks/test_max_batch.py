"""The largest-batch benchmark: its search on fake trials (a peak that is a function of the batch, a cap that the
peak must stay under), the rows it makes, the configurations that cannot run, and one tiny CPU run of the script,
whose trials are subprocesses."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import max_batch
from benchmarks.max_batch import Configuration, Trial, next_batch, outcome, search, table, unavailable
from tests.leaks import loggers_restored

pytestmark = pytest.mark.slow

GiB = 1 << 30
CAP = 40 * GiB
KEY = {"model": "llama-1b", "flow": "loss_only", "cap": "40", "configuration": "memopt", "group": None}


def fake_trials(peak, cap: int = CAP, broken: bool = False):
    """A trial function whose step fits while ``peak(batch)`` stays under ``cap``, and the batches it was
    asked for; ``broken``: every trial fails as a compile error would."""
    asked: list[int] = []

    def run(batch: int, reason: str) -> Trial:
        asked.append(batch)
        if broken:
            return Trial(batch, fits=False, error="RuntimeError: no kernel", reason=reason)
        used = peak(batch)
        if used > cap:
            return Trial(batch, fits=False, oom="OutOfMemoryError: CUDA out of memory", cap_bytes=cap, reason=reason)
        return Trial(batch, fits=True, peak_bytes=used, trial_peak_bytes=used, cap_bytes=cap, step_ms=100.0,
                     tokens_per_s=batch * 2048 / 0.1, reason=reason)

    return run, asked


def linear(a: float, b: float):
    return lambda batch: int((a + b * batch) * GiB)


def test_a_linear_peak_is_found_in_four_trials():
    """Two probes fit the line, its prediction runs, the next batch up does not: the boundary."""
    run, asked = fake_trials(linear(6.0, 2.7))  # (40 - 6) / 2.7 = 12.6
    trials = search(run, probes=(2, 4), max_trials=5)
    assert asked == [2, 4, 12, 13]
    assert [t.reason for t in trials] == ["probe", "probe", "predicted", "step up"]
    row = outcome(KEY, trials, max_trials=5)
    assert (row.largest, row.note, row.at.batch) == (12, "", 12)


def test_a_peak_that_grows_faster_than_the_line_steps_down_until_the_boundary():
    run, asked = fake_trials(lambda batch: int((6.0 + 2.0 * batch + 0.1 * batch**2) * GiB))  # boundary 10
    trials = search(run, probes=(2, 4), max_trials=5)
    assert asked == [2, 4, 13, 12, 11]  # the line through 2 and 4 predicts 13; each failure steps down one
    row = outcome(KEY, trials, max_trials=5)
    assert row.largest == 4 and row.note == "trial cap (5) hit: 4 ran, 11 did not"
    run, asked = fake_trials(lambda batch: int((6.0 + 2.0 * batch + 0.1 * batch**2) * GiB))
    assert outcome(KEY, search(run, probes=(2, 4), max_trials=6), max_trials=6).largest == 10


def test_an_underestimate_jumps_along_the_refitted_line():
    """A peak that flattens: after the prediction runs, the line through the two largest batches predicts more,
    and the search goes there rather than one up."""
    run, asked = fake_trials(lambda batch: int((6.0 + 4.0 * batch if batch <= 4 else 22.0 + 1.5 * (batch - 4)) * GiB))
    trials = search(run, probes=(2, 4), max_trials=5)
    assert asked[:3] == [2, 4, 8] and asked[3] > 9  # 4 + (40 - 22) / 1.5 = 16
    assert outcome(KEY, trials, max_trials=5).largest == 16


@pytest.mark.parametrize("max_trials", [1, 2, 3])
def test_the_trial_cap_is_respected_and_named(max_trials):
    run, asked = fake_trials(linear(6.0, 0.5))  # boundary 68: far from the probes
    trials = search(run, probes=(2, 4), max_trials=max_trials)
    assert len(asked) == len(trials) == max_trials
    assert f"trial cap ({max_trials}) hit" in outcome(KEY, trials, max_trials).note


def test_a_configuration_that_never_fits():
    run, asked = fake_trials(linear(45.0, 1.0))  # the weights alone pass the cap
    trials = search(run, probes=(2, 4), max_trials=5)
    assert asked == [2, 1]  # the second probe is above a failure: halved towards 0 instead
    row = outcome(KEY, trials, max_trials=5)
    assert (row.largest, row.at, row.note) == (None, None, "batch 1 does not fit")


def test_a_failure_other_than_memory_ends_the_search():
    run, asked = fake_trials(linear(6.0, 2.7), broken=True)
    trials = search(run, probes=(2, 4), max_trials=5)
    assert asked == [2]
    assert outcome(KEY, trials, max_trials=5).note == "failed: RuntimeError: no kernel"


def test_the_time_limit_stops_the_search_and_says_so():
    run, asked = fake_trials(linear(6.0, 2.7))
    trials = search(run, probes=(2, 4), max_trials=5, may_start=lambda: len(asked) < 3)
    assert asked == [2, 4, 12]
    assert outcome(KEY, trials, max_trials=5).note == (
        "stopped by the time limit: 12 ran, nothing larger tried; the line through the largest two predicts 12"
    )


def test_batches_are_integers_from_one():
    """A probe of 1 that runs, then no line (a flat peak): the search doubles, and never asks for batch 0."""
    run, asked = fake_trials(lambda batch: 10 * GiB if batch <= 6 else 50 * GiB)
    search(run, probes=(1,), max_trials=6)
    assert asked == [1, 2, 4, 8, 6, 7]  # doubled while the peak is flat, then halved towards the failure
    assert all(isinstance(b, int) and b >= 1 for b in asked)
    assert next_batch([Trial(1, fits=False)], probes=(1,)) is None


def test_the_table_folds_a_group_into_its_best_and_compares_with_torch_compile():
    def row(name: str, batch: int, speed: float, group: str | None = None):
        trial = Trial(batch, fits=True, peak_bytes=30 * GiB, cap_bytes=CAP, tokens_per_s=speed)
        return outcome({**KEY, "configuration": name, "group": group}, [trial, Trial(batch + 1, fits=False)], 5)

    group = "torch.compile+activation budget"
    rows = [row("torch.compile", 10, 50000.0), row("torch.compile+budget0.7", 12, 52000.0, group),
            row("torch.compile+budget0.3", 16, 48000.0, group), row("memopt", 14, 60000.0)]
    text = table(rows)
    assert "| torch.compile+activation budget (best: torch.compile+budget0.7) | 12 | 52000 | 1.04 |" in text
    assert "torch.compile+budget0.3: 16" in text
    assert "| memopt | 14 | 60000 | 1.20 | 30.00 | 2: 14, 15✗ |" in text


def test_rows_that_cannot_run_say_why():
    memopt = max_batch.CONFIGURATIONS["memopt+budget"]
    expected = None if "memory_budget" in max_batch_options() else "not available (unknown memopt option memory_budget)"
    assert unavailable(memopt, "llama-1b", {}) == expected
    made_up = Configuration("memopt+x", compiler="memopt", options={"no_such_option": 1})
    assert unavailable(made_up, "llama-1b", {}) == "not available (unknown memopt option no_such_option)"
    assert unavailable(max_batch.CONFIGURATIONS["liger"], "gpt2", {}) == "not available (Liger has no GPT-2 patch)"
    assert unavailable(max_batch.CONFIGURATIONS["memopt+wta"], "gpt2", {}) is None


def max_batch_options() -> tuple[str, ...]:
    from fxpass import Config

    return Config.option_names()


def test_a_memopt_configuration_is_named_by_its_options():
    added = max_batch.memopt_configuration('memopt+budget0.3={"memory_budget": 0.3}')
    assert added == Configuration("memopt+budget0.3", compiler="memopt", options={"memory_budget": 0.3})


def test_the_activation_budget_is_set_around_each_call_only():
    import torch

    before = torch._functorch.config.activation_memory_budget
    step = max_batch.under_activation_budget(lambda: torch._functorch.config.activation_memory_budget, 0.3)
    assert step() == 0.3 and torch._functorch.config.activation_memory_budget == before


def test_tiny_cpu_run_then_merge(tmp_path):
    """One configuration that runs (one subprocess trial: CPU has no cap to search under) and two that cannot;
    then the run's lines rendered again through ``--merge``."""
    argv = ["--tiny", "--device", "cpu", "--inner", "aot_eager", "--models", "gpt2", "--flows", "loss_only",
            "--caps", "40", "--configs", "memopt,liger", "--memopt-config", 'memopt+x={"no_such_option": 1}',
            "--steps", "1", "--memopt-options", '{"force": true}', "--out", str(tmp_path)]  # fmt: skip
    with loggers_restored("", "fxpass"):  # main sets logging up as a script does
        rows = max_batch.main(argv)
    by_name = {row.configuration: row for row in rows}
    assert list(by_name) == ["memopt", "liger", "memopt+x"]
    memopt = by_name["memopt"]
    assert memopt.largest == 2 and memopt.note == "one trial (CPU: no memory cap)", memopt
    assert memopt.at.tokens_per_s > 0 and memopt.at.peak_bytes > 0 and memopt.at.environment["device"] == "cpu"
    assert "cce×1" in memopt.at.rewrites
    assert by_name["liger"].note == "not available (Liger has no GPT-2 patch)" and not by_name["liger"].trials
    assert by_name["memopt+x"].note == "not available (unknown memopt option no_such_option)"
    report = (tmp_path / "max_batch.md").read_text()
    assert report.startswith("Largest batch under a memory cap") and "commit " in report
    assert "| gpt2 | loss_only | none (CPU) | memopt | 2 |" in report
    assert len(json.loads((tmp_path / "max_batch.json").read_text())) == 3
    merged = tmp_path / "merged"
    with loggers_restored("", "fxpass"):
        max_batch.main(["--merge", str(tmp_path / "max_batch.jsonl"), "--out", str(merged)])
    assert (merged / "max_batch.md").read_text() == report


def test_probes_share_the_gpu_then_each_search_runs_alone(tmp_path, monkeypatch):
    """``--parallel-probes``: the probes of every configuration first, three at a time; a probe that ran out of
    memory beside the others is run again alone and only that trial is kept; then each search goes on alone.
    The subprocesses are replaced by fake trials (a peak linear in the batch)."""
    peaks = {"torch.compile": linear(6.0, 2.7), "memopt": linear(6.0, 2.0)}
    crowded = {("memopt", 4)}  # ran out of memory beside the other probes, not alone

    def spawn(spec, timeout):
        name, batch = spec.configuration["name"], spec.batch
        if (name, batch) in crowded:
            crowded.discard((name, batch))
            return Trial(batch, fits=False, oom="OutOfMemoryError: CUDA out of memory", cap_bytes=CAP)
        return fake_trials(peaks[name])[0](batch, "")

    monkeypatch.setattr(max_batch, "spawn", spawn)
    argv = ["--device", "cuda", "--models", "llama-1b", "--flows", "loss_only", "--caps", "40", "--parallel-probes",
            "3", "--configs", "torch.compile,memopt,liger,memopt+x", "--memopt-config", 'memopt+x={"no_such": 1}',
            "--out", str(tmp_path)]  # fmt: skip
    with loggers_restored("", "fxpass"):
        rows = {row.configuration: row for row in max_batch.main(argv)}
    assert (rows["torch.compile"].largest, rows["memopt"].largest) == (12, 17)
    memopt = rows["memopt"].trials
    assert [(t.batch, t.fits, t.shared) for t in memopt[:2]] == [(2, True, True), (4, True, False)]
    assert [t.reason for t in memopt] == ["probe, GPU shared", "probe, again alone", "predicted", "step up"]
    assert rows["memopt"].note == rows["torch.compile"].note == ""
    assert rows["memopt+x"].note == "not available (unknown memopt option no_such)"
    report = (tmp_path / "max_batch.md").read_text()
    assert "| memopt | 17 | 348160 | 1.42 | 40.00 | 4: 2, 4, 17, 18✗ |" in report  # both at 100 ms a step
    configurations = [line.split(" | ")[3] for line in report.splitlines() if line.startswith("| llama-1b")]
    assert configurations == ["torch.compile", "memopt", "liger", "memopt+x"]  # --configs' order


def test_a_trial_cut_by_the_time_limit_leaves_no_result(tmp_path, monkeypatch):
    """The time limit ends the third trial: it is not recorded, its row says the search was stopped, and the
    configuration after it is not measured."""
    calls: list[int] = []

    def spawn(spec, timeout):
        calls.append(spec.batch)
        if len(calls) == 3:
            return Trial(spec.batch, fits=False, error=f"trial ran past {timeout:.0f} s")
        return fake_trials(linear(6.0, 2.7))[0](spec.batch, "")

    monkeypatch.setattr(max_batch, "spawn", spawn)
    argv = ["--device", "cuda", "--models", "llama-1b", "--flows", "loss_only", "--caps", "40", "--time-limit", "100",
            "--configs", "torch.compile,memopt", "--out", str(tmp_path)]  # fmt: skip
    with loggers_restored("", "fxpass"):
        rows = {row.configuration: row for row in max_batch.main(argv)}
    assert calls == [2, 4, 12]
    assert [t.batch for t in rows["torch.compile"].trials] == [2, 4]
    assert rows["torch.compile"].note == (
        "stopped by the time limit: 4 ran, nothing larger tried; the line through the largest two predicts 12"
    )
    assert rows["memopt"].note == "not measured (time limit)"


def test_the_fit_row_gives_memopt_the_cap_less_the_weights():
    model = torch.nn.Linear(8, 8)
    spec = max_batch.TrialSpec("gpt2", "loss_only", "card", {}, 1, 8, device="cpu")
    options = {"memory_budget": max_batch.CAP, "force": True}
    assert max_batch.resolved_options(options, spec, model, torch.device("cpu")) == {"memory_budget": 0.5,
                                                                                     "force": True}
    assert max_batch.resolved_options({"force": True}, spec, model, torch.device("cpu")) == {"force": True}
    assert unavailable(max_batch.CONFIGURATIONS["memopt+fit"], "llama-1b", {}) is None
