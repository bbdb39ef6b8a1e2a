"""``memopt.cce_rowwise`` (gradients taken during the forward) against float64 math and against eager in low
precision; only the gradients asked for are computed; ragged row chunks change nothing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lowerings.cce import rowwise
from tests.helpers import assert_close_all

N, V, D = 23, 37, 8
FP64 = {"rtol": 1e-10, "atol": 1e-10}


def _kernel_device() -> str:
    """Where the chunk kernel runs in these tests: CPU tensors under Triton's interpreter (no GPU), else CUDA,
    where the driver cannot take CPU tensors."""
    from lowerings._library import interpreting

    return "cpu" if interpreting() or not torch.cuda.is_available() else "cuda"


def _inputs(dtype: torch.dtype, bias: bool, device: str = "cpu"):
    gen = torch.Generator().manual_seed(7)
    tensors = [torch.randn(N, D, generator=gen), torch.randn(V, D, generator=gen) / D**0.5]
    if bias:
        tensors.append(torch.randn(V, generator=gen))
    targets = torch.randint(0, V, (N,), generator=gen)
    targets[::5] = -100
    return [t.to(dtype).to(device).requires_grad_() for t in tensors], targets.to(device)


def _ours(leaves, targets, reduction, smoothing=0.0, softcap=None, needs=None):
    h, w, *b = leaves
    needs = needs or (True, True, bool(b))
    return torch.ops.memopt.cce_rowwise(
        h, w, b[0] if b else None, targets, -100, reduction, smoothing, softcap, *needs
    )[0]


def _eager(leaves, targets, reduction, smoothing=0.0, softcap=None):
    logits = F.linear(*leaves)
    z = logits if logits.dtype == torch.float64 else logits.float()
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    return F.cross_entropy(z, targets, reduction=reduction, label_smoothing=smoothing)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize(("bias", "smoothing", "softcap"), [(False, 0.0, None), (True, 0.1, 4.0)])
@pytest.mark.parametrize("rows_per_chunk", [None, 5])
def test_matches_float64(monkeypatch, reduction, bias, smoothing, softcap, rows_per_chunk):
    if rows_per_chunk is not None:  # several ragged chunks
        monkeypatch.setattr(rowwise, "chunk_rows", lambda *_: rows_per_chunk)
    leaves, targets = _inputs(torch.float64, bias)
    loss = _ours(leaves, targets, reduction, smoothing, softcap)
    expected = _eager(leaves, targets, reduction, smoothing, softcap)
    torch.testing.assert_close(loss, expected, **FP64)
    assert_close_all(torch.autograd.grad(3 * loss, leaves), torch.autograd.grad(3 * expected, leaves), **FP64)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_no_worse_than_eager(dtype):
    """|ours − fp64| ≤ 2·|eager same dtype − fp64| + the result's own rounding, loss and every gradient."""
    leaves, targets = _inputs(dtype, bias=True)
    exact_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ours, low, exact = _ours(leaves, targets, "mean"), _eager(leaves, targets, "mean"), _eager(exact_leaves, targets,
                                                                                              "mean")
    triples = zip(
        (ours, *torch.autograd.grad(ours, leaves)),
        (low, *torch.autograd.grad(low, leaves)),
        (exact, *torch.autograd.grad(exact, exact_leaves)),
        strict=True,
    )
    for index, (mine, theirs, truth) in enumerate(triples):
        our_error = (mine.double() - truth).abs().max().item()
        eager_error = (theirs.double() - truth).abs().max().item()
        rounding = torch.finfo(mine.dtype).eps * truth.abs().max().item()
        assert our_error <= 2 * eager_error + rounding, (index, our_error, eager_error)


