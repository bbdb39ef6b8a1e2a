"""``torch.ops.memopt.cce_rowwise``: cut cross-entropy at 6·N·D·V FLOPs, gradients taken during the forward.

    loss, grad_hidden, grad_weight, grad_bias, logits = torch.ops.memopt.cce_rowwise(
        hidden, weight, bias, targets, ignore_index, reduction, label_smoothing, softcap,
        need_hidden, need_weight, need_bias, return_logits, scale, divisor, transform_logits, grad_dtype)

For a scalar loss (``reduction`` "mean" or "sum") the gradient of the loss is known up to the one upstream
scalar as soon as the logits are: the forward walks the rows in chunks, forms a chunk's logits with one GEMM,
takes its loss terms and ``softmax − one-hot`` in place, and multiplies that into ∂E (the chunk's rows, one GEMM)
and ∂C (a second GEMM, accumulated in fp32 over chunks), as fused losses do (Liger-Kernel's fused linear
cross-entropy is the same schedule). The backward only scales the saved gradients by the upstream scalar.
That is 6·N·D·V FLOPs against the V-chunked op's 8 (its backward recomputes the logits), all of them cuBLAS
GEMMs on CUDA, at the price of keeping ∂E [N, D], ∂C [V, D] and ∂b from forward to backward; the rule charges
them and picks this variant only where they are worth it (``fxpass/rules/cce.py``).

``grad_dtype``: the dtype ∂C and ∂b are kept in from forward to backward. By default the classifier's own: a
16-bit classifier's ∂C is summed in fp32 over the chunks and rounded once at the op's end (or taken by slices,
above), as eager's one GEMM rounds it, so no fp32 ∂C outlives the op (at V = 256000, D = 4096 it is 3.9 GiB). The
backward's multiplication by the upstream scalar then rounds a second time unless that scalar is a power of two
(1 for ``loss.backward()``), as ∂E's always has. The rule passes the parameter's dtype where autocast cast an
fp32 classifier to 16 bits: the fp32 sum is then the parameter's gradient itself, which the compiled backward
scales in place.

Both devices run the op's chunk loop in an opaque op (it must not be traced: it would guard on the number of
rows). On CUDA a Triton kernel (``rowwise_kernel.py``) takes a chunk's loss terms and gradient in two reads and
one write of its logits; a bias's gradient is the column sums of what the kernel writes. Elsewhere (CPU, fp64)
PyTorch ops take them in place in five passes over fp32 or fp64 logits (16-bit logits through an fp32 copy), on
the classifier as it is (CUDA's GEMMs want it padded; the CPU's do not). Gradients the graph does not need are
not computed (``need_*`` come from the rule).

``return_logits``: a whole model compiled as it is returns its logits beside the loss. The op then forms all the
logits with one GEMM (rows padded to 64 columns on CUDA, as Inductor pads them) and returns them, and each chunk's
gradient is read from them into a chunk-sized buffer: still 6·N·D·V FLOPs, and no logits-sized tensor is saved
for the backward. On CUDA ∂C is then taken by slices of the vocabulary over all the rows (each slice's gradient
written into the chunk buffer from the rows' log-sum-exp, then one GEMM into ∂C's slice): no fp32 sum, and ∂C
rounded once as eager's. The returned logits are not differentiable here. Their own gradient, when a caller uses them,
is added by ``fxpass.returned_logits`` outside the compiled graph, so that logits the caller drops cost no
backward work and no zero-filled N×V gradient.

``scale``, ``divisor`` and ``transform_logits`` as in ``memopt.cce_with_logits``: the loss is taken over
c·tanh(x·scale/divisor/c), and with ``transform_logits`` the returned logits are those, transformed in place in
their own buffer once each chunk has read them (on CUDA by the chunk kernel's second sweep, which reads them
anyway; elsewhere op by op in their dtype, as the model wrote it). No second N×V tensor either way.
"""

from __future__ import annotations

import torch

from lowerings import precompile
from lowerings._library import HAS_TRITON, reference_op, tracing, transient_bytes, workspace
from lowerings.cce import reference
from lowerings.cce.op import _check_inputs

if HAS_TRITON:
    from lowerings.cce.rowwise_kernel import column_gradient_, row_gradient_, scaled_copy

