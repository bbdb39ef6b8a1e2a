"""Cut cross-entropy: ``linear → (casts, views, shifts, scale, softcap) → cross_entropy`` becomes ``memopt.cce``.

The pattern is found from the loss backwards. Every op between the classifier and the loss must act on
leading (token) dimensions only, or be a dtype cast, a copy, a scale by a constant or the tanh softcap; such ops
commute with the classifier, so they are replayed on the hidden states instead (a shift ``logits[:, :-1]``
becomes ``hidden[:, :-1]``) or become arguments of the op, and the N×V logits are never formed. Forms covered:
HF transformers' causal-LM and masked-LM losses, ``nn.CrossEntropyLoss``, ``log_softmax → nll_loss``, nanoGPT's
``ignore_index=-1`` with a tied weight, GPT-2's ``addmm``, ``h @ W.T``, Gemma 2's final-logit softcap, Cohere's
``logit_scale`` (a multiplication) and Granite's ``logits_scaling`` (a division), and a scale before a softcap.
Where the model returns its logits after those transforms, the op returns them so transformed.
(Wijmans et al. 2024, "Cut Your Losses in Large-Vocabulary Language Models".)
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Mapping
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fxpass import returned_logits, shapes
from fxpass.config import Config, assumed_device
from fxpass.graph import (
    ADDMM_TARGETS,
    CROSS_ENTROPY_TARGETS,
    LINEAR_TARGETS,
    LOG_SOFTMAX_TARGETS,
    MATMUL_TARGETS,
    NLL_LOSS_TARGETS,
    GraphFacts,
    ViewKind,
    bind_args,
    cast_to,
    copy_memory_format,
    describe_node,
    erase_unused,
    fake_mode_of,
    insert_node,
    is_call,
    is_method,
    is_param_transpose,
    position_in,
    propagate_example_value,
    tensor_value,
    view_kind,
)
from fxpass.rules.base import Decision, Rule, decide_on_saving

NAME = "cce"

GRAPH_BREAK_ADVICE = (
    "the logits arrive as a graph input, so the classifier that produced them was compiled in another "
    "graph (a graph break between the head and the loss); find the break with TORCH_LOGS=graph_breaks "
    "and compile head and loss together (fullgraph=True shows it as an error)"
)


@dataclasses.dataclass(frozen=True)
class LossCall:
    """The loss node's arguments, normalized from any call form."""

    node: fx.Node
    form: str  # "cross_entropy" | "nll_loss"
    input: fx.Node
    targets: Any
    class_weight: Any
    ignore_index: Any
    reduction: Any
    label_smoothing: Any


@dataclasses.dataclass(frozen=True)
class CceMatch:
    """A loss over a linear classifier, or a loss that cannot be rewritten (``blocker`` says why)."""

    loss: LossCall
    path: tuple[fx.Node, ...] = ()  # nodes strictly between classifier and loss, in graph order
    classifier: fx.Node | None = None
    hidden: fx.Node | None = None
    weight: fx.Node | None = None  # [V, D], or [D, V] when weight_is_transposed
    weight_is_transposed: bool = False
    bias: fx.Node | None = None
    softcap: float | None = None
    blocker: str | None = None
    # a logit scale before the softcap: the loss reads c·tanh(x·scale/divisor/c), or x·scale/divisor
    scale: float = 1.0
    divisor: float = 1.0
    transforms: tuple[fx.Node, ...] = ()  # the path's scale and softcap nodes
    # what the graph uses of the logits outside the loss, when it does (returns_logits): the classifier's own
    # output, or the last of the transforms that directly follow it (the model returns its logits transformed)
    head: fx.Node | None = None
    # z-loss terms: (logsumexp node, the chain node it reads, casts between them) served by the op's lse
    log_sum_exps: tuple[tuple[fx.Node, fx.Node, tuple[fx.Node, ...]], ...] = ()
    # the classifier's output is also used outside the loss (returned, say): memopt.cce_with_logits serves both
    returns_logits: bool = False
    # where the graph returns the classifier's own output, when nothing else outside the loss reads it and the
    # backend re-attaches returned logits (fxpass/returned_logits.py): the row-wise op may then serve the loss
    returned_positions: tuple[int, ...] = ()
    # fp32 where 16-bit logits are returned only through casts to fp32 (accelerate's convert_to_fp32 under HF
    # Trainer's bf16=True): the op then writes them in fp32 itself, and no 16-bit copy sits beside the cast's
    returned_dtype: torch.dtype | None = None
    # why logits returned through such casts stay 16-bit (the graph's cast then runs), if they do
    kept_dtype_reason: str | None = None

    @property
    def anchor(self) -> fx.Node:
        return self.loss.node

    @property
    def returned(self) -> fx.Node:
        """The node whose uses outside the loss the op's logits serve (the classifier's output by default)."""
        return self.head if self.head is not None else self.classifier

    @property
    def transform_logits(self) -> bool:
        """Whether the op returns the logits scaled and softcapped, as the loss sees them: the head is the last
        transform or a copy of it (``_servable_heads``), not the classifier's output or a copy of that."""
        return self.returns_logits and self.head is not None and _is_transformed(self, self.head)

    @property
    def nodes(self) -> tuple[fx.Node, ...]:
        head = (self.classifier,) if self.classifier is not None else ()
        extra = tuple(node for lse, _, casts in self.log_sum_exps for node in (*casts, lse))
        return (*head, *self.path, *extra, self.loss.node)

    def params(self) -> Mapping[str, Any]:
        params: dict[str, Any] = {"form": self.loss.form}
        logits = tensor_value(self.loss.input)
        if logits is not None and logits.dim() >= 1:
            params["tokens"] = shapes.render(logits.shape[0]) if logits.dim() == 2 else None
            params["vocab"] = shapes.render(logits.shape[-1])
            params["loss_dtype"] = str(logits.dtype).removeprefix("torch.")
        if self.hidden is not None:
            hidden = tensor_value(self.hidden)
            params["hidden_dim"] = shapes.render(hidden.shape[-1])
            params["dtype"] = str(tensor_value(self.classifier).dtype).removeprefix("torch.")
        params.update(
            ignore_index=self.loss.ignore_index,
            reduction=self.loss.reduction,
            label_smoothing=self.loss.label_smoothing,
            softcap=self.softcap,
            logit_scale=self.scale,
            logit_divisor=self.divisor,
            bias=self.bias is not None,
            z_loss_terms=len(self.log_sum_exps),
            returns_logits=self.returns_logits,
            returned_logits_transformed=self.transform_logits,
        )
        return params


# --- match ------------------------------------------------------------------------------------------------


def match(facts: GraphFacts) -> list[CceMatch]:
    return [_match_loss(loss, facts) for loss in _loss_calls(facts.gm.graph)]


def _loss_calls(graph: fx.Graph) -> list[LossCall]:
    calls = []
    for node in graph.nodes:
        if is_call(node, *CROSS_ENTROPY_TARGETS):
            call = _bind_loss(node, "cross_entropy", CROSS_ENTROPY_PARAMS)
        elif is_call(node, *NLL_LOSS_TARGETS):
            call = _bind_loss(node, "nll_loss", CROSS_ENTROPY_PARAMS[:-1])
        else:
            continue
        if call is not None:
            calls.append(call)
    return calls


# Parameters of F.cross_entropy in order; F.nll_loss has the same ones without label_smoothing.
CROSS_ENTROPY_PARAMS = (
    "input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction", "label_smoothing"
)
_LOSS_DEFAULTS = {
    "weight": None, "size_average": None, "ignore_index": -100, "reduce": None, "reduction": "mean",
    "label_smoothing": 0.0,
}


def _bind_loss(node: fx.Node, form: str, names: tuple[str, ...]) -> LossCall | None:
    bound = bind_args(node, names, _LOSS_DEFAULTS)
    if bound is None or not isinstance(bound.get("input"), fx.Node) or "target" not in bound:
        return None
    reduction = bound["reduction"]
    if bound["size_average"] is not None or bound["reduce"] is not None:
        reduction = torch.nn._reduction.legacy_get_string(bound["size_average"], bound["reduce"], emit_warning=False)
    return LossCall(
        node=node,
        form=form,
        input=bound["input"],
        targets=bound["target"],
        class_weight=bound["weight"],
        ignore_index=bound["ignore_index"],
        reduction=reduction,
        label_smoothing=bound["label_smoothing"],
    )


