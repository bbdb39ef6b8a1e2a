"""``torch.ops.memopt.flash_attention``: attention that keeps O(T) memory, forward and backward.

    out, lse, seed = torch.ops.memopt.flash_attention(q, k, v, bias, scale, causal, dropout_p, softcap=None,
                                                      window=None)

q is [B, Hq, Tq, D], k and v [B, Hk, Tk, D] with Hq a multiple of Hk (grouped-query attention, without
repeating k and v). ``bias`` is None or an additive float tensor broadcastable to [B, Hq, Tq, Tk] (padding
masks, position biases; a boolean mask becomes 0 / -inf). A bias that needs a gradient (T5's learned position
bias) gets one: the backward writes dS, a transient fp32 [B, Hq, Tq, Tk], and sums it over the bias's broadcast
dimensions. ``causal`` masks keys after the query (top-left aligned, as
``F.scaled_dot_product_attention(is_causal=True)``), without any T×T tensor. ``softcap`` c (None: off) turns each
score x = q·k·scale into c·tanh(x/c) before the bias and the mask (Gemma 2's ``attn_logit_softcapping``); no
library attention kernel does this. ``window`` w (None: off; only with ``causal``) is a causal sliding window:
query i sees key j iff i − w < j ≤ i (the ``sliding_window`` of Mistral, Qwen2 and Gemma 2/3); key blocks outside
every query's window are never visited, so the work is O(T·w). ``lse`` is the fp32 log-sum-exp per query;
``seed`` the dropout seed drawn from torch's generator.
Autograd saves q, k, v, bias, out, lse and the seed, never the Tq×Tk probabilities.

On CUDA forward and backward are Triton kernels that Inductor emits (``kernels.py``, a ``triton_op``); on
CPU both are the block-by-block PyTorch reference (``reference.py``).
"""

from __future__ import annotations

import torch

from lowerings._library import HAS_TRITON, device_op, on_cuda, reference_op, transient_bytes, workspace
from lowerings.flash_attention import reference

if HAS_TRITON:
    from lowerings.flash_attention import kernels


def working_set(
    batch, heads, queries, keys, device: torch.device, *, dtype: torch.dtype = torch.float32, head_dim=0,
    kv_heads=None,
) -> dict[str, object]:
    """Bytes the op keeps beyond its inputs and output, by name (for the graph rewrite's memory model).

    ``device`` is the one whose implementation is charged (the CUDA kernels keep only the log-sum-exp; the CPU
    reference a block of scores, ≤ 1/8 of them). ``dtype``, ``head_dim`` and ``kv_heads`` refine the CPU terms:
    16-bit inputs have k and v and their gradients held in fp32. Sizes may be SymInts.
    """
    terms: dict[str, object] = {"saved: log-sum-exp [B, H, Tq] (fp32)": batch * heads * queries * 4}
    if device.type == "cuda":
        return terms
    block = reference.block_budget(batch, heads, queries, keys, head_dim, dtype)
    terms["transient: one block of scores and their gradient, in place (CPU reference)"] = block
    acc = reference.compute_dtype(dtype).itemsize
    if dtype.itemsize < acc:
        kv = batch * (heads if kv_heads is None else kv_heads) * keys * head_dim * acc
        terms["transient: k, v and their gradients in fp32 (CPU reference)"] = 4 * kv
    return terms


