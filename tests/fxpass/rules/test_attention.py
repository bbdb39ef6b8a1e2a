"""The attention rule on each pattern form: rewritten graphs, eager's numbers, causal masks as flags, declines."""

from __future__ import annotations

import contextlib
import math
import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers
from expecttest import Expect, assert_expected_inline
from transformers import masking_utils

import fxpass
from tests.helpers import after_code, assert_close_all, grads, record_lines, rewritten

B, H, T, D = 2, 2, 6, 8


def _qkv(heads=H, kv_heads=H, queries=T, keys=T, dim=D, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    return (
        torch.randn(B, heads, queries, dim, generator=gen, dtype=dtype).requires_grad_(),
        torch.randn(B, kv_heads, keys, dim, generator=gen, dtype=dtype).requires_grad_(),
        torch.randn(B, kv_heads, keys, dim, generator=gen, dtype=dtype).requires_grad_(),
    )


def _check(fn, *inputs, **options):
    """Rewrite ``fn``; its output and the gradients of every input equal eager's (float32 on CPU)."""
    expected = fn(*inputs)
    weights = torch.randn_like(expected)
    explanation = rewritten(fn, *inputs, **options)
    actual = explanation.result
    torch.testing.assert_close(actual, expected)
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    assert_close_all(grads((actual * weights).sum(), leaves), grads((expected * weights).sum(), leaves))
    return explanation


def _attention_records(explanation):
    return [r for r in explanation.records if r.rule == "attention"]


class NanoAttention(nn.Module):
    """nanoGPT: a registered tril buffer, masked_fill(-inf), softmax, dropout, @ v."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.register_buffer("bias", torch.tril(torch.ones(16, 16)).view(1, 1, 16, 16))
        self.dropout = nn.Dropout(dropout)

    def forward(self, q, k, v):
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, : q.size(2), : q.size(2)] == 0, float("-inf"))
        return self.dropout(F.softmax(att, dim=-1)) @ v


def _inline_tril_and_division(q, k, v):
    scores = q @ k.transpose(-2, -1) / math.sqrt(D)
    mask = torch.tril(torch.ones(T, T))
    return torch.softmax(scores.masked_fill(mask == 0, float("-inf")), dim=-1) @ v


def _upcast_and_inverted_tril(upcast):
    def fn(q, k, v, upcast):
        scores = q @ k.transpose(-2, -1) / math.sqrt(D)
        mask = torch.tril(torch.ones(T, T, dtype=torch.bool))
        scores = upcast(scores.masked_fill(~mask, float("-inf")))
        return torch.softmax(scores, dim=-1).to(q.dtype) @ v

    return lambda q, k, v, upcast=upcast: fn(q, k, v, upcast)


def _einsum(scores_eq, values_eq):
    def fn(q, k, v, scores_eq=scores_eq, values_eq=values_eq):
        return torch.einsum(values_eq, torch.softmax(torch.einsum(scores_eq, q, k) * D**-0.5, dim=-1), v)

    return fn


def _bmm_inputs():
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(4, T, D, generator=gen, requires_grad=True) for _ in range(3)]


class TestForms:
    def test_nanogpt_tril_buffer_becomes_a_causal_flag(self):
        ex = _check(NanoAttention(), *_qkv())
        assert_expected_inline(after_code(ex), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_k_: "f32[2, 2, 6, 8]cpu", L_q_: "f32[2, 2, 6, 8]cpu", L_self_buffers_bias_: "f32[1, 1, 16, 16]cpu", L_v_: "f32[2, 2, 6, 8]cpu"):
        l_k_ = L_k_
        l_q_ = L_q_
        l_self_buffers_bias_ = L_self_buffers_bias_
        l_v_ = L_v_
        flash_attention_default = torch.ops.memopt.flash_attention.default(l_q_, l_k_, l_v_, None, 0.35355339059327373, True, 0.0);  l_q_ = l_k_ = l_v_ = None
        getitem_1: "f32[2, 2, 6, 8]cpu" = flash_attention_default[0];  flash_attention_default = None
        return (getitem_1,)""")

    def test_mask_comparison_spelled_as_a_method_call(self):
        """torch 2.11's Dynamo writes ``mask == 0`` as ``mask.__eq__(0)``; the causal flag must not depend on it."""
        spelled = []

        def as_torch_2_11(gm, example_inputs):
            for node in gm.graph.nodes:
                if node.target is operator.eq:  # torch ≥ 2.12's spelling
                    node.op, node.target = "call_method", "__eq__"
                if node.target == "__eq__":
                    spelled.append(node.name)
            gm.recompile()
            return fxpass.MemoptBackend(options={"strict": True, "force": True})(gm, example_inputs)

        fxpass.clear_reports()
        q, k, v = _qkv()
        torch.testing.assert_close(torch.compile(NanoAttention(), backend=as_torch_2_11)(q, k, v), NanoAttention()(q, k, v))
        records = [r for report in fxpass.reports() for r in report.records if r.rule == "attention"]
        assert spelled
        assert [(r.applied, r.params["causal"]) for r in records] == [(True, True)]

    @pytest.mark.parametrize(
        ("fn", "inputs", "expected"),
        [
            pytest.param(_inline_tril_and_division, _qkv, {"causal": True}, id="inline_tril_and_division"),
            # ``softmax(scores.float()).to(q.dtype)`` with ``masked_fill(~tril, -inf)``, as benchmark code writes it
            pytest.param(_upcast_and_inverted_tril(lambda s: s.float()), _qkv, {"causal": True},
                         id="upcast_before_softmax_and_inverted_tril-float"),
            pytest.param(_upcast_and_inverted_tril(lambda s: s.to(torch.float32)), _qkv, {"causal": True},
                         id="upcast_before_softmax_and_inverted_tril-to"),
            pytest.param(_upcast_and_inverted_tril(lambda s: s.type(torch.float32)), _qkv, {"causal": True},
                         id="upcast_before_softmax_and_inverted_tril-type"),
            # einsum for both products: named heads, an ellipsis batch, and [B·H, T, D] operands
            pytest.param(_einsum("bhqd,bhkd->bhqk", "bhqk,bhkd->bhqd"), _qkv, {"scale": D**-0.5},
                         id="einsum_spellings-named_heads"),
            pytest.param(_einsum("...id,...jd->...ij", "...ij,...jd->...id"), lambda: _qkv(queries=5, keys=7),
                         {"scale": D**-0.5}, id="einsum_spellings-ellipsis_batch"),
            pytest.param(_einsum("b i d, b j d -> b i j", "b i j, b j d -> b i d"),
                         lambda: [t.detach().flatten(0, 1).requires_grad_() for t in _qkv()], {"scale": D**-0.5},
                         id="einsum_spellings-heads_in_the_batch"),
            # T5: no scale, a learned [1, H, T, T] position bias added to the scores; its gradient flows
            pytest.param(lambda q, k, v, bias: torch.softmax(q @ k.transpose(-2, -1) + bias, dim=-1) @ v,
                         lambda: (*_qkv(), torch.randn(1, H, T, T, requires_grad=True)), {"mask": "additive bias"},
                         id="learned_position_bias_gets_its_gradient"),
            # T5-like: no scale, ``bmm`` over [B·H, T, D]
            pytest.param(lambda q, k, v: torch.bmm(torch.softmax(torch.bmm(q, k.transpose(1, 2)), dim=-1), v),
                         _bmm_inputs, {"scale": 1.0}, id="batched_three_dim_without_scale"),
            pytest.param(lambda q, k, v: torch.softmax(q @ k.transpose(-2, -1) * 0.3, dim=-1) @ v,
                         lambda: _qkv(queries=5, keys=9), {"keys": "9"}, id="cross_attention_lengths_differ"),
        ],
    )
    def test_rewritten(self, fn, inputs, expected):
        """One attention, rewritten with eager's output and gradients; its record's parameters as ``expected``."""
        (record,) = _attention_records(_check(fn, *inputs()))
        assert record.applied, record.reason
        assert {name: record.params[name] for name in expected} == expected
    def test_einsum_that_is_not_attention(self):
        """Contracting the wrong dimension (q kᵀ over heads, say) is no candidate."""

        def fn(q, k, v):
            return torch.einsum("bhqk,bhkd->bhqd", torch.softmax(torch.einsum("bhqd,bhqe->bhde", q, k), -1), v)

        q, k, v = _qkv(queries=D, keys=D)
        assert _attention_records(rewritten(fn, q, k, v)) == []

    def test_arange_comparison_where_finfo_min(self):
        """GPT-2 style ``where(causal, scores, finfo.min)`` with the mask built from arange comparisons."""

        def fn(q, k, v):
            scores = torch.matmul(q, k.transpose(2, 3)) * 0.35
            rows = torch.arange(T)[:, None]
            cols = torch.arange(T)[None, :]
            allowed = (cols <= rows)[None, None]
            scores = torch.where(allowed, scores, torch.finfo(torch.float32).min)
            return torch.matmul(F.softmax(scores, dim=-1), v)

        ex = _check(fn, *_qkv())
        assert_expected_inline(after_code(ex), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_k_: "f32[2, 2, 6, 8]cpu", L_q_: "f32[2, 2, 6, 8]cpu", L_v_: "f32[2, 2, 6, 8]cpu"):
        l_k_ = L_k_
        l_q_ = L_q_
        l_v_ = L_v_
        flash_attention_default = torch.ops.memopt.flash_attention.default(l_q_, l_k_, l_v_, None, 0.35, True, 0.0);  l_q_ = l_k_ = l_v_ = None
        getitem_3: "f32[2, 2, 6, 8]cpu" = flash_attention_default[0];  flash_attention_default = None
        return (getitem_3,)""")

    def test_additive_padding_mask_and_grouped_query_heads(self):
        """HF's repeat_kv GQA and a [B, 1, 1, Tk] additive padding mask passed as a bias."""
        padding = torch.zeros(B, 1, 1, T)
        padding[0, ..., -2:] = torch.finfo(torch.float32).min

        def repeat_kv(x, n):
            b, h, t, d = x.shape
            return x[:, :, None, :, :].expand(b, h, n, t, d).reshape(b, h * n, t, d)

        def fn(q, k, v, mask):
            k, v = repeat_kv(k, 2), repeat_kv(v, 2)
            weights = torch.matmul(q, k.transpose(2, 3)) * 0.35 + mask
            weights = F.softmax(weights, dim=-1, dtype=torch.float32).to(q.dtype)
            return torch.matmul(weights, v)

        q, k, v = _qkv(heads=4, kv_heads=2)
        ex = _check(fn, q, k, v, padding)
        assert_expected_inline(after_code(ex), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_k_: "f32[2, 2, 6, 8]cpu", L_v_: "f32[2, 2, 6, 8]cpu", L_q_: "f32[2, 4, 6, 8]cpu", L_mask_: "f32[2, 1, 1, 6]cpu"):
        l_k_ = L_k_
        l_v_ = L_v_
        l_q_ = L_q_
        l_mask_ = L_mask_
        flash_attention_default = torch.ops.memopt.flash_attention.default(l_q_, l_k_, l_v_, l_mask_, 0.35, False, 0.0);  l_q_ = l_k_ = l_v_ = l_mask_ = None
        getitem_2: "f32[2, 4, 6, 8]cpu" = flash_attention_default[0];  flash_attention_default = None
        return (getitem_2,)""")
        params = _attention_records(ex)[0].params
        assert (params["heads"], params["kv_heads"], params["mask"]) == ("4", "2", "additive bias")

    @pytest.mark.slow
    def test_dropout_is_passed_on(self):
        """Dropout in training mode reaches the op (its draws differ from eager's, so only shapes compare)."""
        q, k, v = _qkv()
        ex = rewritten(NanoAttention(dropout=0.25), q, k, v)
        [record] = _attention_records(ex)
        assert record.applied and record.params["dropout_p"] == 0.25
        assert ex.result.shape == (B, H, T, D)
        # Unbiased dropout: the mean over many draws approaches the no-dropout output.
        torch.manual_seed(3)
        fused = torch.ops.memopt.flash_attention
        mean = sum(fused(q, k, v, None, 0.35, True, 0.25)[0] for _ in range(400)) / 400
        torch.testing.assert_close(mean, fused(q, k, v, None, 0.35, True, 0.0)[0], rtol=0.1, atol=0.1)


class TestDeclines:
    def test_probabilities_returned(self):
        def fn(q, k, v):
            probs = torch.softmax(q @ k.transpose(-2, -1), dim=-1)
            return probs @ v, probs

        assert_expected_inline(record_lines(rewritten(fn, *_qkv())), """attention applied=False proof=None: the attention scores/probabilities (probs) are also returned from the compiled graph, so they stay alive""")

    def test_sdpa_left_alone(self):
        """SDPA with is_causal or a mask that is not provably causal is already O(T): declined with why."""
        q, k, v = _qkv()
        padding = torch.ones(B, 1, 1, T, dtype=torch.bool)
        padding[1, ..., -2:] = False
        ex = rewritten(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), q, k, v)
        ex_padded = rewritten(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m), q, k, v, padding)
        assert_expected_inline(record_lines(ex) + "\n" + record_lines(ex_padded), """\
attention applied=False proof=None: F.scaled_dot_product_attention is already a fused kernel with O(T) memory; left as is
attention applied=False proof=None: F.scaled_dot_product_attention is already a fused kernel with O(T) memory; left as is (its mask has no query dimension: already [B, 1, 1, Tk])""")

    def test_sdpa_with_a_materialized_causal_mask_gets_the_flag(self):
        """SDPA handed tril(ones) as a boolean mask: SDPA gets is_causal=True (its flash/cuDNN kernels), the mask
        is no longer built."""

        def fn(q, k, v):
            mask = torch.tril(torch.ones(T, T, dtype=torch.bool))
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

        ex = _check(fn, *_qkv())
        (record,) = _attention_records(ex)
        assert record.applied
        assert record.params["mask"] == "causal (flag)"
        assert record.params["lowering"] == "F.scaled_dot_product_attention(is_causal=True)"
        assert "tril" not in after_code(ex)
        assert "is_causal = True" in after_code(ex)

    def test_sdpa_with_one_key_head_broadcast(self):
        """transformers 5.17's Falcon hands SDPA one key/value head broadcast over the query heads (multi-query
        attention, no enable_gqa) and a materialized causal mask: rewritten to ``is_causal=True`` with
        ``enable_gqa=True``, grouped-query attention with one group being the same broadcast, and the form SDPA's
        fused kernels take; eager's numbers."""

        def fn(q, k, v):
            mask = torch.tril(torch.ones(T, T, dtype=torch.bool))
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

        ex = _check(fn, *_qkv(heads=4, kv_heads=1))
        (record,) = _attention_records(ex)
        assert record.applied, record.reason
        assert (record.params["heads"], record.params["kv_heads"]) == ("4", "1")
        assert "enable_gqa = True" in after_code(ex)
        assert "tril" not in after_code(ex)

    def test_sdpa_mask_flag_under_autocast_with_mixed_dtypes(self):
        """Llama's rotary embedding leaves q and k in fp32 beside a bf16 v; autocast casts all three (and a float
        mask) to bf16 inside SDPA. The SDPA call that replaces the masked one casts them itself, as autocast did:
        traced outside autocast, the mixed dtypes failed SDPA's check and the rule was skipped (seen with HF
        Trainer and ``bf16=True`` on the H200)."""

        def fn(q, k, v):
            mask = torch.tril(torch.ones(T, T, dtype=torch.bool))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return F.scaled_dot_product_attention(q, k, v.to(torch.bfloat16), attn_mask=mask)

        ex = _check(fn, *_qkv())
        (record,) = _attention_records(ex)
        assert record.applied, record.reason
        assert "is_causal = True" in after_code(ex)

    def test_softmax_that_is_not_attention(self):
        gate = nn.Linear(D, 4)
        ex = rewritten(lambda x: torch.softmax(gate(x), dim=-1).sum(), torch.randn(B, T, D))
        assert _attention_records(ex) == []