def test_only_the_gradients_asked_for():
    """A frozen classifier: no ∂C is taken (an empty tensor is kept), and asking too little is an error, never
    a silently missing gradient."""
    (hidden, weight), targets = _inputs(torch.float64, bias=False)
    weight.requires_grad_(False)
    outputs = torch.ops.memopt.cce_rowwise(hidden, weight, None, targets, -100, "mean", 0.0, None, True, False, False)
    assert outputs[2].numel() == 0 and outputs[3].numel() == 0
    expected = torch.autograd.grad(_eager([hidden, weight], targets, "mean"), hidden)
    torch.testing.assert_close(torch.autograd.grad(outputs[0], hidden)[0], expected[0], **FP64)
    loss = _ours([hidden, weight.requires_grad_()], targets, "mean", needs=(True, False, False))
    with pytest.raises(RuntimeError, match="told need_weight=False"):
        loss.backward()


def test_all_targets_ignored_mean_is_nan_like_pytorch():
    """A NaN loss and zero gradients, as PyTorch's cross-entropy gives."""
    leaves, targets = _inputs(torch.float64, bias=False)
    ignored = torch.full_like(targets, -100)
    loss, expected = _ours(leaves, ignored, "mean"), _eager(leaves, ignored, "mean")
    assert torch.isnan(loss) and torch.isnan(expected)
    for ours, theirs in zip(torch.autograd.grad(loss, leaves), torch.autograd.grad(expected, leaves), strict=True):
        assert torch.equal(ours, theirs)


def test_no_rows_gives_zero_gradients_like_pytorch():
    """No chunk runs, so nothing writes ∂C: it must still be zero (the first chunk, not a fill, writes it)."""
    leaves, _ = _inputs(torch.float64, bias=False)
    leaves[0] = leaves[0][:0].detach().requires_grad_()
    no_targets = torch.zeros(0, dtype=torch.long)
    loss, expected = _ours(leaves, no_targets, "sum"), _eager(leaves, no_targets, "sum")
    torch.testing.assert_close(loss, expected, **FP64)
    for ours, theirs in zip(torch.autograd.grad(loss, leaves), torch.autograd.grad(expected, leaves), strict=True):
        assert torch.equal(ours, theirs)


def test_out_of_range_target_raises():
    leaves, targets = _inputs(torch.float32, bias=False)
    targets[2] = V
    with pytest.raises(IndexError, match="out of bounds"):
        _ours(leaves, targets, "sum")


def test_non_scalar_reduction_is_refused():
    leaves, targets = _inputs(torch.float32, bias=False)
    with pytest.raises(RuntimeError, match="must be a scalar"):
        _ours(leaves, targets, "none")


@pytest.mark.parametrize(("bias", "reduction", "softcap"), [(False, "mean", None), (True, "sum", 3.0)])
def test_opcheck(bias, reduction, softcap):
    (h, w, *b), targets = _inputs(torch.float32, bias)
    args = (h, w, b[0] if b else None, targets, -100, reduction, 0.1, softcap, True, True, bias)
    torch.library.opcheck(torch.ops.memopt.cce_rowwise.default, args)


