"""Attention subgraphs become ``memopt.flash_attention``: no B·H·Tq·Tk scores or probabilities are kept.

The pattern is found from ``softmax(dim=-1)`` outwards: before it, an optional mask, an optional scale and
``q @ kᵀ`` (matmul, bmm or einsum); after it, an optional cast and dropout, then ``@ v``. Forms covered:
nanoGPT (a registered ``tril`` buffer with ``masked_fill(-inf)``), HF transformers' eager attention
(Llama/Mistral/Qwen2 with ``repeat_kv`` grouped-query heads and the masking utilities' additive mask, GPT-2,
BERT's additive padding mask), scaling by multiplication or division (or none, as in T5),
``torch.where(mask, scores, finfo.min)`` and softmax with a float32 upcast. A mask whose construction is
provably causal (``fxpass.masks``) becomes a flag, so no T×T tensor is materialized at all; any other mask is
passed as an additive bias, learned ones (T5) included: the op returns their gradient.
``F.scaled_dot_product_attention`` calls are already O(T) in memory and are left alone, with the reason
recorded, unless they are handed a materialized mask that is provably causal (then the flag replaces it).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Mapping
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fxpass import masks, shapes
from fxpass.config import Config
from fxpass.graph import (
    MATMUL_TARGETS,
    GraphFacts,
    bind_args,
    describe_node,
    erase_unused,
    fake_mode_of,
    insert_node,
    is_call,
    is_method,
    tensor_value,
)
from fxpass.rules.base import Decision, Rule, decide_on_saving

NAME = "attention"

SOFTMAX_TARGETS = (torch.softmax, F.softmax)
SDPA_TARGETS = (F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention)
# q @ kᵀ and probabilities @ v: the graph's matmul spellings plus bmm over [B·H, T, D].
SCORE_MATMULS = (*MATMUL_TARGETS, torch.bmm)
# A fill value at or below this masks a score out completely (finfo(float32).min and -inf included).
MASKED = -1e30


@dataclasses.dataclass(frozen=True)
class AttentionMatch:
    """softmax(q kᵀ·scale + mask) (dropout) v, or a reason it cannot be rewritten (``blocker``)."""

    softmax: fx.Node
    chain: tuple[fx.Node, ...] = ()  # the nodes replaced, from q @ kᵀ to probabilities @ v
    output: fx.Node | None = None
    q: fx.Node | None = None
    k: fx.Node | None = None
    v: fx.Node | None = None
    scale: float = 1.0
    causal: bool = False
    biases: tuple[fx.Node, ...] = ()  # additive terms, each broadcastable to [B, H, Tq, Tk]
    # A boolean mask to turn into an additive bias: (mask, fill, True if the fill applies where the mask is True)
    bias_from_mask: tuple[fx.Node, float, bool] | None = None
    dropout_p: float = 0.0
    three_d: bool = False  # bmm over [B·H, T, D]
    mask_nodes: tuple[fx.Node, ...] = ()  # mask construction that becomes dead with a causal flag
    blocker: str | None = None

    @property
    def anchor(self) -> fx.Node:
        return self.softmax

    @property
    def nodes(self) -> tuple[fx.Node, ...]:
        return self.chain or (self.softmax,)

    def params(self) -> Mapping[str, Any]:
        params: dict[str, Any] = {"causal": self.causal, "mask": self._mask_kind(), "dropout_p": self.dropout_p}
        q, k = tensor_value(self.q), tensor_value(self.k)
        if q is not None and k is not None:
            params.update(
                batch=shapes.render(q.shape[0]) if not self.three_d else "1",
                heads=shapes.render(q.shape[-3]) if not self.three_d else shapes.render(q.shape[0]),
                kv_heads=shapes.render(k.shape[-3]) if not self.three_d else shapes.render(k.shape[0]),
                queries=shapes.render(q.shape[-2]),
                keys=shapes.render(k.shape[-2]),
                head_dim=shapes.render(q.shape[-1]),
                scale=self.scale,
                dtype=str(q.dtype).removeprefix("torch."),
            )
        return params

    def _mask_kind(self) -> str:
        if self.causal:
            return "causal (flag)"
        if self.biases or self.bias_from_mask is not None:
            return "additive bias"
        return "none"


# --- match ------------------------------------------------------------------------------------------------


def match(facts: GraphFacts) -> list[AttentionMatch]:
    found = []
    for node in facts.gm.graph.nodes:
        if _is_softmax_over_last_dim(node):
            candidate = _match_softmax(node, facts)
            if candidate is not None:
                found.append(candidate)
        elif _is_sdpa(node):
            found.append(_match_sdpa(node, facts))
    return found


SDPA_FUSED = "F.scaled_dot_product_attention is already a fused kernel with O(T) memory; left as is"


def _match_sdpa(node: fx.Node, facts: GraphFacts) -> AttentionMatch:
    """An SDPA call is worth rewriting only when it is handed a materialized mask that is provably causal:
    the flag replaces the mask (and its construction), and the kernel skips the blocks above the diagonal."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    defaults = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}
    bound = bind_args(node, names, defaults)
    mask = bound.get("attn_mask") if bound else None
    if bound is None or not isinstance(mask, fx.Node) or bound["is_causal"] is not False:
        return AttentionMatch(node, blocker=SDPA_FUSED)
    mask_value = tensor_value(mask)
    causal = (
        masks.causal_kind(mask, facts.real_value) == masks.ALLOWED
        if mask_value is not None and mask_value.dtype == torch.bool
        else _causal_additive(mask, facts.real_value)
    )
    if not causal:
        return AttentionMatch(node, blocker=f"{SDPA_FUSED} (its mask is not provably causal)")
    q, k, v = bound["query"], bound["key"], bound["value"]
    values = [tensor_value(t) if isinstance(t, fx.Node) else None for t in (q, k, v)]
    head_dim = shapes.constant(values[0].shape[-1]) if values[0] is not None else None
    if any(t is None or t.dim() != 4 for t in values) or head_dim is None:
        return AttentionMatch(node, blocker=f"{SDPA_FUSED} (not 4-D q, k, v with a static head dim)")
    if not isinstance(bound["dropout_p"], float | int) or not isinstance(bound["scale"], float | int | None):
        return AttentionMatch(node, blocker=f"{SDPA_FUSED} (dropout or scale is not a constant)")
    if not bound["enable_gqa"] and not statically_known_true(values[0].shape[1] == values[1].shape[1]):
        return AttentionMatch(node, blocker=f"{SDPA_FUSED} (query and key heads differ without enable_gqa)")
    scale = float(bound["scale"]) if bound["scale"] is not None else head_dim**-0.5
    candidate = AttentionMatch(
        node, chain=(node,), output=node, q=q, k=k, v=v, scale=scale, causal=True,
        dropout_p=float(bound["dropout_p"]), mask_nodes=(mask,),
    )
    blocker = _blocker(candidate)
    return dataclasses.replace(candidate, blocker=blocker) if blocker else candidate