def square_tensors(explanation, length: int) -> list[str]:
    """Nodes of the rewritten graphs whose example value is a [..., T, T] tensor (scores, probabilities, masks)."""
    found = []
    for report in explanation.graphs:
        for node in report.graph_module.graph.nodes:
            value = node.meta.get("example_value")
            if isinstance(value, torch.Tensor) and value.dim() >= 2 and tuple(value.shape[-2:]) == (length, length):
                found.append(node.name)
    return found


def _padding(kind: str, batch: int = 3, length: int = T) -> torch.Tensor:
    """[B, T] attention_mask: right or left padding, all ones, or one sequence that is all padding."""
    mask = torch.ones(batch, length, dtype=torch.long)
    if kind == "right":
        mask[1, -2:], mask[2, -4:] = 0, 0
    elif kind == "left":
        mask[1, :2], mask[2, :4] = 0, 0
    elif kind == "empty":
        mask[1, :3], mask[2] = 0, 0
    return mask


def _padded_qkv(heads=4, kv_heads=2, dtype=torch.float64):
    gen = torch.Generator().manual_seed(1)
    shapes = [(3, heads, T, D), (3, kv_heads, T, D), (3, kv_heads, T, D)]
    return [torch.randn(*shape, generator=gen, dtype=dtype).requires_grad_() for shape in shapes]


