"""``fxpass.largest_size``: the largest batch (or sequence length) whose step fits in a number of bytes, from
memopt's simulation alone.

People pick a batch size by what fits. Finding it on the card takes a compile and a step per size tried, each in a
fresh process (``benchmarks/max_batch.py``); finding it on a laptop takes ``fxpass.explain(..., execute=False)``
per size: the step captured, rewritten and priced on fake tensors, nothing run. One explain prices the step
under torch.compile and under memopt at once, so the configurations' searches share every explain.

**What is counted against the budget.** ``Explanation.peak_bytes`` is the step's simulated peak *beyond its
inputs*: activations, temporaries, what is saved for the backward, and the gradients the backward produces (a
first step's, or any step's after ``zero_grad(set_to_none=True)``). Not in it: the parameters and buffers, the
optimizer's state, and the batch. The batch is counted here, as the bytes of the tensors ``make_call`` returns
among the step's arguments (it grows with the size; a parameter passed as an argument is counted too). What the
step reaches otherwise (a module's weights, AdamW's moments, the allocator's reserve, another process's share)
is ``overhead``: subtracted from the budget, so that a user can pass the card's size and the weights.

**Search.** A whole step's peak at fixed sequence length is affine in the batch to a very good approximation,
and at fixed batch roughly affine plus quadratic in the sequence length (eager attention's scores), but not
exactly: on CUDA the simulation charges Inductor's padding of GEMM sizes, which makes some sizes dearer than the
next (a toy 256-wide GEMM step's peak jumps 24 KiB at batch 11 and falls back at 12), and memopt's chunked cut
cross-entropy holds a chunk that steps with the rows. So a model only proposes; explains decide. Two probes
(``start``), then the size where a quadratic through three sizes explained meets the budget (where it curves up;
else a line), kept strictly inside the bracket (the largest size that fits, the smallest above it that does
not): a proposal at or past an end moves one step in from it, which is what verifies the answer, a size that
fits next to one that does not. Lines are drawn through sizes at least a factor of two apart (padding's wiggle
tilts a line through neighbours); across a bracket the secant is Illinois's (an end kept twice counts half), and
after a one-step move a second one halves the bracket instead (a flat stretch would have it creep). On a line,
a quadratic, padding and chunks this takes 4-7 explains; a staircase with no slope between its steps about 20
(``TestSearch`` in ``tests/fxpass/test_fit.py``). ``max_explains`` caps each configuration's search (the sizes
it asks for, probes included; the explains run for another configuration are read for free); a result cut
short says so in its ``note``, as does one where a size below it does not fit (the peak is not monotone there).

**Fresh frames.** Dynamo keeps each compile's cache entry on the code object of the frame it compiled, and
``explain`` compiles anew on every call: explains of one function at nine sizes would pass Dynamo's
``recompile_limit`` (8), after which Dynamo runs that code eagerly, so an explain would capture no graph (a
peak of 0, silently) and the user's own ``torch.compile`` of it would stay uncompiled. Each explain here
compiles a fresh wrapper whose code object is its own, and its entries go with it. ``dynamic=False``: at a
second size Dynamo would otherwise compile the batch dimension as a symbol (automatic dynamic shapes); the peaks
come out the same, as hints, but the symbolic compile took several times longer.

Only the first graph is seen (``explain(execute=False)``): a step with a graph break before its backward is
priced up to the break; ``fullgraph=True`` makes such a break an error instead of a smaller answer.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from fxpass.config import ConfigError, parse_memory_budget
from fxpass.explain import explain
from fxpass.shapes import format_bytes

log = logging.getLogger(__name__)

CONFIGURATIONS = ("torch.compile", "memopt")


@dataclasses.dataclass(frozen=True)
class FitResult:
    """One configuration's answer: the largest size found to fit the budget, and every explain behind it.

    ``size`` is 0 where not even size 1 (or the smallest size explained) fits. ``explained`` maps each size whose
    explain the search could read to the step's simulated peak beyond its inputs there, ``inputs`` to the bytes
    of the tensors ``make_call`` built as the step's arguments; ``needed(size)`` adds those and ``overhead``:
    the figure held against ``budget``. ``verified``: ``size`` fits and ``size + 1`` was explained and does not
    (for size 0: size 1 does not fit). ``note`` says why not, or what else a reader must know; empty otherwise.
    """

    configuration: str
    size: int
    budget: int
    overhead: int
    explained: dict[int, int]
    inputs: dict[int, int]
    verified: bool
    explains: int  # the sizes this configuration's search asked for, probes included
    note: str = ""

    def needed(self, size: int) -> int:
        """Bytes ``size`` needs against the budget: the simulated peak, the step's inputs and ``overhead``."""
        return self.explained[size] + self.inputs[size] + self.overhead

    @property
    def peak(self) -> int | None:
        """The simulated peak beyond the inputs at ``size``; None where nothing fits."""
        return self.explained.get(self.size)

    def __str__(self) -> str:
        head = f"{self.configuration}: "
        if self.size == 0:
            smallest = min(self.explained)
            head += (f"nothing fits in {format_bytes(self.budget)}: size {smallest} needs "
                     f"{format_bytes(self.needed(smallest))}")
        else:
            head += (f"size {self.size} fits in {format_bytes(self.budget)} (needs "
                     f"{format_bytes(self.needed(self.size))}: simulated peak {format_bytes(self.explained[self.size])}"
                     f", inputs {format_bytes(self.inputs[self.size])}, overhead {format_bytes(self.overhead)})")
            if self.size + 1 in self.explained:
                over = self.needed(self.size + 1) - self.budget
                head += (f"; size {self.size + 1} needs {format_bytes(self.needed(self.size + 1))} "
                         f"({format_bytes(over)} over)")
        tail = f"; {self.explains} explains"
        return head + tail + (f"; {self.note}" if self.note else "")


