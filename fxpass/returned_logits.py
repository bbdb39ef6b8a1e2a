"""The gradient of logits a compiled graph returns beside its CCE loss, added outside the graph.

A whole model compiled as it is (``torch.compile(model)``, HF Trainer) returns its logits with the loss, and
most callers drop them. Inside the graph AOTAutograd would give such an output a gradient input, and autograd
hands that input zeros when the logits go unused: an N×V zero fill, then two N×V GEMMs that add nothing. So
the CCE rule (``fxpass/rules/cce.py``) returns the logits from ``memopt.cce_with_logits`` (detached) or
``memopt.cce_rowwise`` as a plain, non-differentiable output, and names the classifier's operands as seen by
the op: the hidden states (an extra graph output) and the weight and bias (graph inputs, cast as autocast cast
them, or extra outputs too).

``attach`` wraps the compiled graph: each call re-attaches the returned logits to those operands through
``LogitsGradient``. When the caller uses the logits (a distillation loss, a z-loss), autograd runs its
backward, ``∂h = g·C``, ``∂C = gᵀ·h``, ``∂b = Σ g`` (the linear's own backward), and those gradients flow into
the compiled graph's backward and the parameters as usual. When the caller drops the logits, the node is never
reached, and the backward costs nothing beyond the loss's own gradient.

Logits the model returns after a transform (Gemma 2's final softcap, Cohere's and Granite's logit scale) are
z = c·tanh(x·m/c) of the classifier's x; their gradient first goes back through it (``Transform``), from the
returned logits themselves: ∂z/∂x = m·(1 − (z/c)²).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

META_KEY = "memopt_returned_logits"
# Set by the backend on the graph it compiles: only a graph whose outputs the backend wraps may return logits
# this way (a checkpointed region's body, or a graph rewritten without the backend, keeps ``cce_with_logits``).
WRAPPED_KEY = "memopt_wraps_outputs"


@dataclasses.dataclass(frozen=True)
class Operand:
    """Where the wrapper finds one classifier operand: graph input ``index`` (then cast to ``dtype`` and
    transposed as the op saw it), or extra graph output ``index``."""

    kind: str  # "input" | "output"
    index: int
    dtype: torch.dtype | None = None
    transposed: bool = False

    def value(self, inputs: Sequence[Any], outputs: Sequence[Any]) -> torch.Tensor:
        """The tensor itself: a graph input as it came in (``as_seen`` makes it what the op saw)."""
        return outputs[self.index] if self.kind == "output" else inputs[self.index]

    def as_seen(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` cast and transposed as the op saw it (only in the backward: a cast copy of the classifier
        made at every call would be kept as long as the logits live)."""
        if self.dtype is not None and tensor.dtype != self.dtype:
            tensor = tensor.to(self.dtype)
        return tensor.t() if self.transposed else tensor

    def gradient_of(self, grad: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
        """The gradient of ``tensor`` from the gradient of ``as_seen(tensor)``: the transpose and cast undone, as
        autograd's backward of those two ops would."""
        grad = grad.t() if self.transposed else grad
        return grad.to(tensor.dtype)


@dataclasses.dataclass(frozen=True)
class Transform:
    """Returned logits z = c·tanh(x·m/c) of the classifier's outputs x (x·m without a softcap c)."""

    scale: float = 1.0
    softcap: float | None = None

    @property
    def identity(self) -> bool:
        return self.scale == 1.0 and self.softcap is None

    def input_gradient(self, grad: torch.Tensor, logits: torch.Tensor | None) -> torch.Tensor:
        """∂/∂x from ``grad`` = ∂/∂z, in the compute dtype: times m·(1 − (z/c)²), with z the returned ``logits``
        (tanh(x·m/c) = z/c, so the slope needs no second tensor)."""
        if self.identity:
            return grad
        wide = torch.float64 if grad.dtype == torch.float64 else torch.float32
        grad = grad.to(wide)
        if self.softcap is not None:
            grad = grad * (1.0 - (logits.to(wide) / self.softcap).square())
        return grad * self.scale if self.scale != 1.0 else grad


@dataclasses.dataclass(frozen=True)
class ReturnedLogits:
    """Graph outputs ``positions`` hold logits of the classifier ``hidden`` [N, D] · ``weight`` [V, D]ᵀ (+ ``bias``),
    transformed by ``transform``."""

    positions: tuple[int, ...]
    hidden: Operand
    weight: Operand
    bias: Operand | None
    transform: Transform = Transform()


def returned_logits(graph: fx.Graph) -> list[ReturnedLogits]:
    """What the CCE rule recorded on ``graph``'s output node (nothing if the graph was restored)."""
    return list(graph.output_node().meta.get(META_KEY, ()))


def record(graph: fx.Graph, entry: ReturnedLogits) -> None:
    """Add ``entry`` to the output node's record as a new list: a copy of the graph taken before keeps its own."""
    output = graph.output_node()
    output.meta[META_KEY] = [*output.meta.get(META_KEY, ()), entry]


def output_positions(graph: fx.Graph, node: fx.Node) -> tuple[int, ...] | None:
    """Where ``node`` sits in the graph's flat output tuple; None if the outputs are not a flat tuple or hold it
    some other way too (inside a nested structure)."""
    values = graph.output_node().args[0]
    if not isinstance(values, (tuple, list)):
        return None
    positions = tuple(index for index, value in enumerate(values) if value is node)
    nested = [value for value in values if isinstance(value, (tuple, list, dict))]
    return positions if positions and not nested else None


def output_count(graph: fx.Graph) -> int:
    values = graph.output_node().args[0]
    return len(values) if isinstance(values, (tuple, list)) else 1


def add_output(graph: fx.Graph, node: fx.Node) -> int:
    """Append ``node`` to the graph's outputs; its position."""
    output = graph.output_node()
    values = tuple(output.args[0])
    output.args = ((*values, node), *output.args[1:])
    return len(values)


AS_IS = Operand("output", -1)  # an operand the op saw as it is


class LogitsGradient(torch.autograd.Function):
    """``logits`` as they are, made differentiable in ``hidden``, ``weight`` and ``bias`` as ``transform`` of
    ``F.linear`` of the operands as the op saw them is (``weight_seen.as_seen(weight)``, likewise the bias)."""

    @staticmethod
    def forward(ctx, logits, hidden, weight, bias, weight_seen=AS_IS, bias_seen=AS_IS, transform=Transform()):
        # a softcap's slope is read off the returned logits, which exist as long as the caller keeps them
        ctx.save_for_backward(hidden, weight, bias, logits if transform.softcap is not None else None)
        ctx.seen = (weight_seen, bias_seen)
        ctx.transform = transform
        return logits.view_as(logits)

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, bias, logits = ctx.saved_tensors
        weight_seen, bias_seen = ctx.seen
        classifier = weight_seen.as_seen(weight)
        grad = ctx.transform.input_gradient(grad, logits)
        rows = grad.reshape(-1, grad.shape[-1]).to(classifier.dtype)
        grad_hidden = grad_weight = grad_bias = None
        if ctx.needs_input_grad[1]:
            grad_hidden = (rows @ classifier).view(hidden.shape)
        if ctx.needs_input_grad[2]:
            grad_weight = weight_seen.gradient_of(rows.t() @ hidden.reshape(-1, hidden.shape[-1]), weight)
        if bias is not None and ctx.needs_input_grad[3]:
            grad_bias = bias_seen.gradient_of(rows.sum(0), bias)
        return None, grad_hidden, grad_weight, grad_bias, None, None, None


def attach(compiled: Callable, entries: Sequence[ReturnedLogits], extra_outputs: int) -> Callable:
    """``compiled`` with the returned logits made differentiable again and the ``extra_outputs`` (the last ones,
    the operands) dropped, so that Dynamo sees the outputs of the graph it captured."""
    if not entries:
        return compiled

    def finish(inputs: Sequence[Any], outputs: Sequence[Any]) -> list[Any]:
        outputs = list(outputs)
        if torch.is_grad_enabled():
            for entry in entries:
                hidden = entry.hidden.value(inputs, outputs)
                weight = entry.weight.value(inputs, outputs)
                bias = entry.bias.value(inputs, outputs) if entry.bias is not None else None
                bias_seen = entry.bias if entry.bias is not None else AS_IS
                for position in entry.positions:
                    outputs[position] = LogitsGradient.apply(
                        outputs[position], hidden, weight, bias, entry.weight, bias_seen, entry.transform
                    )
        return outputs[: len(outputs) - extra_outputs]

    def run(*args: Any) -> list[Any]:  # Dynamo calls a backend's result with the graph's inputs, unboxed
        return finish(args, compiled(*args))

    return run
