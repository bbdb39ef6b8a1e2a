"""The WTA-CRS benchmark's search for the largest batch that fits (the GPU part, a step that runs out of memory,
is replaced by a threshold)."""

from __future__ import annotations

import pytest

from benchmarks.wta_crs import largest_that_runs


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