def largest_size(
    make_call: Callable[[int], tuple[Callable, Sequence[Any], Mapping[str, Any]]],
    budget: int | str,
    *,
    overhead: int | str = 0,
    options: Mapping[str, Any] | None = None,
    assume_device: str | None = None,
    start: tuple[int, int] = (1, 2),
    limit: int = 4096,
    returned_held: bool = False,
    configurations: Sequence[str] = CONFIGURATIONS,
    max_explains: int = 6,
    fullgraph: bool = False,
) -> dict[str, FitResult]:
    """The largest size (a batch, a sequence length: any one integer the step is built at) whose simulated step
    fits in ``budget`` bytes, per configuration ("torch.compile", "memopt"), without running the step.

    ``make_call(size)`` returns ``(fn, args, kwargs)``: the step as written (uncompiled, as ``fxpass.explain``
    takes it) and its inputs at that size; it is called once per size explained. ``budget`` and ``overhead`` are
    bytes: an int or a string such as ``"40GiB"``, ``"512 MiB"``, ``"2e9"``. What counts against the budget (the
    module docstring): the simulated peak beyond the step's inputs (gradients included), the inputs
    ``make_call`` built, and ``overhead`` (weights, optimizer state: what the peak does not see).

    ``options`` are memopt's (``memory_budget`` included: memopt's figure is then the planned peak);
    ``assume_device`` is ``explain``'s: "cuda" sizes a GPU's step from a CPU-only machine. ``start``: the two
    probe sizes; ``limit``: the largest size explained (a result at the limit says larger sizes were not tried);
    ``returned_held``: whether the caller holds what the step returns through its backward (``explain``'s
    ``peak_bytes``); ``max_explains``: the sizes each configuration's search may ask for.

    Raises ValueError for a budget, overhead or argument it cannot use, and RuntimeError where Dynamo captured no
    graph or memopt could not price it (no answer would be right then); a budget that not even the smallest size
    fits is an answer (size 0, with its reason), not an error.
    """
    budget_bytes = _bytes("budget", budget)
    overhead_bytes = _bytes("overhead", overhead, zero=True)
    unknown = [name for name in configurations if name not in CONFIGURATIONS]
    if unknown or not configurations:
        raise ValueError(f"configurations must be among {CONFIGURATIONS}, got {tuple(configurations)!r}")
    if any(not isinstance(size, int) or isinstance(size, bool) for size in start):
        raise ValueError(f"start must be two different integer sizes ≥ 1, got {start!r}")
    probes = sorted(set(start))
    if len(probes) != 2 or probes[0] < 1:
        raise ValueError(f"start must be two different integer sizes ≥ 1, got {start!r}")
    if limit < probes[-1]:
        raise ValueError(f"limit ({limit}) must be at least the larger start size ({probes[-1]})")
    if max_explains < 2:
        raise ValueError(f"max_explains must be at least 2 (the probes), got {max_explains}")
    simulator = _Simulator(make_call, options, assume_device, returned_held, fullgraph)
    results = {}
    for name in configurations:
        results[name] = _search(name, simulator, budget_bytes, overhead_bytes, probes, limit, max_explains)
        log.info("fxpass.largest_size: %s", results[name])
    return results