def _match_loss(loss: LossCall, facts: GraphFacts) -> CceMatch:
    blocker = _unsupported_arguments(loss)
    if blocker:
        return CceMatch(loss, blocker=blocker)
    logits = tensor_value(loss.input)
    if logits is None or logits.dim() != 2:
        return CceMatch(loss, blocker="the loss input is not [tokens, classes] (class dimension not last)")
    vocab = logits.shape[-1]
    walk = _walk_to_classifier(loss, vocab)
    if isinstance(walk, str):
        return CceMatch(loss, blocker=walk)
    classifier = _classifier_operands(walk.source, vocab)
    if isinstance(classifier, str):
        return CceMatch(loss, path=walk.path, blocker=classifier)
    hidden, weight, transposed, bias = classifier
    candidate = CceMatch(
        loss, walk.path, walk.source, hidden, weight, transposed, bias, walk.softcap, scale=walk.scale,
        divisor=walk.divisor, transforms=walk.transforms,
    )
    candidate = dataclasses.replace(candidate, log_sum_exps=_log_sum_exp_users(candidate))
    escape, head = _escape(candidate, facts)
    if escape is None:
        return candidate
    if escape is RETURNED:
        candidate = dataclasses.replace(candidate, returns_logits=True, head=head)
        positions, returned_dtype = _returned_only(candidate, facts)
        kept = _widening_is_slow(candidate.classifier) if returned_dtype is not None else None
        return dataclasses.replace(
            candidate, returned_positions=positions,
            returned_dtype=None if kept else returned_dtype, kept_dtype_reason=kept,
        )
    return dataclasses.replace(candidate, blocker=escape)


def _returned_only(candidate: CceMatch, facts: GraphFacts) -> tuple[tuple[int, ...], torch.dtype | None]:
    """Where the graph returns the classifier's output, when every outside use is the output itself, as it
    is or through ``_returned_as``, and the backend wraps this graph's outputs (otherwise no positions); and
    the dtype every such return widens the logits to (``_widened_to``)."""
    if not facts.gm.meta.get(returned_logits.WRAPPED_KEY):
        return (), None
    positions: list[int] = []
    returned: list[fx.Node] = []
    head = candidate.returned
    for _, user in facts.outside_users([head], inside=candidate.nodes):
        node = head if user is facts.output else _returned_as(user, facts.output)
        found = returned_logits.output_positions(facts.gm.graph, node) if node is not None else None
        if not found:
            return (), None
        positions.extend(found)
        returned.append(node)
    return tuple(sorted(set(positions))), _widened_to(head, returned)


def _widened_to(head: fx.Node, returned: list[fx.Node]) -> torch.dtype | None:
    """fp32 where the 16-bit logits ``head`` reach each of ``returned`` through casts to fp32 only (the dtypes
    along each chain: the logits', then fp32), so that writing them in fp32 at once changes no value the
    graph returns. None otherwise."""
    source = tensor_value(head).dtype
    if source not in (torch.float16, torch.bfloat16) or not returned:
        return None
    for node in returned:
        dtypes: list[torch.dtype] = []
        while node is not head:
            dtypes.append(tensor_value(node).dtype)
            node = node.args[0]
        dtypes.reverse()  # from the classifier's first user to the returned node
        widened = dtypes.index(torch.float32) if torch.float32 in dtypes else len(dtypes)
        if widened == len(dtypes) or set(dtypes[:widened]) - {source} or set(dtypes[widened:]) != {torch.float32}:
            return None
    return torch.float32


def _widening_is_slow(classifier: fx.Node) -> str | None:
    """Why writing the logits in fp32 would cost time, or None. cuBLAS's fast GEMMs want each fp32 row of the
    logits 16 bytes after the last, which an odd vocabulary's are not (GPT-2's 50257 classes). The op then
    writes padded row chunks and copies them into place (``fp32_logits_by_row_chunks``), and GPT-2's Trainer
    step took 1.04x torch.compile's time against 0.90x with 16-bit logits and the graph's cast (H200,
    `benchmarks/hf_trainer.py --models gpt2`): the 16-bit logits stay."""
    from lowerings.cce.with_logits import rows_aligned

    logits = tensor_value(classifier)
    vocab = shapes.constant(logits.shape[-1])
    if vocab is not None and rows_aligned(vocab):
        return None
    return (
        f"returned logits kept {str(logits.dtype).removeprefix('torch.')}, then cast by the graph: fp32 rows of "
        f"{shapes.render(logits.shape[-1])} classes are not 16-byte aligned, where cuBLAS writes them slowly"
    )


def _returned_as(node: fx.Node, output: fx.Node) -> fx.Node | None:
    """What the graph returns for the logits when ``node`` starts a chain of casts to a floating dtype, copies
    and reshapes that keep the class dimension last, each read only by the next and the last only by the
    output: accelerate's ``convert_to_fp32`` of a model's outputs under mixed precision (HF Trainer with
    ``bf16=True``). The wrapper's gradient sees the cast undone and the rows flattened (``LogitsGradient``), as
    autograd's backward of such a chain would. None for anything else."""
    vocab = tensor_value(node.args[0]).shape[-1] if node.args and tensor_value(node.args[0]) is not None else None
    while node is not output:
        value = tensor_value(node)
        kind = view_kind(node)
        if value is None or kind not in (ViewKind.CAST, ViewKind.COPY, ViewKind.RESHAPE):
            return None
        if not value.is_floating_point() or value.dim() == 0 or not _same_size(value.shape[-1], vocab):
            return None
        if len(node.users) != 1:
            return None
        (user,) = node.users
        if user is output:
            return node
        node = user
    return None


def _unsupported_arguments(loss: LossCall) -> str | None:
    if loss.class_weight is not None:
        return "class weights are not supported by memopt.cce"
    targets = tensor_value(loss.targets)
    if targets is None:
        return "the targets are not a tensor"
    if targets.is_floating_point():
        return "soft-label targets (class probabilities) are not supported by memopt.cce"
    if targets.dim() != 1:
        return "the loss input is not [tokens, classes] (class dimension not last)"
    for name, value, kind in (
        ("ignore_index", loss.ignore_index, int),
        ("label_smoothing", loss.label_smoothing, (int, float)),
        ("reduction", loss.reduction, str),
    ):
        if not isinstance(value, kind) or isinstance(value, bool):
            return f"{name} is not a constant ({value!r})"
    if loss.reduction not in ("mean", "sum", "none"):
        return f"unknown reduction {loss.reduction!r}"
    return None


@dataclasses.dataclass(frozen=True)
class Walk:
    """The ops from the classifier to the loss (``path``, in graph order), the op that made the logits
    (``source``), and the transform the loss applies to them: c·tanh(x·scale/divisor/c) (its ``transforms``
    nodes; ``softcap`` None: x·scale/divisor)."""

    path: tuple[fx.Node, ...]
    source: fx.Node
    softcap: float | None = None
    scale: float = 1.0
    divisor: float = 1.0
    transforms: tuple[fx.Node, ...] = ()


