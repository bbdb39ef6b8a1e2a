"""Queries and edits on Dynamo's torch-IR graph, shared by every rule.

Dynamo graphs name ops in three ways (``call_function`` on a Python function or builtin, ``call_method`` with
a string target, ``getattr`` on a tensor), so "is this a view?" questions live here once rather than in each
rule. Edits keep ``meta["example_value"]`` filled (computed with the graph's own fake mode, not
``detect_fake_mode()``, which returns a second mode that cannot mix with the first) and carry the user's
``stack_trace`` onto new nodes so reports and Inductor's comments still point at user code.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import operator
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
import torch.utils._pytree as pytree

# Metadata worth carrying from a replaced node to the nodes that replace it.
_CARRIED_META = ("stack_trace", "nn_module_stack", "source_fn_stack", "seq_nr")


def example_value(node: Any) -> Any:
    """The fake value Dynamo recorded for ``node``; constants and non-nodes are returned as they are."""
    if isinstance(node, fx.Node):
        return node.meta.get("example_value")
    return node


def tensor_value(node: Any) -> torch.Tensor | None:
    value = example_value(node)
    return value if isinstance(value, torch.Tensor) else None


def is_call(node: fx.Node, *targets: Any) -> bool:
    return node.op == "call_function" and node.target in targets


def is_method(node: fx.Node, *names: str) -> bool:
    return node.op == "call_method" and node.target in names


def bind_args(node: fx.Node, names: Sequence[str], defaults: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """Bind a call's positional and keyword args to parameter ``names`` (builtins have no signature).

    Returns None if the call passes more positional args than ``names`` or an unknown or duplicate keyword.
    """
    if len(node.args) > len(names):
        return None
    bound = dict(defaults or {})
    bound.update(zip(names, node.args, strict=False))
    for key, value in node.kwargs.items():
        if key not in names or names.index(key) < len(node.args):
            return None
        bound[key] = value
    return bound


# F.scaled_dot_product_attention as Dynamo records it, and its parameters (builtins have no signature to bind).
SDPA_TARGETS = (F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention)
SDPA_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


def bind_sdpa(node: fx.Node) -> dict[str, Any] | None:
    """An SDPA call's arguments by name, defaults filled in; None for any other node."""
    return bind_args(node, SDPA_NAMES, SDPA_DEFAULTS) if is_call(node, *SDPA_TARGETS) else None


# --- view-like ops: ops that move, cast or reshape a tensor without computing on its values ---------------


# Operator dunders a Dynamo graph may call as methods (torch 2.11 writes ``mask == 0`` as ``mask.__eq__(0)``;
# 2.13 as ``operator.eq``), with the function each stands for and whether its operands are reflected.
_OPERATOR_DUNDERS: dict[str, tuple[Callable[..., Any], bool]] = {
    **{f"__{name}__": (getattr(operator, name, None) or getattr(operator, name + "_"), False) for name in (
        "eq", "ne", "lt", "le", "gt", "ge", "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul",
        "and", "or", "xor", "getitem", "invert", "neg", "pos", "abs",
    )},
    **{f"__r{name}__": (getattr(operator, name, None) or getattr(operator, name + "_"), True) for name in (
        "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor",
    )},
}


def canonicalize_operator_methods(graph: fx.Graph) -> int:
    """Rewrite ``x.__eq__(y)``-style method calls on tensors into ``operator.eq(x, y)``; return how many.

    Rules then match one spelling whatever the torch version traced (see ``_OPERATOR_DUNDERS``)."""
    changed = 0
    for node in graph.nodes:
        if node.op != "call_method" or node.kwargs or node.target not in _OPERATOR_DUNDERS:
            continue
        function, reflected = _OPERATOR_DUNDERS[node.target]
        if tensor_value(node.args[0]) is None or len(node.args) > 2:
            continue
        node.op, node.target = "call_function", function
        if reflected and len(node.args) == 2:
            node.args = (node.args[1], node.args[0])
        changed += 1
    return changed


class ViewKind(enum.Enum):
    CAST = "cast"  # dtype change: .float(), .to(dtype), .type(dtype)
    COPY = "copy"  # same values: .contiguous(), .clone()
    RESHAPE = "reshape"  # view/reshape/flatten
    INDEX = "index"  # getitem with slices, ints, ellipsis or index tensors


_CAST_METHODS = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16, "double": torch.float64}

# Copies as Dynamo records them when written as functions rather than methods (``torch.clone(x)``, an ATen overload
# called directly); ``x.contiguous()``, ``x.clone()`` and ``torch.Tensor.contiguous(x)`` arrive as method calls.
CONTIGUOUS_TARGETS: tuple[Any, ...] = (torch.Tensor.contiguous, torch.ops.aten.contiguous.default)
COPY_TARGETS: tuple[Any, ...] = (
    torch.clone, torch.Tensor.clone, torch.ops.aten.clone.default, *CONTIGUOUS_TARGETS,
)