def _repeat_kv(x, n):
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, n, t, d).reshape(b, h * n, t, d)


def _eager_attention(q, k, v, scores_mask, dtype=torch.float64):
    scores = q @ _repeat_kv(k, 2).transpose(-2, -1) * 0.3
    return torch.softmax(scores_mask(scores), dim=-1, dtype=dtype).to(q.dtype) @ _repeat_kv(v, 2)


def _hf_mask(pad, mask_function=masking_utils.causal_mask_function, sdpa=False, dtype=torch.float64):
    """transformers' masks exactly as its models build them (boolean for SDPA, 0 / finfo.min for eager)."""
    build = masking_utils.sdpa_mask if sdpa else masking_utils.eager_mask
    kwargs = {} if sdpa else {"dtype": dtype}
    return build(
        batch_size=pad.shape[0], q_length=pad.shape[1], kv_length=pad.shape[1], mask_function=mask_function,
        attention_mask=pad.bool(), allow_is_causal_skip=False, **kwargs,
    )


# Ways to hide keys from scores: (scores, keep [B, 1, T, T] bool, fill) -> masked scores.
_MASKINGS = {
    "added finfo.min": lambda s, keep, fill: s + torch.where(keep, torch.zeros((), dtype=s.dtype), fill),
    # transformers 5.17's eager_mask spells the zero torch.tensor(0.0)
    "added finfo.min, tensor zero": lambda s, keep, fill: s + torch.where(keep, torch.tensor(0.0, dtype=s.dtype), fill),
    "masked_fill finfo.min": lambda s, keep, fill: s.masked_fill(~keep, fill),
    "where finfo.min": lambda s, keep, fill: torch.where(keep, s, fill),
    "added -inf": lambda s, keep, fill: s + torch.where(keep, torch.zeros((), dtype=s.dtype), float("-inf")),
}


