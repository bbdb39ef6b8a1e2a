"""``torch.ops.memopt.wta_crs_linears``: linears that share an input, saving k sampled rows of it for backward.

    *outputs, index, rows = torch.ops.memopt.wta_crs_linears(x, [W_q, W_k, W_v], [b_q, b_v], [0, -1, 1],
                                                             budget, period, key, winners)

``x`` is [..., D_in] (its leading dimensions are the tokens), each ``W`` [D_out, D_in]; ``bias_of[i]`` is the
index in ``biases`` of weight i's bias, or -1 when it has none. The outputs are exact (x Wᵀ + b); so are the
input and bias gradients. Autograd saves only ``rows`` = the k = ceil(budget·N) sampled rows of x, already
weighted, and their ``index``; each weight gradient is the unbiased WTA-CRS estimate G[index]ᵀ rows. One
sample serves every linear of the group (Q/K/V, gate/up): the rows are stored once. ``period`` is the
sequence length (token i is at position i mod period; 0 takes x.shape[-2] for inputs of 3 or more dimensions)
and ``key`` names the group's running gradient-norm
estimate; ``winners=False`` gives plain column-row sampling (for comparisons).

Randomness comes from torch's default generator: fresh draws each step, reproducible under
``torch.manual_seed``, with fixed shapes so CUDA-graph replays draw anew.
"""

from __future__ import annotations

import torch

from lowerings._library import HAS_TRITON, reference_op
from lowerings.wta_crs import reference, state

if HAS_TRITON:
    from lowerings.wta_crs import kernels


def _row_norms(x: torch.Tensor) -> torch.Tensor:
    if HAS_TRITON and x.is_cuda:
        return kernels.row_norms(x)
    return reference.row_norms(x)