def test_working_set_charges_the_saved_gradients():
    terms = rowwise.working_set(1024, 50000, 768, torch.bfloat16, torch.device("cuda"), (True, True, False))
    # a 16-bit ∂C is kept in 16 bits; its fp32 sum over the padded classifier's rows dies in the op
    assert terms[rowwise.KEPT_16_BIT] == 1024 * 768 * 2 + 50000 * 768 * 2
    assert terms[rowwise.FP32_SUM] == 50048 * 768 * 4
    assert terms["transient (forward): the classifier and its bias, zero-padded to a multiple of 64 rows"] == 50048 * 769 * 2
    chunk = {name: value for name, value in terms.items() if "one chunk of logits" in name}
    # the chunk dies before ∂C's 16-bit copy is allocated: charged only where it is larger
    overlapped = rowwise.CHUNK_BEFORE_KEPT
    row_vectors = rowwise.ROW_VECTOR_BYTES
    padded = 50048  # the classifier's rows padded to the next multiple of 64 above 50000
    assert rowwise.padded_vocab(50000, "cuda") == padded and rowwise.padded_vocab(50048, "cuda") == padded
    assert rowwise.padded_vocab(50000, "cpu") == 50000  # off CUDA the classifier is not copied
    if rowwise.HAS_TRITON:  # the CUDA chunk kernel turns the bf16 logits into their gradient in place: 2 B a logit
        rows = rowwise.chunk_rows(1024, 50000, torch.bfloat16, "cuda", in_place=True)
        share = 1024 * 50000 * 2 // rowwise.FRACTION // (padded * 2 + row_vectors)
        assert rows % 64 == 0 and share // 2 < rows <= share * 5 // 4 + 64
        in_place = "transient (forward): one chunk of logits, turned into their gradient in place [rows, V]"
        assert chunk == {in_place + overlapped: max(rows * (padded * 2 + row_vectors) - 50000 * 768 * 2, 0)}
    product = "transient (forward): a chunk's ∂C product [V, D] and its fp32 copy for the sum"
    assert (product in terms) == (not rowwise._accumulates_in_fp32("cuda"))
    cpu = rowwise.working_set(1024, 50000, 768, torch.bfloat16, torch.device("cpu"), (True, True, False))
    rows = rowwise.chunk_rows(1024, 50000, torch.bfloat16, "cpu")
    per_row = 50000 * 2 + 50000 * 4 + row_vectors  # bf16 logits (not padded off CUDA) and their fp32 copy
    share = 1024 * 50000 * 2 // rowwise.FRACTION // per_row
    assert share < rowwise.MIN_CPU_LOSS_ROWS == rows  # off CUDA a loss-only chunk is at least that many rows
    cpu_chunk = "transient (forward): one chunk of logits and their fp32 copy [rows, V]" + overlapped
    assert cpu[cpu_chunk] == max(rows * per_row - 50000 * 768 * 2, 0)
    assert cpu[product] == 50000 * 768 * 6  # the CPU rounds each chunk's product to bf16, then adds an fp32 copy
    assert not any("zero-padded" in name for name in cpu)
    fp32 = rowwise.working_set(1024, 50000, 768, torch.float32, torch.device("cpu"), (True, True, False))
    rows = rowwise.chunk_rows(1024, 50000, torch.float32, "cpu", in_place=True, gradient_bytes=50000 * 768 * 4)
    assert fp32 == {  # fp32 logits become their gradient in place: no copy, no product to round
        "transient (forward): one chunk of logits, turned into their gradient in place [rows, V]": rows * (50000 * 4 + row_vectors),
        "saved: the loss's gradients ∂E [N, D] and ∂b, taken in the forward": 1024 * 768 * 4,
        rowwise.WEIGHT_GRADIENT_ITSELF: 0,  # an fp32 ∂C is the weight's gradient itself
    }