def _is_sdpa(node: fx.Node) -> bool:
    return is_call(node, *SDPA_TARGETS)


def _is_softmax_over_last_dim(node: fx.Node) -> bool:
    if not (is_call(node, *SOFTMAX_TARGETS) or is_method(node, "softmax")):
        return False
    bound = bind_args(node, ("input", "dim", "_stacklevel", "dtype"), {"dtype": None})
    value = tensor_value(node)
    if bound is None or value is None or value.dim() < 3 or not isinstance(bound.get("dim"), int):
        return False
    return bound["dim"] % value.dim() == value.dim() - 1


def _match_softmax(softmax: fx.Node, facts: GraphFacts) -> AttentionMatch | None:
    """The attention around ``softmax``, or None when it is no attention (no q @ kᵀ before, no @ v after)."""
    after = _after_softmax(softmax)
    before = _before_softmax(softmax.args[0], facts)
    if after is None or before is None:
        return None  # a softmax that is not attention (a gate, a classifier): not a candidate at all
    probs_chain, dropout_p, output, v = after
    scores_chain, q, k, scale, mask = before
    candidate = AttentionMatch(
        softmax,
        chain=(*scores_chain, softmax, *probs_chain, output),
        output=output,
        q=_unrepeated(q),
        k=_unrepeated(k),
        v=_unrepeated(v),
        scale=scale,
        dropout_p=dropout_p,
        three_d=tensor_value(q).dim() == 3,
        **mask,
    )
    blocker = _blocker(candidate)
    return dataclasses.replace(candidate, blocker=blocker) if blocker else candidate