def _gather_rows(x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if HAS_TRITON and x.is_cuda:
        return kernels.gather_rows(x, index, weight)
    return reference.gather_rows(x, index, weight)


def _period(x: torch.Tensor, period: int) -> int:
    if period > 0:
        return period
    return x.shape[-2] if x.dim() >= 3 else 1


def sample(x: torch.Tensor, budget: float, period: int, key: str, winners: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(index [k], weighted rows [k, D]) of the flattened tokens ``x`` [N, D] for this step."""
    rows = x.shape[0]
    k = reference.sample_size(rows, budget)
    if k >= rows:  # nothing to gain: keep every row, unweighted
        index = torch.arange(rows, device=x.device)
        return index, x.clone()
    estimate = state.estimate(key, x.device).lookup(reference.positions_of(rows, period, x.device))
    probabilities = reference.sampling_probabilities(_row_norms(x), estimate)
    index, weight = reference.draw(probabilities, k, winners)
    return index, _gather_rows(x, index, weight)


@reference_op("wta_crs_linears")
def wta_crs_linears(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    biases: list[torch.Tensor],
    bias_of: list[int],
    budget: float,
    period: int,
    key: str,
    winners: bool,
) -> list[torch.Tensor]:
    outputs = [
        torch.nn.functional.linear(x, w, biases[b] if b >= 0 else None) for w, b in zip(weights, bias_of, strict=True)
    ]
    index, rows = sample(x.reshape(-1, x.shape[-1]), budget, _period(x, period), key, winners)
    return [*outputs, index, rows]


@wta_crs_linears.register_fake
def _(x, weights, biases, bias_of, budget, period, key, winners):
    k = reference.sample_size(x.numel() // x.shape[-1], budget)
    outputs = [x.new_empty((*x.shape[:-1], w.shape[0])) for w in weights]
    return [*outputs, x.new_empty(k, dtype=torch.long), x.new_empty((k, x.shape[-1]))]


@reference_op("wta_crs_linears_backward")
def wta_crs_linears_backward(
    grads: list[torch.Tensor],
    weights: list[torch.Tensor],
    index: torch.Tensor,
    rows: torch.Tensor,
    period: int,
    key: str,
    need_input: bool,
    need_weights: list[bool],
    bias_of: list[int],
    need_biases: list[bool],
) -> list[torch.Tensor]:
    """[grad_x, grad_W…, grad_b…]; gradients not needed come back empty. Updates the gradient-norm estimate.

    ``grads`` are the outputs' gradients flattened to [N, D_out]; grad_x comes back [N, D_in].
    """
    grad_x = sum(g @ w for g, w in zip(grads, weights, strict=True)) if need_input else rows.new_empty(0)
    grad_weights = [
        (g[index].t() @ rows).to(w.dtype).contiguous() if need else w.new_empty(0)
        for g, w, need in zip(grads, weights, need_weights, strict=True)
    ]
    grad_biases = [
        _bias_grad(grads, bias_of, slot) if need else rows.new_empty(0) for slot, need in enumerate(need_biases)
    ]
    norms = torch.sqrt(sum(_row_norms(g).square() for g in grads))
    state.estimate(key, rows.device).update(reference.positions_of(norms.numel(), period, rows.device), norms)
    return [grad_x, *grad_weights, *grad_biases]


def _bias_grad(grads: list[torch.Tensor], bias_of: list[int], slot: int) -> torch.Tensor:
    (owner,) = [i for i, b in enumerate(bias_of) if b == slot]
    return grads[owner].sum(0)


@wta_crs_linears_backward.register_fake
def _(grads, weights, index, rows, period, key, need_input, need_weights, bias_of, need_biases):
    grad_x = grads[0].new_empty((grads[0].shape[0], weights[0].shape[1])) if need_input else rows.new_empty(0)
    # Contiguous whatever the weight's layout (a transposed Conv1D weight arrives as a view).
    grad_weights = [
        w.new_empty(w.shape) if need else w.new_empty(0) for w, need in zip(weights, need_weights, strict=True)
    ]
    grad_biases = [
        grads[bias_of.index(slot)].new_empty(grads[bias_of.index(slot)].shape[-1]) if need else rows.new_empty(0)
        for slot, need in enumerate(need_biases)
    ]
    return [grad_x, *grad_weights, *grad_biases]


def _setup_context(ctx, inputs, output) -> None:
    x, weights, biases, bias_of, _budget, period, key, _winners = inputs
    ctx.save_for_backward(output[-2], output[-1], *weights)
    ctx.period, ctx.key, ctx.bias_of = _period(x, period), key, list(bias_of)
    ctx.x_shape = x.shape
    ctx.x_requires_grad = x.requires_grad
    ctx.weights_require_grad = [w.requires_grad for w in weights]
    ctx.biases_require_grad = [b.requires_grad for b in biases]


def _backward(ctx, output_grads):
    index, rows, *weights = ctx.saved_tensors
    count = len(weights)
    rows_count = index.new_empty(ctx.x_shape[:-1]).numel()
    grads = [
        g.reshape(-1, g.shape[-1]) if g is not None else rows.new_zeros((rows_count, w.shape[0]))
        for g, w in zip(output_grads[:count], weights, strict=True)
    ]
    results = torch.ops.memopt.wta_crs_linears_backward(
        grads, weights, index, rows, ctx.period, ctx.key, ctx.x_requires_grad, ctx.weights_require_grad,
        ctx.bias_of, ctx.biases_require_grad,
    )
    grad_x, grad_weights, grad_biases = results[0], results[1 : 1 + count], results[1 + count :]
    return (
        grad_x.reshape(ctx.x_shape) if ctx.x_requires_grad else None,
        [g if need else None for g, need in zip(grad_weights, ctx.weights_require_grad, strict=True)],
        [g if need else None for g, need in zip(grad_biases, ctx.biases_require_grad, strict=True)],
        None, None, None, None, None,
    )


wta_crs_linears.register_autograd(_backward, setup_context=_setup_context)