class TestPaddingMasks:
    """Masks built from a [B, T] attention_mask become a causal flag and a [B, 1, 1, Tk] key bias."""

    def test_transformers_eager_mask_snapshot(self):
        """transformers' eager mask (causal ∧ padding, 0 / finfo.min): no T×T tensor is left; the rows that left
        padding empties get eager's mean of v, with eager's gradients."""

        def fn(q, k, v, pad):
            return _eager_attention(q, k, v, lambda s: s + _hf_mask(pad))

        ex = _check(fn, *_padded_qkv(), _padding("left"))
        (record,) = _attention_records(ex)
        assert record.params["mask"] == "causal (flag) + key padding"
        assert record.params["empty_rows"] == "mean of v, with eager's q and k gradients"
        assert square_tensors(ex, T) == []
        assert_expected_inline(after_code(ex), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_k_: "f64[3, 2, 6, 8]cpu", L_q_: "f64[3, 4, 6, 8]cpu", L_pad_: "i64[3, 6]cpu", L_v_: "f64[3, 2, 6, 8]cpu"):
        l_k_ = L_k_
        l_q_ = L_q_
        l_pad_ = L_pad_
        l_v_ = L_v_
        local_padding_mask: "b8[3, 6]cpu" = l_pad_.bool();  l_pad_ = None
        batch_arange: "i64[3]cpu" = torch.arange(3, device = 'cpu')
        head_arange: "i64[1]cpu" = torch.arange(1, device = 'cpu');  head_arange = None
        arange_3: "i64[6]cpu" = torch.arange(6, device = 'cpu')
        kv_arange: "i64[6]cpu" = arange_3 + 0;  arange_3 = None
        batch_indices: "i64[3, 1, 1, 1]cpu" = batch_arange[(slice(None, None, None), None, None, None)];  batch_arange = None
        kv_indices: "i64[1, 1, 1, 6]cpu" = kv_arange[(None, None, None, slice(None, None, None))];  kv_arange = None
        getitem_5: "b8[3, 1, 1, 6]cpu" = local_padding_mask[(batch_indices, kv_indices)];  local_padding_mask = batch_indices = kv_indices = None
        where_1: "f32[3, 1, 1, 6]cpu" = torch.where(getitem_5, 0.0, -inf)
        to_3: "f64[3, 1, 1, 6]cpu" = where_1.to(torch.float64);  where_1 = None
        flash_attention_default = torch.ops.memopt.flash_attention.default(l_q_, l_k_, l_v_, to_3, 0.3, True, 0.0);  to_3 = None
        getitem_7: "f64[3, 4, 6, 8]cpu" = flash_attention_default[0];  flash_attention_default = None
        cumsum: "i64[3, 1, 1, 6]cpu" = getitem_5.cumsum(-1);  getitem_5 = None
        eq: "b8[3, 1, 1, 6]cpu" = cumsum == 0;  cumsum = None
        transpose_1: "b8[3, 1, 6, 1]cpu" = eq.transpose(-1, -2);  eq = None
        getitem_8: "f64[3, 2, 6, 1]cpu" = l_k_[(Ellipsis, slice(None, 1, None))]
        zeros_like: "f64[3, 2, 6, 1]cpu" = torch.zeros_like(getitem_8);  getitem_8 = None
        transpose_2: "f64[3, 2, 1, 6]cpu" = zeros_like.transpose(-1, -2);  zeros_like = None
        softmax_1: "f64[3, 2, 1, 6]cpu" = torch.softmax(transpose_2, -1);  transpose_2 = None
        matmul_2: "f64[3, 2, 1, 8]cpu" = torch.matmul(softmax_1, l_v_)
        repeat_interleave: "f64[3, 4, 1, 8]cpu" = matmul_2.repeat_interleave(2, 1)
        sub: "f64[3, 2, 6, 8]cpu" = l_v_ - matmul_2;  l_v_ = matmul_2 = None
        transpose_3: "f64[3, 2, 6, 1]cpu" = softmax_1.transpose(-1, -2);  softmax_1 = None
        mul_1: "f64[3, 2, 6, 8]cpu" = sub * transpose_3;  sub = transpose_3 = None
        detach: "f64[3, 2, 6, 8]cpu" = mul_1.detach();  mul_1 = None
        transpose_4: "f64[3, 2, 8, 6]cpu" = l_k_.transpose(-1, -2);  l_k_ = None
        matmul_3: "f64[3, 2, 8, 8]cpu" = torch.matmul(transpose_4, detach);  transpose_4 = detach = None
        repeat_interleave_1: "f64[3, 4, 8, 8]cpu" = matmul_3.repeat_interleave(2, 1);  matmul_3 = None
        matmul_4: "f64[3, 4, 6, 8]cpu" = torch.matmul(l_q_, repeat_interleave_1);  l_q_ = repeat_interleave_1 = None
        mul_2: "f64[3, 4, 6, 8]cpu" = matmul_4 * 0.3;  matmul_4 = None
        detach_1: "f64[3, 4, 6, 8]cpu" = mul_2.detach()
        sub_1: "f64[3, 4, 6, 8]cpu" = mul_2 - detach_1;  mul_2 = detach_1 = None
        add_3: "f64[3, 4, 6, 8]cpu" = repeat_interleave + sub_1;  repeat_interleave = sub_1 = None
        where_2: "f64[3, 4, 6, 8]cpu" = torch.where(transpose_1, add_3, getitem_7);  transpose_1 = add_3 = getitem_7 = None
        return (where_2,)""")

    @pytest.mark.parametrize(("causal", "kind"), [(True, "causal (flag) + key padding"), (False, "key padding")],
                             ids=["causal", "not_causal"])
    @pytest.mark.parametrize(
        ("name", "empty_rows"),
        [
            pytest.param("added finfo.min", "mean of v, with eager's q and k gradients", id="added_finfo_min"),
            pytest.param("added finfo.min, tensor zero", "mean of v, with eager's q and k gradients",
                         id="added_finfo_min_tensor_zero"),
            pytest.param("masked_fill finfo.min", "mean of v", id="masked_fill_finfo_min"),
            pytest.param("where finfo.min", "mean of v", id="where_finfo_min"),
            pytest.param("added -inf", "zero", id="added_minus_inf"),
        ],
    )
    def test_rows_without_keys_match_eager(self, causal, kind, name, empty_rows):
        """Each way of hiding keys, with rows left without any key (left padding, a sequence of padding):
        output and gradients equal eager's in float64, whatever eager computes there."""
        pad = _padding("empty")
        masking = _MASKINGS[name]

        def fn(q, k, v, pad):
            i = torch.arange(pad.shape[1])
            allowed = i[None, None, None, :] <= i[None, None, :, None] if causal else True
            keep = pad.bool()[:, None, None, :] & allowed
            return _eager_attention(q, k, v, lambda s: masking(s, keep, torch.finfo(s.dtype).min))

        inputs = _padded_qkv()
        if name == "added -inf":  # eager softmax gives NaN on rows without keys; the op gives 0
            expected = fn(*inputs, pad).nan_to_num(0.0)
            ex = rewritten(fn, *inputs, pad)
            torch.testing.assert_close(ex.result, expected)
        else:
            ex = _check(fn, *inputs, pad)
        (record,) = _attention_records(ex)
        assert (record.params["mask"], record.params["empty_rows"]) == (kind, empty_rows)
        assert square_tensors(ex, T) == []

    @pytest.mark.parametrize(
        ("mask_function", "padding", "lowering"),
        [
            pytest.param(masking_utils.causal_mask_function, "left", "memopt.flash_attention", id="causal+padding"),
            pytest.param(masking_utils.bidirectional_mask_function, "empty",
                         "F.scaled_dot_product_attention with a [B, 1, 1, Tk] mask", id="padding"),
            pytest.param(masking_utils.causal_mask_function, "ones", "memopt.flash_attention", id="causal+all_ones"),
        ],
    )
    def test_sdpa_boolean_masks(self, mask_function, padding, lowering):
        """transformers' SDPA masks: causal ∧ padding (all ones included: the values are not known when compiling)
        → memopt.flash_attention (rows without keys give 0, as SDPA does); padding alone → SDPA with a
        [B, 1, 1, Tk] mask."""

        def fn(q, k, v, pad):
            mask = _hf_mask(pad, mask_function, sdpa=True)
            return F.scaled_dot_product_attention(q, _repeat_kv(k, 2), _repeat_kv(v, 2), attn_mask=mask, scale=0.3)

        ex = _check(fn, *_padded_qkv(), _padding(padding))
        (record,) = _attention_records(ex)
        assert record.applied, record.reason
        assert record.params["lowering"] == lowering
        assert square_tensors(ex, T) == []

    def test_sdpa_causal_mask_alone(self):
        """transformers' SDPA mask, causal alone → SDPA with is_causal=True."""

        def causal_only(q, k, v):
            mask = masking_utils.sdpa_mask(batch_size=B, q_length=T, kv_length=T, allow_is_causal_skip=False)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

        ex = _check(causal_only, *_qkv())
        assert "is_causal = True" in after_code(ex)
        assert square_tensors(ex, T) == []

    def test_unproved_masks_stay_a_bias_with_the_reason(self):
        """A union of conditions, fp16's finfo.min: the mask stays a tensor and the record says why; the results
        still equal eager's."""
        union = masking_utils.or_masks(masking_utils.causal_mask_function, lambda b, h, q, kv: kv < 2)
        notes = {}
        for name, mask_function in {"union": union}.items():
            def fn(q, k, v, pad, mask_function=mask_function):
                return _eager_attention(q, k, v, lambda s: s + _hf_mask(pad, mask_function))

            ex = _check(fn, *_padded_qkv(), _padding("left"))
            (record,) = _attention_records(ex)
            assert record.applied
            assert record.params["mask"] == "additive bias"
            notes[name] = record.params["mask_note"]

            def sdpa(q, k, v, pad, mask_function=mask_function):
                mask = _hf_mask(pad, mask_function, sdpa=True)
                return F.scaled_dot_product_attention(q, _repeat_kv(k, 2), _repeat_kv(v, 2), attn_mask=mask)

            ex = _check(sdpa, *_padded_qkv(), _padding("left"))
            notes[f"{name}, sdpa"] = _attention_records(ex)[0].reason

        def fp16_fill(q, k, v, pad):
            return _eager_attention(q, k, v, lambda s: s + _hf_mask(pad, dtype=torch.float16).to(s.dtype))

        ex = _check(fp16_fill, *_padded_qkv(), _padding("right"))
        notes["fp16"] = _attention_records(ex)[0].params["mask_note"]
        assert_expected_inline("\n".join(f"{k}: {v}" for k, v in notes.items()), """\
union: the mask (mask) stays a bias: the mask is a union of conditions (or_masks), not an intersection
union, sdpa: F.scaled_dot_product_attention is already a fused kernel with O(T) memory; left as is (its mask stays: the mask is a union of conditions (or_masks), not an intersection)
fp16: the mask (to_2) stays a bias: its fill -65504 does not absorb the scores (a fill <= -1e+30 does)""")

