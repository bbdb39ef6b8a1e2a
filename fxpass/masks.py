"""Proving what a boolean attention mask keeps from how the graph builds it, so attention can take O(B·T) facts
(a causal flag, per-sequence key masks) instead of a T×T tensor.

A boolean mask is read symbolically as a set of (batch b, query i, key j) pairs (``Pairs``): the conjunction of
atoms, or its complement. The atoms are

- ``Diagonal``: ``j − i ≤ c`` or ``j − i > c``. ``j ≤ i`` is the causal lower triangle
  (``F.scaled_dot_product_attention(is_causal=True)``); ``j > i − w`` with it is a sliding window of w keys;
- ``Keys``: a boolean tensor that has size 1 on the query (and head) dimension, so it depends on the batch and
  the key only (a padding mask ``attention_mask[:, None, None, :]``, or transformers' ``padding_mask[b_idx, kv_idx]``).
  It is already O(B·T), so how it was built does not matter.

The forms found in practice: comparisons of position indices (``kv_idx <= q_idx``, ``kv_idx > q_idx - w``, with
the indices built by ``arange`` plus a constant and placed on the last two dimensions), a lower-triangular matrix
of ones (``torch.tril(torch.ones(T, T))``, or a registered buffer holding one, compared with ``== 0`` / ``== 1``),
``&`` / ``|`` / ``~`` between them (transformers' ``and_masks`` starts from ``new_ones((), dtype=bool)``), and
``expand``, ``view``, ``unsqueeze``, ``[None]`` indexing and casts in between. ``kept(node)`` turns the result into
a ``Structure`` or says why it cannot; anything it cannot prove stays a tensor.
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


@dataclasses.dataclass(frozen=True)
class Constant:
    """A tensor whose every element is ``value``: transformers' packed-sequence ids of unpacked positions."""

    value: Any


@dataclasses.dataclass(frozen=True)
class Diagonal:
    """``j − i ≤ bound`` (op "le") or ``j − i > bound`` (op "gt") for key j and query i."""

    op: str
    bound: int

    def negated(self) -> Diagonal:
        return Diagonal("gt" if self.op == "le" else "le", self.bound)


@dataclasses.dataclass(frozen=True)
class Keys:
    """``node[b, 0, 0, j]`` (or its negation): a boolean tensor of size 1 on the query and head dimensions."""

    node: fx.Node
    positive: bool = True

    def negated(self) -> Keys:
        return Keys(self.node, not self.positive)


Atom = Diagonal | Keys


@dataclasses.dataclass(frozen=True)
class Pairs:
    """The pairs a boolean mask marks true: the conjunction of ``atoms`` (every pair when there are none), or with
    ``complement`` every pair outside it. A single atom is never complemented (its negation is an atom)."""

    atoms: frozenset[Atom] = frozenset()
    complement: bool = False


TRUE = Pairs()
FALSE = Pairs(complement=True)
CAUSAL = Pairs(frozenset({Diagonal("le", 0)}))  # j <= i
FUTURE = Pairs(frozenset({Diagonal("gt", 0)}))  # j > i


@dataclasses.dataclass(frozen=True)
class Structure:
    """What a mask keeps, as O(B·T) facts: key j ≤ query i (``causal``), and j > i − ``window`` (a sliding window,
    only with causal), and every ``keys`` tensor true at (b, j)."""

    causal: bool = False
    keys: tuple[Keys, ...] = ()
    window: int | None = None


def kept(node: Any, real_value: RealValue, *, complement: bool = False) -> Structure | str:
    """The structure of the pairs boolean ``node`` is true on (with ``complement``: false on), or why it is unknown."""
    memo: dict = {}
    value = _as_pairs(node, _evaluate(node, real_value, memo))
    if not isinstance(value, Pairs):
        if any(isinstance(part, Pairs) and part.complement and part.atoms for part in memo.values()):
            return "the mask is a union of conditions (or_masks), not an intersection"
        name = node.name if isinstance(node, fx.Node) else repr(node)
        return f"{name} is not built from position comparisons, tril/ones or per-key tensors"
    if complement:
        value = _negate(value)
    if value.complement:
        return "the mask is a union of conditions (or_masks), not an intersection" if value.atoms else (
            "the mask hides every pair"
        )
    return _structure(value)


