"""HF GPT-2 and Llama on a CUDA device through Inductor: the CCE kernel in the output code, eager's numbers."""

from __future__ import annotations

import pytest
import torch
from torch._inductor.utils import run_fw_bw_and_get_code

import fxpass
from tests.helpers import assert_close_scaled
from tests.models.test_hf_models import _batch, _check_whole_model, _gpt2, _grads, _llama, _parameters

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


# What each variant leaves in Inductor's output code: the chunked op's Triton kernels are triton_ops, emitted into
# it; the row-wise op's chunk loop is opaque, called as the op. "auto" takes the row-wise op for these fp32 models:
# ∂C's fp32 sum is their weight's gradient itself, not charged.
_EMITTED = {"chunked": "_lse_forward_kernel", "auto": "torch.ops.memopt.cce_rowwise.default"}


@pytest.mark.parametrize("build", [_gpt2, _llama], ids=["gpt2", "llama"])
@pytest.mark.parametrize("variant", list(_EMITTED))
def test_model_on_cuda_emits_cce_kernel(build, variant):
    """A loss-only step compiled with memopt runs the CCE op the variant names and matches eager (fp32, no
    TF32)."""
    model = build().cuda()
    ids, labels = (t.cuda() for t in _batch(masked_lm=False))
    names, params = _parameters(model)

    def step(ids, labels):
        return model(input_ids=ids, labels=labels).loss

    expected = step(ids, labels)
    expected_grads = _grads(expected, params)
    options = {"force": True, "cce_variant": variant}
    compiled = torch.compile(step, backend="memopt", options=options, fullgraph=True)
    loss, codes = run_fw_bw_and_get_code(lambda: compiled(ids, labels))
    assert any(_EMITTED[variant] in code for code in codes), f"{_EMITTED[variant]} missing from the output code"
    records = [record for report in fxpass.reports() for record in report.records if record.rule == "cce"]
    assert records and records[-1].applied
    assert records[-1].params["variant"] == ("chunked" if variant == "chunked" else "rowwise")
    torch.testing.assert_close(loss, expected, rtol=1e-4, atol=1e-4)
    # gradients in another reduction order: rounding scales with each tensor's magnitude, not a fixed atol
    for name, actual, wanted in zip(names, _grads(compiled(ids, labels), params), expected_grads, strict=True):
        assert_close_scaled(actual, wanted, rel=1e-3, name=name)


@pytest.fixture
def no_tf32():
    """fp32 matmuls without TF32, so fp32 results compare at fp32 tolerances. ``torch.backends.cuda.matmul`` is no
    config module (no ``patch``): set, then restored."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


@pytest.mark.parametrize("build", [_gpt2, _llama], ids=["gpt2", "llama"])
@pytest.mark.parametrize("use_logits", [False, True], ids=["logits_dropped", "second_loss_on_logits"])
@pytest.mark.parametrize("variant", ["auto", "rowwise"])
def test_whole_model_on_cuda(build, use_logits, variant, no_tf32):
    """``torch.compile(model, backend="memopt")`` on CUDA: "auto" serves the returned logits with the detached
    ``cce_with_logits`` (Triton kernels), "rowwise" with the row-wise op (its chunk kernel reading them,
    Inductor checking the padded rows' strides); loss, logits and every gradient equal eager's (fp32), with the
    logits dropped or used by a second loss outside the graph."""
    model = build().cuda()
    ids, labels = (t.cuda() for t in _batch(masked_lm=False))
    options = {"force": True, "cce_variant": variant}
    _check_whole_model(model, ids, labels, use_logits, options=options, rtol=1e-4, atol=1e-5)