def test_working_set_spares_the_fp32_weights_gradient():
    """With fp32 weights (autocast over them, or fp32 training) ∂C's fp32 sum is the weight's gradient itself:
    only its padding rows are charged (48 at V = 50000 on CUDA, none off CUDA). A 16-bit classifier's ∂C is kept
    in 16 bits, its fp32 sum a transient of the op."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    kept = rowwise.working_set(1024, 50000, 768, torch.bfloat16, cuda, (True, True, False))
    spared = rowwise.working_set(1024, 50000, 768, torch.bfloat16, cuda, (True, True, False), False, torch.float32)
    assert spared[rowwise.WEIGHT_GRADIENT_ITSELF] == 48 * 768 * 4
    assert spared["saved: the loss's gradients ∂E [N, D] and ∂b, taken in the forward"] == 1024 * 768 * 2
    assert rowwise.FP32_SUM not in spared and rowwise.KEPT_16_BIT not in spared
    # beside the chunks (which differ: the 16-bit case's may grow to ∂C's size and overlaps ∂C), the fp32 sum and
    # the 16-bit ∂C are what keeping ∂C in 16 bits costs
    def beside_chunk(terms):
        return sum(value for name, value in terms.items() if "one chunk of logits" not in name)

    assert beside_chunk(kept) - beside_chunk(spared) == 50000 * 768 * 2 + 50000 * 768 * 4
    fp32 = rowwise.working_set(2048, 50000, 768, torch.float32, cpu, (True, True, True), False, torch.float32)
    assert fp32[rowwise.WEIGHT_GRADIENT_ITSELF] == 0
    assert fp32["saved: the loss's gradients ∂E [N, D] and ∂b, taken in the forward"] == (2048 * 768 + 50000) * 4
    bf16_weight = rowwise.working_set(1024, 50000, 768, torch.bfloat16, cuda, (True, True, False), False, torch.bfloat16)
    assert bf16_weight == kept  # a 16-bit weight's gradient is kept in its dtype, by default too
    with_bias = rowwise.working_set(1024, 50000, 768, torch.bfloat16, cuda, (True, True, True))
    assert with_bias[rowwise.KEPT_16_BIT] - kept[rowwise.KEPT_16_BIT] == 50000 * 2  # ∂b in 16 bits
    assert with_bias[rowwise.FP32_SUM] - kept[rowwise.FP32_SUM] == 50000 * 4  # its fp32 sum in the op
    no_weight = rowwise.working_set(1024, 50000, 768, torch.float32, cpu, (True, False, False), False, torch.float32)
    assert rowwise.WEIGHT_GRADIENT_ITSELF not in no_weight


@pytest.mark.parametrize(("n_rows", "vocab", "rows"), [(8192, 128256, 2048), (16384, 50257, 4096), (8192, 256000, 1216)])
def test_chunks_are_balanced(n_rows, vocab, rows):
    """Chunks of about equal size within 1/4 over the share, so that no small tail chunk runs its GEMMs slowly
    (8192 rows at V = 128256 were 4 × 1984 + 256 rows)."""
    assert rowwise.chunk_rows(n_rows, vocab, torch.bfloat16, "cuda", in_place=True) == rows
    chunks = -(-n_rows // rows)
    assert n_rows - (chunks - 1) * rows >= rows // 2


def test_chunk_may_grow_to_the_cast_gradient():
    """Where ∂C in the input dtype is larger than CHUNK_BYTES, a chunk may be as large: the backward holds that
    cast beside the fp32 ∂C anyway (V = 256000, D = 2304: 4 chunks instead of 7); the rule is charged the same."""
    cast = 256000 * 2304 * 2
    assert rowwise.chunk_rows(8192, 256000, torch.bfloat16, "cuda", True, False, cast) == 2048
    assert rowwise.chunk_rows(8192, 128256, torch.bfloat16, "cuda", True, False, 128256 * 2048 * 2) == 2048
    assert rowwise.chunk_rows(8192, 256000, torch.bfloat16, "cuda", True, False, 0) == 1216  # no ∂C: the cap
    if rowwise.HAS_TRITON:
        terms = rowwise.working_set(8192, 256000, 2304, torch.bfloat16, torch.device("cuda"), (True, True, False))
        in_place = "transient (forward): one chunk of logits, turned into their gradient in place [rows, V]"
        chunk = 2048 * rowwise.chunk_bytes_per_row(256000, torch.bfloat16, "cuda", in_place=True)
        assert chunk <= cast * 5 // 4
        # charged beyond ∂C's 16-bit copy, which the op allocates once the last chunk is freed
        assert terms[in_place + rowwise.CHUNK_BEFORE_KEPT] == max(chunk - cast, 0)
        no_weight = rowwise.working_set(8192, 256000, 2304, torch.bfloat16, torch.device("cuda"), (True, False, False))
        assert no_weight[in_place] < chunk


def test_chunk_beside_returned_logits_is_small():
    """Returning its logits, the op holds a chunk beside all of them: 1/16 of them, but at least the rows that
    keep its GEMMs and ∂C's sum from being bound by memory (MIN_GEMM_ROWS on CUDA, MIN_CPU_GEMM_ROWS elsewhere,
    in chunks of equal size there), and never more rows than there are."""
    for n_rows, vocab in [(16384, 50257), (8192, 128256)]:
        rows = rowwise.chunk_rows(n_rows, vocab, torch.bfloat16, "cuda", True, returns_logits=True)
        assert rows == rowwise.MIN_GEMM_ROWS
        assert rows <= rowwise.chunk_rows(n_rows, vocab, torch.bfloat16, "cuda", True)
        assert rows * vocab * 2 <= n_rows * vocab * 2 // 4  # beside the logits: at most a quarter of them
    assert rowwise.chunk_rows(100, 1000, torch.bfloat16, "cuda", True, returns_logits=True) == 100
    floor = rowwise.MIN_CPU_GEMM_ROWS
    # GPT-2's vocabulary, fp32: at 512 rows 1/16 of the logits is 16 rows of a chunk and its copy, raised to the
    # floor; at 16384 rows the share (under ∂C's size) already holds more than the floor, which changes nothing
    assert rowwise.chunk_rows(512, 50257, torch.float32, "cpu", returns_logits=True) == floor
    share = min(16384 * 50257 * 4 // 16, 50257 * 768 * 4) // rowwise.chunk_bytes_per_row(50257, torch.float32, "cpu")
    cpu = rowwise.chunk_rows(16384, 50257, torch.float32, "cpu", returns_logits=True, gradient_bytes=50257 * 768 * 4)
    assert floor < share and floor <= cpu <= share * 5 // 4
    assert rowwise.chunk_rows(100, 1000, torch.float32, "cpu", returns_logits=True) == 100


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize(("smoothing", "softcap"), [(0.0, None), (0.1, 4.0)])
@pytest.mark.parametrize("bias", [False, True])
def test_chunk_kernel_path(monkeypatch, reduction, smoothing, softcap, bias):
    """The op with its CUDA chunk kernel (here through Triton's interpreter, forced on): fp32 loss and gradients,
    the bias's (column sums of what the kernel writes) among them, equal float64 math, over ragged chunks."""
    from lowerings._library import HAS_TRITON

    if not HAS_TRITON:
        pytest.skip("Triton is not installed")
    monkeypatch.setattr(rowwise, "_kernel_serves", lambda device_type, dtype: True)
    monkeypatch.setattr(rowwise, "chunk_rows", lambda *_: 7)
    leaves, targets = _inputs(torch.float32, bias=bias, device=_kernel_device())
    exact = [t.detach().double().requires_grad_() for t in leaves]
    loss, expected = _ours(leaves, targets, reduction, smoothing, softcap), _eager(exact, targets, reduction,
                                                                                   smoothing, softcap)
    assert len(leaves) == 3 if bias else len(leaves) == 2
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-6)
    for mine, wanted in zip(torch.autograd.grad(loss, leaves), torch.autograd.grad(expected, exact), strict=True):
        torch.testing.assert_close(mine.double(), wanted, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("pad", [False, True], ids=["cpu", "padded_as_on_cuda"])
def test_every_gemm_sees_the_padded_vocabulary(monkeypatch, pad):
    """With a vocabulary off the alignment (37), the classifier's GEMMs run on 64 zero-padded rows where the op
    pads (CUDA; forced here), on its 37 rows off CUDA, in chunks of 64 rows, and the results match float64 math."""
    shapes = []
    width = -(-V // 64) * 64 if pad else V
    if pad:
        monkeypatch.setattr(rowwise, "padded_vocab", lambda vocab, device_type: width)

    def recording(gemm):
        def call(*args, **kwargs):
            shapes.append(tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor)))
            return gemm(*args, **kwargs)

        return call

    for owner, name in ((torch, "mm"), (torch, "addmm"), (torch.Tensor, "addmm_")):
        monkeypatch.setattr(owner, name, recording(getattr(owner, name)))
    monkeypatch.setattr(rowwise, "chunk_rows", lambda *_: 64)
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(150, D, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, D, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, V, (150,), generator=gen)
    loss = torch.ops.memopt.cce_rowwise(hidden, weight, None, targets, -100, "mean", 0.0, None, True, True, False)[0]
    dims = {size for gemm in shapes for shape in gemm for size in shape}
    assert len(shapes) == 3 * 3 and width in dims and (V not in dims or not pad)  # logits, ∂E, ∂C a chunk
    assert dims <= {64, 150 - 128, D, width}  # chunks of 64 rows, then the 22 left
    expected = _eager([hidden, weight], targets, "mean")
    torch.testing.assert_close(loss, expected, **FP64)
    ours, theirs = torch.autograd.grad(loss, [hidden, weight]), torch.autograd.grad(expected, [hidden, weight])
    assert ours[1].shape == weight.shape
    assert_close_all(ours, theirs, **FP64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_temporaries_within_the_working_set(dtype):
    """The forward's temporaries stay within the transient terms the rule charges (the saved gradients are
    outputs, charged apart): one chunk alive at a time. (16-bit GEMMs on CPU add oneDNN's own scratch, which no
    term charges.)"""
    from tests.lowerings.memory import peak_temporary_bytes

    n_rows, vocab, dim = 512, 1024, 16
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(n_rows, dim, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, dim, generator=gen) / dim**0.5).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (n_rows,), generator=gen)
    terms = rowwise.working_set(n_rows, vocab, dim, dtype, torch.device("cpu"))
    transient = sum(value for name, value in terms.items() if name.startswith("transient"))

    forward, _outputs = peak_temporary_bytes(  # the saved gradients are outputs: kept, so not temporaries
        lambda: torch.ops.memopt.cce_rowwise(hidden, weight, None, targets, -100, "mean", 0.0, None, True, True,
                                             False)
    )
    assert 0 < forward <= transient, (forward, transient)
    assert forward > transient // 2  # the charge is what it holds, not a loose bound