def view_kind(node: fx.Node) -> ViewKind | None:
    """How ``node`` relates its output to its first input, if it only moves or casts values."""
    if node.op == "call_method":
        if node.target in _CAST_METHODS:
            return ViewKind.CAST
        if node.target in ("to", "type") and _is_dtype_only_conversion(node):
            return ViewKind.CAST
        if node.target in ("contiguous", "clone"):
            return ViewKind.COPY
        if node.target in ("view", "reshape", "flatten") and not _is_dtype_view(node):
            return ViewKind.RESHAPE
        return None
    if node.op == "call_function":
        if node.target in (torch.reshape, torch.flatten):
            return ViewKind.RESHAPE
        if node.target in COPY_TARGETS:
            return ViewKind.COPY
        if node.target is operator.getitem and tensor_value(node.args[0]) is not None:
            return ViewKind.INDEX
    return None


def copy_memory_format(node: fx.Node) -> torch.memory_format | None:
    """The memory format a copy (``view_kind`` COPY) promises its result, or None where it keeps its input's
    layout or is no copy: ``contiguous`` promises ``torch.contiguous_format`` unless told another; ``clone``
    preserves the layout unless told one. A rule that stands a tensor of its own making in for the copy knows
    from it whether that tensor's layout is the one promised."""
    if view_kind(node) is not ViewKind.COPY:
        return None
    contiguous = is_method(node, "contiguous") or is_call(node, *CONTIGUOUS_TARGETS)
    named = node.kwargs.get("memory_format", node.args[1] if len(node.args) > 1 else None)
    form = named if named is not None else (torch.contiguous_format if contiguous else torch.preserve_format)
    return None if form is torch.preserve_format else form


def _is_dtype_only_conversion(node: fx.Node) -> bool:
    """``x.to(...)`` / ``x.type(...)`` that changes at most the dtype, not the device or layout."""
    src, out = tensor_value(node.args[0]), tensor_value(node)
    if src is None or out is None:
        return False
    return src.device == out.device and src.layout == out.layout and out.shape == src.shape


def _is_dtype_view(node: fx.Node) -> bool:
    """``x.view(torch.int8)`` reinterprets bytes; it is not a reshape."""
    return any(isinstance(a, torch.dtype) for a in (*node.args[1:], *node.kwargs.values()))


def is_param_transpose(node: fx.Node) -> bool:
    """``W.T``, ``W.t()``, ``torch.t(W)``, ``W.transpose(0, 1)``, ``W.permute(1, 0)`` on a 2-D tensor."""
    src = tensor_value(node.args[0]) if node.args else None
    if src is None or src.dim() != 2:
        return False
    if node.op == "call_function" and node.target is getattr:
        return node.args[1] in ("T", "mT", "H") and not src.is_complex()
    if is_call(node, torch.t) or is_method(node, "t"):
        return True
    if is_method(node, "transpose") or is_call(node, torch.transpose):
        dims = {d % 2 for d in node.args[1:3]}
        return dims == {0, 1}
    if is_method(node, "permute"):
        order = node.args[1] if len(node.args) == 2 else node.args[1:]
        return tuple(d % 2 for d in order) == (1, 0)
    return False


# --- the graph as a whole ---------------------------------------------------------------------------------


@dataclasses.dataclass
class GraphFacts:
    """Use-def facts about one graph, computed once per rule pass.

    ``example_inputs`` are the real tensors the backend was called with, one per placeholder: constant buffers
    (a registered ``tril`` mask) can be read from them, since Dynamo's example values are fake.
    """

    gm: fx.GraphModule
    example_inputs: Sequence[Any] = ()

    def real_value(self, node: fx.Node) -> Any:
        """The real tensor behind a placeholder, if the backend was given one, else None."""
        if node.op != "placeholder" or not self.example_inputs:
            return None
        placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(self.example_inputs):
            return None
        return self.example_inputs[placeholders.index(node)]

    @functools.cached_property
    def output(self) -> fx.Node:
        return next(n for n in reversed(self.gm.graph.nodes) if n.op == "output")

    def outside_users(
        self, nodes: Iterable[fx.Node], inside: Iterable[fx.Node] = ()
    ) -> list[tuple[fx.Node, fx.Node]]:
        """(node, user) pairs where a user of ``nodes`` lies outside ``nodes`` and ``inside``."""
        nodes = list(nodes)
        region = {*nodes, *inside}
        return [(n, u) for n in nodes for u in n.users if u not in region]


def source_location(node: fx.Node) -> str | None:
    """``file:line`` of the innermost user frame that created ``node``."""
    trace = node.meta.get("stack_trace")
    if not trace:
        return None
    frames = re.findall(r'File "([^"]+)", line (\d+)', trace)
    if not frames:
        return None
    file, line = frames[-1]
    return f"{file}:{line}"


def describe_node(node: fx.Node) -> str:
    """``name = target(...)`` at file:line, for reasons in reports."""
    target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    where = source_location(node)
    return f"{node.name} ({node.op} {target})" + (f" at {where}" if where else "")