def _walk_to_classifier(loss: LossCall, vocab) -> Walk | str:
    """Walk from the loss input back through vocabulary-preserving ops to the op that made the logits."""
    path: list[fx.Node] = []
    node = loss.input
    seen_log_softmax = False
    softcap = None
    scale, divisor = 1.0, 1.0
    transforms: list[fx.Node] = []
    while True:
        if not _last_dim_is(node, vocab):
            return f"{describe_node(node)} changes the class dimension"
        kind = view_kind(node)
        if kind is not None:
            if kind in (ViewKind.RESHAPE, ViewKind.INDEX) and not _keeps_last_dim(node, vocab):
                return f"{describe_node(node)} reshapes or indexes the class dimension"
            path.append(node)
            node = node.args[0]
            continue
        if loss.form == "nll_loss" and not seen_log_softmax and _is_log_softmax_over_last_dim(node):
            seen_log_softmax = True
            path.append(node)
            node = node.args[0]
            continue
        if loss.form == "nll_loss" and not seen_log_softmax:
            break  # a transform of log-probabilities is not one of the logits
        cap = _softcap(node)
        if cap is not None:
            if softcap is not None:
                return f"{describe_node(node)} softcaps logits already softcapped; memopt.cce takes one softcap"
            if transforms:
                return (
                    f"the logits are scaled after their softcap ({describe_node(transforms[0])}); memopt.cce takes "
                    "a scale before the softcap only"
                )
            softcap, cap_nodes, node = cap
            path.extend(reversed(cap_nodes))
            transforms.extend(reversed(cap_nodes))
            continue
        found = _scale(node)
        if isinstance(found, str):
            return found
        if found is not None:
            divides, factor, node_before = found
            scale, divisor = (scale, divisor * factor) if divides else (scale * factor, divisor)
            path.append(node)
            transforms.append(node)
            node = node_before
            continue
        break
    if loss.form == "nll_loss" and not seen_log_softmax:
        return "nll_loss input is not a log_softmax of logits"
    if node.op == "placeholder":
        return GRAPH_BREAK_ADVICE
    return Walk(tuple(reversed(path)), node, softcap, scale, divisor, tuple(reversed(transforms)))


def _last_dim_is(node: fx.Node, vocab) -> bool:
    value = tensor_value(node)
    return value is not None and value.dim() >= 1 and _same_size(value.shape[-1], vocab)


def _same_size(a, b) -> bool:
    return statically_known_true(a == b) if isinstance(a == b, torch.SymBool) else bool(a == b)


def _keeps_last_dim(node: fx.Node, vocab) -> bool:
    """A reshape or index that maps whole rows of the class dimension onto whole rows."""
    src = tensor_value(node.args[0])
    if src is None or not _last_dim_is(node.args[0], vocab):
        return False
    if view_kind(node) is ViewKind.RESHAPE:
        if _is_flatten(node):
            end = _flatten_end(node)
            return end % src.dim() != src.dim() - 1
        return _shape_arg(node) is not None
    return _index_keeps_last_dim(node.args[1], src.dim())


def _is_flatten(node: fx.Node) -> bool:
    return is_method(node, "flatten") or is_call(node, torch.flatten)


def _flatten_end(node: fx.Node) -> int:
    bound = dict(zip(("input", "start_dim", "end_dim"), node.args, strict=False))
    bound.update(node.kwargs)
    return int(bound.get("end_dim", -1))


def _shape_arg(node: fx.Node) -> list[Any] | None:
    """The target shape of view/reshape as a list, whether passed as varargs or one sequence."""
    args = list(node.args[1:])
    if "shape" in node.kwargs or "size" in node.kwargs:
        args = [node.kwargs.get("shape", node.kwargs.get("size"))]
    if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)):
        args = list(args[0])
    return args or None


def _index_keeps_last_dim(index: Any, ndim: int) -> bool:
    entries = index if isinstance(index, tuple) else (index,)
    if any(entry is None for entry in entries):
        return False
    if Ellipsis in entries:
        after = entries[entries.index(Ellipsis) + 1 :]
        return not after or after[-1] == slice(None)
    consumed = sum(_dims_indexed(entry) for entry in entries)
    return consumed < ndim or entries[-1] == slice(None)


def _dims_indexed(entry: Any) -> int:
    value = tensor_value(entry) if isinstance(entry, fx.Node) else None
    if value is not None and value.dtype == torch.bool:
        return value.dim()
    return 1


def _is_log_softmax_over_last_dim(node: fx.Node) -> bool:
    if is_call(node, *LOG_SOFTMAX_TARGETS) or is_method(node, "log_softmax"):
        bound = dict(zip(("input", "dim"), node.args, strict=False))
        bound.update(node.kwargs)
        value = tensor_value(node)
        return value is not None and isinstance(bound.get("dim"), int) and bound["dim"] % value.dim() == value.dim() - 1
    return False


def _softcap(node: fx.Node) -> tuple[float, tuple[fx.Node, ...], fx.Node] | None:
    """``tanh(x / c) * c`` (or ``x * (1/c)``): returns c, the three nodes in graph order, and x."""
    if not (is_call(node, operator.mul, torch.mul) and len(node.args) == 2):
        return None
    tanh, cap = node.args if isinstance(node.args[0], fx.Node) else node.args[::-1]
    if not (isinstance(tanh, fx.Node) and isinstance(cap, (int, float)) and cap > 0):
        return None
    if not (is_call(tanh, torch.tanh) or is_method(tanh, "tanh")):
        return None
    scaled = tanh.args[0]
    if not isinstance(scaled, fx.Node) or len(scaled.args) != 2 or scaled.args[0] is None:
        return None
    x, factor = scaled.args
    if is_call(scaled, operator.truediv, torch.div) and factor == cap:
        return float(cap), (scaled, tanh, node), x
    if is_call(scaled, operator.mul, torch.mul) and isinstance(factor, float) and abs(factor * cap - 1) < 1e-12:
        return float(cap), (scaled, tanh, node), x
    return None


_MUL_TARGETS: tuple[Any, ...] = (operator.mul, torch.mul, torch.multiply)
_DIV_TARGETS: tuple[Any, ...] = (operator.truediv, torch.div, torch.divide, torch.true_divide)


def _scale(node: fx.Node) -> tuple[bool, float, fx.Node] | str | None:
    """(divides, c, x) for a logit scale ``x * c``, ``c * x`` or ``x / c`` by a Python number c (Cohere's
    ``logits * logit_scale``, Granite's ``logits / logits_scaling``); why it cannot be served, for such an op whose
    c is a tensor or a symbolic float, or not positive and finite; None for any other op."""
    multiplies = is_call(node, *_MUL_TARGETS) or is_method(node, "mul", "multiply")
    divides = is_call(node, *_DIV_TARGETS) or is_method(node, "div", "divide", "true_divide")
    if not (multiplies or divides) or len(node.args) != 2:
        return None
    if set(node.kwargs) - {"rounding_mode"} or node.kwargs.get("rounding_mode") is not None:
        return None  # a floor or truncating division is not a scale
    first, second = node.args
    orders = [(first, second)] if divides else [(first, second), (second, first)]
    for logits, factor in orders:
        value = tensor_value(logits) if isinstance(logits, fx.Node) else None
        if value is None or value.dim() == 0 or not value.is_floating_point():
            continue
        if isinstance(factor, bool):
            return None
        if isinstance(factor, (int, float)):
            if not (math.isfinite(factor) and factor > 0):
                reason = "memopt.cce takes a positive, finite scale"
                return f"{describe_node(node)} scales the logits by {factor!r}; {reason}"
            return divides, float(factor), logits
        return _unsupported_factor(node, factor)
    return None


def _unsupported_factor(node: fx.Node, factor: Any) -> str | None:
    """Why a scale ``node`` whose factor is not a Python number cannot be served, or None where ``factor`` is not a
    scalar at all (``node`` is then some other op)."""
    if not isinstance(factor, fx.Node):
        return None
    example = factor.meta.get("example_value")
    if isinstance(example, (torch.SymFloat, torch.SymInt)):
        return (
            f"{describe_node(node)} scales the logits by a symbolic number ({factor.name}): Dynamo did not specialize "
            "it (torch._dynamo.config.specialize_float), and memopt's ops take the scale as a constant"
        )
    value = tensor_value(factor)
    if value is None or value.numel() != 1:
        return None
    if value.requires_grad:
        return (
            f"{describe_node(node)} scales the logits by a learned tensor ({factor.name}): memopt's ops take a "
            "constant scale and do not compute its gradient"
        )
    return (
        f"{describe_node(node)} scales the logits by a tensor ({factor.name}): memopt's ops take the scale as a "
        "Python number (reading a tensor's value would sync with the device); store it as a float"
    )