def _window_mask(pad, window, sdpa=False, dtype=torch.float64):
    """transformers' sliding-window mask (its layers' ``sliding_window``) as its models build it; ``pad`` None
    builds it without an attention_mask (no key padding)."""
    build = masking_utils.sdpa_mask if sdpa else masking_utils.eager_mask
    kwargs = {} if sdpa else {"dtype": dtype}
    batch, length = (pad.shape if pad is not None else (3, T))
    return build(
        batch_size=batch, q_length=length, kv_length=length,
        mask_function=masking_utils.sliding_window_causal_mask_function(window),
        attention_mask=pad.bool() if pad is not None else None, allow_is_causal_skip=False, **kwargs,
    )


class TestSlidingWindows:
    """transformers' sliding-window masks (Mistral, Qwen2, Gemma 2/3) become the op's ``window`` argument: no
    T×T tensor is built, under eager attention and SDPA alike."""

    def test_eager_window_snapshot(self):
        """No attention_mask: the mask is built from position comparisons only; it becomes causal + window 3."""

        def fn(q, k, v):
            return _eager_attention(q, k, v, lambda s: s + _window_mask(None, 3))

        ex = _check(fn, *_padded_qkv())
        (record,) = _attention_records(ex)
        assert (record.params["mask"], record.params["window"]) == ("causal (flag) + sliding window of 3 keys", 3)
        assert square_tensors(ex, T) == []
        assert_expected_inline(after_code(ex), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_k_: "f64[3, 2, 6, 8]cpu", L_q_: "f64[3, 4, 6, 8]cpu", L_v_: "f64[3, 2, 6, 8]cpu"):
        l_k_ = L_k_
        l_q_ = L_q_
        l_v_ = L_v_
        batch_arange: "i64[3]cpu" = torch.arange(3, device = 'cpu');  batch_arange = None
        head_arange: "i64[1]cpu" = torch.arange(1, device = 'cpu');  head_arange = None
        flash_attention_default = torch.ops.memopt.flash_attention.default(l_q_, l_k_, l_v_, None, 0.3, True, 0.0, window = 3);  l_q_ = l_k_ = l_v_ = None
        getitem_6: "f64[3, 4, 6, 8]cpu" = flash_attention_default[0];  flash_attention_default = None
        return (getitem_6,)""")

    def test_sdpa_window_snapshot(self):
        """SDPA handed the window as a [B, 1, T, T] boolean: no SDPA argument expresses a window, so memopt's op
        takes it, grouped key/value heads unrepeated."""

        def fn(q, k, v):
            mask = _window_mask(None, 3, sdpa=True)
            return F.scaled_dot_product_attention(q, _repeat_kv(k, 2), _repeat_kv(v, 2), attn_mask=mask, scale=0.3)

        ex = _check(fn, *_padded_qkv())
        (record,) = _attention_records(ex)
        assert record.params["lowering"] == "memopt.flash_attention"
        assert square_tensors(ex, T) == []
        assert_expected_inline(after_code(ex), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_k_: "f64[3, 2, 6, 8]cpu", L_v_: "f64[3, 2, 6, 8]cpu", L_q_: "f64[3, 4, 6, 8]cpu"):
        l_k_ = L_k_
        l_v_ = L_v_
        l_q_ = L_q_
        batch_arange: "i64[3]cpu" = torch.arange(3, device = 'cpu');  batch_arange = None
        head_arange: "i64[1]cpu" = torch.arange(1, device = 'cpu');  head_arange = None
        flash_attention_default = torch.ops.memopt.flash_attention.default(l_q_, l_k_, l_v_, None, 0.3, True, 0.0, window = 3);  l_q_ = l_k_ = l_v_ = None
        getitem_6: "f64[3, 4, 6, 8]cpu" = flash_attention_default[0];  flash_attention_default = None
        return (getitem_6,)""")
        assert (
            "the [B, 1, Tq, Tk] mask is no longer built: memopt.flash_attention, causal flag and a sliding window of 3 keys"
            in record.reason
        )

    @pytest.mark.parametrize("sdpa", [False, True], ids=["eager", "sdpa"])
    @pytest.mark.parametrize("padding", ["right", "left", "empty"])
    @pytest.mark.parametrize("window", [1, 3], ids=["window_1", "window_3"])
    def test_windows_with_padding_match_eager(self, window, padding, sdpa):
        """Windows of 1 and 3 keys with right, left and whole-sequence padding, eager (0 / finfo.min added) and
        SDPA (boolean): causal flag, window and key bias, exact in float64. Right padding empties the rows whose
        window lies wholly in the padding: eager gives them the mean of v (with its gradients), SDPA zeros."""

        def fn(q, k, v, pad):
            mask = _window_mask(pad, window, sdpa=sdpa)
            if sdpa:
                return F.scaled_dot_product_attention(q, _repeat_kv(k, 2), _repeat_kv(v, 2), attn_mask=mask, scale=0.3)
            return _eager_attention(q, k, v, lambda s: s + mask)

        ex = _check(fn, *_padded_qkv(), _padding(padding))
        (record,) = _attention_records(ex)
        assert record.applied, record.reason
        assert record.params["mask"] == f"causal (flag) + sliding window of {window} keys + key padding"
        assert record.params["lowering"] == "memopt.flash_attention"
        assert record.params["empty_rows"] == ("zero" if sdpa else "mean of v, with eager's q and k gradients")
        assert square_tensors(ex, T) == []

    def test_hand_written_band(self):
        """nanoGPT-style code: a band of arange comparisons with masked_fill(-inf)."""

        def fn(q, k, v):
            i = torch.arange(T)
            band = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - 2)
            scores = (q @ k.transpose(-2, -1)) * 0.3
            return torch.softmax(scores.masked_fill(~band, float("-inf")), dim=-1) @ v

        (record,) = _attention_records(_check(fn, *_qkv()))
        assert (record.params["causal"], record.params["window"]) == (True, 2)

    def test_a_window_as_wide_as_the_sequence_is_plain_causal(self):
        """Mistral's 4096 keys at a shorter length hide nothing: causal alone, so SDPA keeps ``is_causal`` (and
        cuDNN can serve eager code) rather than taking a window argument."""

        def eager(q, k, v):
            return _eager_attention(q, k, v, lambda s: s + _window_mask(None, T))

        def sdpa(q, k, v):
            mask = _window_mask(None, T + 3, sdpa=True)
            return F.scaled_dot_product_attention(q, _repeat_kv(k, 2), _repeat_kv(v, 2), attn_mask=mask)

        (record,) = _attention_records(_check(eager, *_padded_qkv()))
        assert record.params["mask"] == "causal (flag)"
        assert "window" not in record.params
        ex = _check(sdpa, *_padded_qkv())
        assert "is_causal = True" in after_code(ex)

    def test_symbolic_lengths_keep_the_window_without_a_guard(self):
        """Under dynamic shapes whether the window is narrower than the sequence is unknown: the window stays an
        argument (exact either way), and no guard on the length is added (a second length reuses the graph)."""

        def fn(q, k, v):
            return _eager_attention(q, k, v, lambda s: s + _window_mask_of_length(q.shape[2], 3))

        fxpass.clear_reports()
        options = {"strict": True, "force": True, "inner_compiler": "aot_eager"}
        compiled = torch.compile(fn, backend=fxpass.MemoptBackend(options=options))
        for length in (6, 9):
            gen = torch.Generator().manual_seed(length)
            q = torch.randn(3, 4, length, D, dtype=torch.float64, generator=gen)
            k, v = (torch.randn(3, 2, length, D, dtype=torch.float64, generator=gen) for _ in range(2))
            for t in (q, k, v):
                torch._dynamo.mark_dynamic(t, 2)
            torch.testing.assert_close(compiled(q, k, v), fn(q, k, v))
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
        (record,) = [r for report in fxpass.reports() for r in report.records if r.rule == "attention"]
        assert (record.applied, record.params["window"]) == (True, 3)


