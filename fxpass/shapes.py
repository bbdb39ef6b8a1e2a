"""Symbolic memory reasoning: byte counts as expressions of the graph's shape symbols, decided without guards.

A rewrite decision must hold for every shape the compiled graph will see, or it must not constrain them:
installing a guard (``int(symint)``, ``guard_or_false`` on a backed size) would recompile the graph when the
batch size changes. So a decision is either *proved* with ``statically_known_true`` (no guard), or taken on
the size hint and recorded as such. This module is also the one place that papers over the torch 2.11–2.13
differences in the hint API.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import sympy
import torch
from torch.fx.experimental import symbolic_shapes

IntLike = int | torch.SymInt

# torch 2.13 renamed ``size_hint(symint, fallback)`` to ``optimization_hint``; both never install a guard.
_hint_fn = getattr(symbolic_shapes, "optimization_hint", None) or symbolic_shapes.size_hint

# Hint for sizes that have none (unbacked, data-dependent sizes such as a boolean-mask selection).
UNBACKED_FALLBACK = 4096


def hint(value: IntLike) -> int:
    """A concrete value for ``value`` to base an optimization on, without installing a guard."""
    if isinstance(value, torch.SymInt):
        return int(_hint_fn(value, fallback=UNBACKED_FALLBACK))
    return int(value)


def constant(value: IntLike) -> int | None:
    """``value`` as a Python int if it is one or a SymInt with a constant expression, else None (no guard)."""
    if isinstance(value, torch.SymInt):
        return int(value.node.expr) if value.node.expr.is_number else None
    return int(value)


def expr(value: IntLike) -> sympy.Expr:
    """The sympy expression behind ``value`` (a constant for a plain int)."""
    if isinstance(value, torch.SymInt):
        return value.node.expr
    return sympy.Integer(value)


def proved(condition: bool | torch.SymBool) -> bool:
    """Whether ``condition`` holds for every shape, decided without installing a guard."""
    return bool(symbolic_shapes.statically_known_true(condition))


def render(value: IntLike) -> str:
    """``value`` as a short string, e.g. ``'1608224*s27*s53 - 4096'``."""
    return str(sympy.expand(expr(value)))


def format_bytes(n: int) -> str:
    """``n`` bytes for people: "3.2 GiB", "12.0 MiB", "96.0 KiB", "-40 B"."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def numel(tensor: torch.Tensor) -> IntLike:
    n: IntLike = 1
    for size in tensor.shape:
        n = n * size
    return n


def nbytes(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> IntLike:
    """Bytes of ``tensor`` if stored contiguously with ``dtype`` (default: its own)."""
    return numel(tensor) * (dtype or tensor.dtype).itemsize


@dataclasses.dataclass(frozen=True)
class MemoryModel:
    """Bytes a candidate keeps alive before and after its rewrite, as named terms.

    Terms cover tensors saved for backward and the transient peak inside the replaced ops; the names are
    what the debug report shows so that a user can check the reasoning.
    """

    before: Mapping[str, IntLike]
    after: Mapping[str, IntLike]

    @property
    def saved(self) -> IntLike:
        return _total(self.before) - _total(self.after)

    def describe(self) -> dict[str, dict[str, str]]:
        return {
            "before": {name: render(v) for name, v in self.before.items()},
            "after": {name: render(v) for name, v in self.after.items()},
        }


def _total(terms: Mapping[str, IntLike]) -> IntLike:
    total: IntLike = 0
    for value in terms.values():
        total = total + value
    return total


@dataclasses.dataclass(frozen=True)
class Verdict:
    """Whether a saving clears the threshold, and how we know: ``proof`` is "static" or "hint"."""

    pays: bool
    proof: str
    saved_hint: int


def clears(saved: IntLike, threshold: int) -> Verdict:
    """Decide ``saved >= threshold`` for all shapes if provable either way, else on the hint."""
    at_least = saved >= threshold
    if not isinstance(at_least, torch.SymBool):
        return Verdict(bool(at_least), "static", int(saved))
    if symbolic_shapes.statically_known_true(at_least):
        return Verdict(True, "static", hint(saved))
    if symbolic_shapes.statically_known_true(saved < threshold):
        return Verdict(False, "static", hint(saved))
    saved_hint = hint(saved)
    return Verdict(saved_hint >= threshold, "hint", saved_hint)