def _classifier_operands(node: fx.Node, vocab) -> tuple[fx.Node, fx.Node, bool, fx.Node | None] | str:
    """(hidden, weight, weight_is_transposed, bias) of a linear classifier producing ``node``."""
    if is_call(node, *LINEAR_TARGETS):
        bound = bind_args(node, ("input", "weight", "bias"), {"bias": None})
        if bound is None or "weight" not in bound:
            return f"unexpected call form {describe_node(node)}"
        return _checked(bound["input"], bound["weight"], False, bound["bias"], vocab, node)
    if is_call(node, *MATMUL_TARGETS) or is_method(node, "matmul", "mm"):
        if len(node.args) != 2 or node.kwargs:
            return f"unexpected call form {describe_node(node)}"
        hidden, other = node.args
        if isinstance(other, fx.Node) and is_param_transpose(other):
            return _checked(hidden, other.args[0], False, None, vocab, node)
        return _checked(hidden, other, True, None, vocab, node)
    if is_call(node, *ADDMM_TARGETS):
        bound = bind_args(node, ("input", "mat1", "mat2", "beta", "alpha"), {"beta": 1, "alpha": 1})
        if bound is None or len(bound) < 5 or bound["beta"] != 1 or bound["alpha"] != 1:
            return f"addmm with beta/alpha other than 1 at {describe_node(node)}"
        other = bound["mat2"]
        if isinstance(other, fx.Node) and is_param_transpose(other):
            return _checked(bound["mat1"], other.args[0], False, bound["input"], vocab, node)
        return _checked(bound["mat1"], other, True, bound["input"], vocab, node)
    return f"the logits come from {describe_node(node)}, not from a linear classifier"


def _checked(hidden, weight, transposed: bool, bias, vocab, node: fx.Node):
    h, w = tensor_value(hidden), tensor_value(weight)
    if h is None or w is None or w.dim() != 2:
        return f"the classifier {describe_node(node)} is not hidden [.., D] times a 2-D weight"
    rows = w.shape[1] if transposed else w.shape[0]
    if not _same_size(rows, vocab) or not _same_size(h.shape[-1], w.shape[0] if transposed else w.shape[1]):
        return f"the classifier {describe_node(node)} has unexpected shapes"
    if h.device != w.device or not (h.is_floating_point() and w.is_floating_point()):
        return f"the classifier {describe_node(node)} mixes devices or is not floating point"
    if bias is not None:
        b = tensor_value(bias)
        if b is None or b.dim() != 1 or not _same_size(b.shape[0], vocab):
            return f"the classifier {describe_node(node)} has a bias that is not [V]"
    return hidden, weight, transposed, bias


def _log_sum_exp_users(candidate: CceMatch) -> tuple[tuple[fx.Node, fx.Node, tuple[fx.Node, ...]], ...]:
    """``logsumexp(logits, -1)`` terms (z-loss) the op's per-row log-sum-exp can replace.

    The logsumexp may read any chain node after the scale and softcap and before a log-softmax (possibly through
    dtype casts of its own) as long as only casts, copies and reshapes follow that node on the way to the loss, so
    that its rows are the loss rows in the same order.
    """
    chain = [candidate.classifier, *candidate.path]
    first = max((i for i, node in enumerate(chain) if node in candidate.transforms), default=0)
    found = []
    for position, node in enumerate(chain):
        later = chain[position + 1 :]
        if position < first or any(view_kind(n) is ViewKind.INDEX for n in later):
            continue
        if any(_is_log_softmax_over_last_dim(n) for n in chain[: position + 1]):
            break  # past the log-softmax the rows hold log-probabilities, not logits
        for user in node.users:
            casts: tuple[fx.Node, ...] = ()
            reader = user
            if view_kind(user) in (ViewKind.CAST, ViewKind.COPY) and len(user.users) == 1:
                casts, reader = (user,), next(iter(user.users))
            if reader not in chain and _is_log_sum_exp_over_last_dim(reader):
                found.append((reader, node, casts))
    return tuple(found)


def _is_log_sum_exp_over_last_dim(node: fx.Node) -> bool:
    if not (is_call(node, torch.logsumexp) or is_method(node, "logsumexp")):
        return False
    bound = bind_args(node, ("input", "dim", "keepdim"), {"keepdim": False})
    value = tensor_value(node.args[0]) if node.args else None
    if bound is None or value is None or bound["keepdim"] is not False:
        return False
    dim = bound.get("dim")
    dims = tuple(dim) if isinstance(dim, (tuple, list)) else (dim,)
    return len(dims) == 1 and isinstance(dims[0], int) and dims[0] % value.dim() == value.dim() - 1


# ``_escape``'s answer when only the classifier's own output is used outside the loss.
RETURNED = "the classifier's output is used outside the loss"


def _escape(candidate: CceMatch, facts: GraphFacts) -> tuple[str | None, fx.Node | None]:
    """(None, None) when only the loss reads the logits; (``RETURNED``, the node used) when the classifier's
    output, or the logits as the transforms that directly follow it leave them, are also used elsewhere
    (returned from the graph, or read by another op) in a way ``memopt.cce_with_logits`` can serve; otherwise
    (why the logits stay alive anyway, None)."""
    outside = facts.outside_users([candidate.classifier, *candidate.path], inside=candidate.nodes)
    if not outside:
        return None, None
    servable = _servable_heads(candidate)
    for node, user in outside:
        if node not in servable:
            return _unservable_use(candidate, node, user), None
    used = {node for node, _ in outside}
    if len(used) > 1:
        transformed = {_is_transformed(candidate, node) for node in used}
        where = "both before and after their transform" if len(transformed) > 1 else "as copies of one another"
        return (
            f"the logits are used outside the loss {where} ("
            f"{', '.join(sorted(node.name for node in used))}); memopt's ops return one of them"
        ), None
    (head,) = used
    candidate = dataclasses.replace(candidate, head=head)
    shift = next((node for node in candidate.path if view_kind(node) is ViewKind.INDEX), None)
    if shift is not None:
        return (
            f"the logits are used outside the loss and the loss reads a subset of their rows ({describe_node(shift)}); "
            "memopt.cce_with_logits needs the loss rows to be the logits' rows (shift the labels instead, as HF does)"
        ), None
    late = _inputs_after(candidate, _insertion_point(candidate))
    if late is not None:
        return (
            f"the logits are used outside the loss before {describe_node(late)} is computed, which the fused op "
            "needs; compute the targets before using the logits"
        ), None
    return RETURNED, head


def _servable_heads(candidate: CceMatch) -> tuple[fx.Node, ...]:
    """The nodes whose uses outside the loss the op's returned logits can stand in for: the classifier's output and
    the copies and casts to its own dtype that directly follow it (OPT's ``lm_head(h).contiguous()``: the
    classifier's values, which the op's logits are); and, where every transform follows the classifier through
    such nodes only, the last transform and such nodes after it (the op then returns its logits transformed as the
    loss's; a transform after a real cast or a view would leave the returned logits half done)."""
    dtype = tensor_value(candidate.classifier).dtype
    total = len(candidate.transforms)
    heads = [candidate.classifier]
    done = 0  # transform nodes passed
    for node in candidate.path:
        if node in candidate.transforms:
            done += 1
            if done == total:
                heads.append(node)
        elif not _keeps_values(node, dtype):
            break
        elif done in (0, total):
            heads.append(node)
    return tuple(heads)


def _is_transformed(candidate: CceMatch, node: fx.Node) -> bool:
    """Whether ``node`` of the chain comes at or after the last transform (holds the logits as the loss sees them)."""
    if not candidate.transforms or node not in candidate.path:
        return False
    return candidate.path.index(node) >= candidate.path.index(candidate.transforms[-1])


def _keeps_values(node: fx.Node, dtype: torch.dtype) -> bool:
    """Whether the op's returned logits, a row-major tensor of their own, can stand in for ``node`` as for its input:
    a cast to ``dtype`` itself, or a copy (``.contiguous()``, ``.clone()``) that asks for no other layout (a
    ``channels_last`` copy does). The copy is not replayed on the op's logits: they are contiguous except where the
    row-wise op returns its rows padded on CUDA (``cce.md``, returned logits), as it does for every head, and a
    copy there would put a second N×V tensor beside them at the forward's end."""
    kind = view_kind(node)
    if kind is ViewKind.CAST:
        return tensor_value(node).dtype == dtype
    return kind is ViewKind.COPY and copy_memory_format(node) in (None, torch.contiguous_format)