def _window_mask_of_length(length, window):
    return masking_utils.eager_mask(
        batch_size=3, q_length=length, kv_length=length,
        mask_function=masking_utils.sliding_window_causal_mask_function(window), attention_mask=None,
        allow_is_causal_skip=False, dtype=torch.float64,
    )


class _Gemma2Like(nn.Module):
    """What Gemma 2's eager attention reads from its module: grouped heads, the head dim, training mode."""

    num_key_value_groups = 2
    head_dim = D


_GEMMA2_MODULE = _Gemma2Like().eval()


def _gemma2_attention(q, k, v, mask, softcap=2.0, scaling=0.3):
    """transformers' Gemma 2 eager attention itself: scores scaled, softcapped (tanh), masked, fp32 softmax."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    return eager_attention_forward(_GEMMA2_MODULE, q, k, v, mask, scaling=scaling, softcap=softcap)[0]


def _mask_then_cap():
    i = torch.arange(T)
    hidden = i[None, :] > i[:, None]

    def mask_then_cap(q, k, v):
        scores = (q @ k.transpose(-2, -1) * 0.3).masked_fill(hidden, float("-inf"))
        return torch.softmax(torch.tanh(scores / 2.0) * 2.0, dim=-1) @ v

    return mask_then_cap


def _cap_then_scale():
    def cap_then_scale(q, k, v):
        return torch.softmax(torch.tanh(q @ k.transpose(-2, -1) / 2.0) * 2.0 * 0.3, dim=-1) @ v

    return cap_then_scale


def _bias_then_scale():
    bias = torch.randn(1, H, T, T)

    def bias_then_scale(q, k, v):
        return torch.softmax((q @ k.transpose(-2, -1) + bias) * 0.3, dim=-1) @ v

    return bias_then_scale


class TestSoftcap:
    """Gemma 2's ``attn_logit_softcapping``: tanh(s/c)·c between the scaled scores and the mask, in the op.

    Gemma 2's code runs its softmax in float32 whatever the inputs, so its tests run in float32 throughout."""

    def test_gemma2_eager_attention_snapshot(self):
        def fn(q, k, v):
            return _gemma2_attention(q, k, v, _hf_mask_without_padding(torch.float32))

        ex = _check(fn, *_padded_qkv(dtype=torch.float32))
        (record,) = _attention_records(ex)
        assert (record.params["softcap"], record.params["mask"]) == (2.0, "causal (flag)")
        assert square_tensors(ex, T) == []
        assert_expected_inline(after_code(ex), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_k_: "f32[3, 2, 6, 8]cpu", L_v_: "f32[3, 2, 6, 8]cpu", L_q_: "f32[3, 4, 6, 8]cpu"):
        l_k_ = L_k_
        l_v_ = L_v_
        l_q_ = L_q_
        batch_arange: "i64[3]cpu" = torch.arange(3, device = 'cpu');  batch_arange = None
        head_arange: "i64[1]cpu" = torch.arange(1, device = 'cpu');  head_arange = None
        flash_attention_default = torch.ops.memopt.flash_attention.default(l_q_, l_k_, l_v_, None, 0.3, True, 0.0, softcap = 2.0);  l_q_ = l_k_ = l_v_ = None
        getitem_6: "f32[3, 4, 6, 8]cpu" = flash_attention_default[0];  flash_attention_default = None
        transpose_1: "f32[3, 6, 4, 8]cpu" = getitem_6.transpose(1, 2);  getitem_6 = None
        attn_output_1: "f32[3, 6, 4, 8]cpu" = transpose_1.contiguous();  transpose_1 = None
        return (attn_output_1,)""")

    def test_gemma2_sliding_layer(self):
        """Gemma 2's sliding layers: softcap and window together."""

        def fn(q, k, v):
            return _gemma2_attention(q, k, v, _window_mask(None, 2, dtype=torch.float32), softcap=1.5)

        (record,) = _attention_records(_check(fn, *_padded_qkv(dtype=torch.float32)))
        assert (record.params["softcap"], record.params["window"]) == (1.5, 2)

    def test_spellings_of_the_cap(self):
        """``c * tanh(s * (1/c))`` caps the same way; the fp32 upcast before softmax is allowed."""

        def fn(q, k, v):
            scores = q @ k.transpose(-2, -1) * 0.3
            scores = 4.0 * torch.tanh(scores * 0.25)
            i = torch.arange(T)
            scores = scores.masked_fill(i[None, :] > i[:, None], float("-inf"))
            return torch.softmax(scores.float(), dim=-1) @ v

        (record,) = _attention_records(_check(fn, *_qkv()))
        assert (record.params["softcap"], record.params["causal"]) == (4.0, True)

    @pytest.mark.parametrize(
        ("build", "expected"),
        [
            pytest.param(_mask_then_cap, Expect("""attention applied=False proof=None: a mask or bias (scores) is applied before the softcap (truediv), which transforms it too"""), id="mask_then_cap"),
            pytest.param(_cap_then_scale, Expect("""attention applied=False proof=None: the scores are scaled after their softcap (mul), not before"""), id="cap_then_scale"),
            pytest.param(_bias_then_scale, Expect("""attention applied=False proof=None: a mask or bias (add) is applied before the scale (mul), which transforms it too"""), id="bias_then_scale"),
        ],
    )
    def test_orders_the_op_cannot_compute_are_declined(self, build, expected):
        """A mask applied before the cap (tanh(-inf) is -1: a capped mask hides nothing), a scale applied after
        it, and a bias added before the scale: each is declined with the reason, never computed otherwise."""
        fn = build()
        ex = rewritten(fn, *_qkv())
        torch.testing.assert_close(ex.result, fn(*_qkv()))
        expected.assert_expected(record_lines(ex))

    @pytest.mark.parametrize("window", [None, 2], ids=["no_window", "window_2"])
    def test_left_padding_with_a_softcap(self, window):
        """Rows without keys (left padding, a sequence of padding), where eager's added finfo.min gives uniform
        probabilities and passes softmax's gradient through each score's cap to q and k: the rewrite gives them
        ``memopt.flash_attention_uniform_rows`` (the mean of v, with exactly that gradient), with and without a
        window."""

        def fn(q, k, v, pad):
            mask = _hf_mask(pad, dtype=torch.float32) if window is None else _window_mask(
                pad, window, dtype=torch.float32)
            return _gemma2_attention(q, k, v, mask, softcap=1.5)

        ex = _check(fn, *_padded_qkv(dtype=torch.float32), _padding("empty"))
        (record,) = _attention_records(ex)
        assert record.params["empty_rows"] == "mean of v, with eager's q and k gradients"
        assert "flash_attention_uniform_rows" in after_code(ex)
        assert square_tensors(ex, T) == []


