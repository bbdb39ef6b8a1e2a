"""``torch.ops.memopt.cce`` against float64 math: loss, gradients, edge cases, precision, layouts, chunking, errors.

The reference is always ``F.cross_entropy(F.linear(hidden, weight, bias), ...)`` (with the softcap ``c·tanh(x/c)``
where one is given) evaluated in float64 on the very values the op received, so every comparison is against
exact math rather than against another implementation's rounding.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from lowerings.cce import linear_cross_entropy, reference
from tests.helpers import assert_close_all, grads

N, V, D = 37, 53, 19  # deliberately not multiples of anything
REDUCTIONS = ("mean", "sum", "none")
FP64 = {"rtol": 1e-10, "atol": 1e-10}
FP32_VS_FP64 = {"rtol": 2e-5, "atol": 2e-5}


def _cce(h, w, b, t, ignore_index=-100, reduction="mean", label_smoothing=0.0, softcap=None):
    return torch.ops.memopt.cce(h, w, b, t, ignore_index, reduction, label_smoothing, softcap)


def _logits64(h, w, b, softcap=None):
    """The logits in float64, computed from the (possibly low-precision) values themselves."""
    z = F.linear(h.double(), w.double(), None if b is None else b.double())
    return z if softcap is None else softcap * torch.tanh(z / softcap)


def _reference(h, w, b, t, ignore_index=-100, reduction="mean", label_smoothing=0.0, softcap=None):
    """float64 ``cross_entropy(linear(...))``, differentiable back to ``h``, ``w`` and ``b``."""
    return F.cross_entropy(
        _logits64(h, w, b, softcap), t, ignore_index=ignore_index, reduction=reduction,
        label_smoothing=label_smoothing,
    )


def _leaves(dtype=torch.float32, bias=False, n=N, vocab=V, dim=D, requires_grad=True):
    h = torch.randn(n, dim, dtype=dtype).requires_grad_(requires_grad)
    w = (torch.randn(vocab, dim, dtype=dtype) / dim**0.5).requires_grad_(requires_grad)
    b = torch.randn(vocab, dtype=dtype).requires_grad_(requires_grad) if bias else None
    return h, w, b


def _targets(n=N, vocab=V, ignore_index=-100, every=4):
    t = torch.randint(0, vocab, (n,))
    t[::every] = ignore_index  # rows that are ignored (for ignore_index=7: a real class, ignored)
    return t


def _params(h, w, b):
    return [x for x in (h, w, b) if x is not None]


def _loss_and_grads(loss, params, seed=1):
    """The loss (detached) and the gradients of ⟨g, loss⟩ for a fixed random cotangent g."""
    g = torch.randn(loss.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    g = g.to(loss.dtype)
    return loss.detach(), torch.autograd.grad(loss, params, g)


# --- loss and gradients against float64 -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("ignore_index", [-100, -1, 7])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("softcap", [None, 2.5])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_matches_float64(reduction, bias, softcap, label_smoothing, ignore_index, dtype):
    h, w, b = _leaves(dtype, bias)
    t = _targets(ignore_index=ignore_index)
    assert (t == ignore_index).sum() >= 9 and (t != ignore_index).any()
    options = dict(ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing, softcap=softcap)

    loss, _ = _cce(h, w, b, t, **options)
    expected = _reference(h, w, b, t, **options)
    assert loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert loss.shape == expected.shape == ((N,) if reduction == "none" else ())
    if reduction == "none":
        assert (loss[t == ignore_index] == 0).all()

    ours, ours_grads = _loss_and_grads(loss, _params(h, w, b))
    ref, ref_grads = _loss_and_grads(expected, _params(h, w, b))
    tol = FP64 if dtype == torch.float64 else FP32_VS_FP64
    torch.testing.assert_close(ours, ref.to(ours.dtype), **tol)
    assert_close_all(ours_grads, [g.to(dtype) for g in ref_grads], **tol)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_all_targets_ignored_like_pytorch(reduction, label_smoothing):
    """Every row ignored: "mean" is 0/0 = NaN (as in PyTorch), "sum" is 0, and every gradient is zero."""
    h, w, b = _leaves(bias=True)
    t = torch.full((N,), -1)
    options = dict(ignore_index=-1, reduction=reduction, label_smoothing=label_smoothing)

    loss = _cce(h, w, b, t, **options)[0]
    eager = F.cross_entropy(F.linear(h, w, b), t, **options)
    torch.testing.assert_close(loss, eager, equal_nan=True)
    if reduction == "mean":
        assert torch.isnan(loss) and torch.isnan(eager)
    else:
        assert (loss == 0).all()

    ours = grads(loss.sum(), _params(h, w, b))
    theirs = grads(eager.sum(), _params(h, w, b))
    assert_close_all(ours, theirs)
    for g in ours:
        assert not g.isnan().any() and (g == 0).all()


@pytest.mark.parametrize(
    ("bad", "ignore_index"),
    [(V, -100), (V + 10, -100), (-2, -1), (-100, -1), (-1, -100)],
    ids=["V", "V+10", "neg2_ii-1", "neg100_ii-1", "neg1_ii-100"],
)
def test_out_of_range_target_raises_index_error_like_pytorch(bad, ignore_index):
    h, w, _ = _leaves()
    t = _targets(ignore_index=ignore_index)
    t[5] = bad
    with pytest.raises(IndexError):
        F.cross_entropy(F.linear(h, w), t, ignore_index=ignore_index)
    with pytest.raises(IndexError, match=f"Target {bad} is out of bounds"):
        _cce(h, w, None, t, ignore_index=ignore_index)


# --- low precision ------------------------------------------------------------------------------------------------


def _max_error(actual: torch.Tensor, exact: torch.Tensor) -> float:
    return (actual.double() - exact).abs().max().item()


def _floor(dtype: torch.dtype, exact: torch.Tensor) -> float:
    """What any answer in ``dtype`` may miss by: a 16-bit gradient is rounded once per logit-gradient element and
    once at the end, so one unit in the last place at its largest value (eager can land within half of one by
    luck, as it did for fp16's bias gradient on an H100); an fp32 result, 1e-6 of its size."""
    largest = exact.abs().max().item()
    ulp = torch.finfo(dtype).eps * largest if dtype in (torch.float16, torch.bfloat16) else 0.0
    return max(1e-6 * (1.0 + largest), ulp)


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_low_precision_no_worse_than_eager(dtype, reduction, bias):
    """|ours − fp64| ≤ 2·|eager − fp64| + a small floor, for the loss and each gradient (max norm).

    eager is the usual ``F.cross_entropy(F.linear(h, w, b).float(), t)`` in the same dtype; fp64 is the exact
    loss at the same (rounded) inputs. (That gradients summed over several chunks are not accumulated in 16 bits
    is checked by ``test_chunked_equals_unchunked``.)
    """
    h, w, b = _leaves(dtype, bias)
    t = _targets(every=5)
    params = _params(h, w, b)

    ours, ours_grads = _loss_and_grads(_cce(h, w, b, t, reduction=reduction)[0], params)
    eager, eager_grads = _loss_and_grads(F.cross_entropy(F.linear(h, w, b).float(), t, reduction=reduction), params)
    exact, exact_grads = _loss_and_grads(_reference(h, w, b, t, reduction=reduction), params)

    assert ours.dtype == torch.float32
    for name, o, e, x in zip(
        ["loss", "hidden", "weight", "bias"], [ours, *ours_grads], [eager, *eager_grads], [exact, *exact_grads],
        strict=False,
    ):
        assert o.dtype == e.dtype, name
        ours_error, eager_error = _max_error(o, x), _max_error(e, x)
        assert ours_error <= 2 * eager_error + _floor(o.dtype, x), f"{name}: ours {ours_error:.3g} vs eager {eager_error:.3g}"


# --- layouts and index dtypes -----------------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_non_contiguous_inputs(reduction):
    """A transposed [D, V] weight, every other hidden column, a strided bias and strided targets."""
    h_wide = torch.randn(N, 2 * D, requires_grad=True)
    w_dv = (torch.randn(D, V) / D**0.5).requires_grad_()
    b_wide = torch.randn(2 * V, requires_grad=True)
    t_wide = _targets(n=2 * N)
    h, w, b, t = h_wide[:, ::2], w_dv.t(), b_wide[::2], t_wide[::2]
    assert not any(x.is_contiguous() for x in (h, w, b, t))

    leaves = [h_wide, w_dv, b_wide]
    ours, ours_grads = _loss_and_grads(_cce(h, w, b, t, reduction=reduction)[0], leaves)
    ref, ref_grads = _loss_and_grads(_reference(h, w, b, t, reduction=reduction), leaves)
    torch.testing.assert_close(ours, ref.float(), **FP32_VS_FP64)
    assert_close_all(ours_grads, [g.float() for g in ref_grads], **FP32_VS_FP64)
    assert ours_grads[0][:, 1::2].eq(0).all()  # the skipped hidden columns get no gradient


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_int32_targets(reduction):
    """PyTorch's cross_entropy rejects int32 targets ("expected ... Long or Byte"); memopt.cce accepts them and
    must then give exactly the int64 result (and if PyTorch accepts them one day, PyTorch's result too)."""
    h, w, b = _leaves(bias=True)
    t64 = _targets()
    t32 = t64.to(torch.int32)
    params = _params(h, w, b)

    loss64, lse64 = _cce(h, w, b, t64, reduction=reduction)
    loss32, lse32 = _cce(h, w, b, t32, reduction=reduction)
    torch.testing.assert_close(loss32, loss64, rtol=0, atol=0)
    torch.testing.assert_close(lse32, lse64, rtol=0, atol=0)
    assert_close_all(_loss_and_grads(loss32, params)[1], _loss_and_grads(loss64, params)[1], rtol=0, atol=0)
    try:
        eager = F.cross_entropy(F.linear(h, w, b), t32, reduction=reduction)
    except RuntimeError as error:
        assert "Long" in str(error)  # 2.13: "expected target dtype to be Long or Byte"; 2.11: "expected scalar type Long"
    else:
        torch.testing.assert_close(loss32, eager)


def test_uint8_targets_like_pytorch():
    """PyTorch's eager cross_entropy accepts Byte targets; so does the op (any integer dtype is widened)."""
    h, w, _ = _leaves(vocab=V)
    t = _targets(ignore_index=7).to(torch.uint8)
    eager = F.cross_entropy(F.linear(h, w), t, ignore_index=7)  # PyTorch accepts "Long or Byte"
    loss = _cce(h, w, None, t, ignore_index=7)[0]
    torch.testing.assert_close(loss, eager)


# --- chunking ---------------------------------------------------------------------------------------------------


TILE_COLUMNS = 7  # vocabulary columns per backward tile, a ragged split of V


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16], ids=["fp64", "bf16", "fp16"])
@pytest.mark.parametrize("rows_per_chunk", [1, 5, 36])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_chunked_equals_unchunked(monkeypatch, reduction, rows_per_chunk, dtype):
    """With chunks small enough that N=37 rows span several (ragged) chunks, nothing changes.

    In 16-bit precision too: the weight and bias gradients are sums over chunks, accumulated in fp32 and rounded
    once, so they agree with the one-chunk result to the last bit (within one ulp).
    """
    h, w, b = _leaves(dtype, bias=True)
    t = _targets(ignore_index=-1)
    options = dict(ignore_index=-1, reduction=reduction, label_smoothing=0.1, softcap=3.0)
    params = _params(h, w, b)

    monkeypatch.setattr(reference, "chunk_rows", lambda *args, **kwargs: N)  # the whole problem in one chunk
    loss, lse = _cce(h, w, b, t, **options)
    whole, whole_grads = _loss_and_grads(loss, params)

    monkeypatch.setattr(reference, "chunk_rows", lambda *args, **kwargs: rows_per_chunk)
    monkeypatch.setattr(reference, "tile_shape", lambda *args, **kwargs: (rows_per_chunk, TILE_COLUMNS))
    calls = []
    chunk_logits = reference._chunk_logits

    def spy(hidden, weight, *args):
        calls.append((hidden.shape[0], weight.shape[0]))
        return chunk_logits(hidden, weight, *args)

    monkeypatch.setattr(reference, "_chunk_logits", spy)
    chunked_loss, chunked_lse = _cce(h, w, b, t, **options)
    chunked, chunked_grads = _loss_and_grads(chunked_loss, params)

    chunks = math.ceil(N / rows_per_chunk)
    # Both passes walk row chunks in 16-bit, tiles of rows × columns in fp32/fp64.
    tiles = chunks * math.ceil(V / TILE_COLUMNS) if dtype == torch.float64 else chunks
    assert len(calls) == 2 * tiles
    assert max(rows for rows, _ in calls) == rows_per_chunk
    assert sum(rows * columns for rows, columns in calls) == 2 * N * V  # each pass computes every logit once
    if dtype == torch.float64:
        torch.testing.assert_close(chunked, whole, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(chunked_lse, lse, rtol=1e-12, atol=1e-12)
        assert_close_all(chunked_grads, whole_grads, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(chunked, _reference(h, w, b, t, **options).detach(), **FP64)
        return
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(chunked_lse, lse, rtol=1e-6, atol=1e-6)
    eps = torch.finfo(dtype).eps
    for name, a, e in zip(["hidden", "weight", "bias"], chunked_grads, whole_grads, strict=True):
        assert a.dtype == dtype, name
        atol = 1e-3 * eps * e.abs().max().item()
        torch.testing.assert_close(a, e, rtol=eps, atol=atol, msg=lambda m, n=name: f"{n} gradient: {m}")


# --- log-sum-exp and z-loss ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("bias", "softcap"), [(False, None), (True, None), (True, 2.0)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_lse_is_logsumexp_of_the_logits(dtype, bias, softcap):
    """Every row, ignored ones included, in the compute dtype; with a softcap, of the capped logits."""
    h, w, b = _leaves(dtype, bias)
    t = _targets()
    _, lse = _cce(h, w, b, t, softcap=softcap)
    expected = torch.logsumexp(_logits64(h, w, b, softcap), dim=-1)
    assert lse.shape == (N,) and lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    tol = FP64 if dtype == torch.float64 else FP32_VS_FP64
    torch.testing.assert_close(lse.detach(), expected.detach().to(lse.dtype), **tol)


@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_z_loss_gradients_exact(reduction, softcap):
    """``loss + 1e-4·mean(lse²)``: the lse output is differentiable and its gradient is float64-exact."""
    h, w, b = _leaves(torch.float64, bias=True)
    t = _targets()
    params = _params(h, w, b)

    loss, lse = _cce(h, w, b, t, reduction=reduction, softcap=softcap)
    ours = loss + 1e-4 * lse.pow(2).mean()
    exact_lse = torch.logsumexp(_logits64(h, w, b, softcap), dim=-1)
    exact = _reference(h, w, b, t, reduction=reduction, softcap=softcap) + 1e-4 * exact_lse.pow(2).mean()
    torch.testing.assert_close(ours, exact, **FP64)
    assert_close_all(grads(ours, params), grads(exact, params), **FP64)

    # The lse term alone (the loss output unused, so its gradient arrives as None) is exact too.
    _, lse = _cce(h, w, b, t, reduction=reduction, softcap=softcap)
    exact_lse = torch.logsumexp(_logits64(h, w, b, softcap), dim=-1)
    z_only = grads(lse.pow(2).mean(), params)
    assert_close_all(z_only, grads(exact_lse.pow(2).mean(), params), **FP64)
    assert all(g.abs().sum() > 0 for g in z_only)


# --- frozen inputs --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("frozen", ["hidden", "weight", "bias"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_frozen_input_gets_no_gradient(monkeypatch, reduction, frozen):
    """No gradient for the frozen input, and none computed: the backward is told which gradients it needs."""
    h, w, b = _leaves(torch.float64, bias=True)
    dict(hidden=h, weight=w, bias=b)[frozen].requires_grad_(False)
    t = _targets()
    loss = _cce(h, w, b, t, reduction=reduction)[0]
    trainable = [x for x in (h, w, b) if x.requires_grad]
    assert len(trainable) == 2

    asked = []
    backward = reference.backward

    def spy(*args):
        asked.append(args[10])  # needs
        return backward(*args)

    monkeypatch.setattr(reference, "backward", spy)
    g = torch.randn(loss.shape, dtype=loss.dtype)
    loss.backward(g)
    assert asked == [tuple(name != frozen for name in ("hidden", "weight", "bias"))]
    expected = torch.autograd.grad(_reference(h, w, b, t, reduction=reduction), trainable, g)
    assert dict(hidden=h, weight=w, bias=b)[frozen].grad is None
    assert_close_all([x.grad for x in trainable], expected, **FP64)


# --- opcheck --------------------------------------------------------------------------------------------------


OPCHECK_CASES = [
    (bias, reduction, label_smoothing, softcap)
    for (bias, reduction), (label_smoothing, softcap) in zip(
        itertools.product([False, True], REDUCTIONS), itertools.cycle([(0.0, None), (0.1, 3.0)]), strict=False
    )
]


@pytest.mark.parametrize(("bias", "reduction", "label_smoothing", "softcap"), OPCHECK_CASES)
def test_opcheck(bias, reduction, label_smoothing, softcap):
    h, w, b = _leaves(bias=bias, n=11, vocab=17, dim=5)
    t = _targets(n=11, vocab=17)
    args = (h, w, b, t, -100, reduction, label_smoothing, softcap)
    torch.library.opcheck(torch.ops.memopt.cce.default, args)


# --- the public wrapper ---------------------------------------------------------------------------------------


def test_linear_cross_entropy_3d():
    """hidden [B, T, D] and targets [B, T]: "none" gives [B, T], ``return_lse`` gives lse [B, T]."""
    batch, seq = 3, 7
    hidden = torch.randn(batch, seq, D, requires_grad=True)
    _, w, b = _leaves(bias=True)
    targets = torch.randint(0, V, (batch, seq))
    targets[1, :3] = -100
    logits = _logits64(hidden, w, b)
    exact = F.cross_entropy(logits.view(-1, V), targets.view(-1), reduction="none").view(batch, seq)

    rows = linear_cross_entropy(hidden, w, targets, b, reduction="none")
    assert rows.shape == (batch, seq)
    torch.testing.assert_close(rows, exact.float(), **FP32_VS_FP64)
    assert_close_all(grads(rows.sum(), [hidden, w, b]), [g.float() for g in grads(exact.sum(), [hidden, w, b])],
                     **FP32_VS_FP64)

    loss, lse = linear_cross_entropy(hidden, w, targets, b, return_lse=True)
    assert loss.shape == () and lse.shape == (batch, seq)
    torch.testing.assert_close(loss, exact.sum().float() / (targets != -100).sum(), **FP32_VS_FP64)
    torch.testing.assert_close(lse, torch.logsumexp(logits, -1).float(), **FP32_VS_FP64)

    rows, lse = linear_cross_entropy(hidden, w, targets, b, reduction="none", return_lse=True)
    assert rows.shape == lse.shape == (batch, seq)


# --- errors ---------------------------------------------------------------------------------------------------


BAD_INPUTS = [
    pytest.param("hidden", lambda a: a | {"h": torch.randn(N, D + 1)}, "differ in D", id="mismatched_D"),
    pytest.param("targets", lambda a: a | {"t": a["t"][:-1]}, r"targets must be \[N=37\]", id="short_targets"),
    pytest.param("targets", lambda a: a | {"t": a["t"].view(-1, 1)}, r"targets must be \[N=37\]", id="2d_targets"),
    pytest.param("targets", lambda a: a | {"t": a["t"].float()}, "class indices", id="float_targets"),
    pytest.param("reduction", lambda a: a | {"reduction": "avg"}, "reduction must be one of", id="unknown_reduction"),
    pytest.param("bias", lambda a: a | {"b": torch.randn(V - 1)}, r"bias must be \[V=53\]", id="bias_length"),
    pytest.param("smoothing", lambda a: a | {"label_smoothing": 1.5}, "label_smoothing must be in", id="smoothing"),
    pytest.param("softcap", lambda a: a | {"softcap": 0.0}, "softcap must be positive", id="softcap"),
]


@pytest.mark.parametrize(("what", "spoil", "message"), BAD_INPUTS)
def test_bad_inputs_raise_clear_errors(what, spoil, message):
    h, w, b = _leaves(bias=True)
    good = dict(h=h, w=w, b=b, t=_targets(), reduction="mean", label_smoothing=0.0, softcap=None)
    _cce(good["h"], good["w"], good["b"], good["t"])  # the unspoiled call works
    bad = spoil(good)
    with pytest.raises((RuntimeError, ValueError), match=message) as error:
        _cce(bad["h"], bad["w"], bad["b"], bad["t"], reduction=bad["reduction"],
             label_smoothing=bad["label_smoothing"], softcap=bad["softcap"])
    assert str(error.value).startswith("memopt.cce:"), what


def test_wrapper_rejects_unknown_reduction():
    h, w, _ = _leaves()
    with pytest.raises((RuntimeError, ValueError), match="reduction must be one of"):
        linear_cross_entropy(h, w, _targets(), reduction="avg")


def test_checked_targets_copies_valid_targets_and_rejects_out_of_range():
    targets = torch.tensor([0, 3, -100, 9])
    checked = torch.ops.memopt.cce_checked_targets(targets, 10, -100)
    assert torch.equal(checked, targets) and checked.data_ptr() != targets.data_ptr()
    with pytest.raises(RuntimeError, match="out of bounds"):
        torch.ops.memopt.cce_checked_targets(torch.tensor([0, 10]), 10, -100)
    torch.library.opcheck(torch.ops.memopt.cce_checked_targets, (targets, 10, -100))