def _unservable_use(candidate: CceMatch, node: fx.Node, user: fx.Node) -> str:
    """Why logits used outside the loss at ``node`` (by ``user``) keep the rewrite from applying."""
    used = "returned from the compiled graph" if user.op == "output" else f"used by {describe_node(user)}"
    if node in candidate.transforms and node is candidate.transforms[-1]:
        return (
            f"the transformed logits ({node.name}) are {used}, but a cast or view comes between the classifier and "
            "their transform; memopt's ops return logits transformed in the classifier's dtype and layout"
        )
    if node in candidate.transforms:
        return (
            f"the logits are {used} part-way through their transform ({node.name}, before "
            f"{candidate.transforms[-1].name}); memopt's ops return the classifier's logits or the fully transformed "
            "ones"
        )
    return (
        f"a copy of the logits ({node.name}, made on the way to the loss) is {used}, so it stays alive "
        "and rewriting saves nothing; return the classifier's own output instead"
    )


def _outside_users(candidate: CceMatch) -> list[fx.Node]:
    """Users of the logits the op returns (``CceMatch.returned``) outside the loss's chain, in graph order."""
    inside = {*candidate.nodes}
    return [user for user in candidate.returned.users if user not in inside]


def _insertion_point(candidate: CceMatch) -> fx.Node:
    """Where the fused op goes: before the loss, or before an earlier outside use of the logits."""
    return min([candidate.loss.node, *_outside_users(candidate)], key=position_in(candidate.loss.node.graph))


def _inputs_after(candidate: CceMatch, point: fx.Node) -> fx.Node | None:
    """The first of the fused op's inputs that the graph computes at or after ``point``, if any."""
    position = position_in(point.graph)
    inputs = (candidate.hidden, candidate.weight, candidate.bias, candidate.loss.targets)
    late = [node for node in inputs if isinstance(node, fx.Node) and position(node) >= position(point)]
    return min(late, key=position) if late else None


# --- decide -----------------------------------------------------------------------------------------------


def decide(candidate: CceMatch, config: Config) -> Decision:
    if candidate.blocker:
        return Decision(False, candidate.blocker)
    variant, why = choose_variant(candidate, config)
    if candidate.returns_logits and variant == "rowwise":
        what = (
            "logits computed once and returned, gradients taken from them in the forward (6·N·D·V FLOPs); "
            "their own gradient is added outside the graph only if the caller uses them"
        )
    elif _wrapper_carries_logits(candidate):
        what = (
            "logits computed once and returned, never saved for backward; their own gradient is added outside "
            "the graph only if the caller uses them"
        )
    elif candidate.returns_logits:
        what = "logits computed once and returned, never saved for backward"
    elif variant == "rowwise":
        what = "logits never materialized; gradients taken in the forward (6·N·D·V FLOPs)"
    else:
        what = "logits never materialized"
    decision = decide_on_saving(memory_model(candidate, config.assume_device, variant), config, what)
    params = {"variant": "with_logits" if candidate.returns_logits and variant == "chunked" else variant}
    if candidate.returned_dtype is not None and params["variant"] == "with_logits":
        params["returned_logits_dtype"] = str(candidate.returned_dtype).removeprefix("torch.")
    if candidate.kept_dtype_reason is not None and params["variant"] == "with_logits":
        params["returned_logits_dtype_reason"] = candidate.kept_dtype_reason
    if why:
        params["variant_reason"] = why
    return dataclasses.replace(decision, params=params)


# Measured (`benchmarks/cce.py`, BENCHMARKS.md "The CCE op"): on the H200 the row-wise op takes 1.01-1.04x
# torch.compile's time where the chunked one takes 1.50-1.52x. Off CUDA, where its chunk loop is PyTorch ops around
# the GEMMs, it was the slower of the two until its chunks took their gradient in place in five passes, on the
# classifier unpadded, in chunks of at least 512 rows: compiled through the backend on 2 cores (fp32), 0.93×
# torch.compile's time at 2048 × 8192 × 128,
# 0.96× at 512 × 50257 × 768 and 1.01× at 2048 × 50257 × 768, where the chunked op took 1.20-1.31×
# (`benchmarks/cpu_ops.py`, backend rows). So "auto" weighs the two alike on every device.
# Returned logits are another matter: the detached cce_with_logits recomputes them in the backward (one more
# 2·N·D·V GEMM at the CPU's rate), where the row-wise op takes the gradients from the logits it returns. The demo's
# head (2048 × 8192 × 128, fp32, 2 cores) took 1.00-1.11× torch.compile's time with cce_with_logits and 0.81-0.96×
# with the row-wise op (`benchmarks/cpu_ops.py`), the demo's training step 1.16× and 0.99×; at GPT-2's head
# (512 × 50257 × 768) 1.32× and 1.05× (`benchmarks/cpu_ops.py`), where with fp32 weights ∂C is the weight's gradient
# itself and the 3/4 rule takes the row-wise op (GPT-2 compiled whole on CPU: 0.99× torch.compile's step time,
# `benchmarks/e2e.py --flows whole_model --device cpu`); with 16-bit weights ∂C outweighs the logits and
# cce_with_logits stays.
RETURNED_LOGITS_OFF_CUDA = (
    "returned logits off CUDA: the row-wise op takes the gradients from them in the forward (6·N·D·V FLOPs), "
    "where cce_with_logits recomputes them at the CPU's GEMM rate"
)


def choose_variant(candidate: CceMatch, config: Config) -> tuple[str, str]:
    """"chunked" (``memopt.cce``, 8·N·D·V FLOPs) or "rowwise" (``memopt.cce_rowwise``, 6·N·D·V), and why.

    "auto" takes the row-wise variant where it may serve the loss and still frees at least 3/4 of what the
    chunked one frees: a quarter of the FLOPs for at most a quarter of
    the saving (it keeps ∂E, ∂C and ∂b from forward to backward). Where the graph also returns the logits, the
    chunked side is the detached ``cce_with_logits``, which "auto" takes on CUDA (see below) unless the graph is
    head-heavy (``_head_heavy``); off CUDA the row-wise op serves returned logits under the same 3/4 rule
    (``RETURNED_LOGITS_OFF_CUDA``). Returns an empty reason where there was nothing to weigh."""
    if config.cce_variant == "chunked":
        return "chunked", ""
    blocker = _rowwise_blocker(candidate, config)
    if blocker is not None:
        return "chunked", f"the row-wise variant does not apply: {blocker}" if config.cce_variant == "rowwise" else ""
    if config.cce_variant == "rowwise":
        return "rowwise", "cce_variant='rowwise'"
    device = config.memory_device(tensor_value(candidate.hidden).device)
    chunked = memory_model(candidate, config.assume_device, "chunked").saved
    rowwise = memory_model(candidate, config.assume_device, "rowwise").saved
    # Returned logits: the wrapper carries their gradient (else _rowwise_blocker declined above).
    if candidate.returns_logits and device.type == "cuda":
        heavy = _head_heavy(*_matmul_work(candidate.classifier), candidate.returned_dtype is not None)
        if heavy:
            return "rowwise", heavy
        # The loss ends the forward, so what the row-wise op keeps for the backward sits on a deep model's peak,
        # beside the logits and every activation. The Llama-3.2-1B shape's 16 blocks (`benchmarks/e2e.py --flows
        # whole_model`, H100): cce_with_logits 0.76× torch.compile's peak at 0.94× its time, the row-wise op 0.82×
        # at 0.86× (bf16 weights; under autocast 0.80× and 0.88×). Where a shallow graph's peak is mid-backward the
        # two peak alike and the extra GEMM shows: Mistral's 2 blocks, 0.87× either way, 1.06× torch.compile's time
        # against 0.93× (`benchmarks/zoo.py`). The step's simulation sees the difference only for a caller that
        # drops the logits before the backward (the usual loop); where the caller holds them the two free alike,
        # and a graph cannot tell which caller it has (docs/cce.md), so it is not weighed here.
        held = shapes.format_bytes(shapes.hint(chunked - rowwise))
        return "chunked", (
            f"returned logits: the detached cce_with_logits keeps nothing for the backward, where the row-wise op "
            f"keeps {held} more (the gradients it takes, a chunk beside the logits) at the forward's end, the step's "
            "peak; for one more 2·N·D·V GEMM"
        )
    return three_quarters(candidate, rowwise, chunked, "")