largest_batch = largest_size  # the usual question; the helper is generic over the one size


class _Simulator:
    """Explains the step at a size once, for every configuration: peaks beyond the inputs, and input bytes."""

    def __init__(self, make_call: Callable, options: Mapping[str, Any] | None, assume_device: str | None,
                 returned_held: bool, fullgraph: bool) -> None:
        self.make_call = make_call
        self.options = dict(options or {})
        self.assume_device = assume_device
        self.returned_held = returned_held
        self.fullgraph = fullgraph
        self.peaks: dict[int, dict[str, int]] = {}
        self.inputs: dict[int, int] = {}

    def at(self, size: int) -> None:
        """Explain the step at ``size`` unless it was."""
        if size in self.peaks:
            return
        began = time.perf_counter()
        call = self.make_call(size)
        if not isinstance(call, tuple) or len(call) not in (2, 3):
            raise ValueError(f"make_call({size}) must return (fn, args, kwargs), got {type(call).__name__}")
        fn, args, kwargs = call if len(call) == 3 else (*call, {})
        explanation = explain(
            _fresh_frame(fn), *args, options=self.options, assume_device=self.assume_device, dynamic=False,
            fullgraph=self.fullgraph, execute=False, **kwargs,
        )
        if not explanation.graphs:
            raise RuntimeError(f"size {size}: Dynamo captured no graph of the step, so there is nothing to price")
        peaks = explanation.peak_bytes(returned_held=self.returned_held)
        if peaks is None:
            errors = "; ".join(graph.step["error"] for graph in explanation.graphs
                               if graph.step is not None and "error" in graph.step)
            raise RuntimeError(f"size {size}: memopt could not price the step ({errors or 'no step costs'})")
        self.peaks[size] = peaks
        self.inputs[size] = _input_bytes(args, kwargs)
        log.info("fxpass.largest_size: size %d: simulated peak %s, inputs %s (explained in %.1f s)", size,
                 ", ".join(f"{name} {format_bytes(peak)}" for name, peak in peaks.items()),
                 format_bytes(self.inputs[size]), time.perf_counter() - began)

    def needed(self, name: str, overhead: int) -> dict[int, int]:
        """Bytes against the budget at each size explained so far, under configuration ``name``."""
        return {size: peaks[name] + self.inputs[size] + overhead for size, peaks in self.peaks.items()}


