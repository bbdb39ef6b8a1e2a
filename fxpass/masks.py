"""Recognising causal masks from how a graph builds them, so attention can take a flag instead of a T×T tensor.

A boolean mask is read symbolically: it is *allowed* when it is true exactly where key j ≤ query i (the lower
triangle, ``torch.tril(torch.ones(Tq, Tk))``, i.e. ``F.scaled_dot_product_attention(is_causal=True)``), and
*future* when it is true exactly where j > i. The forms found in practice:

- comparisons of position indices: ``kv_idx <= q_idx`` (HF transformers' masking utilities), ``j > i``, with
  the indices built by ``arange`` (plus a constant 0) and placed on the last two dimensions;
- a lower-triangular matrix of ones, ``torch.tril(torch.ones(T, T))``, or a registered buffer holding one
  (nanoGPT), compared with ``== 0`` / ``== 1``, converted with ``.bool()``, cropped with ``[..., :T, :T]``;
- negation, ``expand``, ``view``, ``unsqueeze`` and ``[None]`` indexing in between.

Anything else is not causal as far as this module can prove; attention then keeps the mask as a bias.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fxpass.graph import is_call, is_method, tensor_value

ALLOWED = "allowed"  # true where j <= i
FUTURE = "future"  # true where j > i

# A way to read a placeholder's real value (the backend's example inputs), for constant mask buffers.
RealValue = Callable[[fx.Node], Any]


@dataclasses.dataclass(frozen=True)
class Index:
    """``arange(n) + offset`` laid along dimension ``axis`` (counted from the end) of a broadcastable tensor."""

    axis: int
    offset: int


@dataclasses.dataclass(frozen=True)
class Tril:
    """A tensor of ones on and below the diagonal of its last two dimensions (zeros above)."""


def causal_kind(node: Any, real_value: RealValue) -> str | None:
    """``ALLOWED``, ``FUTURE`` or None for a boolean mask node."""
    value = _as_boolean(node, _evaluate(node, real_value))
    return value if value in (ALLOWED, FUTURE) else None


def _as_boolean(node: Any, value):
    """A boolean tril(ones) is the set of allowed pairs itself."""
    known = tensor_value(node) if isinstance(node, fx.Node) else None
    if isinstance(value, Tril) and known is not None and known.dtype == torch.bool:
        return ALLOWED
    return value


def _evaluate(node: Any, real_value: RealValue):
    """Symbolic value of ``node``: ALLOWED / FUTURE (booleans), Tril (numbers), Index, or None (unknown)."""
    if not isinstance(node, fx.Node):
        return None
    if _is_view_like(node):
        inner = _evaluate(node.args[0], real_value)
        if isinstance(inner, Index):
            return _moved_index(node, inner)
        return inner if _keeps_mask_geometry(node) else None
    if node.op == "placeholder":
        return _constant_tril(real_value(node))
    if is_call(node, torch.tril) or is_method(node, "tril"):
        return Tril() if _is_ones(node.args[0]) and _diagonal(node) == 0 else None
    if is_call(node, operator.invert, torch.logical_not) or is_method(node, "logical_not", "bitwise_not"):
        inner = _as_boolean(node.args[0], _evaluate(node.args[0], real_value))
        return {ALLOWED: FUTURE, FUTURE: ALLOWED}.get(inner)
    if is_call(node, torch.arange):
        return _arange(node)
    if is_call(node, operator.add, torch.add) and len(node.args) == 2:
        return _shifted(node, real_value)
    if node.op in ("call_function", "call_method") and len(node.args) == 2:
        return _comparison(node, real_value)
    return None


_VIEW_METHODS = ("expand", "expand_as", "view", "reshape", "unsqueeze", "contiguous", "bool", "float", "to", "long")


def _is_view_like(node: fx.Node) -> bool:
    if is_method(node, *_VIEW_METHODS) or is_call(node, torch.unsqueeze):
        return True
    return is_call(node, operator.getitem) and tensor_value(node.args[0]) is not None


def _keeps_mask_geometry(node: fx.Node) -> bool:
    """The op moves values without changing which (i, j) pairs are true: views, casts, top-left crops."""
    if is_call(node, operator.getitem):
        return _crop_is_top_left(node.args[1]) and _keeps_last_two_dims(node)
    return _keeps_last_two_dims(node)


def _moved_index(node: fx.Node, index: Index) -> Index | None:
    """Where an index vector lies after unsqueeze / [None] / view / expand: the one dimension not of size 1."""
    out = tensor_value(node)
    if out is None:
        return None
    if is_method(node, "expand", "expand_as"):
        return index  # expanding broadcast dims leaves the index's own dimension in place
    wide = [d for d, size in enumerate(out.shape) if not statically_known_true(size == 1)]
    if len(wide) != 1:
        return None
    return dataclasses.replace(index, axis=wide[0] - out.dim())


def _keeps_last_two_dims(node: fx.Node) -> bool:
    """The op leaves the last two dimensions' meaning in place (a crop may shorten them)."""
    src, out = tensor_value(node.args[0]), tensor_value(node)
    if src is None or out is None or src.dim() < 2 or out.dim() < 2:
        return src is not None and out is not None and src.dim() == out.dim()
    if is_method(node, "view", "reshape"):
        return all(statically_known_true(a == b) for a, b in zip(src.shape[-2:], out.shape[-2:], strict=True))
    return True


