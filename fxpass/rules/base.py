"""What every rule provides: a pure ``match``, a ``decide`` on a memory model, and an ``apply``.

A rule module exports one ``Rule``. ``match`` inspects the graph and returns candidates (frozen dataclasses
that change nothing); ``decide`` turns a candidate into a ``Decision`` with a reason and, when the candidate
is complete, the memory model behind it; ``apply`` edits the graph for an accepted candidate (with the
config, for parameters such as a budget).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch.fx as fx

from fxpass import shapes
from fxpass.config import Config
from fxpass.graph import GraphFacts
from fxpass.shapes import MemoryModel, Verdict, clears, format_bytes


class Candidate(Protocol):
    """A match: the node it is anchored on, every node it covers, and the parameters it found."""

    @property
    def anchor(self) -> fx.Node: ...

    @property
    def nodes(self) -> tuple[fx.Node, ...]: ...

    @property
    def blocker(self) -> str | None: ...

    def params(self) -> Mapping[str, Any]: ...


@dataclasses.dataclass(frozen=True)
class Decision:
    apply: bool
    reason: str
    memory: MemoryModel | None = None  # the graph as written (eager's accounting)
    verdict: Verdict | None = None
    params: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # choices the rule made, for the record
    what: str = ""  # what the rewrite does, the head of the reason
    priced: Any = None  # fxpass.pricing.Priced: what it frees against torch.compile, when priced so
    config: Config | None = None  # the config to apply under, where pricing chose among the rule's variants


# A rule's choice among its variants on what each frees against torch.compile: given the candidate, the config
# and a function pricing the rewrite under a config (its decision, and what it frees), the config to decide and
# apply under and why; None where the rule has nothing to weigh.
Chooser = Callable[[Any, Config, Callable[[Config], tuple[Decision, Any]]], tuple[Config, str] | None]


@dataclasses.dataclass(frozen=True)
class Rule:
    name: str
    match: Callable[[GraphFacts], list[Any]]
    decide: Callable[[Any, Config], Decision]
    apply: Callable[[fx.GraphModule, Any, Config], None]
    choose: Chooser | None = None
    # Nodes left in place whose fate under torch.compile decides what the rewrite frees (``fxpass.pricing``).
    context: Callable[[Any], Sequence[fx.Node]] | None = None
    # Which figure of ``fxpass.pricing.Priced`` the decision weighs: "peak" for a piece that runs at the step's
    # peak (a language model's head, attention at the start of the backward), "saved" for one whose benefit is
    # the activation it stops holding across the step (its own transient buffers live in its layer only).
    priced_on: str = "peak"
    # A last say on a decision to apply, once what it frees is known (against torch.compile where priced): the
    # decision as it stands, or declined with why. WTA-CRS weighs a group's step time against its saving here.
    weigh: Callable[[Any, Decision, Config], Decision] | None = None


def decide_on_saving(memory: MemoryModel, config: Config, what: str) -> Decision:
    """Apply iff the modelled saving clears ``config.min_saved_bytes``; say how that was established."""
    verdict = clears(memory.saved, config.min_saved_bytes)
    return Decision(verdict.pays or config.force, _reason(verdict, config, what, ""), memory, verdict, what=what)


def decide_against_compile(decision: Decision, priced, config: Config, figure: str = "peak") -> Decision:
    """``decision`` taken again on what the rewrite frees against torch.compile (``priced``: the drop of the
    piece's peak, saved and transient parts named; ``figure``, which of them is weighed), the graph-as-written
    model kept for the record."""
    verdict = clears(getattr(priced, figure), config.min_saved_bytes)
    if figure == "saved":  # the piece's own peak, in its layer, is said beside it
        change = shapes.hint(priced.peak)
        moves = f"drops by {format_bytes(change)}" if change >= 0 else f"rises by {format_bytes(-change)}"
        split = f" (saved for the backward; the piece's own peak {moves})"
    else:
        split = (
            f" ({format_bytes(shapes.hint(priced.saved))} saved for the backward, "
            f"{format_bytes(shapes.hint(priced.transient))} transient)"
        )
    reason = _reason(verdict, config, decision.what, " against torch.compile" + split)
    return dataclasses.replace(decision, apply=verdict.pays or config.force, reason=reason, verdict=verdict,
                               priced=priced)


def _reason(verdict: Verdict, config: Config, what: str, against: str) -> str:
    how = "for every shape" if verdict.proof == "static" else "for the example shapes (size hints)"
    saving = format_bytes(verdict.saved_hint)
    if verdict.pays:
        reason = f"{what}; frees {saving}{against} {how}"
    elif config.force:
        reason = f"{what}; forced (force=True) although the saving is {saving}{against} {how}"
    else:
        reason = f"saving {saving}{against} is below min_saved_bytes={config.min_saved_bytes} {how}"
    return reason + _assumption(config)


def _assumption(config: Config) -> str:
    """Says which device's implementation the memory model charged, when it is not the graph's own."""
    if config.assume_device is None:
        return ""
    return f" (memory model of the {config.assume_device} implementation: assume_device={config.assume_device!r})"
