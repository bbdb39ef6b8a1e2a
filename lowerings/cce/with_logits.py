"""``torch.ops.memopt.cce_with_logits``: the cut cross-entropy loss of a graph that returns its logits too.

    loss, lse, logits = torch.ops.memopt.cce_with_logits(hidden, weight, bias, targets, ignore_index,
                                                         reduction, label_smoothing, softcap,
                                                         detach_logits, logits_dtype,
                                                         scale, divisor, transform_logits)

A whole model compiled as it is returns the logits beside the loss (HF's ``ModelOutput``, nanoGPT's
``(logits, loss)``), and most callers drop them (``loss = model(...).loss``, HF Trainer). The forward computes
the logits once, with the classifier GEMM in its dtype, and takes the loss and the per-row log-sum-exp from
them; autograd saves what ``memopt.cce`` saves (hidden, weight, bias, targets, the [N] log-sum-exp), never the
logits, so they die as soon as the caller lets them go.

The backward is ``memopt.cce_backward``: it recomputes logit chunks rounded as the forward's GEMM rounded them
(so its softmax is the one the loss was taken from) and adds the gradient that reached the returned logits
to each chunk before the two GEMMs. When the logits were not used, autograd hands it zeros (it materializes a
gradient for every differentiable output); the sum is then exact and costs one read, never a GEMM.

``detach_logits``: where the graph only returns the logits and the backend wraps it, the returned logits carry
no gradient inside the graph (as ``memopt.cce_rowwise``'s do) and ``fxpass/returned_logits.py`` re-attaches
theirs outside it. Logits the caller drops then cost no N×V zeros in the backward, and the forward keeps
nothing beyond the log-sum-exp: the lowest peak of the variants, for 8·N·D·V FLOPs (CPU, and
``cce_variant="chunked"`` on CUDA, where "auto" takes ``memopt.cce_rowwise`` with ``return_logits``). Without
it this op serves logits that another op of the graph reads, ``reduction="none"``, z-loss terms and graphs run
without a backward.

``logits_dtype``: the dtype the graph returns the logits in, where that is wider than the classifier's (fp32 after
bf16 or fp16: accelerate's ``convert_to_fp32`` under HF Trainer's ``bf16=True``). On CUDA the GEMM then writes
its fp32 accumulators itself (``torch.mm(..., out_dtype=torch.float32)``), so the 16-bit N×V never exists
beside its fp32 copy (Llama-3.2-1B's Trainer step on the H200: 33.1 → 31.2 GiB). Those logits are not rounded
to 16 bits, so they sit closer to the exact product than eager's cast of its 16-bit logits; the loss and the
backward's recomputed logits use them unrounded too. (Rounding them back to bf16's values on the bits cost
the Trainer step a second fp32 N×V: Inductor did not write the rounding in place there.) Elsewhere the
classifier's output is cast, as the graph did. Where fp32 rows of the vocabulary are not 16-byte aligned
(GPT-2's 50257 classes), cuBLAS's GEMM into them takes a slow path, so ``memopt.fp32_logits_by_row_chunks``
writes row chunks into an aligned buffer and copies them into place.

``scale``, ``divisor`` and ``transform_logits``: the loss is taken over c·tanh(x·scale/divisor/c) (without a softcap,
x·scale/divisor), as ``memopt.cce`` takes it. Where the model returns the logits after that transform (Gemma 2's
final softcap, Cohere's ``logit_scale``, Granite's ``logits_scaling``), ``transform_logits`` returns them so: the
classifier's output transformed op by op in its dtype, as the model wrote it (``reference.transformed_logits``), and
the gradient that reaches them goes through the same chain rule as the loss's (``reference.chain_rule_``).
Otherwise the classifier's own output comes back, and its gradient joins after the chain rule.

CUDA: Inductor traces the body, so the fp32 upcast, softcap and log-sum-exp fuse into one reduction over the
logits (run eagerly, that upcast is a transient fp32 [N, V]). CPU: an opaque op takes the loss over row chunks
of the reference's size, in place, so ``working_set`` charges both ops alike.
"""

from __future__ import annotations

import torch

from lowerings import precompile
from lowerings._library import HAS_TRITON, device_op, on_cuda, reference_op, workspace
from lowerings.cce import reference
from lowerings.cce.op import _check_inputs, _reduce, input_gradients, save_for_backward
from lowerings.cce.rowwise import padded_rows