def _hf_mask_without_padding(dtype=torch.float64):
    return masking_utils.eager_mask(
        batch_size=3, q_length=T, kv_length=T, mask_function=masking_utils.causal_mask_function,
        attention_mask=None, allow_is_causal_skip=False, dtype=dtype,
    )


def _hf(name: str):
    common = dict(vocab_size=384, attn_implementation="eager")
    if name == "gpt2":
        config = transformers.GPT2Config(
            n_positions=64, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **common
        )
        model = transformers.GPT2LMHeadModel(config)
        model.loss_type = "ForCausalLM"
    elif name == "llama":
        config = transformers.LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=64, **common,
        )
        model = transformers.LlamaForCausalLM(config)
        model.loss_type = "ForCausalLM"
    elif name in ("mistral", "qwen2"):
        decoder = dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=64, **common,
        )
        if name == "mistral":  # a window shorter than the sequence: the mask is banded, not causal
            model = transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=4, **decoder))
        else:
            model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**decoder))
        model.loss_type = "ForCausalLM"
    else:
        config = transformers.BertConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **common,
        )
        model = transformers.BertForMaskedLM(config)
        model.loss_type = "ForMaskedLM"
    return model


@pytest.mark.slow
@pytest.mark.isa_sensitive
@pytest.mark.parametrize(
    ("name", "padding", "mask_kind"),
    [("gpt2", False, "causal (flag)"), ("llama", False, "causal (flag)"), ("llama", True, "causal (flag) + key padding"),
     ("bert", True, "key padding"), ("qwen2", False, "causal (flag)"),
     ("mistral", False, "causal (flag) + sliding window of 4 keys")],
)
def test_hf_eager_attention_rewritten_in_every_layer(name, padding, mask_kind):
    """HF models with eager attention: every layer's attention is rewritten; loss and gradients equal eager."""
    torch.manual_seed(0)
    model = _hf(name)
    ids = torch.randint(3, 384, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, -3:] = 0

    def step(ids, mask):
        return model(input_ids=ids, attention_mask=mask if padding else None, labels=ids).loss

    _, params = zip(*model.named_parameters(), strict=True)
    expected = step(ids, mask)
    expected_grads = grads(expected, params)
    ex = rewritten(step, ids, mask)
    records = _attention_records(ex)
    assert len(records) == 2 and all(r.applied for r in records), [r.reason for r in records]
    assert {r.params["mask"] for r in records} == {mask_kind}
    torch.testing.assert_close(ex.result, expected)
    assert_close_all(grads(ex.result, params), expected_grads, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.isa_sensitive
def test_hf_t5_learned_position_bias_and_causal_decoder():
    """HF T5 with eager attention: encoder, decoder self- and cross-attention all rewritten (the decoder's
    causal mask as a flag beside the learned position bias); loss and every gradient, the relative
    position embeddings' included, equal eager's."""
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=384, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.0,
        attn_implementation="eager", decoder_start_token_id=0, pad_token_id=0, use_cache=False,
    )
    model = transformers.T5ForConditionalGeneration(config)
    ids, labels = torch.randint(1, 384, (2, 12)), torch.randint(1, 384, (2, 7))

    def step(ids, labels):
        return model(input_ids=ids, labels=labels).loss

    names, params = zip(*model.named_parameters(), strict=True)
    expected = step(ids, labels)
    expected_grads = grads(expected, params)
    ex = rewritten(step, ids, labels)
    records = _attention_records(ex)
    assert len(records) == 6 and all(r.applied for r in records), [r.reason for r in records]
    assert sorted(r.params["mask"] for r in records) == ["additive bias"] * 4 + ["causal (flag)"] * 2
    torch.testing.assert_close(ex.result, expected)
    actual_grads = grads(ex.result, params)
    assert any("relative_attention_bias" in n and g is not None and g.abs().sum() > 0
               for n, g in zip(names, actual_grads, strict=True))
    assert_close_all(actual_grads, expected_grads, rtol=1e-4, atol=1e-5)


def _candidate(fn, *inputs):
    """The one attention match Dynamo's graph of ``fn`` holds."""
    from torch._dynamo.testing import EagerAndRecordGraphs

    from fxpass.graph import GraphFacts
    from fxpass.rules import attention

    torch._dynamo.reset()
    recorder = EagerAndRecordGraphs()
    torch.compile(fn, backend=recorder, fullgraph=True)(*inputs)
    (gm,) = recorder.graphs
    (found,) = attention.match(GraphFacts(gm))
    return found