def _after_softmax(softmax: fx.Node):
    """(nodes, dropout p, the @ v node, v) following the probabilities.

    Other users of these nodes (returned attention weights) do not stop the match: the blocker check reports
    them, so that the user learns why the attention stayed as it was.
    """
    chain: list[fx.Node] = []
    node = softmax
    dropout_p = 0.0
    while True:
        steps = [user for user in node.users if _continues(user, node)]
        if len(steps) != 1:
            return None
        user = steps[0]
        if is_call(user, *SCORE_MATMULS) or is_method(user, "matmul", "bmm"):
            return tuple(chain), dropout_p, user, user.args[1]
        if _einsum_form(user) == "values":
            return tuple(chain), dropout_p, user, user.args[2]
        if is_call(user, F.dropout) or is_method(user, "dropout"):
            bound = bind_args(user, ("input", "p", "training", "inplace"), {"p": 0.5, "training": True})
            if bound is None or not isinstance(bound["p"], float | int) or not isinstance(bound["training"], bool):
                return None
            dropout_p = float(bound["p"]) if bound["training"] else 0.0
        chain.append(user)
        node = user


def _continues(user: fx.Node, node: fx.Node) -> bool:
    """``user`` carries the probabilities on towards ``@ v``: a cast, dropout, or the product itself."""
    if _einsum_form(user) == "values" and user.args[1] is node:
        return True
    if not user.args or user.args[0] is not node:
        return False
    return (
        is_method(user, "to", "type", "type_as", "float", "half", "bfloat16", "dropout", "matmul", "bmm")
        or is_call(user, F.dropout, *SCORE_MATMULS)
    )


def _before_softmax(scores: fx.Node, facts: GraphFacts):
    """(nodes from q @ kᵀ on, q, k, scale, mask fields) leading to the softmax input, or None."""
    chain: list[fx.Node] = []
    mask: dict[str, Any] = {}
    node = scores
    scale = 1.0
    while True:
        chain.append(node)
        if (found := _mask_step(node, facts)) is not None:  # T5's decoder adds a position bias, then a mask
            node, step = found
            mask = _merge_masks(mask, step)
            if mask is None:
                return None
            continue
        factor = _scale_step(node)
        if factor is not None and scale == 1.0:
            node, scale = factor
            continue
        if _is_fp32_upcast(node):  # softmax(scores.float()): the op's softmax is fp32 anyway
            node = node.args[0]
            continue
        qk = _qk_product(node)
        if qk is None:
            return None
        q, k = qk
        return tuple(reversed(chain)), q, k, scale, mask


def _merge_masks(mask: dict[str, Any], step: dict[str, Any]) -> dict[str, Any] | None:
    """The mask fields of two steps together: causal flags and additive terms add up; at most one boolean mask
    becomes a bias (two would need their union, which is left to eager)."""
    merged = dict(mask)
    merged["causal"] = mask.get("causal", False) or step.get("causal", False)
    merged["mask_nodes"] = mask.get("mask_nodes", ()) + step.get("mask_nodes", ())
    merged["biases"] = mask.get("biases", ()) + step.get("biases", ())
    if "bias_from_mask" in step:
        if "bias_from_mask" in mask:
            return None
        merged["bias_from_mask"] = step["bias_from_mask"]
    return merged


