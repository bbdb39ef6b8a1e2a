"""The CCE rule on each pattern form: rewritten-graph snapshots, numerics against eager, decline reasons."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from expecttest import Expect, assert_expected_inline

import fxpass
from tests.helpers import after_code, assert_close_all, grads, record_lines, rewritten

V, D = 40, 8
SCALE, DIVISOR, CAP = 0.3, 3.0, 0.5  # not powers of two: a multiplication by 1/3 would not give a division's bits


def _params(bias: bool = False):
    weight = nn.Parameter(torch.randn(V, D) / D**0.5)
    return weight, (nn.Parameter(torch.randn(V)) if bias else None)


def _tokens(*shape: int):
    """Hidden states [*shape, D] that want a gradient, and class targets [*shape]."""
    return torch.randn(*shape, D, requires_grad=True), torch.randint(0, V, shape)


def _rows(*shape: int):
    """Hidden states [*shape, D] and class targets [*shape], for a rule's decision alone."""
    return torch.randn(*shape, D), torch.randint(0, V, shape)


def _check_numerics(fn, params, *args, **options):
    """The rewritten function gives eager's loss and gradients (float32 on CPU)."""
    expected = fn(*args)
    expected_grads = grads(expected, params)
    explanation = rewritten(fn, *args, **options)
    actual = explanation.result
    torch.testing.assert_close(actual, expected)
    assert_close_all(grads(actual, params), expected_grads)
    return explanation