@pytest.mark.parametrize("kernel", [False, True], ids=["pytorch_chunks", "chunk_kernel"])
@pytest.mark.parametrize(("bias", "smoothing", "softcap"), [(False, 0.0, None), (True, 0.1, 4.0)])
def test_returned_logits(monkeypatch, kernel, bias, smoothing, softcap):
    """``return_logits``: the op also returns the classifier's logits (a view of rows padded to 64 columns, as
    its fake says), not differentiable, and reads each chunk's gradient from them: loss, logits and gradients
    equal float64 math over ragged chunks, whichever chunk path runs."""
    from lowerings._library import HAS_TRITON

    if kernel:
        if not HAS_TRITON:
            pytest.skip("the chunk kernel needs Triton")
        monkeypatch.setattr(rowwise, "_kernel_serves", lambda device_type, dtype: True)
    monkeypatch.setattr(rowwise, "chunk_rows", lambda *_: 7)
    dtype = torch.float32 if kernel else torch.float64
    leaves, targets = _inputs(dtype, bias, _kernel_device() if kernel else "cpu")
    h, w, *b = leaves
    loss, *_, logits = torch.ops.memopt.cce_rowwise(
        h, w, b[0] if b else None, targets, -100, "mean", smoothing, softcap, True, True, bias, True
    )
    exact = [t.detach().double().requires_grad_() for t in leaves]
    expected = _eager(exact, targets, "mean", smoothing, softcap)
    tol = FP64 if dtype == torch.float64 else {"rtol": 1e-4, "atol": 1e-6}
    assert logits.shape == (N, V) and logits.stride() == (rowwise.padded_vocab(V, h.device.type), 1)
    assert not logits.requires_grad
    torch.testing.assert_close(logits.double(), F.linear(*exact).detach(), **tol)
    torch.testing.assert_close(loss.double(), expected, **tol)
    for mine, wanted in zip(torch.autograd.grad(loss, leaves), torch.autograd.grad(expected, exact), strict=True):
        torch.testing.assert_close(mine.double(), wanted, **tol)


