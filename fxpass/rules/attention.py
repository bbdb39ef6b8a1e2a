"""Attention subgraphs become one fused attention (``memopt.flash_attention``, or cuDNN's on CUDA; below): no
B·H·Tq·Tk scores or probabilities are kept.

The pattern is found from ``softmax(dim=-1)`` outwards: before it, optional masks, an optional softcap
``tanh(s / c) * c``, an optional scale and ``q @ kᵀ`` (matmul, bmm or einsum), in that order (a mask applied before
the scale or the cap would be scaled or capped with the scores: declined with the reason); after it, an optional
cast and dropout, then ``@ v``. Forms covered: nanoGPT (a registered ``tril`` buffer with ``masked_fill(-inf)``),
HF transformers' eager attention (Llama/Mistral/Qwen2/Gemma with ``repeat_kv`` grouped-query heads and the masking
utilities' additive mask, Gemma 2's ``attn_logit_softcapping``, GPT-2, BERT's additive padding mask), scaling by
multiplication or division (or none, as in T5), ``torch.where(mask, scores, finfo.min)`` and softmax with a
float32 upcast.

Masks are proved from their construction (``fxpass.masks``): a causal mask becomes a flag, a causal sliding window
(transformers' ``sliding_window``: Mistral, Qwen2, Gemma 2/3) the op's ``window`` argument, and a mask built from
a [B, T] ``attention_mask`` (transformers' masking utilities: causal ∧ key padding, left or right) becomes the
flag plus a [B, 1, 1, Tk] additive key bias, so no T×T tensor is materialized at all. Query rows that see no
key (left padding, or right padding past a window) get what the replaced code computed (``EMPTY_*``). Any other
mask (a union) is passed as an additive bias with the reason recorded, learned ones (T5) included: the op returns
their gradient.
``F.scaled_dot_product_attention`` calls are already O(T) in memory and are left alone, with the reason
recorded, unless they are handed a materialized mask whose structure is proved: a causal one becomes
``is_causal=True``, a padding one a [B, 1, 1, Tk] mask, and causal ∧ padding or a sliding window
``memopt.flash_attention``.

On CUDA the rewritten attention runs cuDNN's fused kernel wherever it serves the case (fp16/bf16, head dim a
multiple of 8 up to 128, or 256 on Hopper with cuDNN 9.10 or newer, no mask beyond causal ∧ key padding, no
softcap or window; ``choose_kernel``): it takes a causal flag and a [B, 1, 1, Tk] key bias together, which the
public SDPA refuses, and it was faster than memopt's Triton kernel in every such case measured. Everything else
(learned or arbitrary biases, softcaps, sliding windows, fp32, other head dims, CPU) runs
``memopt.flash_attention``.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Mapping
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fxpass import masks, shapes
from fxpass.config import Config, assumed_device
from fxpass.graph import (
    MATMUL_TARGETS,
    SDPA_TARGETS,
    GraphFacts,
    bind_args,
    bind_sdpa,
    cast_to,
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
# q @ kᵀ and probabilities @ v: the graph's matmul spellings plus bmm over [B·H, T, D].
SCORE_MATMULS = (*MATMUL_TARGETS, torch.bmm)
# A fill value at or below this masks a score out completely (finfo(float32).min and -inf included).
MASKED = -1e30

# What the replaced code computes for a query row that sees no key at all (left padding, or a sequence of padding).
# A finite fill (transformers' finfo.min) absorbs every score of such a row, so eager softmax is uniform over all
# Tk keys: the row is the mean of v. An added fill also passes softmax's gradient at uniform probabilities to q
# and k (autograd differentiates the addition, not the absorbed values); a replaced one (masked_fill, where) does
# not. SDPA with a boolean mask returns zeros (torch >= 2.5 masks such rows in its math path), as the op does; a
# -inf fill gives NaN in eager softmax and zeros here.
EMPTY_ZERO = "zero"
EMPTY_MEAN = "mean of v"
EMPTY_MEAN_GRAD = "mean of v, with eager's q and k gradients"


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
    softcap: float | None = None  # c of c·tanh(scores/c), applied before the biases and masks (Gemma 2)
    window: int | None = None  # a causal sliding window: key j seen by query i iff i − w < j ≤ i
    biases: tuple[fx.Node, ...] = ()  # additive terms, each broadcastable to [B, H, Tq, Tk]
    # A boolean mask to turn into an additive bias: (mask, fill, True if the fill applies where the mask is True)
    bias_from_mask: tuple[fx.Node, float, bool] | None = None
    dropout_p: float = 0.0
    three_d: bool = False  # bmm over [B·H, T, D]
    mask_nodes: tuple[fx.Node, ...] = ()  # mask construction that becomes dead with a causal flag
    # Per-key boolean masks (size 1 on the query dim), ANDed into one [B, 1, 1, Tk] key-padding bias.
    key_masks: tuple[masks.Keys, ...] = ()
    empty_rows: str = EMPTY_ZERO  # what query rows that see no key must give (EMPTY_*)
    # A mask that stays a bias, to find its rows without keys: (boolean node, True if it marks kept pairs).
    bias_rows: tuple[fx.Node, bool] | None = None
    mask_note: str | None = None  # why a mask stays a materialized bias
    # An SDPA call that stays SDPA with an O(B·T) mask: "is_causal", "keys" (a [B, 1, 1, Tk] mask) or "none".
    sdpa_mask: str | None = None
    sdpa_fill: float | None = None  # the fill of an SDPA float mask rebuilt per key
    # One key/value head broadcast over the query heads without enable_gqa (multi-query attention, as
    # transformers 5.17's Falcon calls SDPA): the same as grouped-query attention with one group, so it is taken
    # as that, and the SDPA call that stays is told so.
    broadcast_kv: bool = False
    compute_dtype: torch.dtype | None = None  # autocast's dtype, which q, k, v are cast to
    blocker: str | None = None

    @property
    def anchor(self) -> fx.Node:
        return self.softmax

    @property
    def nodes(self) -> tuple[fx.Node, ...]:
        return self.chain or (self.softmax,)

    def params(self) -> Mapping[str, Any]:
        params: dict[str, Any] = {"causal": self.causal, "mask": self._mask_kind(), "dropout_p": self.dropout_p}
        if self.window is not None:
            params["window"] = self.window
        if self.softcap is not None:
            params["softcap"] = self.softcap
        if self.key_masks or self.bias_rows:
            params["empty_rows"] = self.empty_rows
        if self.mask_note:
            params["mask_note"] = self.mask_note
        if self.chain:
            params["lowering"] = _SDPA_LOWERINGS.get(self.sdpa_mask, "memopt.flash_attention")
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
                dtype=str(self.compute_dtype or q.dtype).removeprefix("torch."),
            )
        return params

    def _mask_kind(self) -> str:
        if self.causal:
            window = f" + sliding window of {self.window} keys" if self.window is not None else ""
            return "causal (flag)" + window + (" + key padding" if self.key_masks else "")
        if self.key_masks:
            return "key padding"
        if self.biases or self.bias_from_mask is not None:
            return "additive bias"
        return "none"


_SDPA_LOWERINGS = {
    "is_causal": "F.scaled_dot_product_attention(is_causal=True)",
    "keys": "F.scaled_dot_product_attention with a [B, 1, 1, Tk] mask",
    "none": "F.scaled_dot_product_attention without a mask",
}


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


CUDNN_LOWERING = "aten._scaled_dot_product_cudnn_attention (cuDNN)"
CUDNN_WHY = "cuDNN's fused attention: faster than memopt's kernel in every case it serves (H200, H100; BENCHMARKS.md)"
# The fill of a masked key in cuDNN's bias: finite, so that a row whose every key is masked stays finite (its
# output is replaced below, and a NaN there would reach dk and dv in the backward); float16's lowest value,
# representable in bfloat16 too, underflows exp beside any real score and does not overflow fp32 times log2(e).
CUDNN_MASK_FILL = -65504.0
# cuDNN reads the bias's rows at this alignment (elements); a key count off it gets a padded bias.
CUDNN_BIAS_ALIGNMENT = 8


def _match_sdpa(node: fx.Node, facts: GraphFacts) -> AttentionMatch:
    """An SDPA call is worth rewriting only when it is handed a materialized mask whose structure is proved: the
    mask (and its construction) is replaced by O(B·T) facts. A causal mask becomes ``is_causal=True`` and a
    padding mask a [B, 1, 1, Tk] one, both kept in SDPA (its flash/cuDNN kernels are the fastest for them);
    causal ∧ padding, which SDPA cannot take without a T×T mask, becomes a fused attention with the causal flag
    and a key bias (``choose_kernel``: cuDNN's on CUDA where it serves, else ``memopt.flash_attention``). A
    causal sliding window (with or without padding), which no SDPA argument expresses, becomes
    ``memopt.flash_attention`` with its ``window``."""
    bound = bind_sdpa(node)
    mask = bound.get("attn_mask") if bound else None
    if bound is None or not isinstance(mask, fx.Node) or bound["is_causal"] is not False:
        return AttentionMatch(node, blocker=SDPA_FUSED)
    q, k, v = bound["query"], bound["key"], bound["value"]
    values = [tensor_value(t) if isinstance(t, fx.Node) else None for t in (q, k, v)]
    head_dim = shapes.constant(values[0].shape[-1]) if values[0] is not None else None
    if any(t is None or t.dim() != 4 for t in values) or head_dim is None:
        return AttentionMatch(node, blocker=f"{SDPA_FUSED} (not 4-D q, k, v with a static head dim)")
    constants = isinstance(bound["dropout_p"], float | int) and isinstance(bound["scale"], float | int | None)
    broadcast_kv = False
    if not bound["enable_gqa"] and not statically_known_true(values[0].shape[1] == values[1].shape[1]):
        if not all(statically_known_true(t.shape[1] == 1) for t in values[1:]):
            return AttentionMatch(node, blocker=f"{SDPA_FUSED} (query and key heads differ without enable_gqa)")
        broadcast_kv = True
    if _per_key_shaped(tensor_value(mask)):
        return AttentionMatch(node, blocker=f"{SDPA_FUSED} (its mask has no query dimension: already [B, 1, 1, Tk])")
    structure, empty_rows, fill = _sdpa_mask_structure(mask, values[0], values[1], facts.real_value)
    if isinstance(structure, str):
        return AttentionMatch(node, blocker=f"{SDPA_FUSED} (its mask stays: {structure})")
    unknown = float("nan")  # a SymFloat (dynamic=True lifts module floats to inputs): SDPA keeps reading it
    fields: dict[str, Any] = dict(
        chain=(node,), output=node, q=q, k=k, v=v, causal=structure.causal, mask_nodes=(mask,),
        dropout_p=float(bound["dropout_p"]) if constants else unknown,
        scale=(float(bound["scale"]) if bound["scale"] is not None else head_dim**-0.5) if constants else unknown,
        key_masks=structure.keys, empty_rows=empty_rows, sdpa_fill=fill, broadcast_kv=broadcast_kv,
    )
    if structure.window is None and not structure.keys:
        fields["sdpa_mask"] = "is_causal" if structure.causal else "none"
    elif structure.window is None and not structure.causal:
        fields["sdpa_mask"] = "keys"
    elif not constants:
        return AttentionMatch(node, blocker=f"{SDPA_FUSED} (dropout or scale is not a constant)")
    else:
        fields.update(k=_unrepeated(k), v=_unrepeated(v), window=structure.window)
    candidate = AttentionMatch(node, compute_dtype=_autocast_dtype((q, k, v), (node,)), **fields)
    blocker = _blocker(candidate)
    return dataclasses.replace(candidate, blocker=blocker) if blocker else candidate


def _per_key_shaped(mask: torch.Tensor | None) -> bool:
    return mask is not None and (mask.dim() < 2 or statically_known_true(mask.shape[-2] == 1))


def _sdpa_mask_structure(
    mask: fx.Node, q: torch.Tensor, k: torch.Tensor, real
) -> tuple[masks.Structure | str, str, float | None]:
    """(what an SDPA mask keeps or why that is unknown, what its fully masked rows give, a float mask's fill)."""
    if tensor_value(mask) is not None and tensor_value(mask).dtype == torch.bool:
        structure = masks.kept(mask, real)
        empty_rows, fill = EMPTY_ZERO, None
    else:
        found = _additive_mask(mask)
        if not isinstance(found, tuple):
            return found or f"{mask.name} is not a boolean condition turned into 0 / -inf", EMPTY_ZERO, None
        keep, fill, cropped = found
        structure = _uncropped(masks.kept(keep, real), cropped)
        empty_rows = _added_rows(fill)
    if isinstance(structure, masks.Structure):
        structure = _without_vacuous_window(structure, q.shape[-2])
    if isinstance(structure, masks.Structure):
        structure = _rows_provable(structure, empty_rows, q.shape[-2], k.shape[-2])
    return structure, empty_rows, fill


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
    if isinstance(before, str):
        return AttentionMatch(softmax, blocker=before)
    probs_chain, dropout_p, output, v = after
    scores_chain, q, k, scale, softcap, mask = before
    candidate = AttentionMatch(
        softmax,
        chain=(*scores_chain, softmax, *probs_chain, output),
        output=output,
        q=_unrepeated(q),
        k=_unrepeated(k),
        v=_unrepeated(v),
        scale=scale,
        softcap=softcap,
        dropout_p=dropout_p,
        three_d=tensor_value(q).dim() == 3,
        compute_dtype=_autocast_dtype((q, k, v), (scores_chain[0], output)),
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
    """(nodes from q @ kᵀ on, q, k, scale, softcap, mask fields) leading to the softmax input, or None; a reason
    (str) when the steps come in an order the op cannot compute.

    Walking back from the softmax the op's order is: masks and biases (any number), then at most one softcap
    c·tanh(x/c), then at most one scale, then q @ kᵀ; fp32 upcasts anywhere. A mask met below a scale or a
    softcap was scaled or capped with the scores (a bias scaled, a -inf capped to -c): not the op's function."""
    chain: list[fx.Node] = []
    steps: list[dict[str, Any]] = []
    node = scores
    scale, softcap = 1.0, None
    below = None  # the first scale or softcap met: masks below it would be transformed with the scores
    while True:
        chain.append(node)
        if (found := _mask_step(node, facts)) is not None:  # T5's decoder adds a position bias, then a mask
            if below is not None:
                return f"a mask or bias ({node.name}) is applied before the {below}, which transforms it too"
            node, step = found
            steps.append(step)
            continue
        if (capped := _softcap_step(node)) is not None and softcap is None:
            if scale != 1.0:
                return f"the scores are scaled after their softcap ({node.name}), not before"
            node, softcap, inner = capped
            chain.extend(inner)
            below = below or f"softcap ({chain[-1].name})"
            continue
        factor = _scale_step(node)
        if factor is not None and scale == 1.0:
            below = below or f"scale ({node.name})"
            node, scale = factor
            continue
        if _is_fp32_upcast(node):  # softmax(scores.float()): the op's softmax is fp32 anyway
            node = node.args[0]
            continue
        qk = _qk_product(node)
        mask = _combine(steps)
        if qk is None or mask is None:
            return None
        q, k = qk
        return tuple(reversed(chain)), q, k, scale, softcap, mask


def _softcap_step(node: fx.Node) -> tuple[fx.Node, float, tuple[fx.Node, ...]] | None:
    """(the scores inside, c, the tanh and division nodes) for ``tanh(x / c) * c``: Gemma 2's
    ``attn_logit_softcapping`` (``x * (1/c)`` and ``c * tanh(...)`` spelled either way)."""
    outer = _scale_step(node)
    if outer is None or outer[1] <= 0:
        return None
    tanh, cap = outer
    if not ((is_call(tanh, torch.tanh) or is_method(tanh, "tanh")) and len(tanh.args) == 1 and not tanh.kwargs):
        return None
    inner = tanh.args[0]
    divided = _scale_step(inner) if isinstance(inner, fx.Node) else None
    if divided is None or not math.isclose(divided[1] * cap, 1.0, rel_tol=1e-12):
        return None
    return divided[0], cap, (tanh, inner)


def _combine(steps: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The mask fields of every step. A per-key mask whose fully masked rows need eager's mean of v is proved
    only alone: beside other terms those rows would depend on them too, so it stays a bias."""
    if len(steps) > 1:  # (rows without keys then also depend on the other terms: left as the op computes them)
        steps = [_as_bias(step, "a per-key mask with a finite fill beside other mask terms")
                 if step.get("key_masks") and step["empty_rows"] != EMPTY_ZERO else step for step in steps]
        steps = [{k: v for k, v in step.items() if k not in ("bias_rows", "empty_rows")} for step in steps]
    merged: dict[str, Any] | None = {}
    for step in steps:
        merged = _merge_masks(merged, step)
        if merged is None:
            return None
    merged.pop("as_bias", None)
    return merged


def _as_bias(step: dict[str, Any], why: str) -> dict[str, Any]:
    mask = step["mask_nodes"][0]
    return {**step["as_bias"], "mask_note": f"the mask ({mask.name}) stays a bias: {why}"}


def _merge_masks(mask: dict[str, Any], step: dict[str, Any]) -> dict[str, Any] | None:
    """The mask fields of two steps together: causal flags, key masks and additive terms add up; at most one
    boolean mask becomes a bias (two would need their union, which is left to eager)."""
    merged = dict(mask)
    merged["causal"] = mask.get("causal", False) or step.get("causal", False)
    windows = [w for w in (mask.get("window"), step.get("window")) if w is not None]
    if windows:  # two windows intersect: the narrower one
        merged["window"] = min(windows)
    for key in ("mask_nodes", "biases", "key_masks"):
        merged[key] = mask.get(key, ()) + step.get(key, ())
    for key in ("empty_rows", "mask_note", "bias_rows"):
        if key in step:
            merged.setdefault(key, step[key])
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
        structure = masks.kept(hidden, real, complement=True)
        as_bias = {"bias_from_mask": (hidden, float(fill), True), **_row_fix(hidden, False, _replaced_rows(fill))}
        return scores, _structured(structure, hidden, node, _replaced_rows(fill), as_bias)
    if is_call(node, torch.where) and len(node.args) == 3:
        keep, scores, fill = node.args
        if not _masks_out(fill) or not isinstance(scores, fx.Node):
            return None
        as_bias = {"bias_from_mask": (keep, float(fill), False), **_row_fix(keep, True, _replaced_rows(fill))}
        return scores, _structured(masks.kept(keep, real), keep, node, _replaced_rows(fill), as_bias)
    if is_call(node, operator.add, torch.add) and len(node.args) == 2 and not node.kwargs:
        scores, additive = node.args
        if not (isinstance(scores, fx.Node) and isinstance(additive, fx.Node)):
            return None
        if _is_scores_shaped(additive) and not _is_scores_shaped(scores):
            scores, additive = additive, scores
        as_bias = {"biases": (additive,)}
        found = _additive_mask(additive)
        if found is None:
            return scores, as_bias  # a position bias, or a float mask built some other way
        if isinstance(found, str):
            return scores, {**as_bias, "mask_note": f"the mask ({additive.name}) stays a bias: {found}"}
        keep, fill, cropped = found
        structure = _uncropped(masks.kept(keep, real), cropped)
        as_bias.update(_row_fix(keep, True, _added_rows(fill)) if not cropped else {})
        return scores, _structured(structure, additive, node, _added_rows(fill), as_bias)
    return None


def _row_fix(mask: fx.Node, keeps: bool, empty_rows: str) -> dict[str, Any]:
    """For a mask that stays a bias: its boolean (True where kept, or where hidden) and what its rows without
    keys give, when that is not the op's zeros. The op cannot give eager's uniform rows itself (its fp32
    log-sum-exp absorbs log Tk next to finfo.min; the CUDA kernel's base-2 scores turn finfo.min into -inf)."""
    if empty_rows == EMPTY_ZERO or not _is_boolean(mask):
        return {}
    return {"bias_rows": (mask, keeps), "empty_rows": empty_rows}


def _is_boolean(node: Any) -> bool:
    value = tensor_value(node)
    return value is not None and value.dtype == torch.bool


def _structured(
    structure: masks.Structure | str, mask: fx.Node, scores: fx.Node, empty_rows: str, as_bias: dict[str, Any]
) -> dict[str, Any]:
    """Mask fields for a mask whose structure is proved (a flag, key masks), else ``as_bias`` with the reason."""
    value = tensor_value(scores)
    if isinstance(structure, masks.Structure):
        structure = _without_vacuous_window(structure, value.shape[-2])
    if isinstance(structure, masks.Structure) and structure.keys and value.dim() != 4:
        structure = "per-key masks need 4-D scores [B, H, Tq, Tk]"
    if isinstance(structure, masks.Structure):
        structure = _rows_provable(structure, empty_rows, value.shape[-2], value.shape[-1])
    if isinstance(structure, str):
        return {**as_bias, "mask_note": f"the mask ({mask.name}) stays a bias: {structure}"}
    fields: dict[str, Any] = {"causal": structure.causal, "mask_nodes": (mask,)}
    if structure.window is not None:
        fields["window"] = structure.window
    if structure.keys:
        fields.update(key_masks=structure.keys, empty_rows=empty_rows, as_bias=as_bias)
    return fields


def _without_vacuous_window(structure: masks.Structure, queries) -> masks.Structure:
    """A causal sliding window of w keys hides nothing when there are at most w queries (Mistral's 4096 at a
    shorter length): plain causal then, which every kernel serves. A narrower one (or one that may be narrower
    under symbolic lengths: no guard is added) stays, as the op's ``window`` argument."""
    if structure.window is not None and statically_known_true(queries <= structure.window):
        return dataclasses.replace(structure, window=None)
    return structure


def _rows_provable(structure: masks.Structure, empty_rows: str, queries, keys) -> masks.Structure | str:
    """Finding the causal rows that see no key reads the key mask's running count at the query's own position,
    which needs as many queries as keys (self-attention)."""
    if structure.keys and structure.causal and empty_rows != EMPTY_ZERO and not statically_known_true(queries == keys):
        return "causal with key padding over unequal query and key lengths"
    return structure


def _uncropped(structure: masks.Structure | str, cropped: bool) -> masks.Structure | str:
    if cropped and isinstance(structure, masks.Structure) and structure.keys:
        return "a crop of a per-key mask"
    return structure


def _replaced_rows(fill: float) -> str:
    """A fill that replaces the scores: a finite one makes a keyless row uniform, without gradient to q or k."""
    return EMPTY_MEAN if math.isfinite(fill) else EMPTY_ZERO


def _added_rows(fill: float) -> str:
    """A finite fill added to the scores absorbs them: uniform rows, with softmax's gradient still reaching q, k."""
    return EMPTY_MEAN_GRAD if math.isfinite(fill) else EMPTY_ZERO


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


def _additive_mask(node: fx.Node) -> tuple[fx.Node, float, bool] | str | None:
    """(keep, fill, cropped) for ``where(keep, 0, fill)`` through views and top-left crops: an additive mask built
    from a boolean one (transformers' eager masks, with fill finfo.min). A reason when its fill is too small to
    mask a score out (fp16's finfo.min, -65504: eager's rows without keys are then not uniform); None when the
    node is no such mask (a position bias)."""
    cropped, outer = False, node
    while is_method(node, "expand", "to", "contiguous") or (
        is_call(node, operator.getitem) and masks._crop_is_top_left(node.args[1])
    ):
        cropped = cropped or is_call(node, operator.getitem)
        node = node.args[0]
    if not (is_call(node, torch.where) and len(node.args) == 3):
        return None
    keep, zero, fill = node.args
    if not (isinstance(keep, fx.Node) and _is_zero(zero) and isinstance(fill, float | int)):
        return None
    if not _masks_out(fill):
        return f"its fill {float(fill):g} does not absorb the scores (a fill <= {MASKED:g} does)"
    return keep, _fill_as(float(fill), tensor_value(outer)), cropped


def _fill_as(fill: float, mask: torch.Tensor | None) -> float:
    """The fill as the mask holds it: finfo(float32).min cast to a 16-bit mask is -inf."""
    if mask is None or not mask.is_floating_point():
        return fill
    return float(torch.tensor(fill, dtype=mask.dtype))


def _is_zero(value: Any) -> bool:
    """0, or a 0-d zero tensor: ``torch.zeros(())`` or ``torch.tensor(0.0)`` (transformers 5.17's eager_mask)."""
    if isinstance(value, int | float):
        return value == 0
    if not isinstance(value, fx.Node) or tensor_value(value) is None or tensor_value(value).dim() != 0:
        return False
    if is_call(value, torch.tensor):
        return bool(value.args) and isinstance(value.args[0], int | float) and value.args[0] == 0
    return is_call(value, torch.zeros)


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


def _autocast_dtype(operands: tuple[fx.Node, ...], products: tuple[fx.Node, ...]) -> torch.dtype | None:
    """The dtype autocast ran the products in, when q, k, v differ from it (Llama's rotary embedding leaves q and
    k in fp32 beside a bf16 v): the rewrite casts them to it, as autocast did."""
    dtypes = {tensor_value(p).dtype for p in products if tensor_value(p) is not None}
    if len(dtypes) != 1:
        return None
    (dtype,) = dtypes
    inputs = [tensor_value(t) for t in operands]
    if any(t is None or not t.is_floating_point() for t in inputs) or all(t.dtype == dtype for t in inputs):
        return None
    return dtype if dtype in (torch.float16, torch.bfloat16) else None


def _blocker(candidate: AttentionMatch) -> str | None:
    q, k, v = (tensor_value(n) for n in (candidate.q, candidate.k, candidate.v))
    if candidate.compute_dtype is None and (q.dtype != k.dtype or q.dtype != v.dtype):
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
    kernel, why = choose_kernel(candidate, config)
    decision = decide_on_saving(memory_model(candidate, config.assume_device), config, _what(candidate, kernel))
    params: dict[str, Any] = {"lowering": CUDNN_LOWERING} if kernel == "cudnn" else {}
    if why:
        params["kernel_reason"] = why
    return dataclasses.replace(decision, params=params)


def choose_kernel(candidate: AttentionMatch, config: Config) -> tuple[str, str]:
    """The kernel that computes the rewritten attention, and why: "cudnn", "memopt" (``memopt.flash_attention``)
    or "sdpa" (an SDPA call kept, with an O(B·T) mask in place of its T×T one). The reason is empty where there
    was nothing to weigh (SDPA with ``is_causal`` or no mask, a graph off CUDA), so such records read as before."""
    otherwise = "sdpa" if candidate.sdpa_mask is not None else "memopt"  # SDPA without a T×T mask stays SDPA
    device = tensor_value(candidate.q).device
    if candidate.sdpa_mask in ("is_causal", "none"):
        return otherwise, ""
    if device.type != "cuda":  # assume_device="cuda" answers for a GPU: what would compute it there
        if config.assume_device != "cuda" or config.attention_kernel == "memopt":
            return otherwise, ""
        blocker = cudnn_case_blocker(candidate, CUDNN_WIDE_HEAD_DIM)
        if blocker is not None:
            return otherwise, f"on CUDA: memopt's kernel ({blocker})"
        if cudnn_case_blocker(candidate) is not None:  # a head dim only Hopper's cuDNN takes
            return otherwise, f"on CUDA: cuDNN's attention on {CUDNN_WIDE_PLATFORM}, memopt's kernel elsewhere"
        return otherwise, "on CUDA: cuDNN's attention"
    if config.attention_kernel == "memopt":
        return otherwise, "attention_kernel='memopt'"
    blocker = _cudnn_platform_blocker(device) or cudnn_case_blocker(candidate, cudnn_head_dim_limit(device))
    if blocker is not None:
        return otherwise, f"cuDNN does not serve it: {blocker}"
    return "cudnn", CUDNN_WHY


def _cudnn_platform_blocker(device: torch.device) -> str | None:
    if not torch.backends.cuda.cudnn_sdp_enabled():
        return "cuDNN attention is disabled (torch.backends.cuda.enable_cudnn_sdp(False))"
    if torch.are_deterministic_algorithms_enabled():  # SDPA skips cuDNN then too
        return "deterministic algorithms are on, and cuDNN's attention backward is not deterministic"
    version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    if version is None or version < 90000:
        return f"cuDNN {version} is older than 9"
    if torch.cuda.get_device_capability(device) < (8, 0):
        return "the GPU is older than sm80"
    return None


# Why a sliding window stays on memopt's kernel, whatever the GPU. cuDNN's entry point
# (``aten._scaled_dot_product_cudnn_attention``) takes no window. SDPA's FA2 backend does
# (``aten._flash_attention_forward(window_size_left=w - 1, window_size_right=0)``), but it takes no key-padding bias,
# and where both serve a plain causal case FA2 was the slower: 268 against memopt's 335 TFLOP/s forward + backward
# at 4×16×4096×128 bf16 (BENCHMARKS.md, the attention op benchmark). Both skip the same key blocks outside the
# window, so a window should not reverse that order; memopt's kernel serves every window case, key padding too.
WINDOW_KERNEL_WHY = "a sliding window: cuDNN's attention takes none, and SDPA's FA2 (which does) trails memopt's kernel"
SOFTCAP_KERNEL_WHY = "a softcap: no library attention kernel caps the scores"


# cuDNN's fused attention takes head dims that are multiples of 8 up to 128 everywhere, and up to 256 on Hopper
# (sm90) from cuDNN 9.10 on: the limit PyTorch's SDPA dispatch applies (``check_cudnn_tensor_shapes``). At Gemma's
# head dim 256 with key padding, causal, bf16, 8×8×1024×256 on an H100 (cuDNN 9.19), cuDNN ran forward + backward
# at 89 TFLOP/s against memopt's kernel's 43, at the same error against FP64 (benchmarks/attention_dispatch.py).
CUDNN_HEAD_DIM = 128
CUDNN_WIDE_HEAD_DIM = 256
CUDNN_WIDE_CAPABILITY = (9, 0)
CUDNN_WIDE_VERSION = 91000
CUDNN_WIDE_PLATFORM = "sm90 with cuDNN 9.10 or newer"


def head_dim_limit(capability: tuple[int, int], cudnn_version: int | None) -> int:
    """The largest head dim cuDNN's attention takes on a GPU of ``capability`` with that cuDNN runtime."""
    wide = capability == CUDNN_WIDE_CAPABILITY and (cudnn_version or 0) >= CUDNN_WIDE_VERSION
    return CUDNN_WIDE_HEAD_DIM if wide else CUDNN_HEAD_DIM


def cudnn_head_dim_limit(device: torch.device) -> int:
    """``head_dim_limit`` of this CUDA device and the cuDNN that torch loaded."""
    version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return head_dim_limit(torch.cuda.get_device_capability(device), version)


def cudnn_case_blocker(candidate: AttentionMatch, max_head_dim: int = CUDNN_HEAD_DIM) -> str | None:
    """Why cuDNN's fused attention cannot compute this case exactly as the replaced code did, or None.
    ``max_head_dim``: the platform's (``cudnn_head_dim_limit``); 128 serves on every GPU cuDNN 9 runs on."""
    if candidate.softcap is not None:
        return SOFTCAP_KERNEL_WHY
    if candidate.window is not None:
        return WINDOW_KERNEL_WHY
    q, k = tensor_value(candidate.q), tensor_value(candidate.k)
    dtype = candidate.compute_dtype or q.dtype
    if dtype not in (torch.float16, torch.bfloat16):
        return f"it takes float16 and bfloat16, not {str(dtype).removeprefix('torch.')}"
    head_dim = shapes.constant(q.shape[-1])
    if head_dim is None or head_dim % 8 or head_dim > max_head_dim:
        wider = f" ({CUDNN_WIDE_HEAD_DIM} on {CUDNN_WIDE_PLATFORM})" if max_head_dim < CUDNN_WIDE_HEAD_DIM else ""
        return f"head dim {shapes.render(q.shape[-1])} is not a multiple of 8 up to {max_head_dim}{wider}"
    if candidate.biases or candidate.bias_from_mask is not None or candidate.bias_rows:
        return "a bias other than key padding (learned, or a mask not proved) stays with memopt's kernel"
    if math.isnan(candidate.dropout_p) or math.isnan(candidate.scale):
        return "dropout or scale is not a constant"
    if candidate.causal and not statically_known_true(q.shape[-2] == k.shape[-2]):
        return "causal with a query count that may differ from the key count"
    if candidate.key_masks and shapes.constant(k.shape[-2]) is None:
        return "the key count is symbolic, and the key bias needs a row stride aligned to 8"
    return None


def _what(candidate: AttentionMatch, kernel: str) -> str:
    """What the rewrite does, for the record's reason."""
    if kernel == "sdpa":
        what = f"the [B, 1, Tq, Tk] mask is no longer built: {_SDPA_LOWERINGS[candidate.sdpa_mask]}"
    elif _is_sdpa(candidate.softmax):
        name = "cuDNN attention" if kernel == "cudnn" else "memopt.flash_attention"
        facts = ["causal flag"] if candidate.causal else []
        facts += [f"a sliding window of {candidate.window} keys"] if candidate.window is not None else []
        facts += ["key-padding bias"] if candidate.key_masks else []
        what = f"the [B, 1, Tq, Tk] mask is no longer built: {name}, " + " and ".join(facts)
    else:
        what = "attention probabilities never stored" + (" (causal mask as a flag)" if candidate.causal else "")
        if candidate.window is not None:
            what += f" (a sliding window of {candidate.window} keys as an argument)"
        if candidate.key_masks:
            what += " (key padding as a [B, 1, 1, Tk] bias)"
        if candidate.softcap is not None:
            what += f" (softcap {candidate.softcap:g} in the kernel)"
    if candidate.key_masks and candidate.empty_rows != EMPTY_ZERO and kernel != "sdpa":
        what += f"; rows without keys give the {candidate.empty_rows}, as eager does"
    return what + (f"; {candidate.mask_note}" if candidate.mask_note else "")


def memory_model(candidate: AttentionMatch, assume_device: str | None = None) -> shapes.MemoryModel:
    """What softmax and the two matmuls keep for backward, against the flash op's log-sum-exp (cuDNN keeps the
    same). Replacing the rows without keys in the output (``torch.where``) is not charged: Inductor fuses it
    into the copy that the heads' transpose and reshape make anyway."""
    from lowerings.flash_attention.op import working_set

    if _is_sdpa(candidate.softmax):
        return _sdpa_memory_model(candidate, assume_device)

    probs = tensor_value(candidate.softmax)
    q, k = tensor_value(candidate.q), tensor_value(candidate.k)
    scores = shapes.numel(probs)
    before: dict[str, Any] = {
        "saved: softmax output [B, H, Tq, Tk]": scores * probs.dtype.itemsize,
        "transient: scores [B, H, Tq, Tk]": scores * tensor_value(candidate.softmax.args[0]).dtype.itemsize,
    }
    if candidate.dropout_p > 0:
        before["saved: dropout mask and dropped probabilities"] = scores * (1 + probs.dtype.itemsize)
    if candidate.softcap is not None:  # tanh's backward reads its output (or the partitioner keeps its input)
        tanh = next(node for node in candidate.chain if is_call(node, torch.tanh) or is_method(node, "tanh"))
        before["saved: the softcap's tanh of the scores [B, H, Tq, Tk]"] = scores * tensor_value(tanh).dtype.itemsize
    for mask in candidate.mask_nodes:
        before[f"transient: the causal mask {mask.name}, no longer built"] = shapes.nbytes(tensor_value(mask))
    batch = 1 if candidate.three_d else q.shape[0]
    heads = q.shape[0] if candidate.three_d else q.shape[1]
    device = assumed_device(q.device, assume_device)
    after = working_set(
        batch, heads, q.shape[-2], k.shape[-2], device, dtype=q.dtype, head_dim=q.shape[-1], kv_heads=k.shape[-3]
    )
    after.update(_key_mask_terms(candidate))
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
    graph = gm.graph
    output = candidate.output
    fake_mode = fake_mode_of([output, candidate.q])
    kernel, _ = choose_kernel(candidate, config)

    def add(op: str, target: Any, *args: Any, **kwargs: Any) -> fx.Node:
        return insert_node(graph, op, target, args, kwargs, meta_from=output, fake_mode=fake_mode)

    if kernel == "sdpa":
        with graph.inserting_before(output):
            result = _sdpa_with_mask_structure(add, candidate)
        output.replace_all_uses_with(result)
        erase_unused([output, *_mask_construction(candidate)])
        return
    with graph.inserting_before(output):
        q, k, v = candidate.q, candidate.k, candidate.v
        if candidate.compute_dtype is not None:
            q, k, v = (cast_to(add, t, candidate.compute_dtype) for t in (q, k, v))
        if candidate.three_d:
            q, k, v = (add("call_method", "unsqueeze", t, 0) for t in (q, k, v))
        keep = _key_keep(add, candidate.key_masks) if candidate.key_masks else None
        if kernel == "cudnn":
            result = _cudnn_attention(add, candidate, q, k, v, keep)
        else:
            result = _memopt_attention(add, candidate, q, k, v, keep)
        replaced = keep is not None and (kernel == "cudnn" or candidate.empty_rows != EMPTY_ZERO)
        if replaced or (candidate.bias_rows and candidate.empty_rows != EMPTY_ZERO):
            if keep is not None:
                empty = _rows_without_keys(add, keep, candidate.causal, candidate.window)
            else:
                empty = _rows_hidden_whole(add, *candidate.bias_rows)
            if candidate.empty_rows == EMPTY_ZERO:
                fix = 0.0
            elif candidate.empty_rows == EMPTY_MEAN_GRAD and candidate.softcap is not None:
                fix = add("call_function", torch.ops.memopt.flash_attention_uniform_rows.default, q, k, v, empty,
                          float(candidate.scale), float(candidate.softcap))
            else:
                fix = _eager_keyless_rows(add, q, k, v, candidate.scale, candidate.empty_rows == EMPTY_MEAN_GRAD)
            result = add("call_function", torch.where, empty, fix, result)
        if candidate.three_d:
            result = add("call_method", "squeeze", result, 0)
        wanted = tensor_value(output).dtype
        if tensor_value(result).dtype != wanted:
            result = add("call_method", "to", result, wanted)
    output.replace_all_uses_with(result)
    erase_unused([*candidate.chain, *_inputs_left_dead(candidate), *_mask_construction(candidate)])


def _memopt_attention(add, candidate: AttentionMatch, q: fx.Node, k: fx.Node, v: fx.Node, keep) -> fx.Node:
    """``memopt.flash_attention`` with every additive term summed into one bias; key padding is 0 / -inf, so the
    rows it empties give 0 (replaced by the caller where the replaced code gave something else)."""
    terms = list(candidate.biases)
    if keep is not None:
        terms.append(add("call_function", torch.where, keep, 0.0, float("-inf")))
    if candidate.bias_from_mask is not None:
        mask, fill, fill_where_true = candidate.bias_from_mask
        values = (float(fill), 0.0) if fill_where_true else (0.0, float(fill))
        terms.append(add("call_function", torch.where, mask, *values))
    bias = terms[0] if terms else None
    for term in terms[1:]:
        bias = add("call_function", operator.add, bias, term)
    if bias is not None and tensor_value(bias).dtype != tensor_value(q).dtype:
        bias = add("call_method", "to", bias, tensor_value(q).dtype)
    # softcap and window are passed only when set, so the graphs of other attentions read as they did
    extra = {"softcap": float(candidate.softcap)} if candidate.softcap is not None else {}
    extra.update({"window": candidate.window} if candidate.window is not None else {})
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
        **extra,
    )
    return add("call_function", operator.getitem, fused, 0)


def _cudnn_attention(add, candidate: AttentionMatch, q: fx.Node, k: fx.Node, v: fx.Node, keep) -> fx.Node:
    """cuDNN's fused attention with the causal flag and the key padding as a [B, H, Tq, Tk] view of a
    [B, 1, 1, Tk] bias (stride 0 over heads and queries; its rows padded to cuDNN's alignment). Grouped heads
    are passed as they are: cuDNN reads each key/value head for its group of query heads (checked on the H200
    against repeated heads: identical outputs)."""
    bias = None
    if keep is not None:
        dtype = tensor_value(q).dtype
        bias = add("call_method", "to", add("call_function", torch.where, keep, 0.0, CUDNN_MASK_FILL), dtype)
        keys = shapes.constant(tensor_value(k).shape[-2])
        pad = -keys % CUDNN_BIAS_ALIGNMENT
        if pad:
            bias = add("call_function", F.pad, bias, (0, pad))
            bias = add("call_function", operator.getitem, bias, (Ellipsis, slice(None, keys)))
        sizes = [_size(add, q, 0), _size(add, q, 1), _size(add, q, 2), _size(add, k, 2)]
        bias = add("call_method", "expand", bias, *sizes)
    fused = add(
        "call_function",
        torch.ops.aten._scaled_dot_product_cudnn_attention.default,
        q,
        k,
        v,
        bias,
        True,
        float(candidate.dropout_p),
        candidate.causal,
        False,
        scale=float(candidate.scale),
    )
    return add("call_function", operator.getitem, fused, 0)


def _size(add, node: fx.Node, dim: int) -> int | fx.Node:
    """A dimension as a constant, or the node that reads it (symbolic sizes cannot be graph constants)."""
    size = shapes.constant(tensor_value(node).shape[dim])
    return size if size is not None else add("call_method", "size", node, dim)


def _sdpa_with_mask_structure(add, candidate: AttentionMatch) -> fx.Node:
    """The SDPA call again, with ``is_causal=True`` or a [B, 1, 1, Tk] mask (same dtype) in place of the T×T one.

    Under autocast with mixed input dtypes, q, k, v and a float mask are cast to autocast's dtype here, as autocast
    does inside SDPA: the new node's value is computed outside autocast, where SDPA rejects mixed dtypes."""
    node = candidate.softmax
    bound = bind_sdpa(node)
    q, k, v = bound["query"], bound["key"], bound["value"]
    if candidate.compute_dtype is not None:
        q, k, v = (cast_to(add, t, candidate.compute_dtype) for t in (q, k, v))
    mask = None
    if candidate.sdpa_mask == "keys":
        mask = _key_keep(add, candidate.key_masks)
        if candidate.sdpa_fill is not None:
            mask = add("call_function", torch.where, mask, 0.0, candidate.sdpa_fill)
            mask_dtype = candidate.compute_dtype or tensor_value(candidate.mask_nodes[0]).dtype
            mask = add("call_method", "to", mask, mask_dtype)
    kwargs = {"attn_mask": mask, "dropout_p": bound["dropout_p"], "is_causal": candidate.sdpa_mask == "is_causal"}
    kwargs.update({key: bound[key] for key in ("scale", "enable_gqa") if key in node.kwargs or bound[key]})
    if candidate.broadcast_kv:  # SDPA's fused kernels take one key head as grouped-query attention, not broadcast
        kwargs["enable_gqa"] = True
    return add("call_function", node.target, q, k, v, **kwargs)


def _key_keep(add, keys: tuple[masks.Keys, ...]) -> fx.Node:
    """The AND of the per-key masks as one 4-D boolean [B|1, 1, 1, Tk|1]: True where a key is attended."""
    keep = None
    for atom in keys:
        node = atom.node
        missing = 4 - tensor_value(node).dim()
        if missing:
            node = add("call_function", operator.getitem, node, (None,) * missing + (Ellipsis,))
        if not atom.positive:
            node = add("call_function", operator.invert, node)
        keep = node if keep is None else add("call_function", operator.and_, keep, node)
    return keep


def _rows_without_keys(add, keep: fx.Node, causal: bool, window: int | None = None) -> fx.Node:
    """[B|1, 1, Tq|1, 1], True for the query rows that see no key: none kept up to the row's own position (causal,
    Tq = Tk: the running count of kept keys), none in its window (that count less the count w positions
    earlier: right padding empties the rows whose window lies wholly in the padding), or none at all."""
    if causal:
        seen = add("call_method", "cumsum", keep, -1)
        if window is not None:  # count[i] − count[i − w], the count before the sequence being 0
            earlier = add("call_function", F.pad, seen, (window, 0))
            earlier = add("call_function", operator.getitem, earlier, (Ellipsis, slice(None, -window)))
            seen = add("call_function", operator.sub, seen, earlier)
        return add("call_method", "transpose", add("call_function", operator.eq, seen, 0), -1, -2)
    return add("call_function", operator.invert, add("call_method", "any", keep, -1, True))


def _rows_hidden_whole(add, mask: fx.Node, keeps: bool) -> fx.Node:
    """[..., Tq, 1], True for the rows of a materialized boolean mask that keep no key."""
    kept = mask if keeps else add("call_function", operator.invert, mask)
    return add("call_function", operator.invert, add("call_method", "any", kept, -1, True))


def _eager_keyless_rows(add, q: fx.Node, k: fx.Node, v: fx.Node, scale: float, with_grad: bool) -> fx.Node:
    """What eager gives a row whose scores a finite fill absorbed: uniform probabilities, so the mean of v.

    With ``with_grad`` (the fill was added) also eager's gradient: softmax's backward at P = 1/Tk gives
    dS_ij = (dO_i · (v_j − v̄)) / Tk, so dq_i = scale · M dO_i and dk_j += scale · q_i (dO_i · (v_j − v̄)) / Tk with
    M = Σ_j k_j (v_j − v̄)ᵀ / Tk. ``q @ M − (q @ M).detach()`` is zero and has exactly that gradient, in
    O(B·H·D²) memory. The uniform weights come from softmax over zeros, as eager's 1/Tk do. (Beside a softcap each
    score's slope enters dS, so no such D×D product exists: ``memopt.flash_attention_uniform_rows`` serves that.)"""
    first_column = add("call_function", operator.getitem, k, (Ellipsis, slice(None, 1)))
    zeros = add("call_function", torch.zeros_like, first_column)
    uniform = add("call_function", torch.softmax, add("call_method", "transpose", zeros, -1, -2), -1)  # [B, Hk, 1, Tk]
    mean = add("call_function", torch.matmul, uniform, v)
    groups = shapes.constant(tensor_value(q).shape[1]) // shapes.constant(tensor_value(k).shape[1])
    fix = _repeat_heads(add, mean, groups)
    if with_grad:
        centered = add("call_function", operator.sub, v, mean)
        weights = add("call_method", "detach", add(
            "call_function", operator.mul, centered, add("call_method", "transpose", uniform, -1, -2)))
        products = add("call_function", torch.matmul, add("call_method", "transpose", k, -1, -2), weights)
        scores = add("call_function", operator.mul, add(
            "call_function", torch.matmul, q, _repeat_heads(add, products, groups)), scale)
        zero = add("call_function", operator.sub, scores, add("call_method", "detach", scores))
        fix = add("call_function", operator.add, fix, zero)
    return fix


def _repeat_heads(add, node: fx.Node, groups: int) -> fx.Node:
    """Key/value heads repeated for the query heads that share them (head h reads h // groups, as repeat_kv)."""
    return node if groups == 1 else add("call_method", "repeat_interleave", node, groups, 1)


def _sdpa_memory_model(candidate: AttentionMatch, assume_device: str | None = None) -> shapes.MemoryModel:
    """SDPA keeps O(T) either way; what the rewrite frees is the T×T mask, if only attention reads it (the
    layers of a model share one mask: each is charged all of it, since all of them are rewritten alike)."""
    from lowerings.flash_attention.op import working_set

    q, k = tensor_value(candidate.q), tensor_value(candidate.k)
    (mask,) = candidate.mask_nodes
    only_here = _read_only_by_attention(mask)
    before = {f"transient: the causal mask {mask.name}, no longer built": shapes.nbytes(tensor_value(mask))
              if only_here else 0}
    if candidate.sdpa_mask is not None:  # SDPA stays: its own working set is the same before and after
        return shapes.MemoryModel(before, _key_mask_terms(candidate))
    device = assumed_device(q.device, assume_device)
    after = working_set(
        q.shape[0], q.shape[1], q.shape[-2], k.shape[-2], device, dtype=q.dtype, head_dim=q.shape[-1],
        kv_heads=k.shape[-3],  # k is un-repeated when the op replaces SDPA
    )
    return shapes.MemoryModel(before, after)


def _read_only_by_attention(mask: fx.Node) -> bool:
    """Every reader of ``mask`` is an SDPA call or a masking step (the attention of another layer)."""
    if mask.op == "placeholder":
        return False
    return all(
        _is_sdpa(user) or is_call(user, operator.add, torch.add, torch.where) or is_method(user, "masked_fill")
        for user in mask.users
    )


def _key_mask_terms(candidate: AttentionMatch) -> dict[str, Any]:
    """What the O(B·T) replacement of a padding mask costs: the key bias, and the rows that see no key."""
    q, k = tensor_value(candidate.q), tensor_value(candidate.k)
    terms: dict[str, Any] = {}
    if candidate.key_masks:
        terms["transient: the key mask [B, 1, 1, Tk]"] = q.shape[0] * k.shape[-2] * q.dtype.itemsize
    if candidate.sdpa_mask is None and candidate.empty_rows != EMPTY_ZERO:
        terms["transient: rows without keys replaced by the mean of v [B, Hq, Tq, D]"] = shapes.nbytes(q)
    if candidate.empty_rows == EMPTY_MEAN_GRAD and candidate.softcap is not None:
        from lowerings.flash_attention.uniform_rows import backward_bytes

        terms["transient (backward): those rows' scores through the softcap, a chunk at a time (at most)"] = (
            backward_bytes(q.shape[-3], q.shape[-2], k.shape[-2])
        )
    return terms


def _inputs_left_dead(candidate: AttentionMatch) -> list[fx.Node]:
    """kᵀ and HF's repeat_kv copies of k and v, which only the replaced matmuls (or SDPA) read."""
    first, last = candidate.chain[0], candidate.chain[-1]
    if _is_sdpa(first):
        bound = bind_sdpa(first) or {}
        found, starts = [], [bound.get("key"), bound.get("value")]
    elif _einsum_form(first) is not None or _einsum_form(last) is not None:
        return []  # einsum reads k and v as they are
    else:
        found = [first.args[1]] if isinstance(first.args[1], fx.Node) else []
        starts = [*found, last.args[1]]
    for node in starts:
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
