"""Activation-checkpointed regions: where they are in a Dynamo graph, and what a rewrite inside one is worth.

``torch.utils.checkpoint`` (and HF's ``gradient_checkpointing_enable()``) under Dynamo becomes a
``torch.ops.higher_order.tag_activation_checkpoint(body, *args)`` call whose body is a nested GraphModule.
AOTAutograd inlines the body and tags its nodes for recomputation: the region saves only its inputs, and its
forward runs again in the backward. A rewrite inside the region therefore frees nothing that is saved for
backward (recomputation already does); what it still lowers is the region's transient peak, in the forward and
again in the recompute and its backward, where a T×T attention score matrix or N×V logits are the largest
buffers of one layer. Those transients happen one region at a time, so their savings do not add up across
regions or layers as saved tensors do.

- attention and CCE apply inside a region, and their records say that the bytes are a transient peak;
- WTA-CRS declines: it only shrinks what is saved for the weight gradient, which the region does not save;
- a region with a ``context_fn`` (selective checkpointing) declines every rule: its policy chooses what to
  save by operator, and a rewrite would change the operators it sees.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

from fxpass import shapes
from fxpass.rules.base import Decision

CHECKPOINT_OPS = frozenset({"tag_activation_checkpoint", "wrap_activation_checkpoint"})
TRANSIENT_NOTE = (
    "inside checkpointed region {region}: recomputation already frees what it would save for backward; "
    "the bytes are the region's transient peak (forward and recompute), not cumulative across regions"
)
WTA_CRS_DECLINE = (
    "inside checkpointed region {region}: recomputation already frees the linear's input (the region saves "
    "only its own inputs), so sampling would add gradient variance and save nothing"
)
SELECTIVE_DECLINE = (
    "inside checkpointed region {region} with a context_fn (selective checkpointing): its policy picks what to "
    "save by operator, and a rewrite would change the operators it sees"
)


@dataclasses.dataclass(frozen=True)
class Region:
    """One checkpoint call: its body graph, that body's attribute name, and its real example inputs."""

    call: fx.Node
    name: str
    body: fx.GraphModule
    example_inputs: tuple[Any, ...]
    selective: bool


def is_checkpoint(node: fx.Node) -> bool:
    target = node.target
    return (
        node.op == "call_function"
        and isinstance(target, torch._ops.HigherOrderOperator)
        and target.name() in CHECKPOINT_OPS
    )


def regions(gm: fx.GraphModule, example_inputs: Sequence[Any] = ()) -> list[Region]:
    """Each checkpointed region called from ``gm``'s top level, once per body (Dynamo gives each call its own)."""
    real = _real_inputs(gm, example_inputs)
    found: dict[str, Region] = {}
    for node in gm.graph.nodes:
        if not is_checkpoint(node) or not node.args or getattr(node.args[0], "op", None) != "get_attr":
            continue
        name = node.args[0].target
        body = getattr(gm, name, None)
        if isinstance(body, fx.GraphModule) and name not in found:
            inputs = tuple(real.get(arg) if isinstance(arg, fx.Node) else None for arg in node.args[1:])
            found[name] = Region(node, name, body, inputs, _selective(node, body))
    return list(found.values())


def _selective(call: fx.Node, body: fx.GraphModule) -> bool:
    """Whether the region has a selective-checkpointing policy (Dynamo keeps it in the body's meta)."""
    return body.meta.get("_checkpoint_context_fn") is not None or call.kwargs.get("context_fn") is not None


def _real_inputs(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> dict[fx.Node, Any]:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_inputs):
        return {}
    return dict(zip(placeholders, example_inputs, strict=True))


def decide_in_region(rule: str, decision: Decision, region: Region) -> Decision:
    """``decision`` for a candidate inside ``region``: transient-only savings, or a decline with the reason."""
    if region.selective:
        return dataclasses.replace(decision, apply=False, reason=SELECTIVE_DECLINE.format(region=region.name))
    if rule == "wta_crs":
        return dataclasses.replace(decision, apply=False, reason=WTA_CRS_DECLINE.format(region=region.name))
    memory = _as_transient(decision.memory) if decision.memory is not None else None
    reason = f"{TRANSIENT_NOTE.format(region=region.name)}; {decision.reason}"
    return dataclasses.replace(decision, reason=reason, memory=memory)


def _as_transient(memory: shapes.MemoryModel) -> shapes.MemoryModel:
    """Rename "saved: ..." terms: in a recomputed region they live only until their backward use."""
    return shapes.MemoryModel(_renamed(memory.before), _renamed(memory.after))


def _renamed(terms: Any) -> dict[str, Any]:
    prefix = "saved: "
    return {
        (f"transient (recomputed, not saved): {name[len(prefix):]}" if name.startswith(prefix) else name): value
        for name, value in terms.items()
    }