def test_opcheck_with_returned_logits():
    (h, w), targets = _inputs(torch.float32, bias=False)
    args = (h, w, None, targets, -100, "mean", 0.0, None, True, True, False, True)
    torch.library.opcheck(torch.ops.memopt.cce_rowwise.default, args)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_classifiers_gradients_are_rounded_once_in_the_forward(dtype):
    """∂C and ∂b leave the op in the classifier's dtype: the fp32 sums (what ``grad_dtype=float32`` keeps) rounded
    once. The backward multiplies them by the upstream scalar: exact for a power of two, one more rounding
    otherwise, as ∂E has always had."""
    (h, w, b), targets = _inputs(dtype, bias=True)
    args = (h, w, b, targets, -100, "mean", 0.0, None, True, True, True)
    _, _, grad_w, grad_b, _ = torch.ops.memopt.cce_rowwise(*args)
    _, _, wide_w, wide_b, _ = torch.ops.memopt.cce_rowwise(*args, grad_dtype=torch.float32)
    assert grad_w.dtype == grad_b.dtype == dtype and wide_w.dtype == wide_b.dtype == torch.float32
    assert torch.equal(grad_w, wide_w.to(dtype)) and torch.equal(grad_b, wide_b.to(dtype))
    torch.library.opcheck(torch.ops.memopt.cce_rowwise.default, args)
    torch.library.opcheck(torch.ops.memopt.cce_rowwise.default, args, {"grad_dtype": torch.float32})
    for upstream in (1.0, 0.25, 0.3):
        loss = torch.ops.memopt.cce_rowwise(*args)[0]
        weight_grad, bias_grad = torch.autograd.grad(loss * upstream, (w, b))
        for ours, rounded_once in ((weight_grad, wide_w), (bias_grad, wide_b)):
            expected = (rounded_once * upstream).to(dtype)
            if upstream in (1.0, 0.25):
                assert torch.equal(ours, expected)
            else:  # at most one unit in the last place from the product rounded once
                torch.testing.assert_close(ours.float(), expected.float(), rtol=2 ** -7, atol=0.0)


