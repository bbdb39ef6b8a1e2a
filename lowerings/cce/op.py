"""``torch.ops.memopt.cce``: linear + cross-entropy that never materializes the N×V logits.

    loss, lse = torch.ops.memopt.cce(hidden, weight, bias, targets, ignore_index, reduction,
                                     label_smoothing, softcap, filter_eps=0.0, scale=1.0, divisor=1.0)

``hidden`` is [N, D], ``weight`` the classifier [V, D], ``bias`` [V] or None, ``targets`` [N] class indices.
``loss`` is fp32 (fp64 for fp64 inputs): a scalar for "mean"/"sum", [N] for "none" (0 on ignored rows), exactly like
``F.cross_entropy(linear(hidden, weight, bias).float(), targets, ...)``; "mean" over zero valid rows is NaN.
``lse`` is the per-row log-sum-exp of the logits, differentiable, for z-loss terms.

``scale`` and ``divisor``: a logit scale between the classifier and the loss, ``linear(...) * scale / divisor``
before the softcap (Cohere's ``logit_scale``, Granite's ``logits_scaling``). It is an argument rather than folded
into the hidden states or the classifier: a folded copy would be an [N, D] or [V, D] tensor autograd saves, rounded
before the GEMM where the model rounds after it. Inside, the loss sees x·m with m = scale / divisor in fp32, and
the backward multiplies by m in its chain rule: no tensor more, no gradient approximated.

Autograd saves hidden, weight, bias, targets and the [N] log-sum-exp, never logits; the backward op
recomputes them chunk by chunk. On CUDA the forward is a Triton kernel that Inductor emits in its output
code and the backward an opaque op running Triton kernels and GEMMs (``kernels.py``); on CPU both are the
chunked PyTorch reference (``reference.py``).

``filter_eps`` > 0 is a speed option of the CUDA backward (Wijmans et al. 2024, §4.3): logit-gradient tiles
whose every |softmax − target| is below it are dropped, with the vocabulary walked in mean-logit order so
that they cluster. The gradients then deviate by up to ``filter_eps`` per dropped logit; the loss is exact.
The CPU reference ignores it (exact gradients).
"""

from __future__ import annotations

import torch

from lowerings import precompile
from lowerings._library import HAS_TRITON, device_op, on_cuda, reference_op, transient_bytes, workspace
from lowerings.cce import reference

if HAS_TRITON:
    from lowerings.cce import kernels

REDUCTIONS = ("mean", "sum", "none")


def working_set(n_rows, vocab: int, dim: int, dtype: torch.dtype, device: torch.device) -> dict[str, object]:
    """Bytes the op keeps beyond its inputs and outputs, by name: what the graph rewrite's model charges.

    ``device`` is the one whose implementation is charged: the CUDA kernels' column chunk of logit gradients, or
    the CPU reference's chunk of rows (≤ 1/8 of the logits, computed in place). Sizes may be SymInts; the result
    is then symbolic too.
    """
    acc_bytes = reference.compute_dtype(dtype).itemsize
    terms: dict[str, object] = {"saved: log-sum-exp [N]": n_rows * acc_bytes}
    if device.type == "cuda" and HAS_TRITON:
        # kernels.chunk_columns, in SymInt arithmetic: a multiple of 128 columns filling CHUNK_BYTES, within
        # [MIN_COLUMNS, CHUNK_COLUMNS], and never more than the vocabulary.
        fitting = kernels.CHUNK_BYTES // torch.sym_max(1, n_rows * dtype.itemsize) // 128 * 128
        columns = torch.sym_max(kernels.MIN_COLUMNS, torch.sym_min(kernels.CHUNK_COLUMNS, fitting))
        chunk = n_rows * torch.sym_min(vocab, columns)
        terms["transient: one column chunk of logit gradients [N, chunk]"] = chunk * dtype.itemsize
        if dtype.itemsize < acc_bytes:
            terms["transient: compensation of the hidden-state gradient sum [N, D]"] = n_rows * dim * dtype.itemsize
        return terms
    terms["transient: one chunk of logits and their gradient, in place (CPU reference)"] = reference.chunk_budget(
        n_rows, vocab, dim, dtype
    )
    if dtype.itemsize < acc_bytes:
        terms["transient: weight-gradient accumulator [V, D]"] = vocab * dim * acc_bytes
    return terms