def three_quarters(
    candidate: CceMatch, rowwise: shapes.IntLike, chunked: shapes.IntLike, against: str
) -> tuple[str, str]:
    """The 3/4 rule on what each variant frees (``against``: what that is measured against, for the reason)."""
    kept = shapes.clears(4 * rowwise - 3 * chunked, 0).pays  # for every shape if provable, else at the hints
    figures = f"the row-wise variant frees {shapes.format_bytes(shapes.hint(rowwise))} of the chunked one's " \
        f"{shapes.format_bytes(shapes.hint(chunked))}{against}"
    if candidate.returns_logits:  # off CUDA
        return ("rowwise", f"{RETURNED_LOGITS_OFF_CUDA}; {figures}") if kept else (
            "chunked", f"{figures}, under 3/4: the detached cce_with_logits, which keeps nothing for the backward"
        )
    return ("rowwise", figures) if kept else ("chunked", f"{figures}, under 3/4, so 8·N·D·V FLOPs")


def choose(candidate: CceMatch, config: Config, priced) -> tuple[Config, str] | None:
    """"auto"'s 3/4 rule (``choose_variant``) on what each variant frees against torch.compile (``priced``: a
    config's decision and ``fxpass.pricing.Priced``), where "auto" weighs the two on memory. The graph as
    written charges fp32 log-probabilities and logit copies torch.compile never keeps, so there the row-wise op
    looked nearly as good as the chunked one: 8.3 of 9.7 GiB at N=8192, V=128256, D=2048, where the op
    benchmark measured 1.0 of 1.9 GiB against torch.compile (`benchmarks/cce.py`)."""
    if candidate.blocker or config.cce_variant != "auto" or _rowwise_blocker(candidate, config) is not None:
        return None
    if candidate.returns_logits and config.memory_device(tensor_value(candidate.hidden).device).type == "cuda":
        return _returned_on_cuda(candidate, config, priced)
    rowwise = priced(dataclasses.replace(config, cce_variant="rowwise"))[1].peak
    chunked = priced(dataclasses.replace(config, cce_variant="chunked"))[1].peak
    variant, why = three_quarters(candidate, rowwise, chunked, " against torch.compile")
    return dataclasses.replace(config, cce_variant=variant), why


def _returned_on_cuda(candidate: CceMatch, config: Config, priced) -> tuple[Config, str] | None:
    """Returned logits on CUDA are decided on time (``_head_heavy``), as long as the row-wise op frees memory
    against torch.compile at all: it returns logits it does not save and keeps ∂C in fp32 beside them, where
    torch.compile returns the logits it saves. Time comes first here because ``cce_with_logits``' extra GEMM is a
    large part of a head-heavy graph's cost: in 2-block models at real widths (`benchmarks/zoo.py`, H200) whose
    head outweighs the blocks, the families it served ran at 1.19-1.44x torch.compile's step time, those the
    row-wise op served at 0.92-0.98x. Where the head does not outweigh the rest (other matmuls 1-3× its work),
    the row-wise op must also keep half of what ``cce_with_logits`` frees (each priced against torch.compile):
    Phi-3, Starcoder2 and Granite keep 0.57-0.78 of it and ran at 0.89-0.96× torch.compile's time on the H100;
    Falcon's (V = 65024, D = 4544) would keep 0.21, and with ``cce_with_logits`` it ran at 0.33× torch.compile's
    peak and 0.77× its time (`benchmarks/zoo.py`)."""
    head, rest = _matmul_work(candidate.classifier)
    heavy = _head_heavy(head, rest, candidate.returned_dtype is not None)
    if not heavy:
        return None  # cce_with_logits (``choose_variant``)
    rowwise = priced(dataclasses.replace(config, cce_variant="rowwise"))[1].peak
    figures = f"the row-wise op frees {shapes.format_bytes(shapes.hint(rowwise))} against torch.compile"
    if shapes.clears(rowwise, config.min_saved_bytes).pays:
        if rest < head:  # the head outweighs the rest: time first
            return None
        chunked = priced(dataclasses.replace(config, cce_variant="chunked"))[1].peak
        if shapes.clears(2 * rowwise - chunked, 0).pays:
            return None
        return dataclasses.replace(config, cce_variant="chunked"), (
            f"{heavy}; but {figures}, under half of cce_with_logits' "
            f"{shapes.format_bytes(shapes.hint(chunked))}: cce_with_logits serves them"
        )
    chunked = priced(dataclasses.replace(config, cce_variant="chunked"))[1].peak
    return dataclasses.replace(config, cce_variant="chunked"), (
        f"{heavy}; but {figures} (it keeps ∂C and returns logits it does not save, where torch.compile returns the "
        f"logits it saves) and cce_with_logits {shapes.format_bytes(shapes.hint(chunked))}: cce_with_logits "
        "serves them"
    )


# Matmuls counted by ``_head_heavy``, with the position of their left operand (``addmm`` takes a bias first).
_MATMULS: tuple[tuple[tuple[Any, ...], int], ...] = (
    ((*LINEAR_TARGETS, *MATMUL_TARGETS, torch.bmm), 0),
    ((*ADDMM_TARGETS, torch.baddbmm), 1),
)


def _matmul_flops(node: fx.Node) -> int:
    """2·(output elements)·(reduced length) of a matmul node at the shapes' hints; 0 for anything else."""
    for targets, operand in _MATMULS:
        if is_call(node, *targets) and len(node.args) > operand:
            out, left = tensor_value(node), tensor_value(node.args[operand])
            if out is None or left is None or left.dim() == 0:
                return 0
            return 2 * shapes.hint(out.numel()) * shapes.hint(left.shape[-1])
    return 0


def _graphs_of(graph: fx.Graph) -> list[fx.Graph]:
    """``graph`` and the graphs of its sub-modules: the bodies of checkpointed regions and other higher-order
    calls, whose matmuls run in the step as much as the graph's own."""
    owner = graph.owning_module
    if owner is None:
        return [graph]
    bodies = [module.graph for module in owner.modules() if isinstance(module, fx.GraphModule) and module is not owner]
    return [graph, *bodies]


def _matmul_work(classifier: fx.Node) -> tuple[int, int]:
    """FLOPs of the classifier and of the other matmuls of its graph (checkpointed bodies included), at the hints."""
    rest = sum(_matmul_flops(node) for graph in _graphs_of(classifier.graph) for node in graph.nodes
               if node is not classifier)
    return _matmul_flops(classifier), rest