def _check_inputs(q, k, v, bias, dropout_p, causal=False, softcap=None, window=None) -> None:
    torch._check(q.dim() == 4 and k.dim() == 4 and v.dim() == 4, lambda: "memopt.flash_attention: q, k, v must be 4-D")
    torch._check(
        k.shape == v.shape, lambda: f"memopt.flash_attention: k {tuple(k.shape)} and v {tuple(v.shape)} differ"
    )
    torch._check(
        q.shape[0] == k.shape[0] and q.shape[3] == k.shape[3],
        lambda: f"memopt.flash_attention: q {tuple(q.shape)} and k {tuple(k.shape)} differ in batch or head dim",
    )
    torch._check(
        q.shape[1] % k.shape[1] == 0,
        lambda: f"memopt.flash_attention: {q.shape[1]} query heads are not a multiple of {k.shape[1]} key heads",
    )
    torch._check(q.dtype == k.dtype == v.dtype, lambda: "memopt.flash_attention: q, k, v must share a dtype")
    torch._check(0.0 <= dropout_p < 1.0, lambda: "memopt.flash_attention: dropout_p must be in [0, 1)")
    torch._check(softcap is None or softcap > 0, lambda: f"memopt.flash_attention: softcap {softcap} must be > 0")
    torch._check(
        window is None or (causal and window >= 1),
        lambda: f"memopt.flash_attention: a window ({window}) must be >= 1 and comes with causal=True",
    )
    if bias is not None:
        torch._check(bias.dim() <= 4, lambda: "memopt.flash_attention: bias has more than 4 dimensions")
        torch._check(bias.is_floating_point(), lambda: "memopt.flash_attention: bias must be floating point")
        full = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        for size, target in zip(reversed(bias.shape), reversed(full), strict=False):
            torch._check(
                size == 1 or size == target,
                lambda: f"memopt.flash_attention: bias {tuple(bias.shape)} does not broadcast to [B, Hq, Tq, Tk] = "
                f"{full}",
            )


def _full_bias(bias, q, k):
    """The bias as a [B, Hq, Tq, Tk] view (broadcast dimensions have stride 0; nothing is copied)."""
    if bias is None:
        return None
    return bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


@reference_op("flash_attention_reference")
def flash_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, scale: float, causal: bool,
    dropout_p: float, seed: torch.Tensor, softcap: float | None = None, window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return reference.forward(q, k, v, bias, scale, causal, dropout_p, int(seed.item()), softcap, window)


# The workspaces of the reference ops that ``memopt.flash_attention`` runs off CUDA: the traced graph shows these.
# On CUDA the op's body is traced through and its Triton kernels' buffers are nodes of that graph; a graph traced
# on CPU tensors but priced for a GPU (``assume_device="cuda"``, a laptop's prediction) shows the reference ops,
# charged then with what the CUDA kernels allocate.
def _reference_workspace(device_type: str, q, k) -> object:
    """Off CUDA the reference's block of scores (and, for 16-bit inputs, k, v and their gradients in fp32); on
    CUDA nothing: a tile of scores lives in registers."""
    if device_type == "cuda":
        return 0
    batch, heads, queries, head_dim = q.shape
    return transient_bytes(working_set(batch, heads, queries, k.shape[-2], torch.device("cpu"), dtype=q.dtype,
                                       head_dim=head_dim, kv_heads=k.shape[-3]))


@workspace("flash_attention_reference")
def forward_workspace(device_type: str, q, k, *_, **__):
    return _reference_workspace(device_type, q, k)


@workspace("flash_attention_backward_reference")
def backward_workspace(device_type: str, q, k, v, bias, out, lse, grad_out, scale, causal, dropout_p, seed,
                       bias_grad=False, *_, **__):
    """The block (on CUDA the fp32 row sums of dO·O [B, Hq, Tq]), and for a bias that wants its gradient the
    full fp32 dS summed into it."""
    rows = q.shape[0] * q.shape[1] * q.shape[2]
    scores = rows * k.shape[-2] * 4 if bias_grad else 0
    return (rows * 4 if device_type == "cuda" else _reference_workspace(device_type, q, k)) + scores


@flash_attention_reference.register_fake
def _(q, k, v, bias, scale, causal, dropout_p, seed, softcap=None, window=None):
    return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=reference.compute_dtype(q.dtype))


