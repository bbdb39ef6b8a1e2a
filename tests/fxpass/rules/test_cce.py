"""The CCE rule on each pattern form: rewritten-graph snapshots, numerics against eager, decline reasons."""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F
from expecttest import TestCase

import fxpass
from tests.helpers import after_code, assert_close_all, grads, record_lines, rewritten

V, D = 40, 8


def _params(bias: bool = False):
    weight = nn.Parameter(torch.randn(V, D) / D**0.5)
    return weight, (nn.Parameter(torch.randn(V)) if bias else None)


def _check_numerics(fn, params, *args, **options):
    """The rewritten function gives eager's loss and gradients (float32 on CPU)."""
    expected = fn(*args)
    expected_grads = grads(expected, params)
    explanation = rewritten(fn, *args, **options)
    actual = explanation.result
    torch.testing.assert_close(actual, expected)
    assert_close_all(grads(actual, params), expected_grads)
    return explanation


class TestForms(TestCase):
    def test_linear_float_view(self):
        weight, _ = _params()
        hidden = torch.randn(2, 5, D, requires_grad=True)
        targets = torch.randint(0, V, (2, 5))

        def loss(h, t):
            logits = F.linear(h, weight)
            return F.cross_entropy(logits.float().view(-1, V), t.view(-1))

        ex = _check_numerics(loss, [hidden, weight], hidden, targets)
        self.assertExpectedInline(after_code(ex), """\
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
        self.assertExpectedInline(after_code(ex), """\
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
        hidden = torch.randn(2, 6, D, requires_grad=True)
        tokens = torch.randint(0, V, (2, 6))

        def loss(h, t):
            logits = F.linear(h, weight, bias)
            shifted = logits[..., :-1, :].contiguous()
            return F.cross_entropy(shifted.view(-1, shifted.size(-1)), t[..., 1:].reshape(-1))

        ex = _check_numerics(loss, [hidden, weight, bias], hidden, tokens)
        self.assertExpectedInline(after_code(ex), """\
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
        hidden = torch.randn(3, 4, D, requires_grad=True)
        targets = torch.randint(0, V, (3, 4))

        def loss(h, t):
            logp = torch.log_softmax(h @ weight.t(), dim=-1, dtype=torch.float32)
            return F.nll_loss(logp.flatten(0, 1), t.flatten(), reduction="sum")

        ex = _check_numerics(loss, [hidden, weight], hidden, targets)
        self.assertExpectedInline(after_code(ex), """\
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
        hidden = torch.randn(2, 5, D, requires_grad=True)
        targets = torch.randint(0, V, (2, 5))
        targets[1, 3] = -1

        def loss(h, t):
            return criterion(torch.matmul(h, weight_dv).view(-1, V), t.view(-1))

        ex = _check_numerics(loss, [hidden, weight_dv], hidden, targets)
        self.assertExpectedInline(after_code(ex), """\
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
        hidden = torch.randn(2, 5, D, requires_grad=True)
        targets = torch.randint(0, V, (2, 5))

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
        hidden = torch.randn(10, D, requires_grad=True)
        targets = torch.randint(0, V, (10,))

        def loss(h, t):
            return F.cross_entropy(torch.addmm(bias, h.view(-1, D), weight_dv), t, reduction="none")

        ex = _check_numerics(lambda h, t: loss(h, t).sum(), [hidden, weight_dv, bias], hidden, targets)
        self.assertExpectedInline(after_code(ex), """\
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
        hidden = torch.randn(2, 5, D, requires_grad=True)
        targets = torch.randint(0, V, (2, 5))

        def loss(h, t):
            logits = F.linear(h, weight)
            logits = torch.tanh(logits / 3.0) * 3.0
            return F.cross_entropy(logits.float().view(-1, V), t.view(-1))

        ex = _check_numerics(loss, [hidden, weight], hidden, targets)
        self.assertExpectedInline(after_code(ex), """\
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
        self.assertEqual(ex.applied[0].params["softcap"], 3.0)

    def test_z_loss_uses_the_ops_log_sum_exp(self):
        """A z-loss ``logsumexp(logits, -1)²`` reads the op's per-row log-sum-exp; no logits remain."""
        weight, _ = _params()
        hidden = torch.randn(2, 5, D, requires_grad=True)
        targets = torch.randint(0, V, (2, 5))

        def loss(h, t):
            logits = F.linear(h, weight)
            ce = F.cross_entropy(logits.float().view(-1, V), t.view(-1))
            return ce + 1e-2 * torch.logsumexp(logits.float(), dim=-1).pow(2).mean()

        ex = _check_numerics(loss, [hidden, weight], hidden, targets)
        self.assertExpectedInline(after_code(ex), """\
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
        self.assertEqual(ex.applied[0].params["z_loss_terms"], 1)

    def test_log_sum_exp_of_other_rows_is_an_escape(self):
        """A logsumexp over logits the loss only sees shifted (``[:, :-1]``) cannot use the op's rows."""
        weight, _ = _params()

        def loss(h, t):
            logits = F.linear(h, weight)
            ce = F.cross_entropy(logits[:, :-1].reshape(-1, V), t[:, 1:].reshape(-1))
            return ce + torch.logsumexp(logits, dim=-1).mean()

        ex = rewritten(loss, torch.randn(2, 5, D), torch.randint(0, V, (2, 5)))
        self.assertFalse(ex.applied)
        self.assertIn("the loss reads a subset of their rows", ex.records[0].reason)

    def test_low_precision_logits_keep_loss_dtype(self):
        """bf16 logits without ``.float()``: the loss stays bf16 as in eager, computed in fp32 inside."""
        weight = nn.Parameter(torch.randn(V, D, dtype=torch.bfloat16))
        hidden = torch.randn(4, D, dtype=torch.bfloat16, requires_grad=True)
        targets = torch.randint(0, V, (4,))

        def loss(h, t):
            return F.cross_entropy(F.linear(h, weight), t)

        ex = rewritten(loss, hidden, targets)
        self.assertEqual(ex.result.dtype, torch.bfloat16)
        self.assertExpectedInline(after_code(ex), """\
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
        hidden = torch.randn(2, 5, D, requires_grad=True)
        targets = torch.randint(0, V, (2, 5))

        def loss(h, t):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = F.linear(h, weight)
            return F.cross_entropy(logits.float().view(-1, V), t.view(-1))

        expected = loss(hidden, targets)
        ex = rewritten(loss, hidden, targets)
        torch.testing.assert_close(ex.result, expected, rtol=2e-2, atol=2e-2)
        self.assertEqual(ex.applied[0].params["dtype"], "bfloat16")
        self.assertExpectedInline(after_code(ex), """\
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


class TestReturnedLogits(TestCase):
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
        self.assertEqual(ex.records[0].params["returns_logits"], True)
        self.assertExpectedInline(after_code(ex), """\
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
        self.assertEqual(ex.records[0].params["variant"], "rowwise")
        self.assertExpectedInline(after_code(ex), """\
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
        self.assertEqual(ex.records[0].params["variant"], "rowwise")
        self.assertEqual(len(ex.result), 3)  # the extra outputs stay inside the wrapper
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
        self.assertEqual(ex.records[0].params["variant"], "with_logits")
        self.assertIn("nothing wants a gradient", ex.records[0].params["variant_reason"])
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
        self.assertEqual([r.applied for r in explanation.records], [True])
        accuracy, loss = explanation.result
        expected_accuracy, expected_loss = fn(hidden, targets)
        torch.testing.assert_close(accuracy, expected_accuracy)
        torch.testing.assert_close(loss, expected_loss)
        assert_close_all(grads(loss, [hidden, weight, bias]), grads(expected_loss, [hidden, weight, bias]))

    def test_dynamic_shapes(self):
        """Symbolic leading sizes of the returned logits are read off the hidden states, for both ops."""
        weight, _ = _params()

        def fn(h, t):
            logits = h @ weight.t()
            return logits, F.cross_entropy(logits.float().flatten(0, 1), t.flatten())

        for variant in ("auto", "rowwise"):
            for batch, seq in [(2, 3), (3, 5)]:
                hidden = torch.randn(batch, seq, D, requires_grad=True)
                targets = torch.randint(0, V, (batch, seq))
                ex = _check_returned(fn, [hidden, weight], hidden, targets, dynamic=True, cce_variant=variant)
                self.assertTrue(ex.applied)
                self.assertEqual(ex.records[0].params["variant"], "rowwise" if variant == "rowwise" else "with_logits")
            self.assertIn("size()", after_code(ex))

    def test_a_copy_of_the_logits_returned_declines(self):
        weight, _ = _params()

        def fn(h, t):
            logits = F.linear(h, weight).float()
            return logits, F.cross_entropy(logits.view(-1, V), t.view(-1))

        self.assertExpectedInline(record_lines(rewritten(fn, torch.randn(2, 3, D), torch.randint(0, V, (2, 3)))), """cce applied=False proof=None: a copy of the logits (logits, made on the way to the loss) is returned from the compiled graph, so it stays alive and rewriting saves nothing; return the classifier's own output instead""")

    def test_shifted_loss_rows_decline(self):
        weight, _ = _params()

        def fn(h, t):
            logits = F.linear(h, weight)
            return logits, F.cross_entropy(logits[:, :-1].reshape(-1, V), t[:, 1:].reshape(-1))

        self.assertExpectedInline(record_lines(rewritten(fn, torch.randn(2, 4, D), torch.randint(0, V, (2, 4)))), """cce applied=False proof=None: the logits are used outside the loss and the loss reads a subset of their rows (getitem (call_function getitem)); memopt.cce_with_logits needs the loss rows to be the logits' rows (shift the labels instead, as HF does)""")


class TestDeclines(TestCase):
    def _decisions(self, fn, *args, **options):
        return record_lines(rewritten(fn, *args, **options))

    def test_class_weights(self):
        weight, _ = _params()
        class_weight = torch.rand(V)
        self.assertExpectedInline(
            self._decisions(
                lambda h, t: F.cross_entropy(F.linear(h, weight), t, weight=class_weight),
                torch.randn(6, D),
                torch.randint(0, V, (6,)),
            ),
            """cce applied=False proof=None: class weights are not supported by memopt.cce""",
        )

    def test_soft_labels(self):
        weight, _ = _params()
        self.assertExpectedInline(
            self._decisions(
                lambda h, p: F.cross_entropy(F.linear(h, weight), p), torch.randn(6, D), torch.rand(6, V).softmax(-1)
            ),
            """cce applied=False proof=None: soft-label targets (class probabilities) are not supported by memopt.cce""",
        )

    def test_logits_as_graph_input(self):
        """A graph break between head and loss: the loss graph sees the logits as an input."""
        self.assertExpectedInline(
            self._decisions(lambda logits, t: F.cross_entropy(logits.float(), t), torch.randn(6, V), torch.randint(0, V, (6,))),
            """cce applied=False proof=None: the logits arrive as a graph input, so the classifier that produced them was compiled in another graph (a graph break between the head and the loss); find the break with TORCH_LOGS=graph_breaks and compile head and loss together (fullgraph=True shows it as an error)""",
        )

    def test_not_a_linear_classifier(self):
        self.assertExpectedInline(
            self._decisions(
                lambda x, t: F.cross_entropy(torch.relu(x * 2), t), torch.randn(6, V), torch.randint(0, V, (6,))
            ),
            """cce applied=False proof=None: the logits come from relu (call_function relu), not from a linear classifier""",
        )

    def test_small_head_below_threshold(self):
        """A 10-class head saves less than min_saved_bytes: declined, proved for every shape."""
        head = nn.Linear(D, 10)
        self.assertExpectedInline(
            self._decisions(
                lambda h, t: F.cross_entropy(head(h), t), torch.randn(64, D), torch.randint(0, 10, (64,)), force=False
            ),
            """cce applied=False proof=static: saving <bytes> against torch.compile (<bytes> saved for the backward, <bytes> transient) is below min_saved_bytes=1048576 for every shape""",
        )

    def test_large_vocabulary_applies_without_force(self):
        """Under dynamic shapes a tiny batch would not pay on CPU, so the decision rests on the size hint."""
        vocab, dim, batch, seq = 8192, 16, 4, 1024
        weight = nn.Parameter(torch.randn(vocab, dim) * 0.02)

        def fn(h, t):
            return F.cross_entropy(F.linear(h, weight).float().view(-1, vocab), t.view(-1))

        ex = rewritten(
            fn, torch.randn(batch, seq, dim), torch.randint(0, vocab, (batch, seq)), force=False, dynamic=True
        )
        self.assertExpectedInline(record_lines(ex), """cce applied=True proof=hint: logits never materialized; gradients taken in the forward (6·N·D·V FLOPs); frees <bytes> against torch.compile (<bytes> saved for the backward, <bytes> transient) for the example shapes (size hints)""")
        record = ex.records[0]
        self.assertIn("s", record.saved_bytes)  # symbolic in the batch and sequence sizes
        # torch.compile keeps the fp32 logits ``.float()`` made: what the rewrite stops saving
        self.assertGreater(record.against_compile["saved_hint"], 0.95 * batch * seq * vocab * 4)
        self.assertGreater(record.saved_bytes_hint, 0)


def test_filter_option_reaches_the_op():
    """``cce_filter_eps`` (a CUDA speed option) is passed to the op: "auto" is the dtype's eps / 32; the default
    passes nothing, so the exact op is called."""
    hidden = torch.randn(4, 6, 8, requires_grad=True)
    weight = nn.Parameter(torch.randn(50, 8))
    targets = torch.randint(0, 50, (4, 6))

    def step(hidden, targets):
        return F.cross_entropy(F.linear(hidden, weight).view(-1, 50), targets.view(-1))

    def op_args(**options):
        code = after_code(rewritten(step, hidden, targets, **options))
        call = code[code.index("torch.ops.memopt.cce.default(") :]
        return call[: call.index(")")]

    assert op_args().endswith("'mean', 0.0, None")
    assert op_args(cce_filter_eps=0.25).endswith("'mean', 0.0, None, 0.25")
    assert op_args(cce_filter_eps="auto").endswith(f"'mean', 0.0, None, {torch.finfo(torch.float32).eps / 32}")


class TestVariant(TestCase):
    """Which CCE op serves a scalar loss: the rule weighs FLOPs against what each variant keeps, and says so."""

    def _loss(self, vocab: int, dim: int, z_loss: bool = False, dtype: torch.dtype = torch.float32):
        weight = nn.Parameter((torch.randn(vocab, dim) * 0.02).to(dtype))

        def fn(h, t):
            logits = F.linear(h, weight).float()
            loss = F.cross_entropy(logits.view(-1, vocab), t.view(-1))
            return loss + 1e-4 * torch.logsumexp(logits, -1).square().mean() if z_loss else loss

        return fn, weight

    def test_auto_takes_rowwise_where_it_keeps_most_of_the_saving(self):
        """Decided as for CUDA (where the row-wise op is the faster), run on CPU."""
        fn, weight = self._loss(vocab=4096, dim=16)
        hidden = torch.randn(2, 256, 16, requires_grad=True)
        ex = _check_numerics(
            fn, [hidden, weight], hidden, torch.randint(0, 4096, (2, 256)), force=False, cce_variant="auto",
            assume_device="cuda",
        )
        record = ex.records[0]
        self.assertEqual(record.params["variant"], "rowwise")
        self.assertIn("of the chunked one's", record.params["variant_reason"])
        self.assertIn("torch.ops.memopt.cce_rowwise.default", after_code(ex))

    def test_auto_weighs_the_variants_against_torch_compile(self):
        """The 3/4 rule on what each variant frees against torch.compile, not on the graph as written: there the
        fp32 log-probabilities eager would keep make the row-wise op look as good as the chunked one (63.2 against
        71.2 MiB here), where torch.compile keeps only the bf16 logits and the row-wise op's ∂C [V, D] (kept in
        bf16, summed in fp32 inside the op) costs most of them at D = 384. Each figure in the reason is the one the forced variant's record carries, and the
        op applied is the chosen one."""
        vocab, dim, tokens = 8192, 384, 1024
        fn, _ = self._loss(vocab=vocab, dim=dim, dtype=torch.bfloat16)
        hidden = torch.randn(1, tokens, dim, dtype=torch.bfloat16, requires_grad=True)
        targets = torch.randint(0, vocab, (1, tokens))

        def decided(**options):
            torch._dynamo.reset()
            ex = rewritten(fn, hidden, targets, force=False, assume_device="cuda", **options)
            return ex, ex.records[0]

        _, eager = decided(pricing="eager")
        self.assertEqual(eager.params["variant"], "rowwise")
        self.assertNotIn("against torch.compile", eager.params["variant_reason"])
        ex, auto = decided(cce_variant="auto")
        peak = {v: decided(cce_variant=v)[1].against_compile["peak_hint"] for v in ("rowwise", "chunked")}
        self.assertLess(4 * peak["rowwise"], 3 * peak["chunked"])
        self.assertEqual(auto.params["variant"], "chunked")
        figures = [fxpass.shapes.format_bytes(peak[v]) for v in ("rowwise", "chunked")]
        self.assertEqual(
            auto.params["variant_reason"],
            f"the row-wise variant frees {figures[0]} of the chunked one's {figures[1]} against torch.compile, "
            "under 3/4, so 8·N·D·V FLOPs",
        )
        self.assertEqual(auto.against_compile["peak_hint"], peak["chunked"])
        code = after_code(ex)
        self.assertIn("torch.ops.memopt.cce.default(", code)
        self.assertNotIn("cce_rowwise", code)
        torch.testing.assert_close(ex.result, fn(hidden, targets), atol=2e-2, rtol=1e-2)

    def _returned_logits_loss(self, vocab: int, dim: int, body=None):
        """Logits returned beside their loss, after ``body`` (a module, or a function of the hidden states) or
        straight from the inputs (the head alone in its graph, as FSDP2's per-block frames leave it)."""
        weight = nn.Parameter(torch.randn(vocab, dim) * 0.02)

        def fn(h, t):
            logits = F.linear(h if body is None else body(h), weight)
            return logits, F.cross_entropy(logits.float().view(-1, vocab), t.view(-1))

        return fn, [weight, *(body.parameters() if isinstance(body, nn.Module) else ())]

    @staticmethod
    def _mlp(dim: int, width: int) -> nn.Module:
        return nn.Sequential(nn.Linear(dim, width), nn.GELU(), nn.Linear(width, dim))

    def _decided(self, fn, vocab: int, dim: int) -> dict:
        """The CCE record's params for ``fn`` on [2, 256, dim] hidden states, decided as for CUDA."""
        hidden = torch.randn(2, 256, dim, requires_grad=True)
        ex = rewritten(fn, hidden, torch.randint(0, vocab, (2, 256)), force=False, cce_variant="auto",
                       assume_device="cuda")
        return ex.records[0].params

    def _check_returned_logits(self, fn, params, hidden, targets, variant: str, reason: str, op: str):
        """The record's variant and reason, the op in the code, and loss, logits and gradients against eager's,
        also with the returned logits in the loss (their gradient re-attached by the backend's wrapper)."""
        ex = rewritten(fn, hidden, targets, force=False, cce_variant="auto", assume_device="cuda")
        record = ex.records[0]
        self.assertEqual(record.params["variant"], variant)
        self.assertIn(reason, record.params["variant_reason"])
        code = after_code(ex)
        self.assertIn(f"torch.ops.memopt.{op}.default(", code)
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

    def test_auto_serves_returned_logits_with_the_detached_op(self):
        """Decided as for CUDA, with the logits returned after a body that outweighs the head more than 3×: what
        the row-wise op keeps for the backward would sit on the step's peak beside them, so "auto" takes
        ``cce_with_logits`` with the logits detached (the backend's wrapper carries their gradient) and says what
        it avoided."""
        vocab, dim = 16384, 16  # fp32 logits of 128 MiB, two of the op's 64 MiB chunks
        fn, params = self._returned_logits_loss(vocab, dim, self._mlp(dim, 32768))  # 2·2·16·32768 = 4 × 2·16·16384
        hidden = torch.randn(2, 1024, dim, requires_grad=True)  # chunks below the logits
        code = self._check_returned_logits(
            fn, params, hidden, torch.randint(0, vocab, (2, 1024)), "with_logits",
            "detached cce_with_logits keeps nothing for the backward", "cce_with_logits",
        )
        call = code[code.index("torch.ops.memopt.cce_with_logits.default(") :]
        self.assertTrue(call[: call.index(")")].endswith(", True"), call)  # detach_logits

    def test_auto_serves_head_alone_returned_logits_with_the_rowwise_op(self):
        """The head alone in its graph (FSDP2 compiles each block as a frame of its own): nothing else runs
        beside the detached op's extra GEMM, so "auto" takes the row-wise op, which returns the logits too."""
        vocab, dim = 16384, 16
        fn, params = self._returned_logits_loss(vocab, dim)
        hidden = torch.randn(2, 2048, dim, requires_grad=True)  # chunks well below the logits
        self._check_returned_logits(
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
        self.assertTrue(record.applied, record.reason)
        self.assertEqual(record.params["variant"], "rowwise")
        self.assertIn("a head-heavy graph", record.params["variant_reason"])
        # the returned logits (bf16 [1024, 32000]) count against the op: it frees less than torch.compile's
        # saved logits plus the zeros autograd hands them
        self.assertLess(record.against_compile["peak_hint"], 2 * 1024 * 32000 * 2)
        self.assertGreater(record.against_compile["peak_hint"], 0)
        peaks = ex.peak_bytes()
        self.assertLess(peaks["memopt"], peaks["torch.compile"])

    def test_a_body_of_addmm_counts(self):
        """GPT-2's Conv1D layers are ``torch.addmm`` (bias first): their work counts against the head's too."""
        vocab, dim, width = 4096, 16, 8192  # other matmuls 4× the classifier's
        up, down = nn.Parameter(torch.randn(dim, width) * 0.1), nn.Parameter(torch.randn(width, dim) * 0.02)
        up_bias, down_bias = nn.Parameter(torch.zeros(width)), nn.Parameter(torch.zeros(dim))

        def body(h):
            x = torch.addmm(down_bias, torch.addmm(up_bias, h.view(-1, dim), up).relu(), down)
            return x.view(h.shape)

        fn, _ = self._returned_logits_loss(vocab, dim, body)
        self.assertEqual(self._decided(fn, vocab, dim)["variant"], "with_logits")

    def test_a_checkpointed_body_counts(self):
        """A body under activation checkpointing (HF's ``activation_checkpointing_enable``) is a region of its own in
        the graph: its matmuls still count against the head's, so the whole model keeps ``cce_with_logits``."""
        vocab, dim = 4096, 16
        mlp = self._mlp(dim, 8192)
        fn, _ = self._returned_logits_loss(
            vocab, dim, lambda h: torch.utils.checkpoint.checkpoint(mlp, h, use_reentrant=False)  # 4× the head
        )
        self.assertEqual(self._decided(fn, vocab, dim)["variant"], "with_logits")

    def test_a_small_body_leaves_the_graph_head_heavy(self):
        """A body whose matmuls do less work than the classifier: the row-wise op, and the reason gives the
        figures."""
        vocab, dim = 4096, 16
        fn, _ = self._returned_logits_loss(vocab, dim, self._mlp(dim, 512))  # 2·16·512 < 4096·16 a token
        params = self._decided(fn, vocab, dim)
        self.assertEqual(params["variant"], "rowwise")
        self.assertRegex(params["variant_reason"],
                         r"other matmuls 1\.7e\+07 FLOPs, at most 3× the classifier's 6\.7e\+07")

    def test_the_head_heavy_bound_is_three_times_the_classifier(self):
        """Other matmuls of exactly 3× the classifier's work (an MLP 1.5× as wide as the vocabulary): the row-wise
        op; a little more: ``cce_with_logits``, whose extra GEMM is then under 1/12 of the step's matmul work."""
        vocab, dim = 4096, 16
        for width, variant in ((6144, "rowwise"), (6208, "with_logits")):
            fn, _ = self._returned_logits_loss(vocab, dim, self._mlp(dim, width))
            self.assertEqual(self._decided(fn, vocab, dim)["variant"], variant, width)

    def test_widened_returned_logits_take_the_row_wise_op_only_where_the_head_outweighs_the_rest(self):
        """Logits returned in fp32 after a bf16 classifier (HF Trainer's ``convert_to_fp32``): ``cce_with_logits``
        writes them from its GEMM in fp32, where the row-wise op's bf16 logits would be cast beside them. A body
        of 2× the classifier's work keeps ``cce_with_logits`` (in bf16 it would be head-heavy); a body lighter
        than the classifier counts as head-heavy (the row-wise op, where it frees memory against torch.compile)."""
        vocab, dim = 4096, 16
        for width, widened, heavy in ((4096, True, False), (4096, False, True), (512, True, True)):
            torch.manual_seed(0)
            body = self._mlp(dim, width).to(torch.bfloat16)
            weight = nn.Parameter((torch.randn(vocab, dim) * 0.02).to(torch.bfloat16))

            def fn(h, t, body=body, weight=weight, widened=widened):
                logits = F.linear(body(h), weight)
                loss = F.cross_entropy(logits.float().view(-1, vocab), t.view(-1))
                return (logits.float() if widened else logits), loss

            hidden = torch.randn(2, 256, dim, dtype=torch.bfloat16, requires_grad=True)
            ex = rewritten(fn, hidden, torch.randint(0, vocab, (2, 256)), force=False, cce_variant="auto",
                           assume_device="cuda")
            reason = ex.records[0].params.get("variant_reason", "")
            self.assertEqual("a head-heavy graph" in reason, heavy, (width, widened, reason))
            if heavy:
                self.assertIn("less than the classifier's" if widened else "at most 3× the classifier's", reason)
            else:
                self.assertEqual(ex.records[0].params["variant"], "with_logits")

    def test_a_head_heavy_graph_keeps_the_detached_op_where_the_row_wise_one_frees_under_half(self):
        """Other matmuls 2× the classifier's (head-heavy, not alone), a wide classifier over few tokens: the
        row-wise op's ∂C [V, D], 3/4 of the logits' [N, V] size here, leaves it under half of what
        ``cce_with_logits`` frees against torch.compile, so ``cce_with_logits`` serves the returned logits, with
        both figures."""
        vocab, dim, tokens = 8192, 768, 1024
        torch.manual_seed(0)
        body = self._mlp(dim, vocab).to(torch.bfloat16)  # 2·2·dim·vocab: twice the classifier's 2·dim·vocab
        weight = nn.Parameter((torch.randn(vocab, dim) * 0.02).to(torch.bfloat16))

        def fn(h, t):
            logits = F.linear(body(h), weight)
            return logits, F.cross_entropy(logits.float().view(-1, vocab), t.view(-1))

        hidden = torch.randn(1, tokens, dim, dtype=torch.bfloat16, requires_grad=True)
        ex = rewritten(fn, hidden, torch.randint(0, vocab, (1, tokens)), force=False, cce_variant="auto",
                       assume_device="cuda")
        record = ex.records[0]
        self.assertTrue(record.applied, record.reason)
        self.assertEqual(record.params["variant"], "with_logits", record.params.get("variant_reason"))
        self.assertRegex(record.params["variant_reason"],
                         r"a head-heavy graph .*; but the row-wise op frees [\d.]+ MiB against torch.compile, under "
                         r"half of cce_with_logits' [\d.]+ MiB")

    def test_auto_takes_rowwise_off_cuda(self):
        """The same loss decided for the CPU: the row-wise op serves it as on CUDA, weighed by the same 3/4 rule
        (at 512 tokens its 512-row chunk would be all the logits, and the chunked op stays: the test below)."""
        fn, weight = self._loss(vocab=4096, dim=16)
        hidden = torch.randn(4, 1024, 16, requires_grad=True)
        ex = _check_numerics(
            fn, [hidden, weight], hidden, torch.randint(0, 4096, (4, 1024)), force=False, cce_variant="auto"
        )
        record = ex.records[0]
        self.assertEqual(record.params["variant"], "rowwise")
        self.assertRegex(record.params["variant_reason"], r"^the row-wise variant frees .* of the chunked one's")
        self.assertIn("memopt.cce_rowwise", after_code(ex))

    # (tokens, hidden size) per device where 16-bit weights keep the chunked op: off CUDA a loss-only chunk is at
    # least 512 rows, so fewer tokens than that leave the row-wise op a chunk of all the logits
    _FEW_TOKENS: ClassVar[dict[str | None, tuple[int, int]]] = {"cuda": (16, 64), None: (2048, 512)}

    def _decided_at_few_tokens(self, device: str | None, dtype: torch.dtype):
        """The loss at ``_FEW_TOKENS[device]`` with weights in ``dtype``, checked against eager and decided for
        ``device`` (None: the graph's own device, the CPU)."""
        tokens, dim = self._FEW_TOKENS[device]
        fn, weight = self._loss(vocab=4096, dim=dim, dtype=dtype)
        hidden = torch.randn(1, tokens, dim, dtype=dtype, requires_grad=True)
        torch._dynamo.reset()
        return _check_numerics(
            fn, [hidden, weight], hidden, torch.randint(0, 4096, (1, tokens)), cce_variant="auto", assume_device=device
        )

    def test_auto_keeps_chunked_where_the_saved_gradients_cost_too_much(self):
        """Few tokens against a large classifier of 16-bit weights: ∂C [V, D], summed in fp32 and kept from
        forward to backward beside the weight's own bf16 gradient, outweighs the logits, on CUDA and on the CPU
        alike."""
        for device in self._FEW_TOKENS:
            with self.subTest(assume_device=device):
                record = self._decided_at_few_tokens(device, torch.bfloat16).records[0]
                self.assertEqual(record.params["variant"], "chunked")
                self.assertIn("under 3/4", record.params["variant_reason"])

    def test_an_fp32_weight_takes_its_gradient_in_the_forward_for_free(self):
        """The same losses with fp32 weights: ∂C's fp32 sum is the weight's gradient itself, which torch.compile
        allocates in the backward anyway, so the memory model charges only its padding rows (none at V = 4096)
        and "auto" takes the row-wise op, on CUDA and on the CPU alike."""
        for device in self._FEW_TOKENS:
            with self.subTest(assume_device=device):
                ex = self._decided_at_few_tokens(device, torch.float32)
                record = ex.records[0]
                self.assertEqual(record.params["variant"], "rowwise")
                self.assertRegex(record.params["variant_reason"], r"^the row-wise variant frees .* of the chunked one's")
                self.assertIn("memopt.cce_rowwise", after_code(ex))

    def test_z_loss_needs_the_chunked_variant(self):
        fn, weight = self._loss(vocab=64, dim=8, z_loss=True)
        hidden = torch.randn(2, 5, 8, requires_grad=True)
        ex = _check_numerics(fn, [hidden, weight], hidden, torch.randint(0, 64, (2, 5)), cce_variant="rowwise")
        record = ex.records[0]
        self.assertEqual(record.params["variant"], "chunked")
        self.assertIn("z-loss terms need the log-sum-exp's own gradient", record.params["variant_reason"])

    def test_inference_takes_no_gradient(self):
        """Under no_grad the forward computes the loss alone: the op is told no input needs a gradient."""
        fn, _ = self._loss(vocab=64, dim=8)
        with torch.no_grad():
            ex = rewritten(fn, torch.randn(2, 5, 8), torch.randint(0, 64, (2, 5)), cce_variant="rowwise")
        self.assertIn("'mean', 0.0, None, False, False, False)", after_code(ex))


# --- transforms between the classifier and the loss --------------------------------------------------------------

SCALE, DIVISOR, CAP = 0.3, 3.0, 0.5  # not powers of two: a multiplication by 1/3 would not give a division's bits


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


class TestTransformedLogits(TestCase):
    """A scale (multiplied or divided) and a softcap between classifier and loss become the op's arguments; where
    the graph returns the transformed logits, the op returns them, bit for bit as eager computes them, and their
    gradient goes back through the transform (the z-loss second loss checks it)."""

    def _dropped(self, kind: str) -> str:
        weight, _ = _params()
        hidden = torch.randn(2, 3, D, requires_grad=True)
        ex = _check_numerics(_transform_fn(kind, weight, returns=False), [hidden, weight], hidden, _labels())
        self.assertEqual(ex.records[0].params["returned_logits_transformed"], False)
        return after_code(ex)

    def _returned(self, kind: str, variant: str = "auto") -> fxpass.Explanation:
        weight, _ = _params()
        hidden = torch.randn(2, 3, D, requires_grad=True)
        fn = _transform_fn(kind, weight, returns=True)
        labels = _labels()
        ex = _check_returned(fn, [hidden, weight], hidden, labels, second_loss=_z_loss, cce_variant=variant)
        self.assertTrue(torch.equal(ex.result[0], fn(hidden, labels)[0]))  # the transformed logits, bit for bit
        record = ex.records[0]
        self.assertEqual(record.params["returned_logits_transformed"], True)
        self.assertEqual(record.params["variant"], "rowwise" if variant == "rowwise" else "with_logits")
        return ex

    def test_mul_scale_dropped(self):
        self.assertExpectedInline(self._dropped("mul"), """\
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
        self.assertExpectedInline(self._dropped("div"), """\
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
        self.assertExpectedInline(self._dropped("softcap"), """\
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
        self.assertExpectedInline(self._dropped("mul_softcap"), """\
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
        self.assertExpectedInline(after_code(self._returned("mul")), """\
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
        self.assertExpectedInline(after_code(self._returned("div")), """\
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
        self.assertExpectedInline(after_code(self._returned("softcap")), """\
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
        self.assertEqual((ex.records[0].params["logit_scale"], ex.records[0].params["softcap"]), (SCALE, CAP))
        self.assertExpectedInline(after_code(ex), """\
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

    def test_rowwise_returns_the_transformed_logits(self):
        """The row-wise op (CUDA's choice for a head alone in its graph) transforms the logits it returns in
        place once its chunks have read them; the wrapper's gradient goes back through the transform."""
        for kind in ("mul", "div", "softcap", "mul_softcap"):
            with self.subTest(kind=kind):
                torch._dynamo.reset()
                code = after_code(self._returned(kind, variant="rowwise"))
                self.assertIn("transform_logits = True", code)

    def test_raw_logits_returned_beside_a_transformed_loss(self):
        """The graph returns the classifier's own output and scales only the loss's copy: the op returns the
        logits untransformed and the loss is taken over the scaled ones."""
        weight, _ = _params()
        hidden = torch.randn(2, 3, D, requires_grad=True)

        def fn(h, t):
            logits = F.linear(h, weight)
            return logits, F.cross_entropy((logits.float() * SCALE).view(-1, V), t.view(-1))

        for variant in ("auto", "rowwise"):
            with self.subTest(variant=variant):
                torch._dynamo.reset()
                ex = _check_returned(fn, [hidden, weight], hidden, _labels(), second_loss=_z_loss, cce_variant=variant)
                self.assertEqual(ex.records[0].params["returned_logits_transformed"], False)
                self.assertNotIn("transform_logits", after_code(ex))
                self.assertIn("scale = 0.3", after_code(ex))

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
        self.assertEqual(record.params["returned_logits_transformed"], True)
        self.assertIn("cce_with_logits.default(", after_code(ex))
        self.assertNotIn("True, scale", after_code(ex))  # detach_logits stays False: the gradient is the graph's

    def test_a_cast_to_the_same_dtype_before_the_transform(self):
        """``.float()`` of fp32 logits changes nothing: the scaled logits after it are still served as returned."""
        weight, _ = _params()
        hidden = torch.randn(6, D, requires_grad=True)

        def fn(h, t):
            logits = F.linear(h, weight).float() * SCALE
            return logits, F.cross_entropy(logits, t)

        ex = _check_returned(fn, [hidden, weight], hidden, torch.randint(0, V, (6,)), second_loss=_z_loss)
        self.assertEqual(ex.records[0].params["returned_logits_transformed"], True)

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
        self.assertTrue(record.applied, record.reason)
        self.assertEqual(record.params["returned_logits_dtype"], "float32")
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
        self.assertEqual(ex.records[0].params["z_loss_terms"], 1)

    def test_nll_loss_over_scaled_logits(self):
        weight, _ = _params()
        hidden = torch.randn(6, D, requires_grad=True)

        def fn(h, t):
            return F.nll_loss(torch.log_softmax(F.linear(h, weight) / DIVISOR, dim=-1), t)

        ex = _check_numerics(fn, [hidden, weight], hidden, torch.randint(0, V, (6,)))
        self.assertEqual(ex.records[0].params["logit_divisor"], DIVISOR)


class TestTransformDeclines(TestCase):
    """Transforms memopt's ops cannot take: each declined with the one reason that blocks it."""

    def _reason(self, fn, *args, **options) -> str:
        ex = rewritten(fn, *args, **options)
        self.assertFalse([r for r in ex.records if r.rule == "cce" and r.applied])
        return "\n".join(line for line in record_lines(ex).splitlines() if line.startswith("cce "))

    def test_scale_after_the_softcap(self):
        weight, _ = _params()

        def fn(h, t):
            return F.cross_entropy(torch.tanh(F.linear(h, weight) / CAP) * CAP * SCALE, t)

        self.assertExpectedInline(self._reason(fn, torch.randn(6, D), torch.randint(0, V, (6,))), """\
cce applied=False proof=None: the logits are scaled after their softcap (mul_1 (call_function mul)); memopt.cce takes a scale before the softcap only""")

    def test_learned_tensor_scale(self):
        weight, _ = _params()
        scale = nn.Parameter(torch.tensor(SCALE))

        def fn(h, t):
            return F.cross_entropy(F.linear(h, weight) * scale, t)

        self.assertExpectedInline(self._reason(fn, torch.randn(6, D), torch.randint(0, V, (6,))), """\
cce applied=False proof=None: mul (call_function mul) scales the logits by a learned tensor (l_scale_): memopt's ops take a constant scale and do not compute its gradient""")

    def test_constant_tensor_scale(self):
        weight, _ = _params()
        scale = torch.tensor(SCALE)

        def fn(h, t):
            return F.cross_entropy(F.linear(h, weight) * scale, t)

        self.assertExpectedInline(self._reason(fn, torch.randn(6, D), torch.randint(0, V, (6,))), """\
cce applied=False proof=None: mul (call_function mul) scales the logits by a tensor (l_scale_): memopt's ops take the scale as a Python number (reading a tensor's value would sync with the device); store it as a float""")

    def test_symbolic_float_scale(self):
        """A float argument Dynamo does not specialize (dynamic shapes, ``specialize_float=False``) reaches the graph
        as a SymFloat."""
        weight, _ = _params()

        def fn(h, t, scale):
            return F.cross_entropy(F.linear(h, weight) * scale, t)

        with torch._dynamo.config.patch(specialize_float=False):
            reason = self._reason(fn, torch.randn(6, D), torch.randint(0, V, (6,)), SCALE, dynamic=True)
        self.assertExpectedInline(reason, """\
cce applied=False proof=None: mul (call_function mul) scales the logits by a symbolic number (item): Dynamo did not specialize it (torch._dynamo.config.specialize_float), and memopt's ops take the scale as a constant""")

    def test_negative_scale(self):
        weight, _ = _params()
        self.assertExpectedInline(
            self._reason(lambda h, t: F.cross_entropy(F.linear(h, weight) * -2.0, t), torch.randn(6, D),
                         torch.randint(0, V, (6,))),
            """\
cce applied=False proof=None: mul (call_function mul) scales the logits by -2.0; memopt.cce takes a positive, finite scale""",
        )

    def test_returned_part_way_through_the_transform(self):
        weight, _ = _params()

        def fn(h, t):
            scaled = F.linear(h, weight) * SCALE
            return scaled, F.cross_entropy(torch.tanh(scaled / CAP) * CAP, t)

        self.assertExpectedInline(self._reason(fn, torch.randn(6, D), torch.randint(0, V, (6,))), """\
cce applied=False proof=None: the logits are returned from the compiled graph part-way through their transform (scaled, before mul_1); memopt's ops return the classifier's logits or the fully transformed ones""")

    def test_returned_after_a_cast_and_a_transform(self):
        weight, _ = _params()

        def fn(h, t):
            logits = F.linear(h, weight).double() * SCALE
            return logits, F.cross_entropy(logits, t)

        self.assertExpectedInline(self._reason(fn, torch.randn(6, D), torch.randint(0, V, (6,))), """\
cce applied=False proof=None: the transformed logits (logits) are returned from the compiled graph, but a cast or view comes between the classifier and their transform; memopt's ops return logits transformed in the classifier's dtype and layout""")

    def test_raw_and_transformed_both_returned(self):
        weight, _ = _params()

        def fn(h, t):
            raw = F.linear(h, weight)
            logits = raw / DIVISOR
            return raw, logits, F.cross_entropy(logits, t)

        self.assertExpectedInline(self._reason(fn, torch.randn(6, D), torch.randint(0, V, (6,))), """\
cce applied=False proof=None: the logits are used outside the loss both before and after their transform (logits, raw); memopt's ops return one of them""")

    def test_scaled_log_probabilities(self):
        weight, _ = _params()

        def fn(h, t):
            return F.nll_loss(torch.log_softmax(F.linear(h, weight), dim=-1) * SCALE, t)

        self.assertExpectedInline(self._reason(fn, torch.randn(6, D), torch.randint(0, V, (6,))), """cce applied=False proof=None: nll_loss input is not a log_softmax of logits""")