def fake_mode_of(nodes: Iterable[fx.Node]):
    """The fake mode that produced these nodes' example values (Dynamo's, shared ShapeEnv)."""
    for node in nodes:
        for value in pytree.tree_leaves(example_value(node)):
            fake_mode = getattr(value, "fake_mode", None)
            if fake_mode is not None:
                return fake_mode
    return None


def _fake_args(args: Any) -> Any:
    return fx.node.map_arg(args, example_value)


def propagate_example_value(node: fx.Node, fake_mode) -> None:
    """Compute ``node.meta['example_value']`` by running it on its inputs' fake values."""
    args, kwargs = _fake_args(node.args), _fake_args(node.kwargs)
    with fake_mode:
        if node.op == "call_method":
            value = getattr(args[0], node.target)(*args[1:], **kwargs)
        elif node.op == "call_function":
            value = node.target(*args, **kwargs)
        else:
            raise ValueError(f"cannot propagate example values through {node.op} node {node.name}")
    node.meta["example_value"] = value


def insert_node(
    graph: fx.Graph,
    op: str,
    target: Any,
    args: Sequence[Any],
    kwargs: dict[str, Any] | None = None,
    *,
    meta_from: fx.Node,
    fake_mode,
) -> fx.Node:
    """Insert a node at the graph's current insertion point with example value and user metadata."""
    node = graph.create_node(op, target, tuple(args), kwargs or {})
    for key in _CARRIED_META:
        if key in meta_from.meta:
            node.meta[key] = meta_from.meta[key]
    propagate_example_value(node, fake_mode)
    return node


def cast_to(add: Callable[..., fx.Node], node: fx.Node, dtype: torch.dtype) -> fx.Node:
    """``node`` in ``dtype``, through a ``.to`` node made with ``add`` if it is not already.

    Rewrites call this to reproduce autocast: a matmul that ran under autocast shows operands of one dtype
    and an output of another, and the replacement op must compute in the output's dtype as autocast did.
    """
    value = tensor_value(node)
    return node if value is None or value.dtype == dtype else add("call_method", "to", node, dtype)


def position_in(graph: fx.Graph) -> Callable[[fx.Node], int]:
    """A key giving each node of ``graph`` its place in graph order (for ``min``/``sorted`` over nodes)."""
    order = {node: index for index, node in enumerate(graph.nodes)}
    return order.__getitem__


# Meta key of a node a rewrite replaced (and erased): the node that now computes its value. Candidates are
# matched before any is applied, so one may name a node an earlier rewrite replaced (LoRA's B reads A's output).
REPLACED_BY = "memopt_replaced_by"


def current(node: fx.Node) -> fx.Node:
    """What ``node`` is now: itself, or what the rewrites applied since it was matched replaced it with."""
    while REPLACED_BY in node.meta:
        node = node.meta[REPLACED_BY]
    return node


def erase_unused(nodes: Iterable[fx.Node]) -> None:
    """Erase those of ``nodes`` left without users (users are erased before the nodes they read).

    Placeholders stay: erasing one would change the compiled function's signature.
    """
    pending = {node for node in nodes if node.op in ("call_function", "call_method")}
    if not pending:
        return
    graph = next(iter(pending)).graph
    for node in reversed(list(graph.nodes)):
        if node in pending and not node.users:
            graph.erase_node(node)


def copy_graph(graph: fx.Graph, val_map: dict[fx.Node, fx.Node] | None = None) -> fx.Graph:
    """A copy to restore if a rule fails halfway, or to try a rewrite on (nodes and their meta; example values
    are shared). ``val_map``, when given, is filled with each node's copy."""
    copy = fx.Graph(owning_module=graph.owning_module, tracer_cls=graph._tracer_cls)
    copy._codegen = graph._codegen
    val_map = {} if val_map is None else val_map
    value, output = copy.graph_copy(graph, val_map, return_output_node=True)
    copy.output(value, type_expr=output.type).meta = output.meta.copy()
    # Dynamo keeps each input's source as a node attribute, not in meta; AOTAutograd asserts it is there.
    for old, new in val_map.items():
        if hasattr(old, "_dynamo_source"):
            new._dynamo_source = old._dynamo_source
    return copy


# Dynamo spells the functional ops of a loss in several ways; these tables say which callables mean what.
CROSS_ENTROPY_TARGETS: tuple[Any, ...] = (F.cross_entropy,)
NLL_LOSS_TARGETS: tuple[Any, ...] = (F.nll_loss,)
LOG_SOFTMAX_TARGETS: tuple[Any, ...] = (F.log_softmax, torch.log_softmax, torch.nn.functional.log_softmax)
LINEAR_TARGETS: tuple[Any, ...] = (F.linear, torch._C._nn.linear)
MATMUL_TARGETS: tuple[Any, ...] = (operator.matmul, torch.matmul, torch.mm)
ADDMM_TARGETS: tuple[Any, ...] = (torch.addmm,)