def _mask_step(node: fx.Node, facts: GraphFacts):
    """(scores node before the mask, mask fields) if ``node`` applies a mask to scores."""
    real = facts.real_value
    if is_method(node, "masked_fill") or is_call(node, torch.masked_fill):
        scores, hidden, fill = node.args[:3]
        if not _masks_out(fill):
            return None
        if masks.causal_kind(hidden, real) == masks.FUTURE:
            return scores, {"causal": True, "mask_nodes": (hidden,)}
        return scores, {"bias_from_mask": (hidden, float(fill), True)}
    if is_call(node, torch.where) and len(node.args) == 3:
        keep, scores, fill = node.args
        if not _masks_out(fill) or not isinstance(scores, fx.Node):
            return None
        if masks.causal_kind(keep, real) == masks.ALLOWED:
            return scores, {"causal": True, "mask_nodes": (keep,)}
        return scores, {"bias_from_mask": (keep, float(fill), False)}
    if is_call(node, operator.add, torch.add) and len(node.args) == 2 and not node.kwargs:
        scores, additive = node.args
        if not (isinstance(scores, fx.Node) and isinstance(additive, fx.Node)):
            return None
        if _is_scores_shaped(additive) and not _is_scores_shaped(scores):
            scores, additive = additive, scores
        if _causal_additive(additive, real):
            return scores, {"causal": True, "mask_nodes": (additive,)}
        return scores, {"biases": (additive,)}
    return None


def _is_fp32_upcast(node: fx.Node) -> bool:
    """``x.float()``, ``x.to(torch.float32)`` or ``x.type(torch.float32)`` of a floating tensor."""
    if not (node.args and isinstance(node.args[0], fx.Node)) or tensor_value(node.args[0]) is None:
        return False
    if not tensor_value(node.args[0]).is_floating_point():
        return False
    if is_method(node, "float"):
        return True
    if is_method(node, "to", "type"):
        dtype = node.kwargs.get("dtype", node.args[1] if len(node.args) == 2 else None)
        return dtype == torch.float32 and set(node.kwargs) <= {"dtype"}
    return False


def _masks_out(fill: Any) -> bool:
    return isinstance(fill, float | int) and fill <= MASKED


def _is_scores_shaped(node: fx.Node) -> bool:
    return (
        is_call(node, *SCORE_MATMULS) or is_method(node, "matmul") or _einsum_form(node) == "scores"
        or _scale_step(node) is not None
    )


def _causal_additive(node: fx.Node, real) -> bool:
    """``where(allowed, 0, finfo.min)`` (through views): an additive mask that is purely causal."""
    while is_method(node, "expand", "to", "contiguous") or (
        is_call(node, operator.getitem) and masks._crop_is_top_left(node.args[1])
    ):
        node = node.args[0]
    if not (is_call(node, torch.where) and len(node.args) == 3):
        return False
    keep, zero, fill = node.args
    return _is_zero(zero) and _masks_out(fill) and masks.causal_kind(keep, real) == masks.ALLOWED


def _is_zero(value: Any) -> bool:
    if isinstance(value, int | float):
        return value == 0
    return isinstance(value, fx.Node) and is_call(value, torch.zeros) and tensor_value(value).dim() == 0


def _scale_step(node: fx.Node):
    """(unscaled scores, factor) for ``s * c``, ``c * s`` or ``s / c`` with a constant c."""
    if not (is_call(node, operator.mul, torch.mul, operator.truediv, torch.div) and len(node.args) == 2):
        return None
    a, b = node.args
    if is_call(node, operator.truediv, torch.div):
        return (a, 1.0 / b) if isinstance(a, fx.Node) and isinstance(b, float | int) and b != 0 else None
    if isinstance(a, fx.Node) and isinstance(b, float | int):
        return a, float(b)
    if isinstance(b, fx.Node) and isinstance(a, float | int):
        return b, float(a)
    return None


