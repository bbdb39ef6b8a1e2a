"""Embedding: a 16-bit table's weight gradient without Inductor's fp32 copy of the table.

Inductor decomposes ``embedding_dense_backward`` into a scatter-add into a zeroed fp32 [V, D] table, then a cast
to the weight's dtype: V·D·4 bytes that neither eager CUDA nor the gradient itself needs, alive at the end of the
backward where every other weight's gradient is (Cohere's 256000 × 4096 table: 4 GiB beside its 2 GiB gradient).
``memopt::embedding``'s backward is PyTorch's CUDA kernel, opaque to Inductor: fp32 partial sums of the rows each
index gathers, the table written once in its dtype (lowerings/embedding/op.py). Priced against torch.compile
like every rule, so a small table (GPT-2's 1024 positions) whose fp32 copy is smaller than the kernel's partial
sums is declined on that figure.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx
import torch.nn.functional as F

from fxpass import shapes
from fxpass.config import Config
from fxpass.graph import REPLACED_BY, GraphFacts, bind_args, fake_mode_of, insert_node, is_call, tensor_value
from fxpass.rules.base import Decision, Rule, decide_on_saving

_ARGS = ("input", "weight", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse")
_DEFAULTS = {"padding_idx": None, "max_norm": None, "norm_type": 2.0, "scale_grad_by_freq": False, "sparse": False}
_SIXTEEN_BIT = (torch.bfloat16, torch.float16)


@dataclasses.dataclass(frozen=True)
class EmbeddingMatch:
    anchor: fx.Node  # the F.embedding call
    indices: fx.Node | None
    weight: fx.Node | None
    padding_idx: int  # -1: none (aten's convention)
    scale_grad_by_freq: bool
    blocker: str | None

    @property
    def nodes(self) -> tuple[fx.Node, ...]:
        return (self.anchor,)

    def params(self) -> dict:
        weight = tensor_value(self.weight)
        if weight is None:
            return {}
        return {"table": [str(s) for s in weight.shape], "dtype": str(weight.dtype).removeprefix("torch.")}


def match(facts: GraphFacts) -> list[EmbeddingMatch]:
    return [_match_one(node) for node in facts.gm.graph.nodes if is_call(node, F.embedding)]


def _match_one(node: fx.Node) -> EmbeddingMatch:
    bound = bind_args(node, _ARGS, _DEFAULTS)
    if bound is None or not isinstance(bound.get("input"), fx.Node) or not isinstance(bound.get("weight"), fx.Node):
        return EmbeddingMatch(node, None, None, -1, False, "F.embedding called with arguments memopt does not read")
    indices, weight = bound["input"], bound["weight"]
    padding_idx = _padding_index(bound["padding_idx"], tensor_value(weight))
    blocker = _blocker(bound, tensor_value(indices), tensor_value(weight), padding_idx)
    return EmbeddingMatch(node, indices, weight, -1 if padding_idx is None else padding_idx,
                          bool(bound["scale_grad_by_freq"]), blocker)


def _padding_index(padding_idx, weight: torch.Tensor | None) -> int | None:
    """``padding_idx`` as ``F.embedding`` passes it to aten (negative counted from the end, None as -1); None
    where it is negative and the table's length is symbolic."""
    if padding_idx is None:
        return -1
    if not isinstance(padding_idx, int) or weight is None:
        return None
    if padding_idx >= 0:
        return padding_idx
    rows = weight.shape[0]
    return rows + padding_idx if isinstance(rows, int) else None


def _blocker(bound: dict, indices: torch.Tensor | None, weight: torch.Tensor | None,
             padding_idx: int | None) -> str | None:
    """Why the call is left to PyTorch, or None."""
    if weight is None or indices is None or weight.dim() != 2:
        return "the table or the indices are not tensors of known shape"
    if bound["sparse"] is not False:
        return "sparse=True: the gradient is a sparse tensor, never a dense table"
    if bound["max_norm"] is not None:
        return "max_norm renormalizes the table in place during the forward; left to PyTorch"
    if not isinstance(bound["scale_grad_by_freq"], bool):
        return "scale_grad_by_freq is not a constant"
    if padding_idx is None:
        return "padding_idx is negative over a table of symbolic length"
    if not weight.requires_grad:
        return "the table takes no gradient (frozen): the backward writes no table"
    if weight.dtype not in _SIXTEEN_BIT:
        return (f"the table is {str(weight.dtype).removeprefix('torch.')}: Inductor accumulates its gradient in "
                "the gradient itself, with no fp32 copy to free")
    if indices.dtype not in (torch.int32, torch.int64):
        return f"indices of dtype {indices.dtype}"
    return None


def decide(candidate: EmbeddingMatch, config: Config) -> Decision:
    if candidate.blocker:
        return Decision(False, candidate.blocker)
    from lowerings.embedding import op

    weight, indices = tensor_value(candidate.weight), tensor_value(candidate.indices)
    rows, width = indices.numel(), weight.shape[1]
    table = weight.shape[0] * width
    device = config.memory_device(weight.device)
    memory = shapes.MemoryModel(
        before={"transient: the fp32 table Inductor's decomposition sums the gradient into": table * 4},
        after=op.working_set(rows, width, device, weight.dtype),
    )
    how = "PyTorch's CUDA kernel" if device.type == "cuda" else "over the distinct indices"
    return decide_on_saving(memory, config, f"the table's gradient summed in fp32 ({how}) and written in its dtype")


def apply(gm: fx.GraphModule, candidate: EmbeddingMatch, config: Config) -> None:
    graph, node = gm.graph, candidate.anchor
    with graph.inserting_before(node):
        replaced = insert_node(
            graph, "call_function", torch.ops.memopt.embedding.default,
            (candidate.indices, candidate.weight, candidate.padding_idx, candidate.scale_grad_by_freq),
            meta_from=node, fake_mode=fake_mode_of([node]),
        )
    node.replace_all_uses_with(replaced)
    node.meta[REPLACED_BY] = replaced
    graph.erase_node(node)


RULE = Rule(name="embedding", match=match, decide=decide, apply=apply)