def _head_heavy(head: int, rest: int, widened: bool = False) -> str:
    """Why the row-wise op should serve returned logits on CUDA, or "", from the classifier's FLOPs (``head``) and
    those of the graph's other matmuls (``rest``, ``_matmul_work``): where those do at most
    ``HEAD_SHARE`` times the classifier's work, the detached ``cce_with_logits``' extra 2·N·D·V GEMM adds at least
    1/12 of the step's matmul work (forward and backward: three times the forward's), more than memopt's other
    savings give back. Measured on the H100 (`benchmarks/zoo.py`, 2 blocks, 8 × 1024 tokens): Granite, Phi-3 and
    Starcoder2 (other matmuls 1.2-2.3× the classifier's) took 1.04-1.11× torch.compile's step time with
    ``cce_with_logits``, 0.90-0.94× with the row-wise op, whose peak was 0.01-0.07 of torch.compile's higher. FSDP2's
    per-block frames leave the head alone in its graph: the op alone 1.52×, the row-wise one 1.04×
    (`benchmarks/e2e.py --flows fsdp`). Past that share, ``cce_with_logits``' lower peak costs no time against
    torch.compile: the Llama-3.2-1B shape's 16 blocks (other matmuls 3.7× the classifier's) at 0.80× its peak and
    0.93× its time (`benchmarks/e2e.py --flows whole_model`).

    Logits returned in a wider dtype (``widened``) take the row-wise op only where the classifier outweighs the
    rest: ``cce_with_logits`` writes them from its GEMM in that dtype, where the row-wise op's 16-bit logits are
    cast beside them (HF Trainer's fp32 logits; its GPT-2 step was measured with ``cce_with_logits``)."""
    if head == 0 or (rest >= head if widened else rest > HEAD_SHARE * head):
        return ""
    bound = f"less than the classifier's {head:.2g}, returned widened" if widened else \
        f"at most {HEAD_SHARE}× the classifier's {head:.2g}"
    return (
        f"returned logits of a head-heavy graph (its other matmuls {rest:.2g} FLOPs, {bound}): the detached "
        "cce_with_logits' extra 2·N·D·V GEMM would add at least 1/12 of the step's matmul work, so the row-wise "
        "op (6·N·D·V, as torch.compile's head) serves it"
    )


# The most the graph's other matmuls may weigh against the classifier for the row-wise op to serve returned logits
# on CUDA (``_head_heavy``): 3, where cce_with_logits' extra GEMM is 1/12 of the step's matmul work.
HEAD_SHARE = 3


def _wrapper_carries_logits(candidate: CceMatch) -> bool:
    """Whether the returned logits leave the graph without a gradient, which the backend's wrapper re-attaches
    (``fxpass/returned_logits.py``): the graph only returns them, the backend wraps it, and a backward exists."""
    return candidate.returns_logits and bool(candidate.returned_positions) and any(_needs(candidate))


def _rowwise_blocker(candidate: CceMatch, config: Config) -> str | None:
    if candidate.returns_logits and not candidate.returned_positions:
        return (
            "the logits are read inside the graph (or the graph is not one the backend wraps), so their gradient "
            "must reach the fused op: memopt.cce_with_logits serves them"
        )
    if candidate.returns_logits and not any(_needs(candidate)):
        return "nothing wants a gradient (no backward): memopt.cce_with_logits takes the loss alone"
    if candidate.loss.reduction not in ("mean", "sum"):
        return f"reduction {candidate.loss.reduction!r} is not a scalar"
    if candidate.log_sum_exps:
        return "z-loss terms need the log-sum-exp's own gradient"
    if config.cce_filter_for(tensor_value(candidate.classifier).dtype):
        return "the gradient filter belongs to the chunked variant"
    return None


def _needs(candidate: CceMatch) -> tuple[bool, bool, bool]:
    """Which of hidden, weight and bias the backward will want a gradient for (nothing without a backward)."""
    if not tensor_value(candidate.loss.node).requires_grad:
        return False, False, False

    def wants(node: fx.Node | None) -> bool:
        value = tensor_value(node) if node is not None else None
        return value is not None and value.requires_grad

    return wants(candidate.hidden), wants(candidate.weight), wants(candidate.bias)


def memory_model(candidate: CceMatch, assume_device: str | None = None, variant: str = "chunked") -> shapes.MemoryModel:
    """Bytes the loss keeps alive as written (saved log-probabilities and logits-sized temporaries), against
    those of the op that replaces it (``variant``)."""
    from lowerings.cce import rowwise
    from lowerings.cce.op import working_set

    logits = tensor_value(candidate.classifier)
    ce_input = tensor_value(candidate.loss.input)
    hidden = tensor_value(candidate.hidden)
    vocab, dim = ce_input.shape[-1], hidden.shape[-1]
    rows = ce_input.shape[0]
    dtype = logits.dtype  # the classifier's compute dtype (autocast's, if it was on)
    # Logits the graph returns exist either way, and so does the gradient autograd hands them (zeros if unused).
    # Returned after their transform, the classifier's own output is a transient of the forward before the rewrite;
    # the ops transform their logits in place: in their own buffer off CUDA and in the row-wise op, and in the
    # traced CUDA body of cce_with_logits by Inductor's pointwise kernel, which reuses the GEMM's buffer (as its CPU
    # output code shows; not yet measured on CUDA).
    returned = shapes.nbytes(tensor_value(candidate.returned)) if candidate.returns_logits else 0
    forward = shapes.nbytes(logits) - returned
    backward = shapes.nbytes(ce_input) + (shapes.nbytes(logits) if logits.dtype != ce_input.dtype else 0)
    for node in candidate.path:
        if _materializes(node):
            forward = forward + shapes.nbytes(tensor_value(node))
    before = {
        "saved: log-probabilities [N, V]": shapes.nbytes(ce_input),
        "transient: logits and their copies (forward) / logit gradients (backward)": torch.sym_max(
            forward, backward
        ),
    }
    device = assumed_device(hidden.device, assume_device)
    if variant == "rowwise":
        weight_grad = tensor_value(candidate.weight).dtype  # the parameter's, before autocast's cast
        after = rowwise.working_set(
            rows, vocab, dim, dtype, device, _needs(candidate), candidate.returns_logits, weight_grad
        )
    else:
        after = working_set(rows, vocab, dim, dtype, device)
    # A caller that drops the returned logits (``.loss``, the Trainer) frees them before the backward, where
    # autograd hands the graph their gradient (zeros): the two are charged as one, never alive together.
    returned_then_gradient = "returned: the logits [N, V] (forward), then their gradient, zeros if unused (backward)"
    if candidate.returns_logits:
        before[returned_then_gradient] = returned
    # (the row-wise op serves returned logits only where the wrapper carries their gradient: _rowwise_blocker)
    if _wrapper_carries_logits(candidate) and variant == "rowwise":  # gradients taken from the logits it returns
        padded = rows * rowwise.padded_vocab(vocab, device.type) * dtype.itemsize
        label = "returned: the logits [N, V] (rows padded to 64 on CUDA); no gradient of theirs enters the graph"
        after[label] = padded
    elif _wrapper_carries_logits(candidate) and candidate.returned_dtype is not None:
        # the fp32 logits the graph returns were the cast's copy before and are the op's output now: charged on
        # neither side; the 16-bit logits they were cast from no longer exist
        after["returned: the logits [N, V], written in fp32 by the op; no 16-bit copy, no gradient in the graph"] = 0
    elif _wrapper_carries_logits(candidate):
        after["returned: the logits [N, V]; no gradient of theirs enters the graph"] = returned
    if _wrapper_carries_logits(candidate):
        # the operands handed back to the wrapper get autograd's zeros when the logits go unused
        after["transient (backward): zero gradients of the hidden states returned for the logits' own"] = (
            rows * dim * dtype.itemsize
        )
    elif candidate.returns_logits:
        after[returned_then_gradient] = returned
    return shapes.MemoryModel(before, after)


def _materializes(node: fx.Node) -> bool:
    """Ops on the path that allocate a logits-sized tensor: dtype changes, copies, log-softmax, softcap."""
    kind = view_kind(node)
    if kind is ViewKind.CAST:
        return tensor_value(node).dtype != tensor_value(node.args[0]).dtype
    return kind is ViewKind.COPY or kind is None


# --- apply ------------------------------------------------------------------------------------------------