def _structure(value: Pairs) -> Structure | str:
    """Diagonal atoms as an interval of j − i: (lower, upper]; causal is upper = 0, a window is lower = −w."""
    uppers = [a.bound for a in value.atoms if isinstance(a, Diagonal) and a.op == "le"]
    lowers = [a.bound for a in value.atoms if isinstance(a, Diagonal) and a.op == "gt"]
    upper, lower = (min(uppers) if uppers else None), (max(lowers) if lowers else None)
    if upper not in (None, 0):
        return f"its diagonal is shifted (keys j <= i + {upper}), not the causal j <= i"
    if lower is not None and upper is None:
        return f"it keeps keys after the query (j - i > {lower}) without a causal bound"
    if lower is not None and lower >= 0:
        return "it hides every pair (an empty band)"
    keys = tuple(sorted((a for a in value.atoms if isinstance(a, Keys)), key=lambda a: (a.node.name, a.positive)))
    return Structure(causal=upper == 0, keys=keys, window=-lower if lower is not None else None)


# --- the algebra of Pairs -------------------------------------------------------------------------------------


def _canonical(value: Pairs) -> Pairs:
    if value.complement and len(value.atoms) == 1:
        (atom,) = value.atoms
        return Pairs(frozenset({atom.negated()}))
    return value


def _negate(value: Pairs) -> Pairs:
    return _canonical(Pairs(value.atoms, not value.complement))


def _and(a: Pairs, b: Pairs) -> Pairs | None:
    if FALSE in (a, b):
        return FALSE
    if TRUE in (a, b):
        return b if a == TRUE else a
    if a.complement or b.complement:
        return None  # (not a conjunction) and ...: not a conjunction
    return Pairs(a.atoms | b.atoms)


def _or(a: Pairs, b: Pairs) -> Pairs | None:
    both = _and(_negate(a), _negate(b))
    return _negate(both) if both is not None else None


# --- symbolic evaluation ------------------------------------------------------------------------------------


def _as_pairs(node: Any, value):
    """A boolean tril(ones) is the causal set of pairs itself."""
    known = tensor_value(node) if isinstance(node, fx.Node) else None
    if isinstance(value, Tril) and known is not None and known.dtype == torch.bool:
        return CAUSAL
    if isinstance(value, Constant) and known is not None and known.dtype == torch.bool:
        return TRUE if value.value else FALSE
    return value


def _evaluate(node: Any, real_value: RealValue, memo: dict):
    """Symbolic value of ``node``: Pairs (booleans), Tril (numbers), Index, or None (unknown)."""
    if not isinstance(node, fx.Node):
        return None
    if node not in memo:
        value = _evaluate_op(node, real_value, memo)
        memo[node] = value if value is not None else _per_key(node)
    return memo[node]


def _evaluate_op(node: fx.Node, real_value: RealValue, memo: dict):
    if _is_gather(node):
        return _gathered(node, real_value, memo)
    if _is_view_like(node):
        inner = _evaluate(node.args[0], real_value, memo)
        if isinstance(inner, Constant):
            return inner  # views, casts and crops of a uniform tensor stay uniform
        if isinstance(inner, Index):
            return _moved_index(node, inner)
        if isinstance(inner, Pairs) and any(isinstance(a, Keys) for a in inner.atoms):
            # A per-key atom is read as [..., B, 1, 1, Tk]: only ops that keep every dimension's meaning keep it.
            return inner if is_method(node, "expand", "expand_as", "bool", "to", "contiguous") else None
        return inner if _keeps_mask_geometry(node) else None
    if node.op == "placeholder":
        return _constant_tril(real_value(node))
    if is_call(node, torch.tril) or is_method(node, "tril"):
        return Tril() if _is_ones(node.args[0]) and _diagonal(node) == 0 else None
    if _is_bool_ones(node):
        return TRUE
    if (is_method(node, "new_zeros") or is_call(node, torch.zeros)) and _is_bool(node):
        return FALSE  # transformers' or_masks starts from new_zeros((), dtype=bool)
    if is_call(node, operator.invert, torch.logical_not, torch.bitwise_not) or is_method(
        node, "logical_not", "bitwise_not"
    ):
        inner = _as_pairs(node.args[0], _evaluate(node.args[0], real_value, memo))
        return _negate(inner) if isinstance(inner, Pairs) and _is_bool(node.args[0]) else None
    if is_call(node, torch.arange):
        return _arange(node)
    if is_call(node, torch.diff) or is_method(node, "diff"):
        return _diff(node, real_value, memo)
    if is_method(node, "cumsum") or is_call(node, torch.cumsum):
        inner = _evaluate(node.args[0], real_value, memo)
        return inner if isinstance(inner, Constant) and inner.value == 0 else None  # running sums of zeros
    if is_call(node, operator.add, torch.add, operator.sub, torch.sub) and len(node.args) == 2 and not node.kwargs:
        return _shifted(node, real_value, memo)
    if (is_call(node, *_AND, *_OR) or is_method(node, *_AND_METHODS, *_OR_METHODS)) and len(node.args) == 2:
        return _logical(node, real_value, memo)
    if node.op in ("call_function", "call_method") and len(node.args) == 2:
        return _comparison(node, real_value, memo)
    return None