def row_terms(
    logits: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    softcap: float | None,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row loss (0 on ignored rows) and log-sum-exp of [rows, V] logits scaled by ``scale``, in the compute
    dtype: the functional twin of ``reference.row_terms_`` for the traced CUDA body, written without in-place
    updates of a copy so that Inductor can fuse the upcast into the reductions."""
    z = logits.to(reference.compute_dtype(logits.dtype))
    if scale != 1.0:
        z = z * scale
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    lse = torch.logsumexp(z, dim=-1)
    valid = reference.valid_rows(targets, ignore_index)
    target_logit = z.gather(1, torch.where(valid, targets, 0).unsqueeze(1)).squeeze(1)
    loss = (1.0 - label_smoothing) * (lse - target_logit)
    if label_smoothing:
        loss = loss + label_smoothing * (lse - z.mean(dim=-1))
    return torch.where(valid, loss, 0.0), lse


@reference_op("cce_rows_from_logits")
def cce_rows_from_logits(
    logits: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    softcap: float | None,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss terms over row chunks sized as the reference's (``reference.chunk_rows``), one buffer each."""
    n_rows, vocab = logits.shape
    reference.check_targets(targets, vocab, ignore_index)
    losses = logits.new_empty(n_rows, dtype=reference.compute_dtype(logits.dtype))
    lse = torch.empty_like(losses)
    step = reference.chunk_rows(vocab, n_rows, 0, logits.dtype, softcap=softcap is not None)
    for start in range(0, n_rows, step):
        rows = slice(start, start + step)
        z = logits[rows].to(reference.compute_dtype(logits.dtype), copy=True)  # the chunk's one buffer
        losses[rows], lse[rows], _ = reference.row_terms_(
            z, targets[rows], ignore_index, label_smoothing, softcap, scale
        )
        del z  # before the next chunk's: two alive at once doubled the op's workspace
    return losses, lse


@workspace("cce_rows_from_logits")
def rows_from_logits_workspace(device_type: str, logits, targets, ignore_index, label_smoothing, softcap, *_):
    """One chunk of rows in the compute dtype: the loss of ``memopt.cce_with_logits`` off CUDA (on CUDA Inductor
    fuses the upcast into the log-sum-exp's reduction, in the traced body: nothing is charged for a GPU)."""
    if device_type == "cuda":
        return 0
    n_rows, vocab = logits.shape
    rows = reference.chunk_rows(vocab, n_rows, 0, logits.dtype, softcap=softcap is not None)
    return rows * vocab * reference.compute_dtype(logits.dtype).itemsize


@cce_rows_from_logits.register_fake
def _(logits, targets, ignore_index, label_smoothing, softcap, scale=1.0):
    rows = logits.new_empty(logits.shape[0], dtype=reference.compute_dtype(logits.dtype))
    return rows, torch.empty_like(rows)


def gemm_writes_fp32(hidden: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype | None) -> bool:
    """Whether the logits asked for in ``dtype`` come straight from the GEMM's fp32 accumulators: fp32 from 16-bit
    operands on CUDA (``torch.mm(..., out_dtype=torch.float32)``)."""
    return dtype == torch.float32 and hidden.dtype in (torch.bfloat16, torch.float16) and on_cuda(hidden, weight)


def classifier_logits(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype | None
) -> torch.Tensor:
    """``F.linear(hidden, weight, bias)`` returned in ``dtype`` (None: the operands'). Where ``gemm_writes_fp32``,
    cuBLAS writes its fp32 accumulators unrounded; elsewhere the linear's own output is cast."""
    if dtype is None or dtype == hidden.dtype:
        return torch.nn.functional.linear(hidden, weight, bias)
    if not gemm_writes_fp32(hidden, weight, dtype):
        return torch.nn.functional.linear(hidden, weight, bias).to(dtype)
    if rows_aligned(weight.shape[0]):
        wide = torch.mm(hidden, weight.t(), out_dtype=torch.float32)
    else:
        wide = torch.ops.memopt.fp32_logits_by_row_chunks(hidden, weight)
    return wide + bias.to(torch.float32) if bias is not None else wide


# cuBLAS's fast GEMMs want every output row to start 16 bytes after the last. An fp32 row of an odd vocabulary
# does not (GPT-2's 50257 classes), and there torch.mm ran 3.5x slower on the H200: 13.3 ms for GPT-2's
# 16384 x 50257 x 768 head, against ~3.9 for the whole head compiled by Inductor, which pads the row stride
# (`benchmarks/hf_trainer.py --models gpt2`, the H200).
_ROW_ALIGNMENT_BYTES = 16
_FP32_BYTES = 4
# The most that the padded buffer of one row chunk's GEMM takes before its copy into place.
ROW_CHUNK_BYTES = 128 * 2**20


def rows_aligned(vocab: int) -> bool:
    """Whether fp32 rows of ``vocab`` classes start 16 bytes apart, as cuBLAS's fast GEMMs want."""
    return vocab * _FP32_BYTES % _ROW_ALIGNMENT_BYTES == 0


@reference_op("fp32_logits_by_row_chunks")
def fp32_logits_by_row_chunks(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``hidden @ weight.T`` from 16-bit operands as contiguous fp32 [N, V], for a V whose fp32 rows are not
    16-byte aligned: each row chunk's GEMM writes a buffer of rows padded to alignment (the weight gets zero
    classes up to it), which is then copied into place. One transient chunk and one padded weight beyond the
    output, and one more write and read of the logits: far cheaper than the GEMM's slow path. Opaque, so
    Inductor runs the loop as it is rather than unrolling it over N."""
    vocab = weight.shape[0]
    per_row = _ROW_ALIGNMENT_BYTES // _FP32_BYTES
    padded = padded_rows(weight, -(-vocab // per_row) * per_row)
    out = hidden.new_empty(hidden.shape[0], vocab, dtype=torch.float32)
    row_bytes = padded.shape[0] * _FP32_BYTES
    step = max(1, min(ROW_CHUNK_BYTES, out.numel() * _FP32_BYTES // 16) // row_bytes)  # <= 1/16 of the output
    for start in range(0, hidden.shape[0], step):
        chunk = _gemm_fp32(hidden[start : start + step], padded.t())
        out[start : start + step] = chunk[:, :vocab]
    return out


@fp32_logits_by_row_chunks.register_fake
def _(hidden, weight):
    return hidden.new_empty(hidden.shape[0], weight.shape[0], dtype=torch.float32)


def _gemm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with fp32 output: cuBLAS's accumulators on CUDA; elsewhere (tests) the product of the fp32 operands."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())


@device_op("cce_with_logits")
def cce_with_logits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    detach_logits: bool = False,
    logits_dtype: torch.dtype | None = None,
    scale: float = 1.0,
    divisor: float = 1.0,
    transform_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_inputs(hidden, weight, bias, targets, reduction, label_smoothing, softcap, scale, divisor)
    targets = targets.long()
    multiplier = scale / divisor
    logits = classifier_logits(hidden, weight, bias, logits_dtype)
    if on_cuda(hidden, weight, targets):
        targets = torch.ops.memopt.cce_checked_targets(targets, weight.shape[0], ignore_index)
        losses, lse = row_terms(logits, targets, ignore_index, label_smoothing, softcap, multiplier)
    else:
        losses, lse = torch.ops.memopt.cce_rows_from_logits(
            logits, targets, ignore_index, label_smoothing, softcap, multiplier
        )
    if transform_logits:  # after the loss terms, which read the classifier's output
        logits = reference.transformed_logits(logits, scale, divisor, softcap)
    return _reduce(losses, targets != ignore_index, reduction), lse, logits


def _setup_context(ctx, inputs, output) -> None:
    scale, divisor, transform_logits = inputs[10:13]
    save_for_backward(ctx, inputs, output, scale / divisor, transform_logits)
    # the backward recomputes the logits as the forward took its log-sum-exp from them: rounded to the operands'
    # dtype, unless the GEMM wrote its fp32 accumulators (logits_dtype)
    ctx.round_logits = not gemm_writes_fp32(inputs[0], inputs[1], inputs[9])
    if inputs[8]:  # detach_logits: their gradient, if any, is added outside the graph
        ctx.mark_non_differentiable(output[2])
    # Gradients an output did not receive arrive as None rather than as zeros of its size (N×V for the logits).
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_loss, grad_lse, grad_logits):
    # grad_logits: None, or (traced) a tangent that may be zeros for logits the caller dropped: added once per
    # chunk, it costs no GEMM.
    return (*input_gradients(ctx, grad_loss, grad_lse, 0.0, grad_logits, ctx.round_logits), *[None] * 10)


cce_with_logits.register_autograd(_backward, setup_context=_setup_context)


if HAS_TRITON:
    from lowerings.cce.op import warm_backward

    @precompile.warmer("cce_with_logits")
    def _(hidden, weight, bias, targets, ignore_index=-100, reduction="mean", label_smoothing=0.0, softcap=None,
          detach_logits=False, logits_dtype=None, scale=1.0, divisor=1.0, transform_logits=False):
        rounded = not gemm_writes_fp32(hidden, weight, logits_dtype)
        warm_backward(hidden, weight, bias, targets, label_smoothing, softcap, round_logits=rounded,
                      scale=scale / divisor)