def apply(gm: fx.GraphModule, candidate: CceMatch, config: Config) -> None:
    graph = gm.graph
    loss_node = candidate.loss.node
    fake_mode = fake_mode_of([loss_node, candidate.hidden])
    dim = tensor_value(candidate.hidden).shape[-1]

    def add(op: str, target: Any, *args: Any, **kwargs: Any) -> fx.Node:
        return insert_node(graph, op, target, args, kwargs, meta_from=loss_node, fake_mode=fake_mode)

    with graph.inserting_before(_insertion_point(candidate)):
        hidden = candidate.hidden
        hidden_at = {candidate.classifier: hidden}  # the hidden states whose rows match each chain node's
        for node in candidate.path:
            kind = view_kind(node)
            if kind is ViewKind.INDEX:
                hidden = add("call_function", operator.getitem, hidden, node.args[1])
            elif kind is ViewKind.RESHAPE:
                hidden = _replay_reshape(add, node, hidden, dim)
            hidden_at[node] = hidden
        # Under autocast the classifier ran in its output's dtype: cast the operands as autocast did.
        dtype = tensor_value(candidate.classifier).dtype
        hidden = cast_to(add, hidden, dtype)
        weight = cast_to(add, candidate.weight, dtype)
        if candidate.weight_is_transposed:
            weight = add("call_method", "t", weight)
        bias = cast_to(add, candidate.bias, dtype) if candidate.bias is not None else None
        loss = candidate.loss
        arguments = (
            hidden, weight, bias, loss.targets, loss.ignore_index, loss.reduction, float(loss.label_smoothing),
            candidate.softcap,
        )
        transform = _transform_kwargs(candidate)  # (by name: a graph without a transform reads as before)
        rowwise = choose_variant(candidate, config)[0] == "rowwise"
        if candidate.returns_logits and rowwise:  # the op returns the logits too (their gradient: the wrapper)
            fused = add(
                "call_function", torch.ops.memopt.cce_rowwise.default, *arguments, *_needs(candidate), True,
                **transform, **_grad_dtype_kwargs(candidate),
            )
        elif candidate.returns_logits:  # the filter drops logit-gradient tiles, which the returned logits may fill
            detach = _wrapper_carries_logits(candidate)  # their gradient (the wrapper's) never enters the graph
            widened = [candidate.returned_dtype] if candidate.returned_dtype is not None else []
            fused = add(
                "call_function", torch.ops.memopt.cce_with_logits.default, *arguments, detach, *widened, **transform
            )
        elif rowwise:
            fused = add(
                "call_function", torch.ops.memopt.cce_rowwise.default, *arguments, *_needs(candidate), **transform,
                **_grad_dtype_kwargs(candidate),
            )
        else:
            filter_eps = [eps] if (eps := config.cce_filter_for(dtype)) else []
            fused = add("call_function", torch.ops.memopt.cce.default, *arguments, *filter_eps, **transform)
        result = _cast_like(add, add("call_function", operator.getitem, fused, 0), loss_node)
        replacements = [(loss_node, result)]
        logits = None
        if candidate.returns_logits:
            logits = _returned_logits(add, fused, candidate.hidden, 4 if rowwise else 2)
            replacements.append((candidate.returned, logits))
        for lse_node, source, _ in candidate.log_sum_exps:
            rows = add("call_function", operator.getitem, fused, 1)
            size = add("call_method", "size", hidden_at[source])
            lead = add("call_function", operator.getitem, size, slice(None, -1))
            replacements.append((lse_node, _cast_like(add, add("call_method", "reshape", rows, lead), lse_node)))
    inside = {*candidate.nodes}
    for old, new in replacements:
        old.replace_all_uses_with(new, delete_user_cb=lambda user: user not in inside)
    if logits is not None and candidate.returned_dtype is not None and not rowwise:  # the chain now starts in fp32
        _refresh_returned_chains(logits, fake_mode)
    transposes = [n for n in candidate.classifier.all_input_nodes if is_param_transpose(n)]
    erase_unused([*candidate.nodes, *transposes])
    if _wrapper_carries_logits(candidate):  # (the row-wise op returns logits only then: _rowwise_blocker)
        _return_operands(graph, candidate, hidden, weight, bias)


def _transform_kwargs(candidate: CceMatch) -> dict[str, Any]:
    """The op's keyword arguments for the logit scale, and for logits returned transformed; none where they keep
    their defaults."""
    kwargs: dict[str, Any] = {}
    if candidate.scale != 1.0:
        kwargs["scale"] = candidate.scale
    if candidate.divisor != 1.0:
        kwargs["divisor"] = candidate.divisor
    if candidate.transform_logits:
        kwargs["transform_logits"] = True
    return kwargs


def _grad_dtype_kwargs(candidate: CceMatch) -> dict[str, Any]:
    """The row-wise op's ``grad_dtype``: the classifier parameter's dtype where autocast cast it (an fp32 weight
    keeps its fp32 sum as its own gradient); none where the op's classifier is the parameter (a 16-bit one's ∂C
    is then rounded at the op's end, as eager's GEMM rounds it)."""
    parameter = tensor_value(candidate.weight).dtype
    return {} if parameter == tensor_value(candidate.classifier).dtype else {"grad_dtype": parameter}


def _refresh_returned_chains(logits: fx.Node, fake_mode) -> None:
    """Re-derive the example values of the casts and reshapes between the op's widened logits and the output,
    which still describe the 16-bit logits they used to read."""
    pending = [user for user in logits.users if user.op != "output"]
    while pending:
        node = pending.pop()
        propagate_example_value(node, fake_mode)
        pending.extend(user for user in node.users if user.op != "output")


def _return_operands(graph: fx.Graph, candidate: CceMatch, hidden: fx.Node, weight: fx.Node, bias) -> None:
    """Name the classifier's operands as the op saw them for the wrapper that re-attaches the returned logits'
    gradient (``fxpass/returned_logits.py``): a graph input (cast and transposed again by the wrapper) where
    the operand is one, else an extra graph output."""
    placeholders = [node for node in graph.nodes if node.op == "placeholder"]
    dtype = tensor_value(candidate.classifier).dtype

    def operand(source: fx.Node, as_seen: fx.Node, transposed: bool) -> returned_logits.Operand:
        if source.op == "placeholder":
            cast = dtype if tensor_value(source).dtype != dtype else None
            return returned_logits.Operand("input", placeholders.index(source), cast, transposed)
        return returned_logits.Operand("output", returned_logits.add_output(graph, as_seen))

    transform = returned_logits.Transform()
    if candidate.transform_logits:
        transform = returned_logits.Transform(candidate.scale / candidate.divisor, candidate.softcap)
    entry = returned_logits.ReturnedLogits(
        positions=candidate.returned_positions,
        hidden=returned_logits.Operand("output", returned_logits.add_output(graph, hidden)),
        weight=operand(candidate.weight, weight, candidate.weight_is_transposed),
        bias=operand(candidate.bias, bias, False) if candidate.bias is not None else None,
        transform=transform,
    )
    returned_logits.record(graph, entry)


def _returned_logits(add, fused: fx.Node, hidden: fx.Node, index: int) -> fx.Node:
    """The op's [N, V] logits (output ``index``) shaped as the classifier returned them: the hidden states'
    leading dims, then V."""
    logits = add("call_function", operator.getitem, fused, index)
    sizes = tensor_value(hidden).shape[:-1]
    if len(sizes) == 1:
        return logits
    static = [shapes.constant(size) for size in sizes]
    if None not in static:
        return add("call_method", "view", logits, *static, -1)
    lead = add("call_function", operator.getitem, add("call_method", "size", hidden), slice(None, -1))
    return add("call_method", "reshape", logits, add("call_function", operator.add, lead, (-1,)))


def _cast_like(add, node: fx.Node, like: fx.Node) -> fx.Node:
    wanted = tensor_value(like).dtype
    return node if tensor_value(node).dtype == wanted else add("call_method", "to", node, wanted)


def _replay_reshape(add, node: fx.Node, hidden: fx.Node, dim) -> fx.Node:
    """Apply ``node``'s reshape of [.., V] logits to [.., D] hidden states."""
    if _is_flatten(node):
        start = node.args[1] if len(node.args) > 1 else node.kwargs.get("start_dim", 0)
        return add("call_method", "flatten", hidden, start, _flatten_end(node))
    shape = _shape_arg(node)
    if shapes.constant(dim) is not None:
        new_last: Any = shapes.constant(dim)
    elif not any(isinstance(size, int) and size == -1 for size in shape[:-1]):
        new_last = -1
    else:  # a symbolic hidden size next to an inferred dimension: read it off the hidden states
        new_last = add("call_method", "size", hidden, -1)
    return add("call_method", "reshape", hidden, *shape[:-1], new_last)


RULE = Rule(name=NAME, match=match, decide=decide, apply=apply, choose=choose)