def _per_key(node: fx.Node) -> Pairs | None:
    """A boolean tensor of at most 4 dims with size 1 on the query dim (and the head dim): a per-key atom."""
    value = tensor_value(node)
    if value is None or value.dtype != torch.bool or not 1 <= value.dim() <= 4:
        return None
    if value.dim() >= 2 and not statically_known_true(value.shape[-2] == 1):
        return None
    if value.dim() >= 3 and not statically_known_true(value.shape[-3] == 1):
        return None
    return Pairs(frozenset({Keys(node)}))


def _is_bool(node: Any) -> bool:
    value = tensor_value(node)
    return value is not None and value.dtype == torch.bool


_AND = (operator.and_, torch.logical_and, torch.bitwise_and)
_OR = (operator.or_, torch.logical_or, torch.bitwise_or)
_AND_METHODS = ("logical_and", "bitwise_and")
_OR_METHODS = ("logical_or", "bitwise_or")


def _logical(node: fx.Node, real_value: RealValue, memo: dict) -> Pairs | None:
    """``a & b`` and ``a | b`` of booleans (bitwise ops on integers are not logic)."""
    left, right = node.args
    if not (_is_bool(left) and _is_bool(right)):
        return None
    a = _as_pairs(left, _evaluate(left, real_value, memo))
    b = _as_pairs(right, _evaluate(right, real_value, memo))
    if not (isinstance(a, Pairs) and isinstance(b, Pairs)):
        return None
    conjunction = is_call(node, *_AND) or is_method(node, *_AND_METHODS)
    return _and(a, b) if conjunction else _or(a, b)


def _is_bool_ones(node: fx.Node) -> bool:
    """``x.new_ones(..., dtype=torch.bool)`` or ``torch.ones(..., dtype=torch.bool)``: every pair."""
    return (is_method(node, "new_ones") or is_call(node, torch.ones)) and _is_bool(node)


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
    if is_call(node, operator.getitem) and not _crop_is_top_left(node.args[1]):
        return None
    entries = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
    if is_call(node, operator.getitem) and all(isinstance(entry, slice) for entry in entries):
        # prefix crops keep each dimension: the index keeps its axis, and a crop to one element is its first value
        return Constant(index.offset) if statically_known_true(out.shape[index.axis] == 1) else index
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


def _shifted(node: fx.Node, real_value: RealValue, memo: dict):
    """``index + c``, ``c + index`` and ``index - c`` (transformers: ``q_idx - sliding_window``)."""
    base, other = node.args
    subtract = is_call(node, operator.sub, torch.sub)
    if isinstance(other, fx.Node):
        if subtract:
            return None
        base, other = other, base
    value = _evaluate(base, real_value, memo)
    if isinstance(value, Index | Constant) and isinstance(other, int) and not isinstance(other, bool):
        shift = -other if subtract else other
        if isinstance(value, Constant):
            return Constant(value.value + shift) if isinstance(value.value, int) else None
        return dataclasses.replace(value, offset=value.offset + shift)
    return None


_COMPARISONS = {
    operator.le: "le", torch.le: "le", "le": "le", operator.ge: "ge", torch.ge: "ge", "ge": "ge",
    operator.lt: "lt", torch.lt: "lt", "lt": "lt", operator.gt: "gt", torch.gt: "gt", "gt": "gt",
    operator.eq: "eq", torch.eq: "eq", "eq": "eq", operator.ne: "ne", torch.ne: "ne", "ne": "ne",
}
_MIRRORED = {"le": "ge", "ge": "le", "lt": "gt", "gt": "lt", "eq": "eq", "ne": "ne"}