class TestKernelChoice:
    """Which kernel computes a rewritten attention: cuDNN where it serves the case on CUDA, memopt's elsewhere.
    The case checks are device-independent, so they are pinned here; the CUDA path runs in test_cuda_attention."""

    def causal(self, q, k, v, bias=None):
        t = q.shape[-2]
        scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
        if bias is not None:
            scores = scores + bias
        scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
        return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v

    def test_cudnn_serves_bf16_causal(self):
        from fxpass.rules.attention import cudnn_case_blocker

        candidate = _candidate(self.causal, *_qkv(dim=64, dtype=torch.bfloat16))
        assert candidate.blocker is None and candidate.causal
        assert cudnn_case_blocker(candidate) is None

    @pytest.mark.parametrize(
        ("dim", "dtype", "reason"),
        [
            (64, torch.float32, "it takes float16 and bfloat16, not float32"),
            (12, torch.float16, "head dim 12 is not a multiple of 8 up to 128 (256 on sm90 with cuDNN 9.10 or newer)"),
            (256, torch.bfloat16, "head dim 256 is not a multiple of 8 up to 128 (256 on sm90 with cuDNN 9.10 or newer)"),
        ],
    )
    def test_cases_cudnn_does_not_serve(self, dim, dtype, reason):
        from fxpass.rules.attention import cudnn_case_blocker

        assert cudnn_case_blocker(_candidate(self.causal, *_qkv(dim=dim, dtype=dtype))) == reason

    def test_head_dim_256_is_cudnns_on_hopper_only(self):
        """Gemma's head dim 256: cuDNN takes it on sm90 from cuDNN 9.10 on (PyTorch's SDPA dispatch applies the
        same limit); on an A100, or with an older cuDNN, memopt's kernel computes it. Past 256, nowhere."""
        from fxpass.rules.attention import cudnn_case_blocker, head_dim_limit

        assert head_dim_limit((9, 0), 91900) == 256
        assert head_dim_limit((9, 0), 90800) == 128
        assert head_dim_limit((8, 0), 91900) == 128
        assert head_dim_limit((10, 0), 91900) == 128
        assert head_dim_limit((9, 0), None) == 128
        wide = _candidate(self.causal, *_qkv(dim=256, dtype=torch.bfloat16))
        assert cudnn_case_blocker(wide, head_dim_limit((9, 0), 91900)) is None
        wider = _candidate(self.causal, *_qkv(dim=264, dtype=torch.bfloat16))
        assert cudnn_case_blocker(wider, 256) == "head dim 264 is not a multiple of 8 up to 256"

    def test_assumed_cuda_names_the_platform_a_head_dim_256_needs(self):
        """On a laptop the record cannot know the GPU: for head dim 256 it says which one would run cuDNN."""
        inputs = _qkv(dim=256, dtype=torch.bfloat16)
        ex = fxpass.explain(self.causal, *inputs, options={"force": True}, assume_device="cuda")
        (record,) = _attention_records(ex)
        assert record.params["kernel_reason"] == (
            "on CUDA: cuDNN's attention on sm90 with cuDNN 9.10 or newer, memopt's kernel elsewhere"
        )

    def test_a_learned_bias_stays_with_memopt(self):
        from fxpass.rules.attention import cudnn_case_blocker

        bias = torch.randn(1, H, T, T, dtype=torch.bfloat16, requires_grad=True)
        candidate = _candidate(self.causal, *_qkv(dim=64, dtype=torch.bfloat16), bias)
        assert "a bias other than key padding" in cudnn_case_blocker(candidate)

    def test_softcap_and_window_stay_with_memopt(self):
        """No library kernel caps scores, and cuDNN takes no window: both stay on memopt's kernel, which the
        record says for a GPU (assume_device="cuda")."""
        from fxpass.rules.attention import SOFTCAP_KERNEL_WHY, WINDOW_KERNEL_WHY, cudnn_case_blocker

        def capped(q, k, v):
            scores = torch.tanh(q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5 / 30.0) * 30.0
            scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
            return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v

        def windowed(q, k, v):
            i = torch.arange(T)
            band = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - 2)
            scores = (q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5).masked_fill(~band, float("-inf"))
            return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v

        inputs = _qkv(dim=64, dtype=torch.bfloat16)
        assert cudnn_case_blocker(_candidate(capped, *inputs)) == SOFTCAP_KERNEL_WHY
        assert cudnn_case_blocker(_candidate(windowed, *inputs)) == WINDOW_KERNEL_WHY
        ex = fxpass.explain(windowed, *inputs, options={"force": True}, assume_device="cuda")
        (record,) = _attention_records(ex)
        assert record.params["kernel_reason"] == f"on CUDA: memopt's kernel ({WINDOW_KERNEL_WHY})"

    def test_off_cuda_the_memopt_kernel_with_nothing_recorded(self):
        from fxpass.config import Config
        from fxpass.rules.attention import choose_kernel

        candidate = _candidate(self.causal, *_qkv(dim=64, dtype=torch.bfloat16))
        assert choose_kernel(candidate, Config()) == ("memopt", "")
        assert choose_kernel(candidate, Config(attention_kernel="memopt")) == ("memopt", "")
        explanation = rewritten(self.causal, *_qkv(dim=64, dtype=torch.bfloat16))
        (record,) = _attention_records(explanation)
        assert record.applied and record.params["lowering"] == "memopt.flash_attention"
        assert "kernel_reason" not in record.params

    def test_assumed_cuda_says_which_kernel_would_compute_it(self):
        """``assume_device="cuda"`` on a CPU-only machine: the record says what a GPU would run; the graph still
        runs memopt's op here."""
        inputs = _qkv(dim=64, dtype=torch.bfloat16)
        ex = fxpass.explain(self.causal, *inputs, options={"force": True}, assume_device="cuda")
        (record,) = _attention_records(ex)
        assert record.params["kernel_reason"] == "on CUDA: cuDNN's attention"
        assert record.params["lowering"] == "memopt.flash_attention"
        ex = fxpass.explain(self.causal, *inputs, options={"force": True, "attention_kernel": "memopt"},
                            assume_device="cuda")
        assert "kernel_reason" not in _attention_records(ex)[0].params

    def test_platform_checks_come_before_the_device(self):
        """Deterministic algorithms and a disabled cuDNN SDPA keep memopt's kernel, whatever the GPU."""
        from fxpass.rules.attention import _cudnn_platform_blocker

        cuda = torch.device("cuda")
        with _deterministic():
            assert "deterministic" in _cudnn_platform_blocker(cuda)
        enabled = torch.backends.cuda.cudnn_sdp_enabled()
        torch.backends.cuda.enable_cudnn_sdp(False)
        try:
            assert "disabled" in _cudnn_platform_blocker(cuda)
        finally:
            torch.backends.cuda.enable_cudnn_sdp(enabled)



@contextlib.contextmanager
def _deterministic():
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)