@reference_op("cce_checked_targets")
def cce_checked_targets(targets: torch.Tensor, vocab: int, ignore_index: int) -> torch.Tensor:
    """A copy of ``targets``, after a check on the device (no host sync) that each is ignored or in [0, vocab),
    so the kernels never read a row of the classifier that does not exist.

    An opaque op rather than ``torch._assert_async`` in the traced body: AOTAutograd's partitioner in
    torch 2.11–2.12 fails on that output-less node when an activation memory budget is set."""
    in_range = (targets == ignore_index) | ((targets >= 0) & (targets < vocab))
    torch._assert_async(in_range.all(), "memopt.cce: a target is out of bounds")
    return targets.clone()


@cce_checked_targets.register_fake
def _(targets, vocab, ignore_index):
    return torch.empty_like(targets)


@reference_op("cce_rows_reference")
def cce_rows_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    softcap: float | None,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    return reference.forward(hidden, weight, bias, targets, ignore_index, label_smoothing, softcap, scale)


@cce_rows_reference.register_fake
def _(hidden, weight, bias, targets, ignore_index, label_smoothing, softcap, scale=1.0):
    rows = hidden.new_empty(hidden.shape[0], dtype=reference.compute_dtype(hidden.dtype))
    return rows, torch.empty_like(rows)


