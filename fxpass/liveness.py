"""Which tensors stay alive for the backward pass anyway: the part of the memory model that rewrites share.

A rewrite that stops one op from saving a tensor frees memory only if nothing else keeps that tensor alive:
another op that saves it for its own backward, the op that produced it (``tanh``, ``softmax`` and attention
save their outputs), a graph output, or the caller (a graph input). Views share storage, so the question is
asked of the whole alias family: the tensor, what it is a view of, and every view of those.

The tables follow PyTorch's derivative formulas (``tools/autograd/derivatives.yaml``): which inputs or outputs
each backward reads. An op missing from them is assumed to keep its inputs, so the analysis errs towards
"no saving", never towards a claim that does not hold.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Iterable

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fxpass.graph import describe_node, is_call, is_method, tensor_value

# Ops whose output aliases their first input's storage.
_VIEW_METHODS = frozenset(
    {"view", "view_as", "reshape", "flatten", "unflatten", "transpose", "permute", "t", "squeeze", "unsqueeze",
     "expand", "expand_as", "split", "chunk", "unbind", "narrow", "select", "detach", "as_strided", "movedim"}
)
_VIEW_FUNCTIONS = (
    operator.getitem, torch.reshape, torch.flatten, torch.transpose, torch.permute, torch.t, torch.squeeze,
    torch.unsqueeze, torch.split, torch.chunk, torch.unbind, torch.narrow, torch.select, torch.movedim,
)
# Ops whose backward needs none of their tensor inputs.
_KEEP_NOTHING_FUNCTIONS = (
    operator.add, operator.sub, operator.neg, torch.add, torch.sub, torch.neg, torch.cat, torch.stack,
    torch.sum, torch.mean, F.dropout, torch.tanh, torch.sigmoid, torch.relu, F.relu, torch.exp, torch.softmax,
    F.softmax, F.log_softmax, torch.log_softmax,
)
_KEEP_NOTHING_METHODS = frozenset(
    {"add", "sub", "neg", "sum", "mean", "tanh", "sigmoid", "relu", "exp", "softmax", "log_softmax", "clone", "to",
     "float", "half", "bfloat16", "type", "new_zeros", "new_ones", "new_empty", "size", "dim"}
)
# Binary ops that keep an operand only when the other operand needs a gradient (mul: ∂a = g·b).
_KEEP_OTHER_FUNCTIONS = (operator.mul, torch.mul, operator.truediv, torch.div)
_KEEP_OTHER_METHODS = frozenset({"mul", "div"})
# Products that keep an operand only when the other factor needs a gradient (a @ b: ∂b = aᵀ·g reads a). A frozen
# weight (LoRA's base layer) thus keeps no input alive. linear and addmm are bound by name below.
_KEEP_OTHER_PRODUCTS = (operator.matmul, torch.matmul, torch.mm, torch.bmm)
_KEEP_OTHER_PRODUCT_METHODS = frozenset({"matmul", "mm", "bmm"})
_LINEAR_FUNCTIONS = (F.linear, torch._C._nn.linear)
# Ops whose backward reads their own output, so the output stays alive.
_SAVE_OUTPUT_FUNCTIONS = (
    torch.tanh, torch.sigmoid, torch.relu, F.relu, torch.exp, torch.softmax, F.softmax, F.log_softmax,
    torch.log_softmax, F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention,
)
_SAVE_OUTPUT_METHODS = frozenset({"tanh", "sigmoid", "relu", "exp", "softmax", "log_softmax"})


def is_view(node: fx.Node) -> bool:
    """Whether ``node``'s output may share its first input's storage (casts to the same dtype return their
    input itself, and so does ``contiguous()`` unless the input is known not to be contiguous)."""
    if node.op == "call_method":
        if node.target in _VIEW_METHODS:
            return True
        if node.target == "contiguous":
            return not _known_non_contiguous(tensor_value(node.args[0]))
        return node.target in ("to", "type", "float", "half", "bfloat16") and _unchanged(node)
    return node.op == "call_function" and node.target in _VIEW_FUNCTIONS and tensor_value(node.args[0]) is not None


def _known_non_contiguous(tensor) -> bool:
    """Provably not in row-major order for every shape (no guard): ``contiguous()`` then copies."""
    if tensor is None:
        return False
    expected = 1
    for size, stride in reversed(list(zip(tensor.shape, tensor.stride(), strict=True))):
        if statically_known_true(size != 1) and statically_known_true(stride != expected):
            return True
        expected = expected * size
    return False


def _unchanged(node: fx.Node) -> bool:
    src, out = tensor_value(node.args[0]), tensor_value(node)
    return src is not None and out is not None and src.dtype == out.dtype and src.device == out.device


def alias_root(node: fx.Node) -> fx.Node:
    """The tensor ``node`` is (through views) a view of."""
    while is_view(node) and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def alias_family(node: fx.Node) -> list[fx.Node]:
    """``node``'s root and every view of it, transitively (they share one storage)."""
    root = alias_root(node)
    family, pending = [root], [root]
    while pending:
        for user in pending.pop().users:
            if is_view(user) and user not in family:
                family.append(user)
                pending.append(user)
    return family