def _crop_is_top_left(index: Any) -> bool:
    """Indexing that only adds/crops leading dims and keeps [:T] prefixes of the last two."""
    entries = index if isinstance(index, tuple) else (index,)
    for entry in entries:
        if entry is None or entry is Ellipsis:
            continue
        if not isinstance(entry, slice) or entry.step not in (None, 1) or entry.start not in (None, 0):
            return False
    return True


def _is_ones(node: Any) -> bool:
    return isinstance(node, fx.Node) and (is_call(node, torch.ones) or is_method(node, "new_ones"))


def _diagonal(node: fx.Node) -> Any:
    if len(node.args) > 1:
        return node.args[1]
    return node.kwargs.get("diagonal", 0)


def _constant_tril(tensor: Any):
    """A mask buffer whose real value is tril(ones) in its last two dimensions (checked at compile time)."""
    if not isinstance(tensor, torch.Tensor) or tensor.dim() < 2 or tensor.requires_grad:
        return None
    rows, cols = tensor.shape[-2:]
    expected = torch.tril(torch.ones(rows, cols, dtype=tensor.dtype, device=tensor.device))
    flat = tensor.reshape(-1, rows, cols)
    return Tril() if all(torch.equal(m, expected) for m in flat) else None


def _arange(node: fx.Node):
    """``arange(n)`` (start 0, step 1) on the last dimension."""
    if len(node.args) == 1 and not {"start", "step"} & set(node.kwargs):
        return Index(axis=-1, offset=0)
    return None


def _shifted(node: fx.Node, real_value: RealValue):
    base, other = node.args
    if isinstance(other, fx.Node):
        base, other = other, base
    value = _evaluate(base, real_value)
    if isinstance(value, Index) and isinstance(other, int):
        return dataclasses.replace(value, offset=value.offset + other)
    return None


_COMPARISONS = {
    operator.le: "le", torch.le: "le", "le": "le", operator.ge: "ge", torch.ge: "ge", "ge": "ge",
    operator.lt: "lt", torch.lt: "lt", "lt": "lt", operator.gt: "gt", torch.gt: "gt", "gt": "gt",
    operator.eq: "eq", torch.eq: "eq", "eq": "eq", operator.ne: "ne", torch.ne: "ne", "ne": "ne",
}


def _comparison(node: fx.Node, real_value: RealValue):
    op = _COMPARISONS.get(node.target) if node.op in ("call_function", "call_method") else None
    if op is None:
        return None
    left, right = node.args
    lhs, rhs = _evaluate(left, real_value), _evaluate(right, real_value)
    if isinstance(lhs, Tril) and right in (0, 1, 0.0, 1.0) and op in ("eq", "ne"):
        return ALLOWED if (op == "eq") == (right in (1, 1.0)) else FUTURE
    if isinstance(lhs, Index) and isinstance(rhs, Index) and lhs.offset == rhs.offset:
        return _index_comparison(op, lhs, rhs)
    return None


def _index_comparison(op: str, lhs: Index, rhs: Index):
    """``kv <= q`` is ALLOWED when kv runs along the last dim and q along the one before."""
    if {lhs.axis, rhs.axis} != {-1, -2}:
        return None
    kv_left = lhs.axis == -1
    if op in ("le", "ge"):
        return ALLOWED if (op == "le") == kv_left else None
    if op in ("gt", "lt"):
        return FUTURE if (op == "gt") == kv_left else None
    return None