def _qk_product(node: fx.Node):
    """(q, k) for ``q @ kᵀ`` (matmul or bmm with k transposed on its last two dimensions, or an einsum)."""
    if _einsum_form(node) == "scores":
        q, k = node.args[1], node.args[2]
        q_value, k_value = tensor_value(q), tensor_value(k)
        if q_value is None or k_value is None or q_value.dim() not in (3, 4) or q_value.dim() != k_value.dim():
            return None
        return q, k
    if not ((is_call(node, *SCORE_MATMULS) or is_method(node, "matmul", "bmm")) and len(node.args) == 2):
        return None
    q, k_t = node.args
    if not isinstance(k_t, fx.Node) or not _transposes_last_two(k_t):
        return None
    q_value, k_value = tensor_value(q), tensor_value(k_t.args[0])
    if q_value is None or k_value is None or q_value.dim() not in (3, 4) or q_value.dim() != k_value.dim():
        return None
    return q, k_t.args[0]


def _einsum_form(node: fx.Node) -> str | None:
    """"scores" for ``einsum("…id,…jd->…ij", q, k)``, "values" for ``einsum("…ij,…jd->…id", p, v)``, else None.

    The batch prefix (letters, or ``...``) must be the same on both operands and the output."""
    if not (is_call(node, torch.einsum) and len(node.args) == 3 and isinstance(node.args[0], str)):
        return None
    if not all(isinstance(a, fx.Node) for a in node.args[1:]):
        return None
    equation = node.args[0].replace(" ", "")
    if equation.count("->") != 1 or equation.count(",") != 1:
        return None
    operands, out = equation.split("->")
    a, b = operands.split(",")
    terms = [_einsum_term(t) for t in (a, b, out)]
    if any(t is None for t in terms):
        return None
    (prefix_a, (a1, a2)), (prefix_b, (b1, b2)), (prefix_o, (o1, o2)) = terms
    if not (prefix_a == prefix_b == prefix_o) or len(prefix_a) + 2 < 3:
        return None
    if len({a1, a2, b1, b2, o1, o2} & set(prefix_a)) or len(set(prefix_a)) != len(prefix_a):
        return None
    if a2 == b2 and (o1, o2) == (a1, b1) and len({a1, b1, a2}) == 3:
        return "scores"
    if a2 == b1 and (o1, o2) == (a1, b2) and len({a1, a2, b2}) == 3:
        return "values"
    return None


def _einsum_term(term: str) -> tuple[tuple[str, ...], tuple[str, str]] | None:
    """(batch prefix, last two letters) of one einsum operand; ``...`` counts as one prefix entry."""
    prefix: tuple[str, ...] = ()
    if term.startswith("..."):
        prefix, term = ("...",), term[3:]
    if len(term) < 2 or not term.isalpha() or "." in term:
        return None
    return prefix + tuple(term[:-2]), (term[-2], term[-1])


def _transposes_last_two(node: fx.Node) -> bool:
    value = tensor_value(node.args[0]) if node.args else None
    if value is None:
        return False
    ndim = value.dim()
    if is_method(node, "transpose") or is_call(node, torch.transpose):
        dims = {d % ndim for d in node.args[1:3]}
        return dims == {ndim - 1, ndim - 2}
    if node.op == "call_function" and node.target is getattr:
        return node.args[1] == "mT"
    return False