def _needs_grad(value) -> bool:
    tensor = tensor_value(value)
    return tensor is not None and tensor.requires_grad


def keeps_operand(user: fx.Node, operand: fx.Node) -> bool:
    """Whether ``user``'s backward keeps ``operand`` (one of its inputs) alive."""
    if user.op == "output":
        return True
    if is_view(user):
        return False  # the view's own users are examined as part of the alias family
    if (user.op == "call_function" and user.target in _KEEP_NOTHING_FUNCTIONS) or (
        user.op == "call_method" and user.target in _KEEP_NOTHING_METHODS
    ):
        return False
    if (
        is_call(user, *_KEEP_OTHER_FUNCTIONS, *_KEEP_OTHER_PRODUCTS)
        or is_method(user, *_KEEP_OTHER_METHODS, *_KEEP_OTHER_PRODUCT_METHODS)
    ) and not user.kwargs:
        others = [a for a in user.args if a is not operand]
        return any(_needs_grad(other) for other in others)
    if is_call(user, *_LINEAR_FUNCTIONS):
        return _linear_keeps(user, operand)
    if is_call(user, torch.addmm):
        return _addmm_keeps(user, operand)
    return True


def _linear_keeps(user: fx.Node, operand: fx.Node) -> bool:
    """``linear(x, w, b)``: ∂w reads x and ∂x reads w; the bias is never read. Unknown forms keep everything."""
    args = [*user.args, *(user.kwargs[k] for k in ("input", "weight", "bias") if k in user.kwargs)]
    if len(args) < 2 or args[0] is args[1]:
        return True
    x, weight = args[0], args[1]
    if operand is x:
        return _needs_grad(weight)
    if operand is weight:
        return _needs_grad(x)
    return False  # the bias


def _addmm_keeps(user: fx.Node, operand: fx.Node) -> bool:
    """``addmm(bias, a, b)`` (GPT-2's Conv1D): ∂b reads a and ∂a reads b; the added bias is never read."""
    args = [*user.args, *(user.kwargs[k] for k in ("input", "mat1", "mat2") if k in user.kwargs)]
    if len(args) < 3 or len({id(a) for a in args[:3]}) < 3:
        return True
    bias, a, b = args[:3]
    if operand is a:
        return _needs_grad(b)
    if operand is b:
        return _needs_grad(a)
    return operand is not bias


def saver_of_output(node: fx.Node) -> fx.Node | None:
    """The op that keeps ``node`` (its output) for its own backward, if any: ``node`` itself, or the
    multi-output op that ``node`` is an output of."""
    if is_call(node, operator.getitem) and isinstance(node.args[0], fx.Node) and tensor_value(node.args[0]) is None:
        node = node.args[0]
    if node.op == "call_function" and node.target in _memopt_ops_saving_output():
        return node
    return node if is_call(node, *_SAVE_OUTPUT_FUNCTIONS) or is_method(node, *_SAVE_OUTPUT_METHODS) else None


def _memopt_ops_saving_output() -> tuple:
    """memopt's own ops whose backward reads their output (flash attention keeps O for dS)."""
    import lowerings  # noqa: F401  (registers torch.ops.memopt.*)

    return (torch.ops.memopt.flash_attention.default,)


@dataclasses.dataclass(frozen=True)
class Holder:
    """Something that keeps a tensor alive for the backward pass, and why."""

    node: fx.Node
    why: str

    def describe(self) -> str:
        return f"{describe_node(self.node)} ({self.why})"


def holders(tensor: fx.Node, excluding: Iterable[fx.Node] = ()) -> list[Holder]:
    """What keeps ``tensor``'s storage alive besides the ops in ``excluding`` (the ones being rewritten)."""
    excluded = set(excluding)
    family = alias_family(tensor)
    root = family[0]
    found: list[Holder] = []
    saver = saver_of_output(root)
    if root.op == "placeholder":
        found.append(Holder(root, "a graph input: the caller keeps it"))
    elif saver is not None:
        found.append(Holder(saver, "saves its output for its backward"))
    for member in family:
        for user in member.users:
            if user in excluded or user in family:
                continue
            if keeps_operand(user, member):
                found.append(Holder(user, "returned" if user.op == "output" else "saves it for its backward"))
    return found