def _search(name: str, simulator: _Simulator, budget: int, overhead: int, probes: list[int], limit: int,
            max_explains: int) -> FitResult:
    """One configuration's search (module docstring): explain until a size that fits sits next to one that
    does not, the limit fits, or ``max_explains`` sizes were asked for."""
    asked = 0
    for size in probes:
        simulator.at(size)
        asked += 1
    note = ""
    moves: list[tuple[str, int | None]] = []  # each explain's effect: the bracket's end it moved, and how far
    weights = {"lo": 1.0, "hi": 1.0}  # Illinois: an end kept through two moves of the other counts half
    while True:
        needed = simulator.needed(name, overhead)
        lo, hi = _bracket(needed, budget)
        if hi is not None and hi == lo + 1:
            break
        if lo >= limit:
            note = f"the limit ({limit}) fits; larger sizes were not tried"
            break
        one_sided = len(moves) >= 2 and moves[-1][0] == moves[-2][0]
        proposal = _propose(needed, budget, lo, hi, limit, weights, one_sided)
        if moves and moves[-1][1] == 1 and proposal in (lo + 1, None if hi is None else hi - 1):
            # the last explain moved an end by one and the model proposes one more: it is not smooth here (a flat
            # stretch, a step); creeping would spend the explains, so halve the bracket, or double up
            proposal = (lo + hi) // 2 if hi is not None else min(2 * lo, limit)
        if asked >= max_explains:
            where = (f"{lo} fits" if lo else "nothing explained fits") + (
                f", {hi} does not" if hi is not None else ", nothing larger was explained")
            note = f"stopped after {asked} explains: {where}; the search would explain {proposal} next"
            break
        simulator.at(proposal)
        asked += 1
        fits = simulator.needed(name, overhead)[proposal] <= budget
        end, was = ("lo", lo) if fits else ("hi", hi)
        if lo >= 1 and hi is not None:
            if moves and moves[-1][0] == end:
                weights["hi" if fits else "lo"] /= 2
            weights[end] = 1.0
        moves.append((end, None if was is None or was == 0 else abs(proposal - was)))
    needed = simulator.needed(name, overhead)
    lo, hi = _bracket(needed, budget)
    below = [size for size in needed if size < lo and needed[size] > budget]
    if below:  # the peak is not monotone in the size (padding): not every size up to lo is known to fit
        note = "; ".join(filter(None, [note, f"size {max(below)} does not fit below it"]))
    return FitResult(
        name, lo, budget, overhead, {size: peaks[name] for size, peaks in sorted(simulator.peaks.items())},
        dict(sorted(simulator.inputs.items())), hi is not None and hi == lo + 1, asked, note,
    )


def _bracket(needed: Mapping[int, int], budget: int) -> tuple[int, int | None]:
    """(the largest size explained that fits, 0 if none; the smallest above it that does not, None if none)."""
    lo = max((size for size, value in needed.items() if value <= budget), default=0)
    hi = min((size for size, value in needed.items() if size > lo and value > budget), default=None)
    return lo, hi


def _propose(needed: Mapping[int, int], budget: int, lo: int, hi: int | None, limit: int,
             weights: Mapping[str, float], one_sided: bool) -> int:
    """The next size to explain, strictly inside (lo, hi) and at most ``limit``: where a quadratic through three
    sizes explained meets the budget (a sequence length's attention scores grow with its square; a straight
    batch gives a curvature of 0, and the line serves), else a line: across the bracket where there is one (an
    Illinois secant, which a one-sided run would otherwise leave creeping), or from the end nearest the
    boundary through a size at most half (or at least twice) as large: padding's wiggle tilts a line through
    neighbours. Doubling up, or halving the bracket, where neither rises."""
    guess = None
    if lo >= 1 and hi is not None:
        if not one_sided:
            guess = _quadratic_root(needed, budget, (_spread(needed, lo, up=False), lo, hi))
        if guess is None:
            below, above = (needed[lo] - budget) * weights["lo"], (needed[hi] - budget) * weights["hi"]
            guess = lo + (hi - lo) * -below / (above - below)
    else:
        end = lo if hi is None else hi  # nothing fits yet: extrapolate down from the smallest size
        partner = _spread(needed, end, up=hi is not None)
        others = [size for size in needed if size not in (end, partner)]
        if others:
            third = min(others, key=lambda size: abs(size - partner))
            guess = _quadratic_root(needed, budget, (end, partner, third))
        if guess is None:
            guess = _line_root(needed, budget, end, partner)
    if guess is None:
        proposal = min(2 * lo, limit) if hi is None else (lo + hi) // 2
    else:
        proposal = limit if guess >= limit else math.floor(guess)
    if proposal <= lo:
        proposal = lo + 1
    if hi is not None and proposal >= hi:
        proposal = hi - 1
    return proposal