def _unrepeated(node: fx.Node) -> fx.Node:
    """The key/value heads before HF's ``repeat_kv`` (x[:, :, None].expand(...).reshape(b, h·n, t, d))."""
    if not (is_method(node, "reshape", "view") and isinstance(node.args[0], fx.Node)):
        return node
    expanded = node.args[0]
    if not (is_method(expanded, "expand") and isinstance(expanded.args[0], fx.Node)):
        return node
    indexed = expanded.args[0]
    if not (is_call(indexed, operator.getitem) and isinstance(indexed.args[0], fx.Node)):
        return node
    index = indexed.args[1]
    if not (isinstance(index, tuple) and len(index) >= 3 and index[2] is None):
        return node
    base = tensor_value(indexed.args[0])
    out = tensor_value(node)
    if base is None or out is None or base.dim() != 4 or out.dim() != 4:
        return node
    return indexed.args[0]


def _blocker(candidate: AttentionMatch) -> str | None:
    q, k, v = (tensor_value(n) for n in (candidate.q, candidate.k, candidate.v))
    if q.dtype != k.dtype or q.dtype != v.dtype:
        return f"q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})"
    if q.shape[-1] != v.shape[-1] or not q.is_floating_point():
        return "value head dim differs from the query's (not supported by memopt.flash_attention)"
    if not candidate.three_d and not _heads_divide(q, k):
        return f"{q.shape[-3]} query heads are not a multiple of {k.shape[-3]} key heads"
    inside = set(candidate.chain)
    for node in candidate.chain[:-1]:
        for user in node.users:
            if user not in inside:
                what = "returned from the compiled graph" if user.op == "output" else f"used by {describe_node(user)}"
                return f"the attention scores/probabilities ({node.name}) are also {what}, so they stay alive"
    return None


def _heads_divide(q: torch.Tensor, k: torch.Tensor) -> bool:
    heads, kv_heads = shapes.constant(q.shape[-3]), shapes.constant(k.shape[-3])
    return heads is not None and kv_heads is not None and heads % kv_heads == 0


# --- decide -----------------------------------------------------------------------------------------------


def decide(candidate: AttentionMatch, config: Config) -> Decision:
    if candidate.blocker:
        return Decision(False, candidate.blocker)
    what = "attention probabilities never stored" + (" (causal mask as a flag)" if candidate.causal else "")
    return decide_on_saving(memory_model(candidate), config, what)


def memory_model(candidate: AttentionMatch) -> shapes.MemoryModel:
    """What softmax and the two matmuls keep for backward, against the flash op's log-sum-exp."""
    from lowerings.flash_attention.op import working_set

    if _is_sdpa(candidate.softmax):
        return _sdpa_memory_model(candidate)

    probs = tensor_value(candidate.softmax)
    q, k = tensor_value(candidate.q), tensor_value(candidate.k)
    scores = shapes.numel(probs)
    before: dict[str, Any] = {
        "saved: softmax output [B, H, Tq, Tk]": scores * probs.dtype.itemsize,
        "transient: scores [B, H, Tq, Tk]": scores * tensor_value(candidate.softmax.args[0]).dtype.itemsize,
    }
    if candidate.dropout_p > 0:
        before["saved: dropout mask and dropped probabilities"] = scores * (1 + probs.dtype.itemsize)
    for mask in candidate.mask_nodes:
        before[f"transient: the causal mask {mask.name}, no longer built"] = shapes.nbytes(tensor_value(mask))
    batch = 1 if candidate.three_d else q.shape[0]
    heads = q.shape[0] if candidate.three_d else q.shape[1]
    after = working_set(batch, heads, q.shape[-2], k.shape[-2], q.device)
    if len(candidate.biases) + (candidate.bias_from_mask is not None) > 1:
        after["transient: the additive terms summed into one bias (at most [B, H, Tq, Tk])"] = scores * q.dtype.itemsize
    if any(tensor_value(term).requires_grad for term in candidate.biases):
        # A learned bias's gradient is a full dS either way: eager's softmax backward builds dP and dS,
        # the flash backward writes dS in fp32 before summing it to the bias's shape.
        before["transient (backward): gradients of probabilities and scores"] = 2 * scores * probs.dtype.itemsize
        after["transient (backward): the bias gradient dS [B, H, Tq, Tk] (fp32)"] = scores * 4
    return shapes.MemoryModel(before, after)