SCALAR_REDUCTIONS = ("mean", "sum")
# A chunk of rows holds its logits and their fp32 copy within 1/FRACTION of the N×V logits (4: each chunk adds
# its product into the fp32 ∂C, so fewer chunks mean fewer passes over it; 1022 → 2048 rows took V = 128256 from
# 27.5 to 24.7 ms on the H200, `benchmarks/tools/cce_tune.py --rowwise`), under CHUNK_BYTES
# (larger on CUDA, where GEMMs want a few hundred rows) or under ∂C's size in the input dtype where that is larger
# (the op ends holding that cast beside the fp32 sum, so a chunk up to its size adds nothing to the op's peak:
# V = 256000, D = 2304 then takes 4 chunks instead of 7), and is at least one row.
FRACTION = 4
CHUNK_BYTES = {"cuda": 512 << 20, "cpu": 32 << 20}
# Where the op returns the logits, a chunk's buffer is held beside all of them rather than in their place, at the
# forward's end where every activation is alive: 1/RETURNED_FRACTION of the logits, but at least
# MIN_GEMM_ROWS rows on CUDA (fewer make ∂C's fp32 accumulation bound by memory: each chunk reads and writes ∂C, and
# a chunk of r rows does r/4 FLOPs a byte of it, against the H200's ~170 FLOPs a byte at cuBLAS's rate). 2048, not
# 1024: at the Llama-3.2-1B shape a 1024-row chunk's ∂E and ∂C GEMMs take 1.61 ms against 2.93 for 2048 rows
# (`benchmarks/tools/cce_tune.py --rowwise`), and FSDP2's step (the head alone in its graph) went from 1.01-1.02×
# torch.compile's time to 0.99× (one run), its peak from 0.87× to 0.88×
# (`benchmarks/e2e.py --models llama-1b --flows fsdp`).
RETURNED_FRACTION = 16
MIN_GEMM_ROWS = 2048
# Off CUDA the same floor is lower, for the same reason: each chunk's ∂E GEMM reads the whole classifier and its ∂C
# sum reads and writes the fp32 ∂C. At GPT-2's vocabulary (512 × 50257 × 768, fp32, 2 cores) 1/16 of the logits
# is 16 rows, 32 chunks: 1.46-1.90× torch.compile's time, against 0.99-1.43× for chunks of 128-512 rows (runs of
# a noisy 2-core machine; `benchmarks/cpu_ops.py`).
MIN_CPU_GEMM_ROWS = 256
# A loss-only chunk off CUDA, held in place of the logits rather than beside them, is at least MIN_CPU_LOSS_ROWS:
# at 512 × 50257 × 768 (fp32, 2 cores, compiled through the backend) the op took 1.37× torch.compile's time in
# 64-row chunks, 1.17× in 128, 1.08× in 256 and 0.99× in one chunk of 512 (`benchmarks/cpu_ops.py`).
MIN_CPU_LOSS_ROWS = 512


ROW_VECTOR_BYTES = 128  # a row's share of the chunk's per-row vectors (loss terms, max, sum, index, validity)
ROW_ALIGN = 64  # elements a chunk's logits row is padded to on CUDA: 128 bytes in 16 bits