@reference_op("flash_attention_backward_reference")
def flash_attention_backward_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
    lse: torch.Tensor, grad_out: torch.Tensor, scale: float, causal: bool, dropout_p: float, seed: torch.Tensor,
    bias_grad: bool, softcap: float | None = None, window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv, dbias = reference.backward(
        q, k, v, bias, out, lse, grad_out, scale, causal, dropout_p, int(seed.item()), bias_grad, softcap, window
    )
    return dq, dk, dv, _bias_grad_of(dbias, bias, q)


@flash_attention_backward_reference.register_fake
def _(q, k, v, bias, out, lse, grad_out, scale, causal, dropout_p, seed, bias_grad, softcap=None, window=None):
    dbias = bias.new_empty(bias.shape) if bias_grad else q.new_empty(0)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dbias


def _bias_grad_of(full: torch.Tensor | None, bias: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    """∂loss/∂bias from the full [B, Hq, Tq, Tk] dS: summed over the bias's broadcast dimensions, in its dtype;
    an empty tensor when no bias gradient was asked for (custom ops cannot return None)."""
    if full is None:
        return q.new_empty(0)
    return full.sum_to_size(bias.shape).to(bias.dtype)


@device_op("flash_attention")
def flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, scale: float, causal: bool,
    dropout_p: float, softcap: float | None = None, window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_inputs(q, k, v, bias, dropout_p, causal, softcap, window)
    if dropout_p > 0:
        seed = torch.randint(0, 2**31 - 1, (1,), device=q.device, dtype=torch.int64)
    else:
        seed = torch.zeros(1, device=q.device, dtype=torch.int64)
    if HAS_TRITON and on_cuda(q, k, v):
        out, lse = kernels.forward(q, k, v, _full_bias(bias, q, k), scale, causal, dropout_p, seed, softcap, window)
    else:
        out, lse = torch.ops.memopt.flash_attention_reference(
            q, k, v, bias, scale, causal, dropout_p, seed, softcap, window
        )
    return out, lse, seed


@device_op("flash_attention_backward")
def flash_attention_backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
    lse: torch.Tensor, grad_out: torch.Tensor, scale: float, causal: bool, dropout_p: float, seed: torch.Tensor,
    bias_grad: bool = False, softcap: float | None = None, window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv and, with ``bias_grad``, ∂loss/∂bias in the bias's shape (else an empty tensor)."""
    if HAS_TRITON and on_cuda(q, k, v):
        dq, dk, dv, dbias = kernels.backward(
            q, k, v, _full_bias(bias, q, k), out, lse, grad_out, scale, causal, dropout_p, seed, bias_grad,
            softcap, window,
        )
        return dq, dk, dv, _bias_grad_of(dbias, bias, q)
    return torch.ops.memopt.flash_attention_backward_reference(
        q, k, v, bias, out, lse, grad_out, scale, causal, dropout_p, seed, bias_grad, softcap, window
    )


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, bias, scale, causal, dropout_p, softcap, window = inputs
    out, lse, seed = output
    ctx.mark_non_differentiable(lse, seed)
    ctx.save_for_backward(q, k, v, bias, out, lse, seed)
    ctx.options = (scale, causal, dropout_p)
    ctx.shape_options = (softcap, window)
    ctx.bias_grad = bias is not None and bias.requires_grad


def _backward(ctx, grad_out, grad_lse, grad_seed):
    q, k, v, bias, out, lse, seed = ctx.saved_tensors
    scale, causal, dropout_p = ctx.options
    softcap, window = ctx.shape_options
    dq, dk, dv, dbias = torch.ops.memopt.flash_attention_backward(
        q, k, v, bias, out, lse, grad_out.contiguous(), scale, causal, dropout_p, seed, ctx.bias_grad,
        softcap=softcap, window=window,
    )
    return dq, dk, dv, dbias if ctx.bias_grad else None, None, None, None, None, None


flash_attention.register_autograd(_backward, setup_context=_setup_context)