# --- apply ------------------------------------------------------------------------------------------------


def apply(gm: fx.GraphModule, candidate: AttentionMatch, config: Config) -> None:
    del config
    graph = gm.graph
    output = candidate.output
    fake_mode = fake_mode_of([output, candidate.q])

    def add(op: str, target: Any, *args: Any) -> fx.Node:
        return insert_node(graph, op, target, args, meta_from=output, fake_mode=fake_mode)

    with graph.inserting_before(output):
        q, k, v = candidate.q, candidate.k, candidate.v
        if candidate.three_d:
            q, k, v = (add("call_method", "unsqueeze", t, 0) for t in (q, k, v))
        terms = list(candidate.biases)
        if candidate.bias_from_mask is not None:
            mask, fill, fill_where_true = candidate.bias_from_mask
            values = (float(fill), 0.0) if fill_where_true else (0.0, float(fill))
            terms.append(add("call_function", torch.where, mask, *values))
        bias = terms[0] if terms else None
        for term in terms[1:]:
            bias = add("call_function", operator.add, bias, term)
        if bias is not None and tensor_value(bias).dtype != tensor_value(q).dtype:
            bias = add("call_method", "to", bias, tensor_value(q).dtype)
        fused = add(
            "call_function",
            torch.ops.memopt.flash_attention.default,
            q,
            k,
            v,
            bias,
            float(candidate.scale),
            candidate.causal,
            float(candidate.dropout_p),
        )
        result = add("call_function", operator.getitem, fused, 0)
        if candidate.three_d:
            result = add("call_method", "squeeze", result, 0)
        wanted = tensor_value(output).dtype
        if tensor_value(result).dtype != wanted:
            result = add("call_method", "to", result, wanted)
    output.replace_all_uses_with(result)
    erase_unused([*candidate.chain, *_inputs_left_dead(candidate), *_mask_construction(candidate)])


def _sdpa_memory_model(candidate: AttentionMatch) -> shapes.MemoryModel:
    """SDPA keeps O(T) either way; what the rewrite frees is the causal mask, if nothing else reads it."""
    from lowerings.flash_attention.op import working_set

    q, k = tensor_value(candidate.q), tensor_value(candidate.k)
    (mask,) = candidate.mask_nodes
    only_here = all(user is candidate.softmax for user in mask.users) and mask.op != "placeholder"
    before = {f"transient: the causal mask {mask.name}, no longer built": shapes.nbytes(tensor_value(mask))
              if only_here else 0}
    return shapes.MemoryModel(before, working_set(q.shape[0], q.shape[1], q.shape[-2], k.shape[-2], q.device))


def _inputs_left_dead(candidate: AttentionMatch) -> list[fx.Node]:
    """kᵀ and HF's repeat_kv copies of k and v, which only the replaced matmuls read."""
    first, last = candidate.chain[0], candidate.chain[-1]
    if _is_sdpa(first):
        return []
    if _einsum_form(first) is not None or _einsum_form(last) is not None:
        return []  # einsum reads k and v as they are
    found = [first.args[1]] if isinstance(first.args[1], fx.Node) else []
    for node in (*found, last.args[1]):
        while isinstance(node, fx.Node) and node not in (candidate.k, candidate.v) and node.op != "placeholder":
            found.append(node)
            node = node.args[0] if node.args else None
    return found


def _mask_construction(candidate: AttentionMatch) -> list[fx.Node]:
    """The nodes that built a causal mask, so they can be erased once nothing reads them."""
    pending = list(candidate.mask_nodes)
    found: list[fx.Node] = []
    while pending:
        node = pending.pop()
        if node in found or node.op not in ("call_function", "call_method"):
            continue
        found.append(node)
        pending.extend(node.all_input_nodes)
    return found


RULE = Rule(name=NAME, match=match, decide=decide, apply=apply)
