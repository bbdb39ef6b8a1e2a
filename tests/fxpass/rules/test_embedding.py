"""The embedding rule: which tables it rewrites (16-bit, trained, dense), what it frees against torch.compile,
and the gradient it gives through a compiled step against float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from expecttest import TestCase

import fxpass
from tests.helpers import after_code, record_lines, rewritten

VOCAB, WIDTH = 32768, 32


def _step(table: nn.Embedding, head: nn.Linear):
    def step(ids):
        return head(table(ids)).float().square().mean()

    return step


def _model(dtype=torch.bfloat16, **embedding):
    torch.manual_seed(0)
    return nn.Embedding(VOCAB, WIDTH, **embedding).to(dtype), nn.Linear(WIDTH, 8).to(dtype)


def _ids():
    return torch.randint(0, VOCAB, (2, 64), generator=torch.Generator().manual_seed(1))


class TestRewrite(TestCase):
    def test_a_16_bit_table_takes_the_op(self):
        table, head = _model(padding_idx=-1)
        ex = rewritten(_step(table, head), _ids(), force=False)
        self.assertExpectedInline(after_code(ex), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_table_parameters_weight_: "bf16[32768, 32]cpu", L_ids_: "i64[2, 64]cpu", L_head_parameters_weight_: "bf16[8, 32]cpu", L_head_parameters_bias_: "bf16[8]cpu"):
        l_table_parameters_weight_ = L_table_parameters_weight_
        l_ids_ = L_ids_
        l_head_parameters_weight_ = L_head_parameters_weight_
        l_head_parameters_bias_ = L_head_parameters_bias_
        embedding_default: "bf16[2, 64, 32]cpu" = torch.ops.memopt.embedding.default(l_ids_, l_table_parameters_weight_, 32767, False);  l_ids_ = l_table_parameters_weight_ = None
        linear: "bf16[2, 64, 8]cpu" = torch._C._nn.linear(embedding_default, l_head_parameters_weight_, l_head_parameters_bias_);  embedding_default = l_head_parameters_weight_ = l_head_parameters_bias_ = None
        float_1: "f32[2, 64, 8]cpu" = linear.float();  linear = None
        square: "f32[2, 64, 8]cpu" = float_1.square();  float_1 = None
        mean: "f32[]cpu" = square.mean();  square = None
        return (mean,)""")
        self.assertExpectedInline(record_lines(ex), """\
wta_crs applied=False proof=static: WTA-CRS is off: it replaces exact weight gradients by unbiased estimates, so it is opt-in; enable with options={'wta_crs_budget': 0.3}, MEMOPT_WTA_CRS_BUDGET=0.3 or backend='memopt_wta' (saved bytes: what budget 0.3 would free as the graph is written; enabled, each group is priced against torch.compile)
embedding applied=True proof=static: the table's gradient summed in fp32 (over the distinct indices) and written in its dtype; frees <bytes> against torch.compile (<bytes> saved for the backward, <bytes> transient) for every shape""")

    def test_tables_with_nothing_to_free_are_declined_with_why(self):
        cases = {
            "fp32": _model(torch.float32),
            "frozen": _model(),
            "sparse": _model(sparse=True),
            "max_norm": _model(max_norm=1.0),
        }
        cases["frozen"][0].weight.requires_grad_(False)
        lines = []
        for name, (table, head) in cases.items():
            ex = rewritten(_step(table, head), _ids(), force=False)
            lines += [f"{name}: {line}" for line in record_lines(ex).splitlines() if line.startswith("embedding")]
        self.assertExpectedInline("\n".join(lines), """\
fp32: embedding applied=False proof=None: the table is float32: Inductor accumulates its gradient in the gradient itself, with no fp32 copy to free
frozen: embedding applied=False proof=None: the table takes no gradient (frozen): the backward writes no table
sparse: embedding applied=False proof=None: sparse=True: the gradient is a sparse tensor, never a dense table
max_norm: embedding applied=False proof=None: max_norm renormalizes the table in place during the forward; left to PyTorch""")


def test_a_small_table_is_declined_on_its_price():
    """GPT-2's position table (1024 × 768): its fp32 copy is smaller than the partial sums the kernel takes
    for 8 × 1024 rows, so against torch.compile the rewrite frees nothing."""
    table = nn.Embedding(1024, 768).bfloat16()
    ids = torch.arange(1024).expand(8, 1024)
    ex = rewritten(lambda ids: table(ids).float().sum(), ids, force=False, assume_device="cuda")
    (record,) = [r for r in ex.records if r.rule == "embedding"]
    assert not record.applied
    assert "below min_saved_bytes" in record.reason


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_price_is_the_fp32_table_less_the_ops_workspace(device):
    """Against torch.compile the backward's peak drops by the V·D·4 table Inductor's decomposition allocates,
    less what the op's kernel takes (its working set) and at most the incoming gradient's fp32 copy."""
    from lowerings.embedding import op

    table, head = _model()
    ids = _ids()
    ex = rewritten(_step(table, head), ids, force=False, assume_device=device)
    (record,) = [r for r in ex.records if r.rule == "embedding"]
    assert record.applied
    workspace = sum(op.working_set(ids.numel(), WIDTH, torch.device(device)).values())
    fp32_table, fp32_rows = VOCAB * WIDTH * 4, ids.numel() * WIDTH * 4
    freed = record.against_compile["peak_hint"]
    assert fp32_table - workspace - fp32_rows <= freed <= fp32_table - workspace + fp32_rows


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_compiled_gradient_is_the_float64_sum_rounded_once(dtype):
    """Rows of a 16-bit table gathered 1024 times over 40 indices, one of them the padding row: the compiled
    step's table gradient is within one rounding of the float64 sum of the incoming gradient's rows (the
    weights a float32 product casts back to the table's dtype)."""
    table = nn.Embedding(VOCAB, WIDTH, padding_idx=3).to(dtype)
    ids = torch.randint(0, 40, (4, 256), generator=torch.Generator().manual_seed(2))
    ids[0, :8] = 3
    weights = torch.randn(4, 256, WIDTH, generator=torch.Generator().manual_seed(3))
    compiled = torch.compile(lambda ids: (table(ids).float() * weights).sum(), backend="memopt", fullgraph=True)
    compiled(ids).backward()
    (record,) = [r for r in fxpass.reports()[-1].records if r.rule == "embedding"]
    assert record.applied
    rows = weights.to(dtype).double().reshape(-1, WIDTH)
    exact = torch.zeros(VOCAB, WIDTH, dtype=torch.float64).index_add_(0, ids.reshape(-1), rows)
    exact[3] = 0
    rounded = (exact.to(dtype).double() - exact).abs().max()
    assert (table.weight.grad.double() - exact).abs().max() <= rounded
    assert not table.weight.grad[3].any()


def test_dynamic_shapes_price_the_table_against_symbolic_rows():
    """Under dynamic shapes the saving is an expression of the batch's sizes (the fp32 table less what the
    op's kernel takes per row), decided on the example's hints without a guard."""
    table, head = _model()
    ex = rewritten(_step(table, head), _ids(), force=False, dynamic=True)
    (record,) = [r for r in ex.records if r.rule == "embedding"]
    assert record.applied and record.proof == "hint"
    freed = record.against_compile["peak"]
    assert str(VOCAB * WIDTH * 4) in freed and "s" in freed  # V·D·4 less a term in the symbolic row count
    assert record.against_compile["peak_hint"] < VOCAB * WIDTH * 4