@reference_op("cce_backward_rows")
def cce_backward_rows(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    lse: torch.Tensor,
    grad_rows: torch.Tensor,
    grad_lse: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    softcap: float | None,
    need_hidden: bool,
    need_weight: bool,
    need_bias: bool,
    filter_eps: float = 0.0,
    grad_logits: torch.Tensor | None = None,
    round_logits: bool = False,
    scale: float = 1.0,
    logits_transformed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # The CPU reference recomputes logits with the forward's own matmul, so they are rounded as it rounded them.
    needs = (need_hidden, need_weight, need_bias)
    return reference.backward(
        hidden, weight, bias, targets, lse, grad_rows, grad_lse, ignore_index, label_smoothing, softcap, needs,
        grad_logits, scale, logits_transformed,
    )


# The workspaces of the two opaque ops that ``memopt.cce`` (and ``memopt.cce_with_logits``'s backward) run: the
# traced graph shows these, not ``memopt.cce``, whose body is traced through (its CUDA forward's Triton kernels and
# their buffers are nodes of that graph). A graph traced on CPU tensors and priced for a GPU (``assume_device``)
# shows the reference forward, charged then as the CUDA kernels allocate.
@workspace("cce_rows_reference")
def forward_workspace(device_type: str, hidden, weight, *_, **__):
    """The reference forward's chunk of logits (within the chunk budget it shares with the backward); the CUDA
    kernels keep per-row statistics only."""
    if device_type == "cuda":
        return 0
    return reference.chunk_budget(hidden.shape[0], weight.shape[0], weight.shape[1], hidden.dtype)


@workspace("cce_backward_rows")
def backward_workspace(device_type: str, hidden, weight, *_, **__):
    """``working_set``'s transient terms for ``device_type``: the column chunk of logit gradients and the
    compensation of the hidden-state gradient sum on CUDA, the reference's chunk and its fp32 weight-gradient
    accumulator off CUDA."""
    terms = working_set(hidden.shape[0], weight.shape[0], weight.shape[1], hidden.dtype, torch.device(device_type))
    return transient_bytes(terms)


@cce_backward_rows.register_fake
def _(hidden, weight, bias, targets, lse, grad_rows, grad_lse, ignore_index, label_smoothing, softcap,
      need_hidden, need_weight, need_bias, filter_eps=0.0, grad_logits=None, round_logits=False, scale=1.0,
      logits_transformed=False):
    return _empty_grads(hidden, weight, bias, need_hidden, need_weight, need_bias)


if HAS_TRITON:

    @cce_backward_rows.register_kernel("cuda")
    def _(hidden, weight, bias, targets, lse, grad_rows, grad_lse, ignore_index, label_smoothing, softcap,
          need_hidden, need_weight, need_bias, filter_eps=0.0, grad_logits=None, round_logits=False, scale=1.0,
          logits_transformed=False):
        needs = (need_hidden, need_weight, need_bias)
        return kernels.backward(
            hidden, weight, bias, targets, lse, grad_rows, grad_lse, label_smoothing, softcap, needs, filter_eps,
            grad_logits, round_logits, scale, logits_transformed,
        )

    def warm_backward(hidden, weight, bias, targets, label_smoothing, softcap, filter_eps=0.0, round_logits=False,
                      scale=1.0):
        """The kernels ``cce_backward_rows`` launches on CUDA for a call of these inputs (``precompile.py``)."""
        rows = hidden.new_empty(hidden.shape[0], dtype=reference.compute_dtype(hidden.dtype))
        needs = (hidden.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad)
        if not any(needs):  # a call without a backward
            return
        kernels.backward(
            hidden, weight, bias, targets.long(), rows, rows, rows, label_smoothing, softcap, needs, filter_eps,
            None, round_logits, scale,
        )

    @precompile.warmer("cce")
    def _(hidden, weight, bias, targets, ignore_index=-100, reduction="mean", label_smoothing=0.0, softcap=None,
          filter_eps=0.0, scale=1.0, divisor=1.0):
        warm_backward(hidden, weight, bias, targets, label_smoothing, softcap, filter_eps, scale=scale / divisor)


def _empty_grads(hidden, weight, bias, need_hidden, need_weight, need_bias):
    """Contiguous gradients whatever the inputs' layouts, as both implementations return them."""
    return (
        hidden.new_empty(hidden.shape) if need_hidden else hidden.new_empty(0),
        weight.new_empty(weight.shape) if need_weight else weight.new_empty(0),
        bias.new_empty(bias.shape) if need_bias and bias is not None else weight.new_empty(0),
    )


def _check_inputs(hidden, weight, bias, targets, reduction, label_smoothing, softcap, scale=1.0, divisor=1.0) -> None:
    torch._check(hidden.dim() == 2, lambda: f"memopt.cce: hidden must be [N, D], got {tuple(hidden.shape)}")
    torch._check(weight.dim() == 2, lambda: f"memopt.cce: weight must be [V, D], got {tuple(weight.shape)}")
    torch._check(
        hidden.shape[1] == weight.shape[1],
        lambda: f"memopt.cce: hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} differ in D",
    )
    torch._check(
        targets.dim() == 1 and targets.shape[0] == hidden.shape[0],
        lambda: f"memopt.cce: targets must be [N={hidden.shape[0]}], got {tuple(targets.shape)}",
    )
    torch._check(
        not targets.is_floating_point() and not targets.is_complex(),
        lambda: f"memopt.cce: targets must hold class indices, got dtype {targets.dtype}",
    )
    torch._check(
        bias is None or (bias.dim() == 1 and bias.shape[0] == weight.shape[0]),
        lambda: f"memopt.cce: bias must be [V={weight.shape[0]}], got {None if bias is None else tuple(bias.shape)}",
    )
    torch._check(reduction in REDUCTIONS, lambda: f"memopt.cce: reduction must be one of {REDUCTIONS}")
    torch._check(0.0 <= label_smoothing <= 1.0, lambda: "memopt.cce: label_smoothing must be in [0, 1]")
    torch._check(softcap is None or softcap > 0, lambda: "memopt.cce: softcap must be positive")
    reference.check_logit_scale(scale, divisor)


def _reduce(losses: torch.Tensor, valid: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "none":
        return losses
    total = losses.sum()
    # PyTorch divides by the number of non-ignored rows: 0/0 gives NaN when every target is ignored.
    return total / valid.sum() if reduction == "mean" else total


def _grad_rows(grad_loss: torch.Tensor, valid: torch.Tensor, reduction: str) -> torch.Tensor:
    """Upstream gradient of each row's loss term; zero on ignored rows."""
    scale = grad_loss.to(reference.compute_dtype(grad_loss.dtype))
    if reduction == "mean":
        scale = scale / valid.sum()
    return torch.where(valid, scale, 0.0)


@device_op("cce")
def cce(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    filter_eps: float = 0.0,
    scale: float = 1.0,
    divisor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_inputs(hidden, weight, bias, targets, reduction, label_smoothing, softcap, scale, divisor)
    torch._check(filter_eps >= 0.0, lambda: "memopt.cce: filter_eps must be ≥ 0")
    targets = targets.long()  # any integer dtype, as PyTorch's cross_entropy accepts Byte as well as Long
    multiplier = scale / divisor
    if HAS_TRITON and on_cuda(hidden, weight, targets):
        targets = torch.ops.memopt.cce_checked_targets(targets, weight.shape[0], ignore_index)
        losses, lse = kernels.forward_rows(
            hidden, weight, bias, targets, ignore_index, label_smoothing, softcap, multiplier
        )
    else:
        losses, lse = torch.ops.memopt.cce_rows_reference(
            hidden, weight, bias, targets, ignore_index, label_smoothing, softcap, multiplier
        )
    return _reduce(losses, targets != ignore_index, reduction), lse


@device_op("cce_backward")
def cce_backward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    lse: torch.Tensor,
    grad_loss: torch.Tensor,
    grad_lse: torch.Tensor,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    softcap: float | None,
    need_hidden: bool,
    need_weight: bool,
    need_bias: bool,
    filter_eps: float = 0.0,
    grad_logits: torch.Tensor | None = None,
    round_logits: bool = False,
    scale: float = 1.0,
    logits_transformed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    targets = targets.long()
    grad_rows = _grad_rows(grad_loss, targets != ignore_index, reduction)
    return torch.ops.memopt.cce_backward_rows(
        hidden, weight, bias, targets, lse, grad_rows, grad_lse, ignore_index, label_smoothing, softcap,
        need_hidden, need_weight, need_bias, filter_eps, grad_logits, round_logits, scale, logits_transformed,
    )


def save_for_backward(ctx, inputs, output, scale: float = 1.0, logits_transformed: bool = False) -> None:
    """What both CCE ops keep for the backward: hidden, weight, bias, targets and the [N] log-sum-exp; the logit
    scale m (a Python float) and whether returned logits were transformed as the loss's were."""
    hidden, weight, bias, targets, ignore_index, reduction, label_smoothing, softcap = inputs[:8]
    ctx.save_for_backward(hidden, weight, bias, targets, output[1])
    ctx.options = (ignore_index, reduction, label_smoothing, softcap, scale, logits_transformed)


def input_gradients(ctx, grad_loss, grad_lse, filter_eps: float = 0.0, grad_logits=None, round_logits=False):
    """Gradients of hidden, weight and bias (None where not needed) from the saved tensors; shared by
    ``memopt.cce`` and ``memopt.cce_with_logits``, whose returned logits' gradient is ``grad_logits``."""
    hidden, weight, bias, targets, lse = ctx.saved_tensors
    ignore_index, reduction, label_smoothing, softcap, scale, logits_transformed = ctx.options
    need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
    need_bias = need_bias and bias is not None
    if grad_lse is None:
        grad_lse = torch.zeros_like(lse)
    if grad_loss is None:
        grad_loss = lse.new_zeros(() if reduction != "none" else lse.shape)
    grad_hidden, grad_weight, grad_bias = torch.ops.memopt.cce_backward(
        hidden, weight, bias, targets, lse, grad_loss, grad_lse, ignore_index, reduction, label_smoothing,
        softcap, need_hidden, need_weight, need_bias, filter_eps, grad_logits, round_logits, scale,
        logits_transformed,
    )
    return (
        grad_hidden if need_hidden else None,
        grad_weight if need_weight else None,
        grad_bias if need_bias else None,
    )


def _setup_context(ctx, inputs, output) -> None:
    scale, divisor = inputs[9:11]
    save_for_backward(ctx, inputs, output, scale / divisor)
    ctx.filter_eps = inputs[8]


def _backward(ctx, grad_loss, grad_lse):
    return (*input_gradients(ctx, grad_loss, grad_lse, ctx.filter_eps), *[None] * 8)


cce.register_autograd(_backward, setup_context=_setup_context)