def padded_vocab(vocab, device_type: str):
    """The vocabulary rounded up to ROW_ALIGN on CUDA: the classifier's rows and a chunk's logits columns in the
    GEMMs. An odd vocabulary (GPT-2's 50257) as a leading dimension or as ∂E's reduction length keeps cuBLAS off
    its tensor-core kernels in all three GEMMs of a chunk (Inductor's ``pad_mm`` pads such shapes too). Off CUDA
    the vocabulary as it is: the CPU's GEMMs run odd sizes at the same rate, and the padded copy of the classifier
    (a zero fill and a copy of [V, D] each call) cost more than the GEMMs gained."""
    return -(-vocab // ROW_ALIGN) * ROW_ALIGN if device_type == "cuda" else vocab


def chunk_bytes_per_row(vocab, dtype: torch.dtype, device_type: str, in_place: bool = False):
    """A row of a chunk: its logits in the input dtype (padded rows on CUDA), their copy in the compute dtype
    unless the chunk's gradient is taken in place (the CUDA kernel, or fp32 and fp64 chunks off CUDA), and its
    per-row vectors."""
    copy = 0 if in_place else vocab * reference.compute_dtype(dtype).itemsize
    return padded_vocab(vocab, device_type) * dtype.itemsize + copy + ROW_VECTOR_BYTES


def chunk_rows(
    n_rows,
    vocab,
    dtype: torch.dtype,
    device_type: str,
    in_place: bool = False,
    returns_logits: bool = False,
    gradient_bytes=0,
):
    """Rows per chunk (SymInts give a symbolic answer). ``gradient_bytes``: ∂C's size in the input dtype where the
    op takes ∂C (0 otherwise), a ceiling that costs no peak."""
    fraction = RETURNED_FRACTION if returns_logits else FRACTION
    ceiling = torch.sym_max(CHUNK_BYTES.get(device_type, 32 << 20), gradient_bytes)
    share = torch.sym_min(n_rows * vocab * dtype.itemsize // fraction, ceiling)
    fits = share // chunk_bytes_per_row(vocab, dtype, device_type, in_place)
    if returns_logits and device_type == "cuda":  # (a power of two, so usually a divisor of the rows as it is)
        return torch.sym_max(1, torch.sym_min(n_rows, torch.sym_max(fits // ROW_ALIGN * ROW_ALIGN, MIN_GEMM_ROWS)))
    if device_type != "cuda":
        fits = torch.sym_max(fits, MIN_CPU_GEMM_ROWS if returns_logits else MIN_CPU_LOSS_ROWS)
    # a multiple of ROW_ALIGN where that leaves any: ∂C's GEMM sums over the chunk's rows
    aligned = torch.sym_max(1, torch.sym_max(fits // ROW_ALIGN * ROW_ALIGN, torch.sym_min(fits, ROW_ALIGN - 1)))
    # Chunks of equal size, each at most 1/4 over the share: 8192 rows in 1984-row chunks left a 256-row tail
    # whose GEMMs ran at a third of the rate, and a fifth pass over the fp32 ∂C (4 × 2048 rows instead).
    chunks = -(-n_rows // (aligned * 5 // 4 + 1))
    unit = torch.sym_max(1, torch.sym_min(ROW_ALIGN, aligned // ROW_ALIGN * ROW_ALIGN))
    even = -(-n_rows // torch.sym_max(1, chunks))  # ceil(rows / chunks)
    balanced = -(-even // unit) * unit
    return torch.sym_max(1, torch.sym_min(n_rows, balanced))


def _gradient_bytes(vocab, dim, dtype: torch.dtype, need_weight: bool):
    """∂C [V, D] in the input dtype where the op takes it: a 16-bit ∂C's rounded copy, alive beside the fp32 sum
    at the op's end, where no chunk is."""
    return vocab * dim * dtype.itemsize if need_weight else 0


def _rows_per_chunk(hidden: torch.Tensor, vocab: int, need_weight: bool, return_logits: bool, device_type: str) -> int:
    """The op's chunk height for these inputs on ``device_type`` (the last chunk takes what is left)."""
    in_place = _gradient_in_place(device_type, hidden.dtype)
    cast_bytes = _gradient_bytes(vocab, hidden.shape[1], hidden.dtype, need_weight)
    return int(chunk_rows(hidden.shape[0], vocab, hidden.dtype, device_type, in_place, return_logits, cast_bytes))


def _kernel_serves(device_type: str, dtype: torch.dtype) -> bool:
    """The chunk kernel (``rowwise_kernel.py``) replaces the PyTorch chunk path on CUDA for 16-bit and fp32
    inputs; a bias's gradient is then the column sums of the gradient it writes (``_add_bias_gradient_``)."""
    return HAS_TRITON and device_type == "cuda" and dtype != torch.float64


def _by_columns(device_type: str, dtype: torch.dtype, return_logits: bool, need_weight: bool) -> bool:
    """Whether ∂C is taken by slices of the vocabulary over every row (``_weight_gradient_by_columns_``): where
    the op returns the logits, so all of them are in memory, and the chunk kernel serves the chunks (it stores
    the rows' log-sum-exp the slices' sweep needs)."""
    return need_weight and return_logits and _kernel_serves(device_type, dtype)


def _transforms(return_logits: bool, transform_logits: bool, scale: float, divisor: float,
                softcap: float | None) -> bool:
    """Whether the op transforms the logits it returns: asked to, and there is a scale or a softcap to apply."""
    return return_logits and transform_logits and (scale, divisor, softcap) != (1.0, 1.0, None)


def _gradient_in_place(device_type: str, dtype: torch.dtype) -> bool:
    """Whether a chunk's gradient overwrites its logits' buffer, with no copy in the compute dtype: the CUDA
    kernel's, and the PyTorch path's where the logits already are in the compute dtype (fp32, fp64)."""
    return _kernel_serves(device_type, dtype) or reference.compute_dtype(dtype) == dtype


def _accumulates_in_fp32(device_type: str) -> bool:
    """cuBLAS adds a 16-bit product into an fp32 matrix in one GEMM (``addmm``'s ``out_dtype``, CUDA only);
    elsewhere the chunk's product is formed in 16 bits, rounded once, then added."""
    return device_type == "cuda" and hasattr(torch.ops.aten.addmm, "dtype_out")


def _add_product_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool) -> None:
    """``acc += a @ b`` (``acc = a @ b`` for the ``first`` chunk: no zero fill, no read of the accumulator),
    with ``acc`` in the compute dtype of 16-bit (or like-typed) ``a`` and ``b``."""
    if acc.dtype == a.dtype:
        torch.mm(a, b, out=acc) if first else acc.addmm_(a, b)
    elif _accumulates_in_fp32(acc.device.type):
        if first:
            torch.mm(a, b, out_dtype=acc.dtype, out=acc)
        else:
            torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc.copy_(a @ b) if first else acc.add_(a @ b)


def working_set(
    n_rows,
    vocab,
    dim,
    dtype: torch.dtype,
    device: torch.device,
    needs=(True, True, False),
    returns_logits: bool = False,
    weight_grad_dtype: torch.dtype | None = None,
):
    """Bytes the op keeps beyond its inputs and the loss (and the logits it returns), by name, for the rule's
    memory model. ``weight_grad_dtype``: the dtype the op keeps ∂C in (its ``grad_dtype``: the parameter's where
    autocast cast an fp32 classifier; None, the classifier's own ``dtype``).

    Kept in 16 bits, ∂C's fp32 sum is a transient of the op, and ∂C is saved at half its size; with returned
    logits on CUDA there is no fp32 sum (``_weight_gradient_by_columns_``). Kept in the
    compute dtype (fp32 weights, under autocast or not), the sum is the weight's gradient itself: the compiled
    backward scales it in place (donated buffers: the backward's peak above its start was 92 MiB for a 1002 MiB
    gradient on the H200) where torch.compile's backward allocates the same fp32 [V, D] while the logits'
    gradient is alive, so only its padding rows are charged."""
    acc = reference.compute_dtype(dtype).itemsize
    need_hidden, need_weight, need_bias = needs
    kept = kept_dtype(dtype, weight_grad_dtype)
    in_place = _gradient_in_place(device.type, dtype)
    cast_bytes = _gradient_bytes(vocab, dim, dtype, need_weight)
    rows = chunk_rows(n_rows, vocab, dtype, device.type, in_place, returns_logits, cast_bytes)
    if in_place:
        chunk = "transient (forward): one chunk of logits, turned into their gradient in place [rows, V]"
    else:
        chunk = "transient (forward): one chunk of logits and their fp32 copy [rows, V]"
    chunk_bytes = rows * chunk_bytes_per_row(vocab, dtype, device.type, in_place=in_place)
    by_columns = _by_columns(device.type, dtype, returns_logits, need_weight)
    if need_weight and kept.itemsize < acc and not by_columns:
        # ∂C's 16-bit copy is allocated once the last chunk is freed: the chunk overlaps it, not the sum beside it
        chunk += CHUNK_BEFORE_KEPT
        chunk_bytes = torch.sym_max(chunk_bytes - vocab * dim * kept.itemsize, 0)
    terms: dict[str, object] = {chunk: chunk_bytes}
    if need_weight and dtype.itemsize < acc and not _accumulates_in_fp32(device.type):
        product = "transient (forward): a chunk's ∂C product [V, D] and its fp32 copy for the sum"
        terms[product] = vocab * dim * (dtype.itemsize + acc)
    width = padded_vocab(vocab, device.type)
    if device.type == "cuda" and not (isinstance(vocab, int) and width == vocab):  # (a symbolic one is charged)
        terms["transient (forward): the classifier and its bias, zero-padded to a multiple of 64 rows"] = (
            width * (dim + 1) * dtype.itemsize
        )
    if need_bias and _kernel_serves(device.type, dtype):
        terms["transient (forward): a chunk's ∂b column sums [V] (fp32)"] = vocab * acc
    saved = (n_rows * dim * dtype.itemsize if need_hidden else 0) + (vocab * kept.itemsize if need_bias else 0)
    if by_columns:  # the slices' sweep works in the chunk's buffer; the row kernel stores each row's lse for it
        terms["transient (forward): the rows' log-sum-exp [N] (fp32), for ∂C's column slices"] = n_rows * 4
    if not need_weight:
        terms["saved: the loss's gradients ∂E [N, D] and ∂b, taken in the forward"] = saved
    elif kept.itemsize < acc:
        if by_columns:  # ∂C's slices rounded once each: no fp32 sum, only ∂b's
            terms["transient (forward): ∂b's fp32 sum [V]"] = vocab * acc if need_bias else 0
        else:
            terms[FP32_SUM] = width * dim * acc + (vocab * acc if need_bias else 0)
        terms[KEPT_16_BIT] = saved + vocab * dim * kept.itemsize
    else:
        terms["saved: the loss's gradients ∂E [N, D] and ∂b, taken in the forward"] = saved
        terms[WEIGHT_GRADIENT_ITSELF] = 0 if by_columns else (width - vocab) * dim * acc
    return terms


# The chunk term's suffix where the chunk is charged only beyond the 16-bit ∂C it dies before (``working_set``).
CHUNK_BEFORE_KEPT = ", less ∂C's 16-bit copy, allocated after the last chunk dies"
FP32_SUM = "transient (forward): ∂C's and ∂b's fp32 sums [V, D], rounded to 16 bits at the op's end"
KEPT_16_BIT = "saved: the loss's gradients ∂E [N, D], ∂C [V, D] and ∂b in 16 bits, taken in the forward"
WEIGHT_GRADIENT_ITSELF = (
    "saved: ∂C [V, D] (fp32), taken in the forward, the weight's fp32 gradient itself (torch.compile allocates it "
    "in the backward): its padding rows only"
)


def padded_rows(tensor: torch.Tensor | None, rows: int) -> torch.Tensor | None:
    """``tensor`` with zero rows appended up to ``rows`` (itself when it has them): the classifier and its bias
    padded to ``padded_vocab`` here (to aligned fp32 rows in ``with_logits``), so that the padded logits columns
    are exactly zero."""
    if tensor is None or tensor.shape[0] == rows:
        return tensor
    padded = tensor.new_zeros((rows, *tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    return padded


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``hidden @ weightᵀ (+ bias)`` for the padded classifier: [rows, padded V], zero past the vocabulary."""
    if bias is None:
        return torch.mm(hidden, weight.t())
    return torch.addmm(bias, hidden, weight.t())


def _chunk_gradient_(
    z: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    softcap: float | None,
    grad_scale: torch.Tensor,
    logit_scale: float = 1.0,
) -> torch.Tensor:
    """Σ of the chunk's loss terms; the chunk's classifier outputs ``z`` (compute dtype) become ``grad_scale`` ·
    ∂(Σ loss)/∂z in place, in five passes over them where there is no softcap, scale or smoothing (max, subtract,
    exp, sum, scale).

    loss = (1 − ε)(lse − z_t) + ε(lse − mean z); ∂/∂z = softmax − (1 − ε)·onehot − ε/V, times 1 − tanh² under the
    softcap z = c·tanh(x·m/c) and times the logit scale m; ignored rows contribute nothing."""
    vocab = z.shape[1]
    slope = None
    if logit_scale != 1.0:
        z.mul_(logit_scale)
    if softcap is not None:  # applied here rather than in row_terms_, to keep tanh for the chain rule
        z.div_(softcap).tanh_()
        slope = 1.0 - z.square()  # a second buffer, only under a softcap
        z.mul_(softcap)
    loss, _, sums = reference.row_terms_(z, targets, ignore_index, label_smoothing, None)
    valid = reference.valid_rows(targets, ignore_index)
    index = torch.where(valid, targets, 0).unsqueeze(1)
    scale = torch.where(valid, grad_scale * logit_scale, 0.0)  # per row: ignored rows get a zero gradient
    z.mul_((scale / sums).unsqueeze(1))  # z held exp(z − max): now the scaled softmax
    z.scatter_add_(1, index, (scale * -(1.0 - label_smoothing)).unsqueeze(1))
    if label_smoothing:
        z.sub_((scale * (label_smoothing / vocab)).unsqueeze(1))
    if slope is not None:
        z.mul_(slope)
    return loss.sum()


def kept_dtype(weight_dtype: torch.dtype, grad_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype the op keeps ∂C (and ∂b) in from forward to backward: ``grad_dtype``, else the classifier's."""
    return weight_dtype if grad_dtype is None else grad_dtype


@reference_op("cce_rowwise")
def cce_rowwise(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    softcap: float | None,
    need_hidden: bool,
    need_weight: bool,
    need_bias: bool,
    return_logits: bool = False,
    scale: float = 1.0,
    divisor: float = 1.0,
    transform_logits: bool = False,
    grad_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_inputs(hidden, weight, bias, targets, reduction, label_smoothing, softcap, scale, divisor)
    torch._check(reduction in SCALAR_REDUCTIONS, lambda: "memopt.cce_rowwise: the loss must be a scalar (mean or sum)")
    targets = targets.long()
    n_rows, vocab = hidden.shape[0], weight.shape[0]
    reference.check_targets(targets, vocab, ignore_index)
    acc = reference.compute_dtype(hidden.dtype)
    grad_hidden = torch.empty_like(hidden) if need_hidden else hidden.new_empty(0)
    # Every CUDA GEMM runs on the classifier padded to a multiple of ROW_ALIGN rows (zeros): GPT-2's 50257 as a
    # leading dimension or reduction length keeps cuBLAS on its slow pre-Hopper kernels (the op 3.2× slower at
    # GPT-2's loss shape on the H200: 30.8 against 9.7 ms).
    width = padded_vocab(vocab, hidden.device.type)
    weight_rows, bias_rows = padded_rows(weight, width), padded_rows(bias, width)
    fused = _kernel_serves(hidden.device.type, hidden.dtype)
    # ∂C by slices of the vocabulary over every row, from the returned logits (no fp32 sum), or summed over chunks
    by_columns = _by_columns(hidden.device.type, hidden.dtype, return_logits, need_weight) and n_rows > 0
    grad_weight_rows = weight.new_empty(0)
    if need_weight and not by_columns:  # the first chunk writes ∂C; with no rows there is no chunk, and ∂C is 0
        grad_weight_rows = (weight.new_empty if n_rows else weight.new_zeros)((width, weight.shape[1]), dtype=acc)
    grad_bias = weight.new_zeros(vocab, dtype=acc) if need_bias and bias is not None else weight.new_empty(0)
    valid = reference.valid_rows(targets, ignore_index)
    # mean: every row's gradient carries 1 / (valid rows), known before the first chunk (0/0 → NaN as PyTorch)
    mean = 1.0 / valid.sum().to(acc) if reduction == "mean" else torch.ones((), dtype=acc, device=hidden.device)
    grad_scale = torch.nan_to_num(mean, posinf=0.0)  # no valid row: a NaN loss, zero gradients, as PyTorch
    total = torch.zeros((), dtype=acc, device=hidden.device)
    lse = torch.empty(n_rows, dtype=torch.float32, device=hidden.device) if by_columns else None
    multiplier = scale / divisor  # the logit scale m
    transform = _transforms(return_logits, transform_logits, scale, divisor, softcap)
    step = _rows_per_chunk(hidden, vocab, need_weight, return_logits, hidden.device.type)
    all_logits = _chunk_logits(hidden, weight_rows, bias_rows) if return_logits else None  # [N, width]
    chunk_buffer = None
    if all_logits is not None and n_rows:  # one chunk's gradient at a time; its padding columns stay zero
        chunk_buffer = hidden.new_empty(min(step, n_rows), width)
        chunk_buffer[:, vocab:].zero_()
    for start in range(0, n_rows, step):
        rows = slice(start, min(start + step, n_rows))
        if all_logits is None:
            padded = _chunk_logits(hidden[rows], weight_rows, bias_rows)  # [rows, width]: zero past the vocabulary
            source = None
        else:
            padded = chunk_buffer[: rows.stop - rows.start]
            source = all_logits[rows, :vocab]
        logits = padded[:, :vocab]
        if fused:  # loss terms and the scaled gradient in one kernel (in place unless the logits are returned)
            terms = row_gradient_(
                logits, targets[rows], ignore_index, label_smoothing, softcap, grad_scale, source, multiplier,
                transform and not by_columns, None if lse is None else lse[rows],
            )
            total += terms.sum()
            if grad_bias.numel():  # from the gradient as the GEMMs see it, rounded, as the eager backward sums it
                grad_bias += logits.sum(dim=0, dtype=acc)
        else:  # in place in fp32 and fp64; 16-bit logits through an fp32 copy (the GEMMs' operands stay 16-bit)
            if logits.dtype == acc:
                grad = logits if source is None else logits.copy_(source)
            else:
                grad = (logits if source is None else source).to(acc, copy=True)
            total += _chunk_gradient_(
                grad, targets[rows], ignore_index, label_smoothing, softcap, grad_scale, multiplier
            )
            if grad is not logits:
                logits.copy_(grad)  # padding columns still zero
            if transform:  # the chunk's returned logits, now that its gradient is taken from them
                reference.transform_logits_(source, scale, divisor, softcap)
        if need_hidden:
            torch.mm(padded, weight_rows, out=grad_hidden[rows])
        if need_weight and not by_columns:
            _add_product_(grad_weight_rows, padded.t(), hidden[rows], first=start == 0)
        if grad_bias.numel() and not fused:
            grad_bias += grad.sum(dim=0)
        # drop this chunk's buffers before the next chunk's GEMM allocates, or two chunks are alive at once
        padded = logits = grad = None
    # ∂C and ∂b in the dtype they are kept in: a 16-bit classifier's rounded once here (``grad_dtype``); an fp32
    # ∂C stays the padded sum's view (its padding rows dropped only by a copy)
    kept = kept_dtype(weight.dtype, grad_dtype)
    if by_columns:
        grad_weight = weight.new_empty(weight.shape, dtype=kept)
        buffer, chunk_buffer = chunk_buffer, None
        _weight_gradient_by_columns_(
            grad_weight, buffer, all_logits[:, :vocab], hidden, targets, lse, ignore_index, label_smoothing,
            softcap, grad_scale, multiplier, transform,
        )
    else:
        grad_weight = grad_weight_rows[:vocab].to(kept) if need_weight else grad_weight_rows
    grad_bias = grad_bias.to(kept_dtype(bias.dtype, grad_dtype)) if grad_bias.numel() else grad_bias
    returned = all_logits[:, :vocab] if all_logits is not None else hidden.new_empty(0)
    return total * mean, grad_hidden, grad_weight, grad_bias, returned


def column_width(n_rows: int, vocab: int, buffer_elements: int) -> int:
    """Columns of a slice of the vocabulary in ``_weight_gradient_by_columns_``: the chunk buffer's room for every
    row, a multiple of ROW_ALIGN (∂C's slice GEMM has that many output rows), at least ROW_ALIGN."""
    fits = buffer_elements // max(n_rows, 1) // ROW_ALIGN * ROW_ALIGN
    return max(ROW_ALIGN, min(padded_vocab(vocab, "cuda"), fits))


def _weight_gradient_by_columns_(
    grad_weight: torch.Tensor,
    buffer: torch.Tensor,
    logits: torch.Tensor,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    softcap: float | None,
    grad_scale: torch.Tensor,
    logit_scale: float,
    transform: bool,
) -> None:
    """∂C = Gᵀ·E into ``grad_weight`` [V, D], a slice of the vocabulary at a time: the slice's gradient for every
    row from the returned ``logits`` and each row's log-sum-exp (``column_gradient_``, in the chunk ``buffer``'s
    memory), then one GEMM over all the rows, rounded once into ∂C's dtype as eager's backward GEMM is. No fp32
    sum over row chunks: each chunk's GEMM read and wrote it (at Cohere's head, V = 256000, D = 4096, 3.9 GiB a
    pass), and a 16-bit ∂C was its cast beside it. The slices' sweep reads the logits once more and, with
    ``transform``, leaves them transformed."""
    n_rows, vocab = logits.shape
    columns = column_width(n_rows, vocab, buffer.numel())
    if n_rows * columns > buffer.numel():  # (a buffer too small for ROW_ALIGN columns of every row)
        buffer = hidden.new_empty(n_rows * columns)
    slices = buffer.view(-1)[: n_rows * columns].view(n_rows, columns)
    for first in range(0, vocab, columns):
        last = min(first + columns, vocab)
        gradient = slices[:, : last - first]
        column_gradient_(
            gradient, logits, first, targets, lse, ignore_index, label_smoothing, softcap, grad_scale,
            logit_scale, transform,
        )
        _add_product_(grad_weight[first:last], gradient.t(), hidden, first=True)


@cce_rowwise.register_fake
def _(hidden, weight, bias, targets, ignore_index, reduction, label_smoothing, softcap, need_hidden, need_weight,
      need_bias, return_logits=False, scale=1.0, divisor=1.0, transform_logits=False, grad_dtype=None):
    acc = reference.compute_dtype(hidden.dtype)
    rows, vocab = hidden.shape[0], weight.shape[0]
    return (
        hidden.new_empty((), dtype=acc),
        hidden.new_empty(hidden.shape) if need_hidden else hidden.new_empty(0),
        weight.new_empty(weight.shape, dtype=kept_dtype(weight.dtype, grad_dtype))
        if need_weight
        else weight.new_empty(0),
        weight.new_empty(weight.shape[0], dtype=kept_dtype(bias.dtype, grad_dtype))
        if need_bias and bias is not None
        else weight.new_empty(0),
        # the padded rows' view, strides and all: Inductor checks a custom op's output strides against these
        hidden.new_empty_strided((rows, vocab), (padded_vocab(vocab, hidden.device.type), 1))
        if return_logits
        else hidden.new_empty(0),
    )


@workspace("cce_rowwise")
def forward_workspace(device_type: str, hidden, weight, bias, targets, ignore_index, reduction, label_smoothing,
                      softcap, need_hidden, need_weight, need_bias, return_logits=False, scale=1.0, divisor=1.0,
                      transform_logits=False, grad_dtype=None):
    """What the op allocates inside while it runs (``working_set``'s transient terms): its chunk of logits, the
    classifier padded on CUDA, a chunk's ∂C product off CUDA, ∂C's fp32 sum where ∂C is kept in 16 bits. All of
    it dies before the op returns, beside the
    results it writes, where the simulation charges it (``fxpass/compiled_cost.py``). Charged as the backward
    starts instead, the op's record at the Llama-3.2-1B head (8192 × 128256 × 2048, bf16) said it freed 501 MiB
    against torch.compile, where `benchmarks/cce.py` measured 1002 on the H200."""
    needs = (need_hidden, need_weight, need_bias and bias is not None)
    terms = working_set(hidden.shape[0], weight.shape[0], weight.shape[1], hidden.dtype, torch.device(device_type),
                        needs, return_logits, kept_dtype(weight.dtype, grad_dtype))
    return transient_bytes(terms)


if HAS_TRITON:

    @precompile.warmer("cce_rowwise")
    def _(hidden, weight, bias, targets, ignore_index, reduction, label_smoothing, softcap, need_hidden,
          need_weight, need_bias, return_logits=False, scale=1.0, divisor=1.0, transform_logits=False,
          grad_dtype=None):
        """The chunk kernel at each chunk height the op's loop takes on CUDA (the last may be shorter), and with
        returned logits the column sweep of ∂C's slices. Its backward's scaling is traced, hence Inductor's to
        compile."""
        n_rows, vocab = hidden.shape[0], weight.shape[0]
        if not n_rows or not _kernel_serves("cuda", hidden.dtype):
            return
        step = _rows_per_chunk(hidden, vocab, need_weight, return_logits, "cuda")
        width = padded_vocab(vocab, "cuda")
        grad_scale = hidden.new_empty((), dtype=reference.compute_dtype(hidden.dtype))
        by_columns = _by_columns("cuda", hidden.dtype, return_logits, need_weight)
        transform = _transforms(return_logits, transform_logits, scale, divisor, softcap)
        targets = targets.long()
        for rows in {min(step, n_rows), n_rows - (n_rows - 1) // step * step}:
            source = hidden.new_empty(rows, width)[:, :vocab] if return_logits else None
            logits = hidden.new_empty(rows, width)[:, :vocab]
            lse = hidden.new_empty(rows, dtype=torch.float32) if by_columns else None
            row_gradient_(
                logits, targets[:rows], ignore_index, label_smoothing, softcap, grad_scale, source,
                scale / divisor, transform and not by_columns, lse,
            )
        if not by_columns:
            return
        # the column sweep's two slice widths (a first slice, a last one), one row each: the grid is not specialized
        columns = column_width(n_rows, vocab, min(step, n_rows) * width)
        for first in {0, (vocab - 1) // columns * columns}:
            last = min(first + columns, vocab)
            out = hidden.new_empty(1, columns)[:, : last - first]
            column_gradient_(
                out, hidden.new_empty(1, width)[:, :vocab], first, targets[:1], grad_scale.new_empty(1),
                ignore_index, label_smoothing, softcap, grad_scale, scale / divisor, transform,
            )


def _setup_context(ctx, inputs, output) -> None:
    hidden, weight, bias = inputs[:3]
    # The outputs past the loss carry no gradient: without this autograd would fill zeros of their size for the
    # backward, ∂C's fp32 [V, D] among them (1 GiB at V = 128256) when the op runs eagerly.
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(*output[1:4])
    ctx.mark_non_differentiable(*output[1:])
    ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
    ctx.needs = inputs[8:11]


def _scaled(saved: torch.Tensor, grad_loss: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``saved · grad_loss`` in ``dtype`` (the input's), in one pass. Traced, Inductor fuses it into its reader or
    writes it over the saved buffer, which AOTAutograd donates (with an fp32 classifier under autocast, the cast
    back to fp32 fuses in too, so the kept fp32 sum becomes the parameter's gradient in place); run eagerly on
    CUDA, a Triton kernel does it (``rowwise_kernel.scaled_copy``)."""
    if HAS_TRITON and saved.is_cuda and saved.is_contiguous() and not tracing():
        return scaled_copy(saved, grad_loss.reshape(()), dtype)
    return torch.mul(saved, grad_loss, out=saved.new_empty(saved.shape, dtype=dtype))


def _backward(ctx, grad_loss, *_):
    """The upstream scalar times the gradients the forward took; nothing else is computed."""
    if grad_loss is None:  # (gradients are not materialized: an output other than the loss was differentiated)
        return (None,) * 16
    grads = []
    names = ("hidden", "weight", "bias")
    for name, saved, dtype, taken, needed in zip(
        names, ctx.saved_tensors, ctx.dtypes, ctx.needs, ctx.needs_input_grad[:3], strict=True
    ):
        if needed and not taken:  # a gradient silently left out would be a wrong answer
            raise RuntimeError(f"memopt.cce_rowwise: {name} needs a gradient but was told need_{name}=False")
        grads.append(_scaled(saved, grad_loss, dtype) if needed and dtype is not None else None)
    return (*grads, *[None] * 13)


cce_rowwise.register_autograd(_backward, setup_context=_setup_context)