def _comparison(node: fx.Node, real_value: RealValue, memo: dict):
    op = _COMPARISONS.get(node.target)
    if op is None:
        return None
    left, right = node.args
    lhs, rhs = _evaluate(left, real_value, memo), _evaluate(right, real_value, memo)
    if isinstance(lhs, Tril | Pairs) and right in (0, 1, 0.0, 1.0) and op in ("eq", "ne"):
        as_set = CAUSAL if isinstance(lhs, Tril) else lhs
        return as_set if (op == "eq") == (right in (1, 1.0)) else _negate(as_set)
    if isinstance(lhs, Constant) or isinstance(rhs, Constant):
        return _constant_comparison(op, lhs if isinstance(lhs, Constant) else left, rhs if isinstance(rhs, Constant)
                                    else right)
    if isinstance(lhs, Index) and isinstance(rhs, Index):
        return _index_comparison(op, lhs, rhs)
    if isinstance(lhs, Index) and isinstance(right, int):
        return _index_against_constant(op, lhs, right)
    if isinstance(rhs, Index) and isinstance(left, int):
        return _index_against_constant(_MIRRORED[op], rhs, left)
    return None


def _index_comparison(op: str, lhs: Index, rhs: Index) -> Pairs | None:
    """``kv + a OP q + b`` with kv on the last dim and q on the one before: a bound on j − i."""
    if {lhs.axis, rhs.axis} != {-1, -2}:
        return None
    if lhs.axis == -2:
        lhs, rhs, op = rhs, lhs, _MIRRORED[op]
    shift = rhs.offset - lhs.offset  # j + a OP i + b  <=>  j - i OP b - a
    atom = {
        "le": Diagonal("le", shift), "lt": Diagonal("le", shift - 1),
        "gt": Diagonal("gt", shift), "ge": Diagonal("gt", shift - 1),
    }.get(op)
    return Pairs(frozenset({atom})) if atom is not None else None


def _index_against_constant(op: str, index: Index, constant: int) -> Pairs | None:
    """``arange(n) + offset OP c`` that holds for every position (transformers' bidirectional ``q_idx >= 0``)."""
    if (op == "ge" and index.offset >= constant) or (op == "gt" and index.offset > constant):
        return TRUE
    return None


_COMPARE = {"le": operator.le, "ge": operator.ge, "lt": operator.lt, "gt": operator.gt, "eq": operator.eq,
            "ne": operator.ne}


def _constant_comparison(op: str, lhs: Any, rhs: Any) -> Constant | None:
    """Two uniform tensors (or one and a number) compare to a uniform boolean."""
    values = [side.value if isinstance(side, Constant) else side for side in (lhs, rhs)]
    if not all(isinstance(v, int | bool) for v in values):
        return None
    return Constant(bool(_COMPARE[op](*values)))


def _diff(node: fx.Node, real_value: RealValue, memo: dict) -> Constant | None:
    """``torch.diff`` of positions along their own (last) dimension is all ones: with ``prepend`` one less than
    the first position, as transformers builds packed-sequence ids (``find_packed_sequence_indices``), too."""
    arguments = dict(zip(("input", "n", "dim", "prepend", "append"), node.args, strict=False)) | dict(node.kwargs)
    positions = _evaluate(arguments["input"], real_value, memo)
    if not isinstance(positions, Index) or positions.axis != -1 or arguments.get("n", 1) != 1:
        return None
    if arguments.get("dim", -1) not in (-1, tensor_value(node).dim() - 1) or arguments.get("append") is not None:
        return None
    prepend = arguments.get("prepend")
    if prepend is not None:  # one column (a wider uniform block would add zero differences) of position − 1
        width = tensor_value(prepend).shape[-1] if tensor_value(prepend) is not None else None
        if width is None or not statically_known_true(width == 1):
            return None
        if _evaluate(prepend, real_value, memo) != Constant(positions.offset - 1):
            return None
    return Constant(1)


def _is_gather(node: fx.Node) -> bool:
    """``x[(rows, cols)]`` with two index tensors: transformers reads ``position_ids[batch_idx, q_idx]``."""
    if not is_call(node, operator.getitem) or not isinstance(node.args[1], tuple) or len(node.args[1]) != 2:
        return False
    return all(isinstance(entry, fx.Node) for entry in node.args[1])


def _gathered(node: fx.Node, real_value: RealValue, memo: dict):
    """``positions[b, i]`` over positions laid along the last dim of a 2-D tensor: position i, on i's axis; a
    uniform tensor gathers to itself. Every row holds the same values, so the row index does not matter (one
    out of range fails at run time, as eager does)."""
    base, (_, cols) = _evaluate(node.args[0], real_value, memo), node.args[1]
    source = tensor_value(node.args[0])
    if source is None or source.dim() != 2:
        return None
    if isinstance(base, Constant):
        return base
    where = _evaluate(cols, real_value, memo)
    if isinstance(base, Index) and base.axis == -1 and isinstance(where, Index) and where.offset >= 0:
        return dataclasses.replace(where, offset=where.offset + base.offset)  # (a negative index would wrap)
    return None