def _spread(needed: Mapping[int, int], size: int, up: bool) -> int:
    """A size explained to draw a line from ``size`` through: the largest at most half of it (``up``: the
    smallest at least twice it), else the farthest other."""
    others = [other for other in needed if other != size]
    if up:
        return min((other for other in others if other >= 2 * size), default=max(others))
    return max((other for other in others if 2 * other <= size), default=min(others))


def _line_root(needed: Mapping[int, int], budget: int, first: int, second: int) -> float | None:
    """Where the line through two sizes' figures meets the budget; None where it does not rise."""
    slope = (needed[second] - needed[first]) / (second - first)
    return first + (budget - needed[first]) / slope if slope > 0 else None


def _quadratic_root(needed: Mapping[int, int], budget: int, sizes: tuple[int, int, int]) -> float | None:
    """Where the quadratic through three sizes' figures meets the budget (its larger root); None where the sizes
    are not three, the quadratic does not curve up (the line serves), or it never meets the budget."""
    if len(set(sizes)) != 3:
        return None
    (x1, y1), (x2, y2), (x3, y3) = sorted((size, needed[size]) for size in sizes)
    first, second = (y2 - y1) / (x2 - x1), (y3 - y2) / (x3 - x2)
    c = (second - first) / (x3 - x1)
    if c <= 0:
        return None
    b = first - c * (x1 + x2)
    a = y1 - b * x1 - c * x1 * x1
    discriminant = b * b - 4 * c * (a - budget)
    return None if discriminant < 0 else (-b + math.sqrt(discriminant)) / (2 * c)


def _bytes(name: str, value: Any, zero: bool = False) -> int:
    """``value`` as a number of bytes: an int (``zero``: 0 allowed), an integral float, or a string with a unit,
    read by ``memory_budget``'s parser; a fraction means nothing here (a fraction of what?), so it is refused."""
    wrong = f"{name} must be bytes: an int or a string such as '40GiB', '512 MiB', '2e9'; got {value!r}"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        if value > 0 or (zero and value == 0):
            return value
        raise ValueError(wrong)
    if not isinstance(value, str):
        raise ValueError(wrong)
    try:
        parsed = parse_memory_budget(value)
    except ConfigError as error:
        raise ValueError(wrong) from error
    if not isinstance(parsed, int):  # "0.5": memory_budget's fraction of torch.compile's peak
        raise ValueError(wrong)
    return parsed


def _input_bytes(args: Sequence[Any], kwargs: Mapping[str, Any]) -> int:
    """Bytes of the tensors among the step's arguments, each storage once (a view of another input is free)."""
    seen: set[Any] = set()
    total = 0
    for leaf in pytree.tree_leaves((list(args), dict(kwargs))):
        if not isinstance(leaf, torch.Tensor):
            continue
        storage = leaf.untyped_storage()
        key = (leaf.device, storage.data_ptr()) if storage.data_ptr() else id(leaf)
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def _fresh_frame(fn: Callable) -> Callable:
    """``fn`` behind a wrapper whose code object is new (the module docstring's "Fresh frames")."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    call.__code__ = call.__code__.replace()
    return call
