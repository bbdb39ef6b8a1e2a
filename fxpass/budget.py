"""Fitting a compiled graph into a memory budget (the ``memory_budget`` option) by recomputation.

AOTAutograd's min-cut partitioner already knows how to trade recomputation for memory: under
``torch._functorch.config.activation_memory_budget`` (a fraction of the activations its default partition saves)
a knapsack picks the activations to recompute in the backward, cheapest recompute FLOPs first, and the setting is
part of AOTAutograd's cache key. What it lacks is a number a user can choose: a fraction of saved activations is
not a peak in bytes. memopt simulates the partitioned graph on fake tensors (``fxpass.compiled_cost``, the step
simulation ``fxpass.explain`` prints), so it searches the setting whose simulated peak meets the budget and
compiles under it. Nothing is partitioned by memopt itself, and the search runs in a shape environment of its own:
it adds no guard to the user's graph.

The budget is the graph's own peak beyond its inputs (parameters, buffers, the batch), as ``fxpass.explain``
and the benchmarks count it, with returned tensors held through the backward: in bytes, or as a fraction of
torch.compile's simulated peak for the same graph. Decided at the example shapes; at other shapes the same
setting recomputes the same share of the activations.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch.fx as fx

from fxpass import shapes
from fxpass.compiled_cost import CompiledCost, compiled_cost, partitioned_under
from fxpass.notes import error_note

log = logging.getLogger(__name__)

# The search stops when the setting is known to within this (AOTAutograd's knapsack rounds it anyway).
RESOLUTION = 1 / 64


@dataclasses.dataclass(frozen=True)
class BudgetPlan:
    """What memopt did to fit a graph into its budget, for the report."""

    requested: int | float  # as the user gave it: bytes, or a fraction of torch.compile's peak
    budget: int  # in bytes
    torch_compile: int  # torch.compile's simulated peak for the graph
    before: int  # memopt's simulated peak with the exact rewrites alone
    after: int  # with the plan
    activation_memory_budget: float | None  # the setting compiled under; None: nothing added
    met: bool
    reason: str

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        setting = ("nothing added" if self.activation_memory_budget is None
                   else f"recomputation at activation_memory_budget={self.activation_memory_budget:g}")
        return (f"memory budget {_mib(self.budget)}: {setting}; simulated peak {_mib(self.before)} → "
                f"{_mib(self.after)} (torch.compile {_mib(self.torch_compile)}); {self.reason}")


def _mib(value: int) -> str:
    return f"{value / 2**20:.1f} MiB"


def graph_peak(cost: CompiledCost) -> int:
    """A graph's simulated peak beyond its inputs with what it returns held through the backward (hints): the
    figure ``GraphReport.peaks`` gives."""
    hints = cost.hints()
    return max(hints["forward_peak"], hints["backward_peak"] + shapes.hint(cost.returned))


def peak_under(gm: fx.GraphModule, example_inputs: Sequence[Any], device: str | None, setting: float) -> int:
    """The graph's simulated peak when AOTAutograd partitions it under ``activation_memory_budget=setting``."""
    with partitioned_under(setting):
        return graph_peak(compiled_cost(gm, list(example_inputs), device))


# The settings tried first; the search then bisects between the largest that meets the budget and the next above.
GRID = (1.0, 0.75, 0.5, 0.25, 0.0)


def search(peak_at: Callable[[float], int], budget: int, resolution: float = RESOLUTION) -> tuple[float, int, bool]:
    """The setting to compile under, its simulated peak, and whether that meets ``budget``: the largest setting
    in [0, 1] found within the budget (fewest activations recomputed), else the one with the lowest peak.

    The peak does not always fall with the setting: recomputing every activation can bring them all back at once
    at the start of the backward (a small MLP's simulated peak at 0.0 was its peak at 1.0, at 0.5 0.73× it). So
    the settings of ``GRID`` are tried first, then the interval above the largest one within the budget is
    bisected to ``resolution``."""
    peaks = {setting: peak_at(setting) for setting in GRID}
    within = [setting for setting in GRID if peaks[setting] <= budget]
    if not within:
        lowest = min(GRID, key=lambda setting: (peaks[setting], -setting))
        return lowest, peaks[lowest], False
    low = max(within)
    high = min((setting for setting in GRID if setting > low), default=low)
    while high - low > resolution:
        middle = (low + high) / 2
        peaks[middle] = peak_at(middle)
        low, high = (middle, high) if peaks[middle] <= budget else (low, middle)
    return low, peaks[low], True


def plan(
    original: fx.GraphModule, rewritten: fx.GraphModule, example_inputs: Sequence[Any], requested: int | float,
    device: str | None = None,
) -> BudgetPlan:
    """Price the graph as torch.compile and as memopt compile it; where memopt's simulated peak is over the
    budget, find the recomputation setting that brings it within, or the lowest peak recomputation reaches."""
    torch_compile = peak_under(original, example_inputs, device, 1.0)
    budget = int(requested * torch_compile) if isinstance(requested, float) else requested
    before = peak_under(rewritten, example_inputs, device, 1.0)

    def done(setting: float | None, after: int, met: bool, reason: str) -> BudgetPlan:
        return BudgetPlan(requested, budget, torch_compile, before, after, setting, met, reason)

    if before <= budget:
        return done(None, before, True, "the exact rewrites meet it")
    cache = {1.0: before}

    def peak_at(setting: float) -> int:
        if setting not in cache:
            cache[setting] = peak_under(rewritten, example_inputs, device, setting)
        return cache[setting]

    setting, after, met = search(peak_at, budget)
    if met:
        return done(setting, after, True, "met by recomputation")
    if after >= before:
        return done(None, before, False, (
            f"not met: recomputation does not lower the simulated peak ({_mib(before - budget)} over); nothing "
            "added"))
    return done(setting, after, False, (
        f"not met: the lowest peak recomputation reaches is {_mib(after)}, {_mib(after - budget)} over; compiled "
        "at that setting"))


def plan_or_note(
    original: fx.GraphModule, rewritten: fx.GraphModule, example_inputs: Sequence[Any], requested: int | float,
    device: str | None, strict: bool,
) -> BudgetPlan | str:
    """``plan``, or why none was made: a graph the simulation cannot take keeps torch.compile's partition (a
    budget is a wish, never a reason to fail the user's compile; ``strict`` raises)."""
    try:
        return plan(original, rewritten, example_inputs, requested, device)
    except Exception as error:
        if strict:
            raise
        log.debug("memopt could not plan the memory budget", exc_info=True)
        return f"memory budget not planned: the graph could not be simulated ({error_note(error)})"
