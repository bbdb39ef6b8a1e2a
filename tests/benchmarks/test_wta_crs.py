"""The WTA-CRS benchmark's searches: for the largest batch that fits (the GPU part, a step that runs out of memory,
is replaced by a threshold), and for the activation budget whose memory matches a WTA-CRS variant's (on fake
memories, then on CPU with tiny models, where the memory is the bytes saved for backward)."""

from __future__ import annotations

import json
import math
import random

import pytest

from benchmarks.wta_crs import (
    compile_with_activation_budget,
    largest_that_runs,
    main,
    matched_budget,
    saved_bytes,
    variant_names,
    verdict,
)
from tests.leaks import loggers_restored


def _fits_up_to(limit: int):
    tried: list[int] = []

    def runs(size: int) -> bool:
        tried.append(size)
        return size <= limit

    return runs, tried


@pytest.mark.parametrize(
    ("estimate", "limit", "expected"),
    [
        (303, 255, 255),  # the H200's exact-recompute row: three steps down failed, the fourth ran
        (339, 339, 339),  # the estimate runs, one step up does not
        (200, 230, 224),  # an underestimate: up until a step fails
        (50, 49, 48),
        (100, 5000, 120),  # five steps up all ran: the search stops there (a lower bound)
    ],
)
def test_searches_down_then_up_in_four_percent_steps(estimate, limit, expected):
    runs, tried = _fits_up_to(limit)
    assert largest_that_runs(runs, estimate, step=0.04, tries=5) == expected
    assert len(tried) <= 6


def test_gives_up_after_its_tries_and_stops_when_nothing_fits():
    runs, tried = _fits_up_to(100)
    assert largest_that_runs(runs, 1000, step=0.04, tries=5) is None
    assert len(tried) == 6  # the estimate and five steps down
    runs, tried = _fits_up_to(0)
    assert largest_that_runs(runs, 3, step=0.5, tries=5) is None
    assert 0 not in tried  # never a batch of zero


def _recording(memory):
    """``memory`` as a probe that records the budgets it was asked for."""
    asked: list[float] = []

    def measure(budget: float) -> float:
        asked.append(budget)
        return memory(budget)

    return measure, asked


def _is_largest_within(budget, tried, target):
    within = [b for b, memory in tried.items() if memory <= target]
    return budget == (max(within) if within else None)


@pytest.mark.parametrize(
    ("memory", "target", "expected"),
    [
        (lambda x: 0.6 + 0.9 * x, 1.0, (0.42, 0.4445)),  # a fixed part plus what the budget keeps
        (lambda x: 0.5 + math.floor(x * 10) / 10, 0.93, (0.4, 0.5)),  # a staircase: the top step within is 0.9
        (lambda x: 5.12 if x == 1 else 3.87, 4.52, (0.5, 1.0)),  # the knapsack below 1 keeps less than 1's partition
    ],
)
def test_matched_budget_is_the_largest_tried_within_the_target(memory, target, expected):
    measure, asked = _recording(memory)
    budget, tried = matched_budget(measure, target, tries=6)
    assert asked[0] == 1.0 and len(asked) <= 6
    assert list(tried) == asked
    assert _is_largest_within(budget, tried, target)
    assert expected[0] <= budget < expected[1], tried


def test_matched_budget_uses_known_points_and_stops_early():
    measure, asked = _recording(lambda x: 0.6 + 0.9 * x)
    budget, tried = matched_budget(measure, 1.0, known={1.0: 1.5})
    assert 1.0 not in asked and tried[1.0] == 1.5 and len(asked) <= 3  # the line through 1 finds it fast
    assert 0.98 * 1.0 <= tried[budget] <= 1.0
    measure, asked = _recording(lambda x: 0.5 * x)
    assert matched_budget(measure, 1.0) == (1.0, {1.0: 0.5}) and asked == [1.0]  # memopt already fits
    measure, asked = _recording(lambda x: 3.87 if x < 1 else 5.12)
    budget, _ = matched_budget(measure, 4.52, known={1.0: 5.12})
    assert len(asked) == 2 and budget == max(asked)  # flat below 1: a second probe at the same memory ends it


def test_matched_budget_reports_none_when_budget_zero_stays_above():
    measure, asked = _recording(lambda x: 2.0 + x)
    budget, tried = matched_budget(measure, 1.0, tries=4)
    assert budget is None and asked[-1] == 0.0 and len(asked) <= 4 and tried[0.0] == 2.0  # the line leads to 0


