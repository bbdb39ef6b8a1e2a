"""What a rewrite frees against torch.compile: the nodes it replaces and the nodes it inserts, each priced by
``compiled_cost`` (partitioned as AOTAutograd and Inductor run them).

The rewrite is tried on a copy of the graph, so the priced pieces are exactly what ``apply`` removes and what
it adds, for every rule and variant, with no list per pattern to keep in step with the rules. The inserted
pieces call memopt's ops, whose autograd the partitioner traces like any other: what they save is read from
the trace. What an op allocates inside its own kernels (a chunk of logits, an fp32 accumulator) is invisible to
the partitioner; the op registers it (``lowerings._library.workspace``, its memory model's transient terms) and
the simulation charges it at the op's own node, forward or backward.

Pieces repeat across a model (one attention per layer), so costs are cached by the piece's code and its inputs'
sizes and dtypes.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx

from fxpass import shapes
from fxpass.compiled_cost import CompiledCost, compiled_cost, extract, graph_env
from fxpass.config import Config
from fxpass.graph import copy_graph, current, example_value
from fxpass.liveness import is_view
from fxpass.notes import INTERNAL

log = logging.getLogger(__name__)

IntLike = shapes.IntLike


@dataclasses.dataclass(frozen=True)
class Priced:
    """Bytes a rewrite frees against torch.compile, and the two pieces' costs behind them.

    ``saved``: what the compiled forward no longer keeps for the backward (alive across the step's peak).
    ``peak``: how much lower the piece's own peak is, forward or backward, the ops' internal buffers included:
    what the step's peak drops by where the piece runs at it (a language model's head, at the start of the
    backward). ``transient`` is the part of ``peak`` that is not ``saved``. A tensor the piece returns to the
    step's caller (a model's logits) is held through the backward: torch.compile's head saves its logits and
    returns that storage, where memopt's ops return logits they do not save, so the backward's peak counts
    them (``held_peak``): without them, memopt's row-wise head looked as good as ``cce_with_logits`` at Cohere's
    V = 256000, where the whole step simulated 2.3 GiB dearer than torch.compile's.
    """

    saved: IntLike
    peak: IntLike
    before: CompiledCost
    after: CompiledCost

    @property
    def transient(self) -> IntLike:
        return self.peak - self.saved

    def describe(self) -> dict[str, Any]:
        """The figures as the report prints them: expressions, their hints, and the saved tensors."""
        figures = {"saved": self.saved, "transient": self.transient, "peak": self.peak}
        return {
            **{name: shapes.render(value) for name, value in figures.items()},
            **{f"{name}_hint": shapes.hint(value) for name, value in figures.items()},
            "torch.compile keeps": list(self.before.saved_tensors),
            "memopt keeps": list(self.after.saved_tensors),
            INTERNAL: shapes.render(self.after.workspace),
            "internal_hint": shapes.hint(self.after.workspace),
        }


# Per shape environment (one per compiled graph, shared by its layers): a cost holds SymInts of that
# environment, which mean nothing in another graph's.
_CACHE: weakref.WeakKeyDictionary[Any, dict[tuple, CompiledCost]] = weakref.WeakKeyDictionary()
_NO_SHAPE_ENV = type("NoShapeEnv", (), {})()  # the key of graphs with static shapes only


def clear_cache() -> None:
    """Forget the costs of pieces seen so far (their figures for static shapes are kept across graphs)."""
    _CACHE.clear()


def price(rule, candidate, config: Config, context: Sequence[fx.Node] = ()) -> Priced:
    """Try ``rule``'s rewrite of ``candidate`` on a copy of its graph and price both sides (module docstring).
    ``context``: nodes the rewrite leaves in place but whose fate decides what it frees (the producers of a
    tensor torch.compile may save or recompute), priced on both sides."""
    graph = candidate.anchor.graph
    owner = graph.owning_module
    copies: dict[fx.Node, fx.Node] = {}
    trial_graph = copy_graph(graph, copies)
    trial = fx.GraphModule(owner, trial_graph)
    kept = set(copies.values())
    rule.apply(trial, _remap(candidate, copies), config)
    around = set(context)
    before_nodes = [old for old, new in copies.items() if old.op.startswith("call_") and (new._erased or old in around)]
    around_copies = {copies[n] for n in around if not copies[n]._erased}
    # (an inserted ``get_attr``, such as WTA-CRS's gradient-norm estimate, is read as an input of the piece)
    after_nodes = [n for n in trial.graph.nodes if (n not in kept or n in around_copies) and n.op.startswith("call_")]
    before = _cost(before_nodes, config.assume_device)
    after = _cost(after_nodes, config.assume_device)
    return Priced(before.saved - after.saved, held_peak(before) - held_peak(after), before, after)


def held_peak(cost: CompiledCost) -> IntLike:
    """A piece's peak with what it returns to the caller held through its backward."""
    return torch.sym_max(cost.forward_peak, cost.backward_peak + cost.returned)


def _cost(nodes: list[fx.Node], device: str | None = None) -> CompiledCost:
    """The compiled cost of ``nodes`` (one graph's, in its order), returning those read by other nodes;
    ``device``: the device assumed to run it (``compiled_cost``), if not the graph's own."""
    if not nodes:
        return CompiledCost(0, 0, 0)
    inside = set(nodes)
    outputs = [n for n in nodes if any(user not in inside for user in n.users)]
    piece, inputs = extract(nodes, outputs)
    values = [example_value(n) for n in inputs]
    to_caller = frozenset(i for i, n in enumerate(outputs) if _reaches_caller(n))
    key = (piece.code, tuple(_signature(v) for v in values), device, to_caller)
    cache = _CACHE.setdefault(graph_env(values) or _NO_SHAPE_ENV, {})
    if key not in cache:
        cache[key] = compiled_cost(piece, values, device, to_caller)
    return cache[key]


def _reaches_caller(node: fx.Node, depth: int = 8) -> bool:
    """Whether ``node``'s value (or a view of it, ``liveness.is_view``) is one of the graph's outputs: the caller
    holds it."""
    return any(user.op == "output" or (depth and is_view(user) and _reaches_caller(user, depth - 1))
               for user in node.users)


def _signature(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (tuple(str(shapes.expr(s)) for s in value.shape), value.dtype, value.device.type, value.requires_grad)
    if isinstance(value, torch.SymInt):
        return ("symint", str(shapes.expr(value)))
    return ("value", repr(value))


def _remap(value: Any, copies: dict[fx.Node, fx.Node]) -> Any:
    """``value`` (a candidate: dataclasses, tuples, lists, dicts of nodes) with every node replaced by its copy."""
    if isinstance(value, fx.Node):
        return copies.get(current(value), value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {f.name: _remap(getattr(value, f.name), copies) for f in dataclasses.fields(value) if f.init}
        return dataclasses.replace(value, **changes)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_remap(v, copies) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_remap(v, copies) for v in value)
    if isinstance(value, dict):
        return {_remap(k, copies): _remap(v, copies) for k, v in value.items()}
    return value