class TestForms:
    def test_linear_float_view(self):
        weight, _ = _params()
        hidden, targets = _tokens(2, 5)

        def loss(h, t):
            logits = F.linear(h, weight)
            return F.cross_entropy(logits.float().view(-1, V), t.view(-1))

        ex = _check_numerics(loss, [hidden, weight], hidden, targets)
        assert_expected_inline(after_code(ex), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_h_: "f32[2, 5, 8]cpu", L_weight_: "f32[40, 8]cpu", L_t_: "i64[2, 5]cpu"):
        l_h_ = L_h_
        l_weight_ = L_weight_
        l_t_ = L_t_
        view_1: "i64[10]cpu" = l_t_.view(-1);  l_t_ = None
        reshape: "f32[10, 8]cpu" = l_h_.reshape(-1, 8);  l_h_ = None
        cce_default = torch.ops.memopt.cce.default(reshape, l_weight_, None, view_1, -100, 'mean', 0.0, None);  reshape = l_weight_ = view_1 = None
        getitem: "f32[]cpu" = cce_default[0];  cce_default = None
        return (getitem,)""")

    def test_hf_causal_lm_shifted_labels_and_num_items(self):
        """transformers' ForCausalLMLoss: pad + shift labels, float(), view(-1, V), sum / num_items."""
        weight, _ = _params()
        hidden = torch.randn(2, 6, D, requires_grad=True)
        labels = torch.randint(0, V, (2, 6))
        labels[0, :2] = -100

        def loss(h, labels, num_items):
            logits = F.linear(h[:, slice(0, None), :], weight).float()
            labels = F.pad(labels, (0, 1), value=-100)
            shift = labels[..., 1:].contiguous()
            out = F.cross_entropy(logits.view(-1, V), shift.view(-1), ignore_index=-100, reduction="sum")
            return out / num_items

        ex = _check_numerics(loss, [hidden, weight], hidden, labels, torch.tensor(7))
        assert_expected_inline(after_code(ex), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_h_: "f32[2, 6, 8]cpu", L_weight_: "f32[40, 8]cpu", L_labels_: "i64[2, 6]cpu", L_num_items_: "i64[]cpu"):
        l_h_ = L_h_
        l_weight_ = L_weight_
        l_labels_ = L_labels_
        l_num_items_ = L_num_items_
        getitem: "f32[2, 6, 8]cpu" = l_h_[(slice(None, None, None), slice(0, None, None), slice(None, None, None))];  l_h_ = None
        labels: "i64[2, 7]cpu" = torch._C._nn.pad(l_labels_, (0, 1), 'constant', -100);  l_labels_ = None
        getitem_1: "i64[2, 6]cpu" = labels[(Ellipsis, slice(1, None, None))];  labels = None
        shift: "i64[2, 6]cpu" = getitem_1.contiguous();  getitem_1 = None
        view_1: "i64[12]cpu" = shift.view(-1);  shift = None
        reshape: "f32[12, 8]cpu" = getitem.reshape(-1, 8);  getitem = None
        cce_default = torch.ops.memopt.cce.default(reshape, l_weight_, None, view_1, -100, 'sum', 0.0, None);  reshape = l_weight_ = view_1 = None
        getitem_2: "f32[]cpu" = cce_default[0];  cce_default = None
        truediv: "f32[]cpu" = getitem_2 / l_num_items_;  getitem_2 = l_num_items_ = None
        return (truediv,)""")

    def test_shift_slice_on_logits_moves_to_hidden(self):
        weight, bias = _params(bias=True)
        hidden, tokens = _tokens(2, 6)

        def loss(h, t):
            logits = F.linear(h, weight, bias)
            shifted = logits[..., :-1, :].contiguous()
            return F.cross_entropy(shifted.view(-1, shifted.size(-1)), t[..., 1:].reshape(-1))

        ex = _check_numerics(loss, [hidden, weight, bias], hidden, tokens)
        assert_expected_inline(after_code(ex), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_h_: "f32[2, 6, 8]cpu", L_weight_: "f32[40, 8]cpu", L_bias_: "f32[40]cpu", L_t_: "i64[2, 6]cpu"):
        l_h_ = L_h_
        l_weight_ = L_weight_
        l_bias_ = L_bias_
        l_t_ = L_t_
        getitem_1: "i64[2, 5]cpu" = l_t_[(Ellipsis, slice(1, None, None))];  l_t_ = None
        reshape: "i64[10]cpu" = getitem_1.reshape(-1);  getitem_1 = None
        getitem_2: "f32[2, 5, 8]cpu" = l_h_[(Ellipsis, slice(None, -1, None), slice(None, None, None))];  l_h_ = None
        reshape_1: "f32[10, 8]cpu" = getitem_2.reshape(-1, 8);  getitem_2 = None
        cce_default = torch.ops.memopt.cce.default(reshape_1, l_weight_, l_bias_, reshape, -100, 'mean', 0.0, None);  reshape_1 = l_weight_ = l_bias_ = reshape = None
        getitem_3: "f32[]cpu" = cce_default[0];  cce_default = None
        return (getitem_3,)""")

    def test_log_softmax_nll_loss(self):
        weight, _ = _params()
        hidden, targets = _tokens(3, 4)

        def loss(h, t):
            logp = torch.log_softmax(h @ weight.t(), dim=-1, dtype=torch.float32)
            return F.nll_loss(logp.flatten(0, 1), t.flatten(), reduction="sum")

        ex = _check_numerics(loss, [hidden, weight], hidden, targets)
        assert_expected_inline(after_code(ex), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_weight_: "f32[40, 8]cpu", L_h_: "f32[3, 4, 8]cpu", L_t_: "i64[3, 4]cpu"):
        l_weight_ = L_weight_
        l_h_ = L_h_
        l_t_ = L_t_
        flatten_1: "i64[12]cpu" = l_t_.flatten();  l_t_ = None
        flatten_2: "f32[12, 8]cpu" = l_h_.flatten(0, 1);  l_h_ = None
        cce_default = torch.ops.memopt.cce.default(flatten_2, l_weight_, None, flatten_1, -100, 'sum', 0.0, None);  flatten_2 = l_weight_ = flatten_1 = None
        getitem: "f32[]cpu" = cce_default[0];  cce_default = None
        return (getitem,)""")

    def test_matmul_with_untransposed_weight_and_module_loss(self):
        """``h @ W`` with W stored [D, V]; ``nn.CrossEntropyLoss`` with label smoothing."""
        weight_dv = nn.Parameter(torch.randn(D, V) / D**0.5)
        criterion = nn.CrossEntropyLoss(ignore_index=-1, label_smoothing=0.1)
        hidden, targets = _tokens(2, 5)
        targets[1, 3] = -1

        def loss(h, t):
            return criterion(torch.matmul(h, weight_dv).view(-1, V), t.view(-1))

        ex = _check_numerics(loss, [hidden, weight_dv], hidden, targets)
        assert_expected_inline(after_code(ex), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_h_: "f32[2, 5, 8]cpu", L_weight_dv_: "f32[8, 40]cpu", L_t_: "i64[2, 5]cpu"):
        l_h_ = L_h_
        l_weight_dv_ = L_weight_dv_
        l_t_ = L_t_
        view_1: "i64[10]cpu" = l_t_.view(-1);  l_t_ = None
        reshape: "f32[10, 8]cpu" = l_h_.reshape(-1, 8);  l_h_ = None
        t: "f32[40, 8]cpu" = l_weight_dv_.t();  l_weight_dv_ = None
        cce_default = torch.ops.memopt.cce.default(reshape, t, None, view_1, -1, 'mean', 0.1, None);  reshape = t = view_1 = None
        getitem: "f32[]cpu" = cce_default[0];  cce_default = None
        return (getitem,)""")

    def test_untransposed_weight_through_inductor(self):
        """A [D, V] weight reaches the op as a transposed view; the gradients match what Inductor compiled for."""
        weight_dv = nn.Parameter(torch.randn(D, V) / D**0.5)
        hidden, targets = _tokens(2, 5)

        def loss(h, t):
            return F.cross_entropy(torch.matmul(h, weight_dv).view(-1, V), t.view(-1))

        compiled = torch.compile(loss, backend=fxpass.MemoptBackend(options={"force": True, "strict": True}))
        actual = compiled(hidden, targets)
        expected = loss(hidden, targets)
        torch.testing.assert_close(actual, expected)
        assert_close_all(grads(actual, [hidden, weight_dv]), grads(expected, [hidden, weight_dv]))

    def test_gpt2_conv1d_addmm(self):
        """GPT-2's Conv1D head: ``addmm(bias, h.view(-1, D), W[D, V])``."""
        weight_dv = nn.Parameter(torch.randn(D, V) / D**0.5)
        bias = nn.Parameter(torch.randn(V))
        hidden, targets = _tokens(10)

        def loss(h, t):
            return F.cross_entropy(torch.addmm(bias, h.view(-1, D), weight_dv), t, reduction="none")

        ex = _check_numerics(lambda h, t: loss(h, t).sum(), [hidden, weight_dv, bias], hidden, targets)
        assert_expected_inline(after_code(ex), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_h_: "f32[10, 8]cpu", L_loss_closure_0_cell_contents: "f32[40]cpu", L_loss_closure_1_cell_contents: "f32[8, 40]cpu", L_t_: "i64[10]cpu"):
        l_h_ = L_h_
        l_loss_closure_0_cell_contents = L_loss_closure_0_cell_contents
        l_loss_closure_1_cell_contents = L_loss_closure_1_cell_contents
        l_t_ = L_t_
        view: "f32[10, 8]cpu" = l_h_.view(-1, 8);  l_h_ = None
        t: "f32[40, 8]cpu" = l_loss_closure_1_cell_contents.t();  l_loss_closure_1_cell_contents = None
        cce_default = torch.ops.memopt.cce.default(view, t, l_loss_closure_0_cell_contents, l_t_, -100, 'none', 0.0, None);  view = t = l_loss_closure_0_cell_contents = l_t_ = None
        getitem: "f32[10]cpu" = cce_default[0];  cce_default = None
        sum_1: "f32[]cpu" = getitem.sum();  getitem = None
        return (sum_1,)""")

    def test_softcap(self):
        """Gemma-style final-logit softcapping: ``tanh(logits / c) * c`` before the loss."""
        weight, _ = _params()
        hidden, targets = _tokens(2, 5)

        def loss(h, t):
            logits = F.linear(h, weight)
            logits = torch.tanh(logits / 3.0) * 3.0
            return F.cross_entropy(logits.float().view(-1, V), t.view(-1))

        ex = _check_numerics(loss, [hidden, weight], hidden, targets)
        assert_expected_inline(after_code(ex), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_h_: "f32[2, 5, 8]cpu", L_weight_: "f32[40, 8]cpu", L_t_: "i64[2, 5]cpu"):
        l_h_ = L_h_
        l_weight_ = L_weight_
        l_t_ = L_t_
        view_1: "i64[10]cpu" = l_t_.view(-1);  l_t_ = None
        reshape: "f32[10, 8]cpu" = l_h_.reshape(-1, 8);  l_h_ = None
        cce_default = torch.ops.memopt.cce.default(reshape, l_weight_, None, view_1, -100, 'mean', 0.0, 3.0);  reshape = l_weight_ = view_1 = None
        getitem: "f32[]cpu" = cce_default[0];  cce_default = None
        return (getitem,)""")
        assert ex.applied[0].params["softcap"] == 3.0

    def test_z_loss_uses_the_ops_log_sum_exp(self):
        """A z-loss ``logsumexp(logits, -1)²`` reads the op's per-row log-sum-exp; no logits remain."""
        weight, _ = _params()
        hidden, targets = _tokens(2, 5)

        def loss(h, t):
            logits = F.linear(h, weight)
            ce = F.cross_entropy(logits.float().view(-1, V), t.view(-1))
            return ce + 1e-2 * torch.logsumexp(logits.float(), dim=-1).pow(2).mean()

        ex = _check_numerics(loss, [hidden, weight], hidden, targets)
        assert_expected_inline(after_code(ex), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_h_: "f32[2, 5, 8]cpu", L_weight_: "f32[40, 8]cpu", L_t_: "i64[2, 5]cpu"):
        l_h_ = L_h_
        l_weight_ = L_weight_
        l_t_ = L_t_
        view_1: "i64[10]cpu" = l_t_.view(-1);  l_t_ = None
        reshape: "f32[10, 8]cpu" = l_h_.reshape(-1, 8)
        cce_default = torch.ops.memopt.cce.default(reshape, l_weight_, None, view_1, -100, 'mean', 0.0, None);  reshape = l_weight_ = view_1 = None
        getitem: "f32[]cpu" = cce_default[0]
        getitem_1: "f32[10]cpu" = cce_default[1];  cce_default = None
        size = l_h_.size();  l_h_ = None
        getitem_2 = size[slice(None, -1, None)];  size = None
        reshape_1: "f32[2, 5]cpu" = getitem_1.reshape(getitem_2);  getitem_1 = getitem_2 = None
        pow_1: "f32[2, 5]cpu" = reshape_1.pow(2);  reshape_1 = None
        mean: "f32[]cpu" = pow_1.mean();  pow_1 = None
        mul: "f32[]cpu" = 0.01 * mean;  mean = None
        add: "f32[]cpu" = getitem + mul;  getitem = mul = None
        return (add,)""")
        assert ex.applied[0].params["z_loss_terms"] == 1

    def test_low_precision_logits_keep_loss_dtype(self):
        """bf16 logits without ``.float()``: the loss stays bf16 as in eager, computed in fp32 inside."""
        weight = nn.Parameter(torch.randn(V, D, dtype=torch.bfloat16))
        hidden = torch.randn(4, D, dtype=torch.bfloat16, requires_grad=True)
        targets = torch.randint(0, V, (4,))

        def loss(h, t):
            return F.cross_entropy(F.linear(h, weight), t)

        ex = rewritten(loss, hidden, targets)
        assert ex.result.dtype == torch.bfloat16
        assert_expected_inline(after_code(ex), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_h_: "bf16[4, 8]cpu", L_weight_: "bf16[40, 8]cpu", L_t_: "i64[4]cpu"):
        l_h_ = L_h_
        l_weight_ = L_weight_
        l_t_ = L_t_
        cce_default = torch.ops.memopt.cce.default(l_h_, l_weight_, None, l_t_, -100, 'mean', 0.0, None);  l_h_ = l_weight_ = l_t_ = None
        getitem: "f32[]cpu" = cce_default[0];  cce_default = None
        to: "bf16[]cpu" = getitem.to(torch.bfloat16);  getitem = None
        return (to,)""")


    def test_autocast_casts_operands_like_autocast(self):
        """Under autocast the classifier ran in bf16 from fp32 operands: the op gets them cast the same way."""
        weight, _ = _params()
        hidden, targets = _tokens(2, 5)

        def loss(h, t):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = F.linear(h, weight)
            return F.cross_entropy(logits.float().view(-1, V), t.view(-1))

        expected = loss(hidden, targets)
        ex = rewritten(loss, hidden, targets)
        torch.testing.assert_close(ex.result, expected, rtol=2e-2, atol=2e-2)
        assert ex.applied[0].params["dtype"] == "bfloat16"
        assert_expected_inline(after_code(ex), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_h_: "f32[2, 5, 8]cpu", L_weight_: "f32[40, 8]cpu", L_t_: "i64[2, 5]cpu"):
        l_h_ = L_h_
        l_weight_ = L_weight_
        l_t_ = L_t_
        _enter_autocast = torch.amp.autocast_mode._enter_autocast('cpu', torch.bfloat16, True, None)
        _exit_autocast = torch.amp.autocast_mode._exit_autocast(_enter_autocast);  _enter_autocast = _exit_autocast = None
        view_1: "i64[10]cpu" = l_t_.view(-1);  l_t_ = None
        reshape: "f32[10, 8]cpu" = l_h_.reshape(-1, 8);  l_h_ = None
        to: "bf16[10, 8]cpu" = reshape.to(torch.bfloat16);  reshape = None
        to_1: "bf16[40, 8]cpu" = l_weight_.to(torch.bfloat16);  l_weight_ = None
        cce_default = torch.ops.memopt.cce.default(to, to_1, None, view_1, -100, 'mean', 0.0, None);  to = to_1 = view_1 = None
        getitem: "f32[]cpu" = cce_default[0];  cce_default = None
        return (getitem,)""")


def _check_returned(fn, params, *args, second_loss=None, **options):
    """``fn`` returns (logits, loss): the rewritten function returns eager's logits and loss, and the gradients of
    the loss alone (logits unused: autograd hands them zeros) and of the loss plus ``second_loss(logits)``."""
    explanation = rewritten(fn, *args, **options)
    logits, loss = explanation.result
    expected_logits, expected_loss = fn(*args)
    torch.testing.assert_close(logits, expected_logits)
    torch.testing.assert_close(loss, expected_loss)
    assert_close_all(grads(loss, params), grads(expected_loss, params))
    if second_loss is not None:
        logits, loss = rewritten(fn, *args, **options).result  # fresh graphs for a second backward
        expected_logits, expected_loss = fn(*args)
        expected = expected_loss + second_loss(expected_logits)
        assert_close_all(grads(loss + second_loss(logits), params), grads(expected, params))
    return explanation


def _z_loss(logits):
    return 1e-2 * torch.logsumexp(logits.float(), dim=-1).square().mean()


class TestReturnedLogits:
    """A graph that returns its logits beside the loss (a whole model compiled) gets ``cce_with_logits``; where
    the graph only returns them and the backend wraps it, with the logits detached and their operands returned
    for the wrapper, which re-attaches their gradient (the z-loss second loss checks it)."""

    def test_returned_logits_and_their_gradient(self):
        weight, _ = _params()
        hidden = torch.randn(2, 3, D, requires_grad=True)

        def fn(h, t):
            logits = F.linear(h, weight)
            return logits, F.cross_entropy(logits.view(-1, V), t.view(-1))

        ex = _check_returned(fn, [hidden, weight], hidden, torch.randint(0, V, (2, 3)), second_loss=_z_loss)
        assert ex.records[0].params["returns_logits"] is True
        assert_expected_inline(after_code(ex), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_h_: "f32[2, 3, 8]cpu", L_weight_: "f32[40, 8]cpu", L_t_: "i64[2, 3]cpu"):
        l_h_ = L_h_
        l_weight_ = L_weight_
        l_t_ = L_t_
        view_1: "i64[6]cpu" = l_t_.view(-1);  l_t_ = None
        reshape: "f32[6, 8]cpu" = l_h_.reshape(-1, 8);  l_h_ = None
        cce_with_logits_default = torch.ops.memopt.cce_with_logits.default(reshape, l_weight_, None, view_1, -100, 'mean', 0.0, None, True);  l_weight_ = view_1 = None
        getitem: "f32[]cpu" = cce_with_logits_default[0]
        getitem_1: "f32[6, 40]cpu" = cce_with_logits_default[2];  cce_with_logits_default = None
        view_2: "f32[2, 3, 40]cpu" = getitem_1.view(2, 3, -1);  getitem_1 = None
        return (view_2, getitem, reshape)""")

    def test_rowwise_returns_the_logits_and_hands_back_their_operands(self):
        """``cce_variant='rowwise'`` (the CUDA default for returned logits): the op returns the logits, not
        differentiable; the graph returns the hidden states it used as an extra output, and the wrapper casts
        the weight and bias inputs as autocast did, so the logits' own gradient (a z-loss here) is exact."""
        weight, bias = _params(bias=True)
        hidden = torch.randn(2, 3, D, requires_grad=True)

        def fn(h, t):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = F.linear(h, weight, bias)
            return logits, F.cross_entropy(logits.float().view(-1, V), t.view(-1))

        targets = torch.randint(0, V, (2, 3))
        ex = rewritten(fn, hidden, targets, cce_variant="rowwise")
        assert ex.records[0].params["variant"] == "rowwise"
        assert_expected_inline(after_code(ex), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_h_: "f32[2, 3, 8]cpu", L_weight_: "f32[40, 8]cpu", L_bias_: "f32[40]cpu", L_t_: "i64[2, 3]cpu"):
        l_h_ = L_h_
        l_weight_ = L_weight_
        l_bias_ = L_bias_
        l_t_ = L_t_
        _enter_autocast = torch.amp.autocast_mode._enter_autocast('cpu', torch.bfloat16, True, None)
        _exit_autocast = torch.amp.autocast_mode._exit_autocast(_enter_autocast);  _enter_autocast = _exit_autocast = None
        view_1: "i64[6]cpu" = l_t_.view(-1);  l_t_ = None
        reshape: "f32[6, 8]cpu" = l_h_.reshape(-1, 8);  l_h_ = None
        to: "bf16[6, 8]cpu" = reshape.to(torch.bfloat16);  reshape = None
        to_1: "bf16[40, 8]cpu" = l_weight_.to(torch.bfloat16);  l_weight_ = None
        to_2: "bf16[40]cpu" = l_bias_.to(torch.bfloat16);  l_bias_ = None
        cce_rowwise_default = torch.ops.memopt.cce_rowwise.default(to, to_1, to_2, view_1, -100, 'mean', 0.0, None, True, True, True, True, grad_dtype = torch.float32);  to_1 = to_2 = view_1 = None
        getitem: "f32[]cpu" = cce_rowwise_default[0]
        getitem_1: "bf16[6, 40]cpu" = cce_rowwise_default[4];  cce_rowwise_default = None
        view_2: "bf16[2, 3, 40]cpu" = getitem_1.view(2, 3, -1);  getitem_1 = None
        return (view_2, getitem, to)""")
        logits, loss = ex.result
        expected_logits, expected_loss = fn(hidden, targets)
        torch.testing.assert_close(logits, expected_logits)
        torch.testing.assert_close(loss, expected_loss, rtol=2e-2, atol=2e-2)
        params = [hidden, weight, bias]
        assert_close_all(grads(loss + _z_loss(logits), params), grads(expected_loss + _z_loss(expected_logits), params),
                         rtol=2e-2, atol=2e-2)
        _, loss = rewritten(fn, hidden, targets, cce_variant="rowwise").result  # logits dropped
        assert_close_all(grads(loss, params), grads(fn(hidden, targets)[1], params), rtol=2e-2, atol=2e-2)

    def test_rowwise_with_a_weight_computed_in_the_graph(self):
        """A classifier weight the graph computes (a merged low-rank update) is handed back as an extra output,
        and the logits returned twice get their gradient at both places."""
        weight, _ = _params()
        down = torch.randn(V, 2, requires_grad=True)
        up = torch.randn(2, D, requires_grad=True)
        hidden = torch.randn(6, D, requires_grad=True)

        def fn(h, t):
            logits = F.linear(h, weight + down @ up)
            return logits, F.cross_entropy(logits, t), logits

        targets = torch.randint(0, V, (6,))
        params = [hidden, weight, down, up]
        ex = rewritten(fn, hidden, targets, cce_variant="rowwise")
        assert ex.records[0].params["variant"] == "rowwise"
        assert len(ex.result) == 3  # the extra outputs stay inside the wrapper
        logits, loss, again = ex.result
        expected = fn(hidden, targets)
        torch.testing.assert_close(logits, expected[0])
        torch.testing.assert_close(loss, expected[1])
        assert_close_all(
            grads(loss + _z_loss(logits) + again.square().mean(), params),
            grads(expected[1] + _z_loss(expected[0]) + expected[2].square().mean(), params),
        )

    def test_rowwise_without_a_backward_keeps_cce_with_logits(self):
        """Under ``no_grad`` (HF Trainer's evaluation) nothing wants a gradient: the loss comes from
        ``cce_with_logits`` and the logits are eager's."""
        weight, _ = _params()
        hidden = torch.randn(6, D)

        def fn(h, t):
            logits = F.linear(h, weight)
            return logits, F.cross_entropy(logits, t)

        targets = torch.randint(0, V, (6,))
        with torch.no_grad():
            ex = rewritten(fn, hidden, targets, cce_variant="rowwise")
            expected_logits, expected_loss = fn(hidden, targets)
        assert ex.records[0].params["variant"] == "with_logits"
        assert "nothing wants a gradient" in ex.records[0].params["variant_reason"]
        torch.testing.assert_close(ex.result[0], expected_logits)
        torch.testing.assert_close(ex.result[1], expected_loss)

    def test_logits_used_elsewhere(self):
        """Another op of the graph reads the logits (an accuracy metric): it reads the op's logits."""
        weight, bias = _params(bias=True)
        hidden = torch.randn(6, D, requires_grad=True)

        def fn(h, t):
            logits = F.linear(h, weight, bias)
            accuracy = (logits.argmax(-1) == t).float().mean()
            return accuracy, F.cross_entropy(logits, t, label_smoothing=0.1)

        targets = torch.randint(0, V, (6,))
        explanation = rewritten(fn, hidden, targets)
        assert [r.applied for r in explanation.records] == [True]
        accuracy, loss = explanation.result
        expected_accuracy, expected_loss = fn(hidden, targets)
        torch.testing.assert_close(accuracy, expected_accuracy)
        torch.testing.assert_close(loss, expected_loss)
        assert_close_all(grads(loss, [hidden, weight, bias]), grads(expected_loss, [hidden, weight, bias]))

    @pytest.mark.parametrize(
        ("variant", "op"), [pytest.param("auto", "with_logits", id="auto"), pytest.param("rowwise", "rowwise", id="rowwise")]
    )
    def test_dynamic_shapes(self, variant, op):
        """Symbolic leading sizes of the returned logits are read off the hidden states, for both ops."""
        weight, _ = _params()

        def fn(h, t):
            logits = h @ weight.t()
            return logits, F.cross_entropy(logits.float().flatten(0, 1), t.flatten())

        for batch, seq in [(2, 3), (3, 5)]:
            hidden, targets = _tokens(batch, seq)
            ex = _check_returned(fn, [hidden, weight], hidden, targets, dynamic=True, cce_variant=variant)
            assert ex.applied
            assert ex.records[0].params["variant"] == op
        assert "size()" in after_code(ex)


def _class_weights():
    weight, _ = _params()
    class_weight = torch.rand(V)
    return (lambda h, t: F.cross_entropy(F.linear(h, weight), t, weight=class_weight)), _rows(6)


def _soft_labels():
    weight, _ = _params()
    return (lambda h, p: F.cross_entropy(F.linear(h, weight), p)), (torch.randn(6, D), torch.rand(6, V).softmax(-1))


def _logits_as_graph_input():
    """A graph break between head and loss: the loss graph sees the logits as an input."""
    return (lambda logits, t: F.cross_entropy(logits.float(), t)), (torch.randn(6, V), torch.randint(0, V, (6,)))


def _not_a_linear_classifier():
    return (lambda x, t: F.cross_entropy(torch.relu(x * 2), t)), (torch.randn(6, V), torch.randint(0, V, (6,)))


def _small_head():
    """A 10-class head: it saves less than min_saved_bytes (declined, proved for every shape) unless forced."""
    head = nn.Linear(D, 10)
    return (lambda h, t: F.cross_entropy(head(h), t)), (torch.randn(64, D), torch.randint(0, 10, (64,)))


def _log_sum_exp_of_other_rows():
    """A logsumexp over logits the loss only sees shifted (``[:, :-1]``) cannot use the op's rows."""
    weight, _ = _params()

    def loss(h, t):
        logits = F.linear(h, weight)
        ce = F.cross_entropy(logits[:, :-1].reshape(-1, V), t[:, 1:].reshape(-1))
        return ce + torch.logsumexp(logits, dim=-1).mean()

    return loss, _rows(2, 5)


def _a_copy_of_the_logits_returned():
    """Logits cast to another dtype on the way to the loss and returned so: the cast is a second N×V tensor."""
    weight, _ = _params()

    def fn(h, t):
        logits = F.linear(h, weight).double()
        return logits, F.cross_entropy(logits.view(-1, V), t.view(-1))

    return fn, _rows(2, 3)


def _logits_and_their_copy_returned():
    weight, _ = _params()

    def fn(h, t):
        logits = F.linear(h, weight)
        copy = logits.contiguous()
        return logits, copy, F.cross_entropy(copy.view(-1, V), t.view(-1))

    return fn, _rows(2, 3)


def _a_channels_last_copy_returned():
    """A copy into another layout than the op's row-major logits: not the classifier's output as the op returns it."""
    weight, _ = _params()

    def fn(h, t):
        logits = F.linear(h, weight).contiguous(memory_format=torch.channels_last)
        return logits, F.cross_entropy(logits.reshape(-1, V), t.view(-1))

    return fn, _rows(2, 3, 2)


def _returned_logits_with_shifted_loss_rows():
    weight, _ = _params()

    def fn(h, t):
        logits = F.linear(h, weight)
        return logits, F.cross_entropy(logits[:, :-1].reshape(-1, V), t[:, 1:].reshape(-1))

    return fn, _rows(2, 4)


class TestDeclines:
    @pytest.mark.parametrize(
        ("build", "options", "expected"),
        [
            pytest.param(_class_weights, {}, Expect("""cce applied=False proof=None: class weights are not supported by memopt.cce"""), id="class_weights"),
            pytest.param(_soft_labels, {}, Expect("""cce applied=False proof=None: soft-label targets (class probabilities) are not supported by memopt.cce"""), id="soft_labels"),
            pytest.param(_logits_as_graph_input, {}, Expect("""cce applied=False proof=None: the logits arrive as a graph input, so the classifier that produced them was compiled in another graph (a graph break between the head and the loss); find the break with TORCH_LOGS=graph_breaks and compile head and loss together (fullgraph=True shows it as an error)"""), id="logits_as_graph_input"),
            pytest.param(_not_a_linear_classifier, {}, Expect("""cce applied=False proof=None: the logits come from relu (call_function relu), not from a linear classifier"""), id="not_a_linear_classifier"),
            pytest.param(_small_head, {"force": False}, Expect("""cce applied=False proof=static: saving <bytes> against torch.compile (<bytes> saved for the backward, <bytes> transient) is below min_saved_bytes=1048576 for every shape"""), id="small_head_below_threshold"),
            pytest.param(_log_sum_exp_of_other_rows, {}, Expect("""cce applied=False proof=None: the logits are used outside the loss and the loss reads a subset of their rows (getitem (call_function getitem)); memopt.cce_with_logits needs the loss rows to be the logits' rows (shift the labels instead, as HF does)"""), id="log_sum_exp_of_other_rows"),
            pytest.param(_a_copy_of_the_logits_returned, {}, Expect("""cce applied=False proof=None: a copy of the logits (logits, made on the way to the loss) is returned from the compiled graph, so it stays alive and rewriting saves nothing; return the classifier's own output instead"""), id="a_copy_of_the_logits_returned"),
            pytest.param(_a_channels_last_copy_returned, {}, Expect("""cce applied=False proof=None: a copy of the logits (logits, made on the way to the loss) is returned from the compiled graph, so it stays alive and rewriting saves nothing; return the classifier's own output instead"""), id="a_channels_last_copy_returned"),
            pytest.param(_logits_and_their_copy_returned, {}, Expect("""cce applied=False proof=None: the logits are used outside the loss as copies of one another (copy, logits); memopt's ops return one of them"""), id="logits_and_their_copy_returned"),
            pytest.param(_returned_logits_with_shifted_loss_rows, {}, Expect("""cce applied=False proof=None: the logits are used outside the loss and the loss reads a subset of their rows (getitem (call_function getitem)); memopt.cce_with_logits needs the loss rows to be the logits' rows (shift the labels instead, as HF does)"""), id="returned_logits_with_shifted_loss_rows"),
        ],
    )
    def test_declined(self, build, options, expected):
        """Every decision for the graph, each declined with the reason that blocks it."""
        fn, inputs = build()
        expected.assert_expected(record_lines(rewritten(fn, *inputs, **options)))

    def test_large_vocabulary_applies_without_force(self):
        """Under dynamic shapes a tiny batch would not pay on CPU, so the decision rests on the size hint."""
        vocab, dim, batch, seq = 8192, 16, 4, 1024
        weight = nn.Parameter(torch.randn(vocab, dim) * 0.02)

        def fn(h, t):
            return F.cross_entropy(F.linear(h, weight).float().view(-1, vocab), t.view(-1))

        ex = rewritten(
            fn, torch.randn(batch, seq, dim), torch.randint(0, vocab, (batch, seq)), force=False, dynamic=True
        )
        assert_expected_inline(record_lines(ex), """cce applied=True proof=hint: logits never materialized; gradients taken in the forward (6·N·D·V FLOPs); frees <bytes> against torch.compile (<bytes> saved for the backward, <bytes> transient) for the example shapes (size hints)""")
        record = ex.records[0]
        assert "s" in record.saved_bytes  # symbolic in the batch and sequence sizes
        # torch.compile keeps the fp32 logits ``.float()`` made: what the rewrite stops saving
        assert record.against_compile["saved_hint"] > 0.95 * batch * seq * vocab * 4
        assert record.saved_bytes_hint > 0


@pytest.mark.parametrize(
    ("options", "last_arguments"),
    [
        pytest.param({}, "'mean', 0.0, None", id="default"),
        pytest.param({"cce_filter_eps": 0.25}, "'mean', 0.0, None, 0.25", id="number"),
        pytest.param({"cce_filter_eps": "auto"}, f"'mean', 0.0, None, {torch.finfo(torch.float32).eps / 32}", id="auto"),
    ],
)
def test_filter_option_reaches_the_op(options, last_arguments):
    """``cce_filter_eps`` (a CUDA speed option) is passed to the op: "auto" is the dtype's eps / 32; the default
    passes nothing, so the exact op is called."""
    hidden = torch.randn(4, 6, 8, requires_grad=True)
    weight = nn.Parameter(torch.randn(50, 8))
    targets = torch.randint(0, 50, (4, 6))

    def step(hidden, targets):
        return F.cross_entropy(F.linear(hidden, weight).view(-1, 50), targets.view(-1))

    code = after_code(rewritten(step, hidden, targets, **options))
    call = code[code.index("torch.ops.memopt.cce.default(") :]
    assert call[: call.index(")")].endswith(last_arguments)


def _vocab_loss(vocab: int, dim: int, z_loss: bool = False, dtype: torch.dtype = torch.float32):
    weight = nn.Parameter((torch.randn(vocab, dim) * 0.02).to(dtype))

    def fn(h, t):
        logits = F.linear(h, weight).float()
        loss = F.cross_entropy(logits.view(-1, vocab), t.view(-1))
        return loss + 1e-4 * torch.logsumexp(logits, -1).square().mean() if z_loss else loss

    return fn, weight


def _returned_logits_loss(vocab: int, dim: int, body=None):
    """Logits returned beside their loss, after ``body`` (a module, or a function of the hidden states) or
    straight from the inputs (the head alone in its graph, as FSDP2's per-block frames leave it)."""
    weight = nn.Parameter(torch.randn(vocab, dim) * 0.02)

    def fn(h, t):
        logits = F.linear(h if body is None else body(h), weight)
        return logits, F.cross_entropy(logits.float().view(-1, vocab), t.view(-1))

    return fn, [weight, *(body.parameters() if isinstance(body, nn.Module) else ())]


def _mlp(dim: int, width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(dim, width), nn.GELU(), nn.Linear(width, dim))


def _addmm_mlp(dim: int, width: int):
    """GPT-2's MLP as its Conv1D layers compute it: ``torch.addmm`` with the bias first."""
    up, down = nn.Parameter(torch.randn(dim, width) * 0.1), nn.Parameter(torch.randn(width, dim) * 0.02)
    up_bias, down_bias = nn.Parameter(torch.zeros(width)), nn.Parameter(torch.zeros(dim))

    def body(h):
        x = torch.addmm(down_bias, torch.addmm(up_bias, h.view(-1, dim), up).relu(), down)
        return x.view(h.shape)

    return body


def _checkpointed(module: nn.Module):
    return lambda h: torch.utils.checkpoint.checkpoint(module, h, use_reentrant=False)


def _decided(fn, vocab: int, dim: int) -> dict:
    """The CCE record's params for ``fn`` on [2, 256, dim] hidden states, decided as for CUDA."""
    hidden = torch.randn(2, 256, dim, requires_grad=True)
    ex = rewritten(fn, hidden, torch.randint(0, vocab, (2, 256)), force=False, cce_variant="auto",
                   assume_device="cuda")
    return ex.records[0].params


def _check_returned_logits(fn, params, hidden, targets, variant: str, reason: str, op: str):
    """The record's variant and reason, the op in the code, and loss, logits and gradients against eager's,
    also with the returned logits in the loss (their gradient re-attached by the backend's wrapper)."""
    ex = rewritten(fn, hidden, targets, force=False, cce_variant="auto", assume_device="cuda")
    record = ex.records[0]
    assert record.params["variant"] == variant
    assert reason in record.params["variant_reason"]
    code = after_code(ex)
    assert f"torch.ops.memopt.{op}.default(" in code
    logits, loss = ex.result
    expected_logits, expected_loss = fn(hidden, targets)
    torch.testing.assert_close(logits, expected_logits)
    torch.testing.assert_close(loss, expected_loss)
    params = [hidden, *params]
    assert_close_all(grads(loss, params), grads(expected_loss, params))
    logits, loss = rewritten(fn, hidden, targets, force=False, cce_variant="auto", assume_device="cuda").result
    expected_logits, expected_loss = fn(hidden, targets)
    assert_close_all(grads(logits.square().mean() + loss, params),
                     grads(expected_logits.square().mean() + expected_loss, params))
    return code


_FOR_CUDA = {"cce_variant": "auto", "assume_device": "cuda"}
_FOR_CPU = {"cce_variant": "auto", "assume_device": None}
_ROWWISE_REASON = r"^the row-wise variant frees .* of the chunked one's"


class TestVariant:
    """Which CCE op serves a scalar loss: the rule weighs FLOPs against what each variant keeps, and says so."""

    @pytest.mark.parametrize(
        ("loss", "shape", "options", "variant", "reason", "op"),
        [
            # decided as for CUDA (where the row-wise op is the faster), run on CPU
            pytest.param({"vocab": 4096, "dim": 16}, (2, 256), {"force": False, **_FOR_CUDA}, "rowwise",
                         "of the chunked one's", "cce_rowwise", id="auto_takes_rowwise_where_it_keeps_most_of_the_saving"),
            # the same loss decided for the CPU: the row-wise op serves it as on CUDA, weighed by the same 3/4 rule
            # (at 512 tokens its 512-row chunk would be all the logits, and the chunked op stays: the cases below)
            pytest.param({"vocab": 4096, "dim": 16}, (4, 1024), {"force": False, "cce_variant": "auto"}, "rowwise",
                         _ROWWISE_REASON, "cce_rowwise", id="auto_takes_rowwise_off_cuda"),
            # few tokens against a large classifier of 16-bit weights: ∂C [V, D], summed in fp32 and kept from forward
            # to backward beside the weight's own bf16 gradient, outweighs the logits, on CUDA and on the CPU alike;
            # off CUDA a loss-only chunk is at least 512 rows, so fewer tokens than that leave the row-wise op a chunk
            # of all the logits
            pytest.param({"vocab": 4096, "dim": 64, "dtype": torch.bfloat16}, (1, 16), _FOR_CUDA, "chunked",
                         "under 3/4", "cce", id="auto_keeps_chunked_where_the_saved_gradients_cost_too_much-cuda"),
            pytest.param({"vocab": 4096, "dim": 512, "dtype": torch.bfloat16}, (1, 2048), _FOR_CPU, "chunked",
                         "under 3/4", "cce", id="auto_keeps_chunked_where_the_saved_gradients_cost_too_much-cpu"),
            # the same losses with fp32 weights: ∂C's fp32 sum is the weight's gradient itself, which torch.compile
            # allocates in the backward anyway, so the memory model charges only its padding rows (none at V = 4096)
            # and "auto" takes the row-wise op, on CUDA and on the CPU alike
            pytest.param({"vocab": 4096, "dim": 64}, (1, 16), _FOR_CUDA, "rowwise", _ROWWISE_REASON, "cce_rowwise",
                         id="an_fp32_weight_takes_its_gradient_in_the_forward_for_free-cuda"),
            pytest.param({"vocab": 4096, "dim": 512}, (1, 2048), _FOR_CPU, "rowwise", _ROWWISE_REASON, "cce_rowwise",
                         id="an_fp32_weight_takes_its_gradient_in_the_forward_for_free-cpu"),
            pytest.param({"vocab": 64, "dim": 8, "z_loss": True}, (2, 5), {"cce_variant": "rowwise"}, "chunked",
                         "z-loss terms need the log-sum-exp's own gradient", "cce",
                         id="z_loss_needs_the_chunked_variant"),
        ],
    )
    def test_decided(self, loss, shape, options, variant, reason, op):
        """The variant the record names, its reason (a pattern), and the op in the graph; the loss and its
        gradients are eager's."""
        fn, weight = _vocab_loss(**loss)
        vocab, dim = weight.shape
        hidden = torch.randn(*shape, dim, dtype=weight.dtype, requires_grad=True)
        ex = _check_numerics(fn, [hidden, weight], hidden, torch.randint(0, vocab, shape), **options)
        record = ex.records[0]
        assert record.params["variant"] == variant
        assert re.search(reason, record.params["variant_reason"]), record.params["variant_reason"]
        assert f"torch.ops.memopt.{op}.default(" in after_code(ex)

    @pytest.mark.slow
    def test_auto_weighs_the_variants_against_torch_compile(self):
        """The 3/4 rule on what each variant frees against torch.compile, not on the graph as written: there the
        fp32 log-probabilities eager would keep make the row-wise op look as good as the chunked one (63.2 against
        71.2 MiB here), where torch.compile keeps only the bf16 logits and the row-wise op's ∂C [V, D] (kept in
        bf16, summed in fp32 inside the op) costs most of them at D = 384. Each figure in the reason is the one the forced variant's record carries, and the
        op applied is the chosen one."""
        vocab, dim, tokens = 8192, 384, 1024
        fn, _ = _vocab_loss(vocab=vocab, dim=dim, dtype=torch.bfloat16)
        hidden = torch.randn(1, tokens, dim, dtype=torch.bfloat16, requires_grad=True)
        targets = torch.randint(0, vocab, (1, tokens))

        def decided(**options):
            torch._dynamo.reset()
            ex = rewritten(fn, hidden, targets, force=False, assume_device="cuda", **options)
            return ex, ex.records[0]

        _, eager = decided(pricing="eager")
        assert eager.params["variant"] == "rowwise"
        assert "against torch.compile" not in eager.params["variant_reason"]
        ex, auto = decided(cce_variant="auto")
        peak = {v: decided(cce_variant=v)[1].against_compile["peak_hint"] for v in ("rowwise", "chunked")}
        assert 4 * peak["rowwise"] < 3 * peak["chunked"]
        assert auto.params["variant"] == "chunked"
        figures = [fxpass.shapes.format_bytes(peak[v]) for v in ("rowwise", "chunked")]
        assert auto.params["variant_reason"] == (
            f"the row-wise variant frees {figures[0]} of the chunked one's {figures[1]} against torch.compile, "
            "under 3/4, so 8·N·D·V FLOPs"
        )
        assert auto.against_compile["peak_hint"] == peak["chunked"]
        code = after_code(ex)
        assert "torch.ops.memopt.cce.default(" in code
        assert "cce_rowwise" not in code
        torch.testing.assert_close(ex.result, fn(hidden, targets), atol=2e-2, rtol=1e-2)

    @pytest.mark.slow
    def test_auto_serves_returned_logits_with_the_detached_op(self):
        """Decided as for CUDA, with the logits returned after a body that outweighs the head more than 3×: what
        the row-wise op keeps for the backward would sit on the step's peak beside them, so "auto" takes
        ``cce_with_logits`` with the logits detached (the backend's wrapper carries their gradient) and says what
        it avoided."""
        vocab, dim = 16384, 16  # fp32 logits of 128 MiB, two of the op's 64 MiB chunks
        fn, params = _returned_logits_loss(vocab, dim, _mlp(dim, 32768))  # 2·2·16·32768 = 4 × 2·16·16384
        hidden = torch.randn(2, 1024, dim, requires_grad=True)  # chunks below the logits
        code = _check_returned_logits(
            fn, params, hidden, torch.randint(0, vocab, (2, 1024)), "with_logits",
            "detached cce_with_logits keeps nothing for the backward", "cce_with_logits",
        )
        call = code[code.index("torch.ops.memopt.cce_with_logits.default(") :]
        assert call[: call.index(")")].endswith(", True"), call  # detach_logits

    @pytest.mark.slow
    def test_auto_serves_head_alone_returned_logits_with_the_rowwise_op(self):
        """The head alone in its graph (FSDP2 compiles each block as a frame of its own): nothing else runs
        beside the detached op's extra GEMM, so "auto" takes the row-wise op, which returns the logits too."""
        vocab, dim = 16384, 16
        fn, params = _returned_logits_loss(vocab, dim)
        hidden = torch.randn(2, 2048, dim, requires_grad=True)  # chunks well below the logits
        _check_returned_logits(
            fn, params, hidden, torch.randint(0, vocab, (2, 2048)), "rowwise", "a head-heavy graph",
            "cce_rowwise",
        )

    def test_head_alone_returned_logits_are_priced_with_the_logits_the_caller_holds(self):
        """A one-block Cohere (logit scale, 16-bit weights) returns its scaled logits; its head outweighs the block,
        so the row-wise op serves it (time first) as long as it frees memory against torch.compile, priced with
        the logits it returns and does not save beside its fp32 ∂C (torch.compile returns the logits it saves).
        The record's figure is the piece's, and the whole step simulated peaks lower than torch.compile's."""
        import transformers

        config = transformers.CohereConfig(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                           num_key_value_heads=2, vocab_size=32000, num_hidden_layers=1,
                                           logit_scale=0.0625, eos_token_id=0)
        torch.manual_seed(0)
        model = transformers.CohereForCausalLM(config).to(torch.bfloat16).train()
        ids = torch.randint(0, 32000, (2, 512))
        ex = fxpass.explain(lambda ids: model(input_ids=ids, labels=ids), ids, assume_device="cuda", execute=False)
        [record] = [r for r in ex.records if r.rule == "cce"]
        assert record.applied, record.reason
        assert record.params["variant"] == "rowwise"
        assert "a head-heavy graph" in record.params["variant_reason"]
        # the returned logits (bf16 [1024, 32000]) count against the op: it frees less than torch.compile's
        # saved logits plus the zeros autograd hands them
        assert record.against_compile["peak_hint"] < 2 * 1024 * 32000 * 2
        assert record.against_compile["peak_hint"] > 0
        peaks = ex.peak_bytes()
        assert peaks["memopt"] < peaks["torch.compile"]

    @pytest.mark.parametrize(
        ("body", "variant", "reason"),
        [
            # GPT-2's Conv1D layers are ``torch.addmm`` (bias first): their work counts against the head's too
            pytest.param(lambda: _addmm_mlp(16, 8192), "with_logits", None, id="a_body_of_addmm_counts"),
            # under activation checkpointing (HF's ``activation_checkpointing_enable``) the body is a region of its
            # own in the graph: its matmuls still count against the head's, so the whole model keeps
            # ``cce_with_logits``
            pytest.param(lambda: _checkpointed(_mlp(16, 8192)), "with_logits", None, id="a_checkpointed_body_counts"),
            # matmuls doing less work than the classifier (2·16·512 < 4096·16 a token): the row-wise op, and the
            # reason gives the figures
            pytest.param(lambda: _mlp(16, 512), "rowwise",
                         r"other matmuls 1\.7e\+07 FLOPs, at most 3× the classifier's 6\.7e\+07",
                         id="a_small_body_leaves_the_graph_head_heavy"),
            # other matmuls of exactly 3× the classifier's work (an MLP 1.5× as wide as the vocabulary): the
            # row-wise op; a little more: ``cce_with_logits``, whose extra GEMM is then under 1/12 of the step's
            # matmul work
            pytest.param(lambda: _mlp(16, 6144), "rowwise", None,
                         id="the_head_heavy_bound_is_three_times_the_classifier-at"),
            pytest.param(lambda: _mlp(16, 6208), "with_logits", None,
                         id="the_head_heavy_bound_is_three_times_the_classifier-above"),
        ],
    )
    def test_body_beside_the_head(self, body, variant, reason):
        """Logits returned after ``body()`` and a [4096, 16] classifier, decided as for CUDA: the variant, and the
        reason where the case gives a pattern."""
        vocab, dim = 4096, 16
        fn, _ = _returned_logits_loss(vocab, dim, body())
        params = _decided(fn, vocab, dim)
        assert params["variant"] == variant
        if reason is not None:
            assert re.search(reason, params["variant_reason"]), params["variant_reason"]

    @pytest.mark.parametrize(
        ("width", "widened", "heavy"),
        [
            pytest.param(4096, True, False, id="twice_the_head-widened"),
            pytest.param(4096, False, True, id="twice_the_head-bf16"),
            pytest.param(512, True, True, id="lighter_than_the_head-widened"),
        ],
    )
    def test_widened_returned_logits_take_the_row_wise_op_only_where_the_head_outweighs_the_rest(
        self, width, widened, heavy
    ):
        """Logits returned in fp32 after a bf16 classifier (HF Trainer's ``convert_to_fp32``): ``cce_with_logits``
        writes them from its GEMM in fp32, where the row-wise op's bf16 logits would be cast beside them. A body
        of 2× the classifier's work keeps ``cce_with_logits`` (in bf16 it would be head-heavy); a body lighter
        than the classifier counts as head-heavy (the row-wise op, where it frees memory against torch.compile)."""
        vocab, dim = 4096, 16
        body = _mlp(dim, width).to(torch.bfloat16)
        weight = nn.Parameter((torch.randn(vocab, dim) * 0.02).to(torch.bfloat16))

        def fn(h, t):
            logits = F.linear(body(h), weight)
            loss = F.cross_entropy(logits.float().view(-1, vocab), t.view(-1))
            return (logits.float() if widened else logits), loss

        hidden = torch.randn(2, 256, dim, dtype=torch.bfloat16, requires_grad=True)
        ex = rewritten(fn, hidden, torch.randint(0, vocab, (2, 256)), force=False, cce_variant="auto",
                       assume_device="cuda")
        reason = ex.records[0].params.get("variant_reason", "")
        assert ("a head-heavy graph" in reason) == heavy, reason
        if heavy:
            assert ("less than the classifier's" if widened else "at most 3× the classifier's") in reason
        else:
            assert ex.records[0].params["variant"] == "with_logits"

    def test_a_head_heavy_graph_keeps_the_detached_op_where_the_row_wise_one_frees_under_half(self):
        """Other matmuls 2× the classifier's (head-heavy, not alone), a wide classifier over few tokens: the
        row-wise op's ∂C [V, D], 3/4 of the logits' [N, V] size here, leaves it under half of what
        ``cce_with_logits`` frees against torch.compile, so ``cce_with_logits`` serves the returned logits, with
        both figures."""
        vocab, dim, tokens = 8192, 768, 1024
        torch.manual_seed(0)
        body = _mlp(dim, vocab).to(torch.bfloat16)  # 2·2·dim·vocab: twice the classifier's 2·dim·vocab
        weight = nn.Parameter((torch.randn(vocab, dim) * 0.02).to(torch.bfloat16))

        def fn(h, t):
            logits = F.linear(body(h), weight)
            return logits, F.cross_entropy(logits.float().view(-1, vocab), t.view(-1))

        hidden = torch.randn(1, tokens, dim, dtype=torch.bfloat16, requires_grad=True)
        ex = rewritten(fn, hidden, torch.randint(0, vocab, (1, tokens)), force=False, cce_variant="auto",
                       assume_device="cuda")
        record = ex.records[0]
        assert record.applied, record.reason
        assert record.params["variant"] == "with_logits", record.params.get("variant_reason")
        assert re.search(
            r"a head-heavy graph .*; but the row-wise op frees [\d.]+ MiB against torch.compile, under "
            r"half of cce_with_logits' [\d.]+ MiB",
            record.params["variant_reason"],
        ), record.params["variant_reason"]

    def test_inference_takes_no_gradient(self):
        """Under no_grad the forward computes the loss alone: the op is told no input needs a gradient."""
        fn, _ = _vocab_loss(vocab=64, dim=8)
        with torch.no_grad():
            ex = rewritten(fn, torch.randn(2, 5, 8), torch.randint(0, 64, (2, 5)), cce_variant="rowwise")
        assert "'mean', 0.0, None, False, False, False)" in after_code(ex)


# --- transforms between the classifier and the loss --------------------------------------------------------------

def _transformed(kind: str):
    """Logits as the families transform them: Cohere's ``logits * logit_scale``, Granite's ``logits /
    logits_scaling``, Gemma 2's final softcap, and a scale before a softcap."""

    def transform(logits):
        if kind in ("mul", "mul_softcap"):
            logits = logits * SCALE
        if kind == "div":
            logits = logits / DIVISOR
        if kind in ("softcap", "mul_softcap"):
            logits = torch.tanh(logits / CAP) * CAP
        return logits

    return transform


def _transform_fn(kind: str, weight, returns: bool):
    """HF's causal-LM loss over transformed logits; returns (logits, loss) where ``returns``, else the loss."""
    transform = _transformed(kind)

    def fn(h, labels):
        logits = transform(F.linear(h, weight))
        shift = F.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
        loss = F.cross_entropy(logits.float().view(-1, V), shift.view(-1))
        return (logits, loss) if returns else loss

    return fn


def _labels(batch: int = 2, seq: int = 3):
    labels = torch.randint(0, V, (batch, seq))
    labels[0, 0] = -100
    return labels


class TestTransformedLogits:
    """A scale (multiplied or divided) and a softcap between classifier and loss become the op's arguments; where
    the graph returns the transformed logits, the op returns them, bit for bit as eager computes them, and their
    gradient goes back through the transform (the z-loss second loss checks it)."""

    def _dropped(self, kind: str) -> str:
        weight, _ = _params()
        hidden = torch.randn(2, 3, D, requires_grad=True)
        ex = _check_numerics(_transform_fn(kind, weight, returns=False), [hidden, weight], hidden, _labels())
        assert ex.records[0].params["returned_logits_transformed"] is False
        return after_code(ex)

    def _returned(self, kind: str, variant: str = "auto") -> fxpass.Explanation:
        weight, _ = _params()
        hidden = torch.randn(2, 3, D, requires_grad=True)
        fn = _transform_fn(kind, weight, returns=True)
        labels = _labels()
        ex = _check_returned(fn, [hidden, weight], hidden, labels, second_loss=_z_loss, cce_variant=variant)
        assert torch.equal(ex.result[0], fn(hidden, labels)[0])  # the transformed logits, bit for bit
        record = ex.records[0]
        assert record.params["returned_logits_transformed"] is True
        assert record.params["variant"] == ("rowwise" if variant == "rowwise" else "with_logits")
        return ex

    def test_mul_scale_dropped(self):
        assert_expected_inline(self._dropped("mul"), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_h_: "f32[2, 3, 8]cpu", L_weight_: "f32[40, 8]cpu", L_labels_: "i64[2, 3]cpu"):
        l_h_ = L_h_
        l_weight_ = L_weight_
        l_labels_ = L_labels_
        pad: "i64[2, 4]cpu" = torch._C._nn.pad(l_labels_, (0, 1), 'constant', -100);  l_labels_ = None
        getitem: "i64[2, 3]cpu" = pad[(Ellipsis, slice(1, None, None))];  pad = None
        shift: "i64[2, 3]cpu" = getitem.contiguous();  getitem = None
        view_1: "i64[6]cpu" = shift.view(-1);  shift = None
        reshape: "f32[6, 8]cpu" = l_h_.reshape(-1, 8);  l_h_ = None
        cce_default = torch.ops.memopt.cce.default(reshape, l_weight_, None, view_1, -100, 'mean', 0.0, None, scale = 0.3);  reshape = l_weight_ = view_1 = None
        getitem_1: "f32[]cpu" = cce_default[0];  cce_default = None
        return (getitem_1,)""")

    def test_div_scale_dropped(self):
        assert_expected_inline(self._dropped("div"), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_h_: "f32[2, 3, 8]cpu", L_weight_: "f32[40, 8]cpu", L_labels_: "i64[2, 3]cpu"):
        l_h_ = L_h_
        l_weight_ = L_weight_
        l_labels_ = L_labels_
        pad: "i64[2, 4]cpu" = torch._C._nn.pad(l_labels_, (0, 1), 'constant', -100);  l_labels_ = None
        getitem: "i64[2, 3]cpu" = pad[(Ellipsis, slice(1, None, None))];  pad = None
        shift: "i64[2, 3]cpu" = getitem.contiguous();  getitem = None
        view_1: "i64[6]cpu" = shift.view(-1);  shift = None
        reshape: "f32[6, 8]cpu" = l_h_.reshape(-1, 8);  l_h_ = None
        cce_default = torch.ops.memopt.cce.default(reshape, l_weight_, None, view_1, -100, 'mean', 0.0, None, divisor = 3.0);  reshape = l_weight_ = view_1 = None
        getitem_1: "f32[]cpu" = cce_default[0];  cce_default = None
        return (getitem_1,)""")

    def test_softcap_dropped(self):
        assert_expected_inline(self._dropped("softcap"), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_h_: "f32[2, 3, 8]cpu", L_weight_: "f32[40, 8]cpu", L_labels_: "i64[2, 3]cpu"):
        l_h_ = L_h_
        l_weight_ = L_weight_
        l_labels_ = L_labels_
        pad: "i64[2, 4]cpu" = torch._C._nn.pad(l_labels_, (0, 1), 'constant', -100);  l_labels_ = None
        getitem: "i64[2, 3]cpu" = pad[(Ellipsis, slice(1, None, None))];  pad = None
        shift: "i64[2, 3]cpu" = getitem.contiguous();  getitem = None
        view_1: "i64[6]cpu" = shift.view(-1);  shift = None
        reshape: "f32[6, 8]cpu" = l_h_.reshape(-1, 8);  l_h_ = None
        cce_default = torch.ops.memopt.cce.default(reshape, l_weight_, None, view_1, -100, 'mean', 0.0, 0.5);  reshape = l_weight_ = view_1 = None
        getitem_1: "f32[]cpu" = cce_default[0];  cce_default = None
        return (getitem_1,)""")

    def test_scale_and_softcap_dropped(self):
        assert_expected_inline(self._dropped("mul_softcap"), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_h_: "f32[2, 3, 8]cpu", L_weight_: "f32[40, 8]cpu", L_labels_: "i64[2, 3]cpu"):
        l_h_ = L_h_
        l_weight_ = L_weight_
        l_labels_ = L_labels_
        pad: "i64[2, 4]cpu" = torch._C._nn.pad(l_labels_, (0, 1), 'constant', -100);  l_labels_ = None
        getitem: "i64[2, 3]cpu" = pad[(Ellipsis, slice(1, None, None))];  pad = None
        shift: "i64[2, 3]cpu" = getitem.contiguous();  getitem = None
        view_1: "i64[6]cpu" = shift.view(-1);  shift = None
        reshape: "f32[6, 8]cpu" = l_h_.reshape(-1, 8);  l_h_ = None
        cce_default = torch.ops.memopt.cce.default(reshape, l_weight_, None, view_1, -100, 'mean', 0.0, 0.5, scale = 0.3);  reshape = l_weight_ = view_1 = None
        getitem_1: "f32[]cpu" = cce_default[0];  cce_default = None
        return (getitem_1,)""")

    def test_mul_scale_returned(self):
        assert_expected_inline(after_code(self._returned("mul")), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_h_: "f32[2, 3, 8]cpu", L_weight_: "f32[40, 8]cpu", L_labels_: "i64[2, 3]cpu"):
        l_h_ = L_h_
        l_weight_ = L_weight_
        l_labels_ = L_labels_
        pad: "i64[2, 4]cpu" = torch._C._nn.pad(l_labels_, (0, 1), 'constant', -100);  l_labels_ = None
        getitem: "i64[2, 3]cpu" = pad[(Ellipsis, slice(1, None, None))];  pad = None
        shift: "i64[2, 3]cpu" = getitem.contiguous();  getitem = None
        view_1: "i64[6]cpu" = shift.view(-1);  shift = None
        reshape: "f32[6, 8]cpu" = l_h_.reshape(-1, 8);  l_h_ = None
        cce_with_logits_default = torch.ops.memopt.cce_with_logits.default(reshape, l_weight_, None, view_1, -100, 'mean', 0.0, None, True, scale = 0.3, transform_logits = True);  l_weight_ = view_1 = None
        getitem_1: "f32[]cpu" = cce_with_logits_default[0]
        getitem_2: "f32[6, 40]cpu" = cce_with_logits_default[2];  cce_with_logits_default = None
        view_2: "f32[2, 3, 40]cpu" = getitem_2.view(2, 3, -1);  getitem_2 = None
        return (view_2, getitem_1, reshape)""")

    def test_div_scale_returned(self):
        assert_expected_inline(after_code(self._returned("div")), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_h_: "f32[2, 3, 8]cpu", L_weight_: "f32[40, 8]cpu", L_labels_: "i64[2, 3]cpu"):
        l_h_ = L_h_
        l_weight_ = L_weight_
        l_labels_ = L_labels_
        pad: "i64[2, 4]cpu" = torch._C._nn.pad(l_labels_, (0, 1), 'constant', -100);  l_labels_ = None
        getitem: "i64[2, 3]cpu" = pad[(Ellipsis, slice(1, None, None))];  pad = None
        shift: "i64[2, 3]cpu" = getitem.contiguous();  getitem = None
        view_1: "i64[6]cpu" = shift.view(-1);  shift = None
        reshape: "f32[6, 8]cpu" = l_h_.reshape(-1, 8);  l_h_ = None
        cce_with_logits_default = torch.ops.memopt.cce_with_logits.default(reshape, l_weight_, None, view_1, -100, 'mean', 0.0, None, True, divisor = 3.0, transform_logits = True);  l_weight_ = view_1 = None
        getitem_1: "f32[]cpu" = cce_with_logits_default[0]
        getitem_2: "f32[6, 40]cpu" = cce_with_logits_default[2];  cce_with_logits_default = None
        view_2: "f32[2, 3, 40]cpu" = getitem_2.view(2, 3, -1);  getitem_2 = None
        return (view_2, getitem_1, reshape)""")

    def test_softcap_returned(self):
        assert_expected_inline(after_code(self._returned("softcap")), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_h_: "f32[2, 3, 8]cpu", L_weight_: "f32[40, 8]cpu", L_labels_: "i64[2, 3]cpu"):
        l_h_ = L_h_
        l_weight_ = L_weight_
        l_labels_ = L_labels_
        pad: "i64[2, 4]cpu" = torch._C._nn.pad(l_labels_, (0, 1), 'constant', -100);  l_labels_ = None
        getitem: "i64[2, 3]cpu" = pad[(Ellipsis, slice(1, None, None))];  pad = None
        shift: "i64[2, 3]cpu" = getitem.contiguous();  getitem = None
        view_1: "i64[6]cpu" = shift.view(-1);  shift = None
        reshape: "f32[6, 8]cpu" = l_h_.reshape(-1, 8);  l_h_ = None
        cce_with_logits_default = torch.ops.memopt.cce_with_logits.default(reshape, l_weight_, None, view_1, -100, 'mean', 0.0, 0.5, True, transform_logits = True);  l_weight_ = view_1 = None
        getitem_1: "f32[]cpu" = cce_with_logits_default[0]
        getitem_2: "f32[6, 40]cpu" = cce_with_logits_default[2];  cce_with_logits_default = None
        view_2: "f32[2, 3, 40]cpu" = getitem_2.view(2, 3, -1);  getitem_2 = None
        return (view_2, getitem_1, reshape)""")

    def test_scale_and_softcap_returned(self):
        ex = self._returned("mul_softcap")
        assert (ex.records[0].params["logit_scale"], ex.records[0].params["softcap"]) == (SCALE, CAP)
        assert_expected_inline(after_code(ex), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_h_: "f32[2, 3, 8]cpu", L_weight_: "f32[40, 8]cpu", L_labels_: "i64[2, 3]cpu"):
        l_h_ = L_h_
        l_weight_ = L_weight_
        l_labels_ = L_labels_
        pad: "i64[2, 4]cpu" = torch._C._nn.pad(l_labels_, (0, 1), 'constant', -100);  l_labels_ = None
        getitem: "i64[2, 3]cpu" = pad[(Ellipsis, slice(1, None, None))];  pad = None
        shift: "i64[2, 3]cpu" = getitem.contiguous();  getitem = None
        view_1: "i64[6]cpu" = shift.view(-1);  shift = None
        reshape: "f32[6, 8]cpu" = l_h_.reshape(-1, 8);  l_h_ = None
        cce_with_logits_default = torch.ops.memopt.cce_with_logits.default(reshape, l_weight_, None, view_1, -100, 'mean', 0.0, 0.5, True, scale = 0.3, transform_logits = True);  l_weight_ = view_1 = None
        getitem_1: "f32[]cpu" = cce_with_logits_default[0]
        getitem_2: "f32[6, 40]cpu" = cce_with_logits_default[2];  cce_with_logits_default = None
        view_2: "f32[2, 3, 40]cpu" = getitem_2.view(2, 3, -1);  getitem_2 = None
        return (view_2, getitem_1, reshape)""")

    @pytest.mark.parametrize("kind", ["mul", "div", "softcap", "mul_softcap"])
    def test_rowwise_returns_the_transformed_logits(self, kind):
        """The row-wise op (CUDA's choice for a head alone in its graph) transforms the logits it returns in
        place once its chunks have read them; the wrapper's gradient goes back through the transform."""
        assert "transform_logits = True" in after_code(self._returned(kind, variant="rowwise"))

    @pytest.mark.parametrize("variant", ["auto", "rowwise"])
    def test_raw_logits_returned_beside_a_transformed_loss(self, variant):
        """The graph returns the classifier's own output and scales only the loss's copy: the op returns the
        logits untransformed and the loss is taken over the scaled ones."""
        weight, _ = _params()
        hidden = torch.randn(2, 3, D, requires_grad=True)

        def fn(h, t):
            logits = F.linear(h, weight)
            return logits, F.cross_entropy((logits.float() * SCALE).view(-1, V), t.view(-1))

        ex = _check_returned(fn, [hidden, weight], hidden, _labels(), second_loss=_z_loss, cce_variant=variant)
        assert ex.records[0].params["returned_logits_transformed"] is False
        code = after_code(ex)
        assert "transform_logits" not in code
        assert "scale = 0.3" in code

    def test_transformed_logits_read_inside_the_graph(self):
        """Another op of the graph reads the transformed logits (a penalty on them, added to the loss): the op's
        logits stay differentiable in the graph, and their gradient goes back through the transform in its
        backward."""
        weight, bias = _params(bias=True)
        hidden = torch.randn(6, D, requires_grad=True)
        transform = _transformed("mul_softcap")

        def fn(h, t):
            logits = transform(F.linear(h, weight, bias))
            return F.cross_entropy(logits, t) + 0.1 * logits.square().mean()

        ex = _check_numerics(fn, [hidden, weight, bias], hidden, torch.randint(0, V, (6,)))
        record = ex.records[0]
        assert record.params["returned_logits_transformed"] is True
        assert "cce_with_logits.default(" in after_code(ex)
        assert "True, scale" not in after_code(ex)  # detach_logits stays False: the gradient is the graph's

    def test_a_cast_to_the_same_dtype_before_the_transform(self):
        """``.float()`` of fp32 logits changes nothing: the scaled logits after it are still served as returned."""
        weight, _ = _params()
        hidden = torch.randn(6, D, requires_grad=True)

        def fn(h, t):
            logits = F.linear(h, weight).float() * SCALE
            return logits, F.cross_entropy(logits, t)

        ex = _check_returned(fn, [hidden, weight], hidden, torch.randint(0, V, (6,)), second_loss=_z_loss)
        assert ex.records[0].params["returned_logits_transformed"] is True

    def test_under_autocast_the_transform_runs_in_bf16(self):
        """Autocast's bf16 classifier, then the scale and softcap in bf16 as eager runs them, returned and cast to
        fp32 on the way out (accelerate's convert_to_fp32): the op writes fp32 logits and transforms them."""
        weight, _ = _params()
        hidden = torch.randn(2, 3, D, requires_grad=True)
        transform = _transformed("mul_softcap")

        def fn(h, t):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = transform(F.linear(h, weight))
            loss = F.cross_entropy(logits.float().view(-1, V), t.view(-1))
            return logits.float(), loss

        labels = _labels()
        ex = rewritten(fn, hidden, labels)
        record = ex.records[0]
        assert record.applied, record.reason
        assert record.params["returned_logits_dtype"] == "float32"
        logits, loss = ex.result
        expected_logits, expected_loss = fn(hidden, labels)
        # unrounded fp32 logits against eager's bf16 ones, cast: a bf16 rounding apart
        torch.testing.assert_close(logits, expected_logits, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(loss, expected_loss, rtol=2e-2, atol=2e-2)
        assert_close_all(grads(loss + _z_loss(logits), [hidden, weight]),
                         grads(expected_loss + _z_loss(expected_logits), [hidden, weight]), rtol=3e-2, atol=3e-2)

    def test_z_loss_reads_the_transformed_log_sum_exp(self):
        """A z-loss over the scaled and softcapped logits reads the op's log-sum-exp, which is theirs."""
        weight, _ = _params()
        hidden = torch.randn(2, 3, D, requires_grad=True)
        transform = _transformed("mul_softcap")

        def fn(h, t):
            logits = transform(F.linear(h, weight)).float()
            ce = F.cross_entropy(logits.view(-1, V), t.view(-1))
            return ce + 1e-1 * torch.logsumexp(logits, dim=-1).square().mean()

        ex = _check_numerics(fn, [hidden, weight], hidden, _labels())
        assert ex.records[0].params["z_loss_terms"] == 1

    def test_nll_loss_over_scaled_logits(self):
        weight, _ = _params()
        hidden = torch.randn(6, D, requires_grad=True)

        def fn(h, t):
            return F.nll_loss(torch.log_softmax(F.linear(h, weight) / DIVISOR, dim=-1), t)

        ex = _check_numerics(fn, [hidden, weight], hidden, torch.randint(0, V, (6,)))
        assert ex.records[0].params["logit_divisor"] == DIVISOR


# --- copies of the classifier's output ---------------------------------------------------------------------------

# Copies of the classifier's output as models write them and Dynamo records them: OPT's ``lm_head(h).contiguous()``
# (a method call, however spelled), clones, ATen's overloads called directly, and a cast to the logits' own dtype.
COPIES = {
    "contiguous": lambda x: x.contiguous(),
    "Tensor.contiguous": lambda x: torch.Tensor.contiguous(x),
    "clone": lambda x: x.clone(),
    "torch.clone": lambda x: torch.clone(x),
    "aten.clone": lambda x: torch.ops.aten.clone.default(x),
    "aten.contiguous": lambda x: torch.ops.aten.contiguous.default(x),
    "same_dtype_cast": lambda x: x.float(),
    "contiguous_then_cast": lambda x: x.contiguous().float(),
}


def _copied_head(copy, weight):
    """transformers' causal-LM loss over logits ``copy`` made of the classifier's output, returned beside it."""

    def fn(h, labels):
        logits = copy(F.linear(h, weight))
        shift = F.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
        return logits, F.cross_entropy(logits.float().view(-1, V), shift.view(-1))

    return fn


class TestCopiedHead:
    """A copy of the classifier's output is still its output: where the graph returns the copy, the op's logits stand
    in for it, eager's bits and contiguous (off CUDA every op returns them so), and their gradient reaches the
    classifier."""

    def test_opt_head(self):
        """OPT's ``self.lm_head(h).contiguous()``: the op's logits are returned in place of the copy."""
        weight, _ = _params()
        hidden = torch.randn(2, 3, D, requires_grad=True)
        ex = _check_returned(_copied_head(COPIES["contiguous"], weight), [hidden, weight], hidden, _labels(),
                             second_loss=_z_loss)
        assert ex.records[0].params["returned_logits_transformed"] is False
        assert_expected_inline(after_code(ex), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_h_: "f32[2, 3, 8]cpu", L_weight_: "f32[40, 8]cpu", L_labels_: "i64[2, 3]cpu"):
        l_h_ = L_h_
        l_weight_ = L_weight_
        l_labels_ = L_labels_
        pad: "i64[2, 4]cpu" = torch._C._nn.pad(l_labels_, (0, 1), 'constant', -100);  l_labels_ = None
        getitem: "i64[2, 3]cpu" = pad[(Ellipsis, slice(1, None, None))];  pad = None
        shift: "i64[2, 3]cpu" = getitem.contiguous();  getitem = None
        view_1: "i64[6]cpu" = shift.view(-1);  shift = None
        reshape: "f32[6, 8]cpu" = l_h_.reshape(-1, 8);  l_h_ = None
        cce_with_logits_default = torch.ops.memopt.cce_with_logits.default(reshape, l_weight_, None, view_1, -100, 'mean', 0.0, None, True);  l_weight_ = view_1 = None
        getitem_1: "f32[]cpu" = cce_with_logits_default[0]
        getitem_2: "f32[6, 40]cpu" = cce_with_logits_default[2];  cce_with_logits_default = None
        view_2: "f32[2, 3, 40]cpu" = getitem_2.view(2, 3, -1);  getitem_2 = None
        return (view_2, getitem_1, reshape)""")

    @pytest.mark.parametrize("variant", ["auto", "rowwise"])
    @pytest.mark.parametrize("copy", list(COPIES))
    def test_returned_copy(self, copy, variant):
        """Each spelling of a copy, served by ``cce_with_logits`` and by the row-wise op: eager's logits bit for bit
        and contiguous, eager's loss, and the gradients of the loss alone and of a second loss on the logits."""
        weight, _ = _params()
        hidden = torch.randn(2, 3, D, requires_grad=True)
        fn = _copied_head(COPIES[copy], weight)
        labels = _labels()
        ex = _check_returned(fn, [hidden, weight], hidden, labels, second_loss=_z_loss, cce_variant=variant)
        record = ex.records[0]
        assert record.applied, record.reason
        assert record.params["returns_logits"] is True and record.params["returned_logits_transformed"] is False
        assert record.params["variant"] == ("rowwise" if variant == "rowwise" else "with_logits")
        logits = ex.result[0]
        assert torch.equal(logits, fn(hidden, labels)[0]) and logits.is_contiguous()

    @pytest.mark.parametrize("where", ["before", "after"])
    def test_a_copy_beside_the_transform(self, where):
        """A copy before the scale and softcap, or of the transformed logits: the op returns them transformed."""
        weight, _ = _params()
        hidden = torch.randn(2, 3, D, requires_grad=True)
        transform = _transformed("mul_softcap")

        def fn(h, labels):
            logits = F.linear(h, weight)
            logits = transform(logits.contiguous()) if where == "before" else transform(logits).contiguous()
            shift = F.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
            return logits, F.cross_entropy(logits.float().view(-1, V), shift.view(-1))

        labels = _labels()
        ex = _check_returned(fn, [hidden, weight], hidden, labels, second_loss=_z_loss)
        assert ex.records[0].params["returned_logits_transformed"] is True
        assert torch.equal(ex.result[0], fn(hidden, labels)[0])


def _scaled_after_the_softcap(weight):
    return lambda h, t: F.cross_entropy(torch.tanh(F.linear(h, weight) / CAP) * CAP * SCALE, t)


def _scaled_by_a_learned_tensor(weight):
    scale = nn.Parameter(torch.tensor(SCALE))
    return lambda h, t: F.cross_entropy(F.linear(h, weight) * scale, t)


def _scaled_by_a_constant_tensor(weight):
    scale = torch.tensor(SCALE)
    return lambda h, t: F.cross_entropy(F.linear(h, weight) * scale, t)


def _scaled_by_a_negative_number(weight):
    return lambda h, t: F.cross_entropy(F.linear(h, weight) * -2.0, t)


def _returned_part_way_through_the_transform(weight):
    def fn(h, t):
        scaled = F.linear(h, weight) * SCALE
        return scaled, F.cross_entropy(torch.tanh(scaled / CAP) * CAP, t)

    return fn


def _returned_after_a_cast_and_a_transform(weight):
    def fn(h, t):
        logits = F.linear(h, weight).double() * SCALE
        return logits, F.cross_entropy(logits, t)

    return fn


def _raw_and_transformed_both_returned(weight):
    def fn(h, t):
        raw = F.linear(h, weight)
        logits = raw / DIVISOR
        return raw, logits, F.cross_entropy(logits, t)

    return fn


def _scaled_log_probabilities(weight):
    return lambda h, t: F.nll_loss(torch.log_softmax(F.linear(h, weight), dim=-1) * SCALE, t)


def _cce_decline(fn, *args, **options) -> str:
    """The CCE rule's decision lines for ``fn``, none of which applies."""
    ex = rewritten(fn, *args, **options)
    assert not [r for r in ex.records if r.rule == "cce" and r.applied]
    return "\n".join(line for line in record_lines(ex).splitlines() if line.startswith("cce "))


class TestTransformDeclines:
    """Transforms memopt's ops cannot take: each declined with the one reason that blocks it."""

    @pytest.mark.parametrize(
        ("build", "expected"),
        [
            pytest.param(_scaled_after_the_softcap, Expect("""cce applied=False proof=None: the logits are scaled after their softcap (mul_1 (call_function mul)); memopt.cce takes a scale before the softcap only"""), id="scale_after_the_softcap"),
            pytest.param(_scaled_by_a_learned_tensor, Expect("""cce applied=False proof=None: mul (call_function mul) scales the logits by a learned tensor (l_scale_): memopt's ops take a constant scale and do not compute its gradient"""), id="learned_tensor_scale"),
            pytest.param(_scaled_by_a_constant_tensor, Expect("""cce applied=False proof=None: mul (call_function mul) scales the logits by a tensor (l_scale_): memopt's ops take the scale as a Python number (reading a tensor's value would sync with the device); store it as a float"""), id="constant_tensor_scale"),
            pytest.param(_scaled_by_a_negative_number, Expect("""cce applied=False proof=None: mul (call_function mul) scales the logits by -2.0; memopt.cce takes a positive, finite scale"""), id="negative_scale"),
            pytest.param(_returned_part_way_through_the_transform, Expect("""cce applied=False proof=None: the logits are returned from the compiled graph part-way through their transform (scaled, before mul_1); memopt's ops return the classifier's logits or the fully transformed ones"""), id="returned_part_way_through_the_transform"),
            pytest.param(_returned_after_a_cast_and_a_transform, Expect("""cce applied=False proof=None: the transformed logits (logits) are returned from the compiled graph, but a cast or view comes between the classifier and their transform; memopt's ops return logits transformed in the classifier's dtype and layout"""), id="returned_after_a_cast_and_a_transform"),
            pytest.param(_raw_and_transformed_both_returned, Expect("""cce applied=False proof=None: the logits are used outside the loss both before and after their transform (logits, raw); memopt's ops return one of them"""), id="raw_and_transformed_both_returned"),
            pytest.param(_scaled_log_probabilities, Expect("""cce applied=False proof=None: nll_loss input is not a log_softmax of logits"""), id="scaled_log_probabilities"),
        ],
    )
    def test_declined(self, build, expected):
        weight, _ = _params()
        fn = build(weight)
        expected.assert_expected(_cce_decline(fn, *_rows(6)))

    def test_symbolic_float_scale(self):
        """A float argument Dynamo does not specialize (dynamic shapes, ``specialize_float=False``) reaches the graph
        as a SymFloat."""
        weight, _ = _params()

        def fn(h, t, scale):
            return F.cross_entropy(F.linear(h, weight) * scale, t)

        with torch._dynamo.config.patch(specialize_float=False):
            reason = _cce_decline(fn, *_rows(6), SCALE, dynamic=True)
        assert_expected_inline(reason, """cce applied=False proof=None: mul (call_function mul) scales the logits by a symbolic number (item): Dynamo did not specialize it (torch._dynamo.config.specialize_float), and memopt's ops take the scale as a constant""")