class _TiedLM(torch.nn.Module):
    """An embedding, one layer and the embedding as classifier: the classifier's gradient is the sum of the head's
    and the embedding's, taken at the backward's end."""

    def __init__(self, vocab: int, dim: int):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.mix = torch.nn.Linear(dim, dim)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.mix(self.embed(ids))).flatten(0, 1)
        return F.cross_entropy(F.linear(hidden, self.embed.weight).float(), labels.flatten())


def test_a_tied_16_bit_classifier_keeps_no_fp32_gradient_into_the_backward():
    """A tied classifier's gradient is the sum of the head's and the embedding's, taken at the backward's end.
    Were ∂C kept in fp32 from forward to backward, the traced scaling would fuse into that sum and the fp32 ∂C
    would be alive beside the embedding's fp32 gradient there (the CPU profile showed both). A 16-bit classifier's
    ∂C is rounded in the forward: when the backward allocates the embedding's fp32 [V, D] gradient, no other block
    of that size is alive."""
    from torch.profiler import ProfilerActivity, profile

    import fxpass
    from benchmarks._common import allocation_events

    vocab, dim = 4096, 128  # [V, D] fp32: 2 MiB, apart from the cast's 4 MiB block and every other tensor
    torch.manual_seed(0)
    model = _TiedLM(vocab, dim).to(torch.bfloat16)
    ids = torch.randint(0, vocab, (2, 64))
    # (the embedding rule off: Inductor's decomposition allocates the fp32 [V, D] gradient this test looks for)
    options = {"cce_variant": "rowwise", "force": True, "disable": "embedding"}
    torch._dynamo.reset()
    step = torch.compile(model, backend=fxpass.MemoptBackend(options=options))
    reference = torch.nn.functional.cross_entropy(
        F.linear(torch.tanh(model.mix(model.embed(ids))).flatten(0, 1), model.embed.weight).float(), ids.flatten()
    )
    loss = step(ids, ids)
    torch.testing.assert_close(loss, reference, rtol=1e-2, atol=1e-2)
    loss.backward()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step(ids, ids).backward()
    torch._dynamo.reset()
    block = vocab * dim * 4
    alive: set[int] = set()
    alive_at_last = None
    for _, ptr, size in allocation_events(prof):
        if size == block:
            alive_at_last = set(alive)
            alive.add(ptr)
        elif size == -block:
            alive.discard(ptr)
    assert alive_at_last == set(), "the fp32 ∂C was alive when the embedding's fp32 gradient was allocated"