def test_matched_budget_on_random_staircases_and_failed_probes():
    generator = random.Random(0)
    for _ in range(200):
        edges = sorted(generator.random() for _ in range(generator.randint(1, 12)))
        heights = sorted(generator.uniform(0, 10) for _ in edges)
        broken = generator.random()

        def memory(x, edges=edges, heights=heights, broken=broken):
            if abs(x - broken) < 0.05:
                return math.inf  # a probe that failed: counted as above any target
            return 1.0 + sum(h for e, h in zip(edges, heights, strict=True) if x >= e)

        target = generator.uniform(0.5, 1.0 + sum(heights))
        measure, asked = _recording(memory)
        budget, tried = matched_budget(measure, target, tries=6)
        assert len(asked) <= 6 and len(set(asked)) == len(asked) and all(0 <= b <= 1 for b in asked)
        assert _is_largest_within(budget, tried, target)
        if budget is None:
            assert 0.0 in tried


@pytest.mark.slow
def test_match_peak_on_cpu_finds_a_budget_within_wta_crs_memory(tmp_path):
    """The whole search on tiny GPT-2 (AOTAutograd's min-cut without Inductor, memopt's rewrites forced at toy
    sizes): the activation budget reaches memopt's partitioner (its saved bytes fall below memopt's own), the row
    chosen keeps no more than WTA-CRS's, is the largest such budget tried, and the report says who is faster."""
    argv = ["--tiny", "--device", "cpu", "--models", "gpt2", "--seq", "64", "--batch", "8", "--inner", "aot_eager",
            "--memopt-options", '{"force": true}', "--budgets", "0.3", "--variants", "memopt,memopt + WTA-CRS 0.3",
            "--match-peak", "--match-tries", "3", "--steps", "1", "--out", str(tmp_path)]  # fmt: skip
    with loggers_restored("", "fxpass"):  # main sets logging up as a script does
        results = main(argv)
    by_variant = {row.variant: row for row in results}
    memopt, wta = by_variant["memopt"], by_variant["memopt + WTA-CRS 0.3"]
    matched = by_variant.pop(next(v for v in by_variant if v.endswith("(peak-matched to WTA-CRS 0.3)")))
    assert wta.wta_groups > 0 and all(row.note == "" and row.step_ms > 0 for row in results), results
    assert matched.saved_mib <= wta.saved_mib < memopt.saved_mib
    [match] = json.loads((tmp_path / "wta_crs_matches.json").read_text())
    tried = {float(budget): memory for budget, memory in match["tried"].items()}
    assert tried[1.0] == pytest.approx(memopt.saved_mib * 2**20) and len(tried) <= 1 + 3
    target = wta.saved_mib * 2**20
    assert match["budget"] == max(budget for budget, memory in tried.items() if memory <= target) < 1.0
    assert matched.variant == f"memopt + activation budget {match['budget']:g} (peak-matched to WTA-CRS 0.3)"
    report = (tmp_path / "wta_crs.md").read_text()
    line = next(line for line in report.splitlines() if line.startswith("- gpt2, WTA-CRS 0.3: "))
    assert "recomputation at the matched peak (activation budget" in line and "× its time: " in line
    assert line.count("MiB saved") == 2
    assert sum(verdict in line for verdict in ("WTA-CRS wins", "recomputation wins", "neither wins")) == 1


def test_each_activation_budget_compiles_its_own_graph():
    """Dynamo reuses a graph compiled by an equal backend, and two ``torch.compile`` calls naming the same backend
    compare equal: without a backend object of its own, the second budget would run the first one's graph."""
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU())
    inputs = torch.randn(32, 16)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def saved_at(budget: float) -> int:
        step = compile_with_activation_budget(lambda x: model(x).sum(), budget, backend="aot_eager")
        return saved_bytes(lambda: step(inputs).backward(), weights)

    assert saved_at(0.0) < saved_at(1.0)


def test_variant_names_keep_the_every_group_variant_whole():
    assert variant_names("memopt,memopt + WTA-CRS 0.3,memopt + WTA-CRS 0.3, every group,torch.compile") == [
        "memopt", "memopt + WTA-CRS 0.3", "memopt + WTA-CRS 0.3, every group", "torch.compile"
    ]


@pytest.mark.parametrize(
    ("ratio", "wta", "recompute", "expected"),
    [
        (1.05, 7.15, 6.67, "recomputation wins"),  # GPT-2 small, every group (H100): slower and higher
        (0.98, 7.54, 6.67, "neither wins"),  # the time rule's 12 groups: faster, but 12 % more memory
        (0.98, 7.54, 7.40, "WTA-CRS wins"),
        (0.98, 7.54, None, "WTA-CRS wins"),
    ],
)
def test_verdict_weighs_time_and_the_peak_each_reaches(ratio, wta, recompute, expected):
    assert verdict(ratio, wta, recompute).startswith(expected)
