"""``torch.ops.memopt.wta_crs_linears``: linears that share an input, saving k sampled rows of it for backward.

    index, rows = sample(x2d, estimate, budget, period, winners)   # PyTorch + the one-program draw kernel
    *outputs = torch.ops.memopt.wta_crs_linears(x, [W_q, W_k, W_v], [b_q, b_v], [0, -1, 1],
                                                index, rows, key, period)

``x`` is [..., D_in] (its leading dimensions are the tokens), each ``W`` [D_out, D_in]; ``bias_of[i]`` is the
index in ``biases`` of weight i's bias, or -1 when it has none. The outputs are exact (x Wᵀ + b); so are the
input and bias gradients. Autograd saves only ``rows``, the k = ceil(budget·N) sampled rows of x already
weighted, and their ``index``; each weight gradient is the unbiased WTA-CRS estimate G[index]ᵀ rows. One
sample serves every linear of the group (Q/K/V, gate/up), so the rows are stored once. ``period`` is the
sequence length: token i sits at position i mod period, and 0 takes x.shape[-2] for inputs of 3 or more
dimensions. ``key`` names the group's running gradient-norm estimate (``state.py``), which the sample reads;
the backward folds this step's gradient norms into it through ``memopt::wta_crs_store``.

The store is an op with a side effect that updates the estimate in place by name, hidden from autograd. A graph
called several times before one backward (blocks that share one compiled graph, two forwards of one model
before the backward) reads the same estimate in each forward, and an in-place write that autograd saw would
fail every later backward's saved-tensor version check. The estimate only steers sampling, so which update a
later call of one step reads never biases a gradient.

The linears form an opaque op; the backward is ordinary PyTorch, which AOTAutograd traces into the compiled
graph, except the estimate's update (the store). The sample enters the graph one of two ways
(``Config.wta_crs_sampling``): traced (``sample`` itself: Inductor fuses its row norms and gather with the
layer around them, and only the draw is a call at training time) or opaque (``memopt::wta_crs_sample``, which
runs ``sample`` as it is at training time and gives Inductor nothing to compile). The draw itself (scores from
the estimate, winners, then draws with replacement) is ``memopt::wta_crs_draw``, opaque in both: on CUDA one
Triton program, where the sorted PyTorch rule took a top-k and about fifteen launches.
Randomness comes from torch's generator (Inductor's when compiled): fresh draws each step, reproducible
under ``torch.manual_seed``, fixed shapes, CUDA-graph safe.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lowerings import precompile
from lowerings._library import HAS_TRITON, cuda_kernel, interpreting, keep_side_effect, on_cuda, reference_op
from lowerings.wta_crs import reference, state

if HAS_TRITON:
    from lowerings.wta_crs import kernels


def _use_kernels(x: torch.Tensor) -> bool:
    """Hand-written kernels for eager CUDA calls (and inside the opaque ops, which always run eagerly). While a
    graph is traced, the PyTorch reference goes in instead, and Inductor fuses it with its neighbours into
    kernels of its own."""
    return HAS_TRITON and on_cuda(x) and not interpreting() and torch._guards.detect_fake_mode((x,)) is None


def _row_norms(x: torch.Tensor) -> torch.Tensor:
    return kernels.row_norms(x) if _use_kernels(x) else reference.row_norms(x)


def _period(x: torch.Tensor, period: int | torch.SymInt) -> int | torch.SymInt:
    """The sequence length for positions: ``period`` if given (> 0 or symbolic), else x's second-last size."""
    if not isinstance(period, int) or period > 0:
        return period
    return x.shape[-2] if x.dim() >= 3 else 1


def sample(
    x: torch.Tensor, estimate: torch.Tensor, budget: float, period: int | torch.SymInt, winners: bool,
    uniforms: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(index [k], weighted rows [k, D]) of the flattened tokens ``x`` [N, D] for this step.

    ``x`` must be detached: no gradient flows through the sample, and autograd must not keep x for it.
    ``uniforms`` are the k slots' draws from U[0, 1); None draws them here. The rule hands every group of a graph
    a slice of one ``torch.rand`` (``fxpass/rules/wta_crs.py``)."""
    rows = x.shape[0]
    torch._check(rows % period == 0, lambda: f"memopt WTA-CRS: {rows} token rows are not whole sequences of {period}")
    if budget >= 1.0:  # every row, unweighted: the exact gradient (a static branch, no guard on N)
        return torch.arange(rows, device=x.device), x.clone()
    k = reference.sample_size(rows, budget)
    if uniforms is None:
        uniforms = torch.rand(k, device=x.device)
    torch._check(uniforms.shape == (k,), lambda: f"memopt WTA-CRS: {k} slots need {k} uniforms")
    if _use_kernels(x):  # run eagerly (the opaque sample, ``sampled_linears``): three launches in all
        return _sample_with_kernels(x, estimate, uniforms, period, winners)
    # traced: Inductor fuses the norms and the gather with the layer around them; the draw stays one opaque call
    index, weight = torch.ops.memopt.wta_crs_draw(reference.row_norms(x), estimate, uniforms, period, winners)
    return index, reference.gather_rows(x, index, weight)


def _sample_with_kernels(
    x: torch.Tensor, estimate: torch.Tensor, uniforms: torch.Tensor, period: int, winners: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    index, weight = kernels.draw(kernels.row_norms(x), uniforms, winners, estimate=estimate, period=period)
    return index, kernels.gather_rows(x, index, weight)


@reference_op("wta_crs_sample")
def wta_crs_sample(
    x: torch.Tensor, estimate: torch.Tensor, budget: float, period: int, winners: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sample`` as one opaque op: its PyTorch and kernels run as they are at training time, and Inductor
    compiles nothing for it (traced, each group's sampling fuses with its neighbours into kernels of its own)."""
    return sample(x, estimate, budget, period, winners)


@wta_crs_sample.register_fake
def _(x, estimate, budget, period, winners):
    rows = x.shape[0]
    k = rows if budget >= 1.0 else reference.sample_size(rows, budget)
    return x.new_empty(k, dtype=torch.long), x.new_empty(k, x.shape[1])


@reference_op("wta_crs_draw")
def wta_crs_draw(
    norms: torch.Tensor, estimate: torch.Tensor, uniforms: torch.Tensor, period: int, winners: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(index, weight) of one sample of rows scored ‖x_i‖ · ĝ(i mod period), one slot per uniform in [0, 1).

    Opaque on purpose. As a ``triton_op`` its kernel was emitted by Inductor, but torch 2.11 and 2.13 compile
    a user kernel to TTIR and walk it to find the arguments it writes at each call site, once per consumer
    (functionalization, lowering, the IR node; pytorch/pytorch#193227 counts about 90 ms each): for GPT-2's 48
    groups the larger part of WTA-CRS's extra first call on the H200. Opaque, it costs one call a step and
    nothing to compile. On CUDA one Triton program (``kernels.draw``: the estimate's lookup and the draw, no
    sort); elsewhere the reference's lookup and sorted draw, from the same distribution with the same uniforms."""
    return _draw(norms, estimate, uniforms, period, winners, with_kernel=_use_kernels(norms))


def _draw(norms, estimate, uniforms, period, winners, with_kernel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The draw op's body, on the Triton kernel or the reference (the op and its CUDA kernel each say which)."""
    torch._check(norms.dim() == 1 and uniforms.dim() == 1, lambda: "memopt.wta_crs_draw: norms and uniforms are 1-D")
    torch._check(uniforms.numel() <= norms.numel(), lambda: "memopt.wta_crs_draw: more slots than rows to draw from")
    norms, uniforms = norms.float().contiguous(), uniforms.float().contiguous()
    if with_kernel:
        return _draw_with_kernel(norms, estimate, uniforms, period, winners)
    positions = reference.positions_of(norms.numel(), period, norms.device)
    grad_estimate = reference.GradNormEstimate(estimate).lookup(positions)
    scores = reference.sampling_scores(norms, grad_estimate)
    return reference.draw(reference.normalize(scores), uniforms, winners)


def _draw_with_kernel(norms, estimate, uniforms, period, winners) -> tuple[torch.Tensor, torch.Tensor]:
    return kernels.draw(norms, uniforms, winners, estimate=estimate.float().contiguous(), period=period)


@wta_crs_draw.register_fake
def _(norms, estimate, uniforms, period, winners):
    k = uniforms.shape[0]
    return norms.new_empty(k, dtype=torch.long), norms.new_empty(k, dtype=torch.float32)


def sampled_linears(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    biases: list[torch.Tensor],
    bias_of: list[int],
    budget: float,
    period: int,
    key: str,
    winners: bool = True,
) -> list[torch.Tensor]:
    """The outputs of the linears of one group, with WTA-CRS weight gradients: sample, then the op.

    What the rule inserts into a graph, as one call for direct use; ``key`` names the gradient-norm estimate."""
    estimate = state.estimate(key, x.device).values
    period = _period(x, period)
    index, rows = sample(x.detach().reshape(-1, x.shape[-1]), estimate, budget, period, winners)
    return torch.ops.memopt.wta_crs_linears(x, weights, biases, bias_of, index, rows, key, period)


@reference_op("wta_crs_linears")
def wta_crs_linears(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    biases: list[torch.Tensor],
    bias_of: list[int],
    index: torch.Tensor,
    rows: torch.Tensor,
    key: str,
    period: int,
) -> list[torch.Tensor]:
    return _linears(x, weights, biases, bias_of)


def _linears(x, weights, biases, bias_of) -> list[torch.Tensor]:
    return [F.linear(x, w, biases[b] if b >= 0 else None) for w, b in zip(weights, bias_of, strict=True)]


@wta_crs_linears.register_fake
def _(x, weights, biases, bias_of, index, rows, key, period):
    return [x.new_empty((*x.shape[:-1], w.shape[0])) for w in weights]


def _setup_context(ctx, inputs, output) -> None:
    x, weights, biases, bias_of, index, rows, key, period = inputs
    ctx.save_for_backward(index, rows, *weights)
    ctx.key, ctx.period, ctx.bias_of = key, period, list(bias_of)
    ctx.x_shape = x.shape
    ctx.x_requires_grad = x.requires_grad
    ctx.weights_require_grad = [w.requires_grad for w in weights]
    ctx.biases_require_grad = [b.requires_grad for b in biases]


def _backward(ctx, output_grads):
    """Exact grad_x and bias gradients, G[index]ᵀ rows for the weights; then the estimate learns ‖G_i‖."""
    index, rows, *weights = ctx.saved_tensors
    tokens = rows.new_empty(ctx.x_shape[:-1]).numel()
    grads = [
        g.reshape(-1, g.shape[-1]) if g is not None else rows.new_zeros((tokens, w.shape[0]))
        for g, w in zip(output_grads, weights, strict=True)
    ]
    grad_x = None
    if ctx.x_requires_grad:
        grad_x = sum(g @ w for g, w in zip(grads, weights, strict=True)).reshape(ctx.x_shape)
    grad_weights = [
        (g[index].t() @ rows).to(w.dtype) if need else None
        for g, w, need in zip(grads, weights, ctx.weights_require_grad, strict=True)
    ]
    grad_biases = [
        grads[ctx.bias_of.index(slot)].sum(0) if need else None for slot, need in enumerate(ctx.biases_require_grad)
    ]
    norms = torch.sqrt(sum(_row_norms(g).square() for g in grads))
    torch.ops.memopt.wta_crs_store(norms, ctx.key, ctx.period)
    return grad_x, grad_weights, grad_biases, None, None, None, None, None


wta_crs_linears.register_autograd(_backward, setup_context=_setup_context)


@reference_op("wta_crs_store")
def wta_crs_store(norms: torch.Tensor, key: str, period: int) -> None:
    """Fold this step's per-row gradient norms into the group's estimate (``state.py``), in place, hidden from
    autograd: on CUDA one kernel (``kernels.update_estimate``), elsewhere the reference's update and a copy.

    Opaque, so that the fifteen-odd ops of the update are no kernels of every group's own for Inductor to
    generate in the backward (the norms stay traced, fused with the gradient's kernels). It names its target
    instead of taking it as an argument, so nothing in the graph is mutated, and it is marked as having a side
    effect so that no pass drops it for having no output (``keep_side_effect``)."""
    _store(norms, key, period, with_kernel=_use_kernels(norms))


def _store(norms: torch.Tensor, key: str, period: int, with_kernel: bool) -> None:
    """The store op's body, on the Triton kernel (whose write moves no version counter) or the reference."""
    target = state.estimate(key, norms.device).values
    if with_kernel:
        _update_with_kernel(target, norms, period)
        return
    with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(target):
        target.copy_(reference.GradNormEstimate(target).updated(norms, period))


def _update_with_kernel(target: torch.Tensor, norms: torch.Tensor, period: int) -> None:
    kernels.update_estimate(target, norms.float().contiguous(), period, reference.EMA_DECAY)


@wta_crs_store.register_fake
def _(norms, key, period):
    return None


keep_side_effect(wta_crs_store)


if HAS_TRITON:
    # The CUDA kernels of the ops a compiled WTA-CRS step calls every step, registered with the dispatcher
    # directly (``cuda_kernel``): behind the custom ops' Python layers each call took 60-240 µs of host on an H100
    # machine (`wta_crs_profile.py --host-calls`), which a step of GPT-2 small waited on. They run on real CUDA
    # tensors only (tracing's fake tensors stop at their fake implementations), so they need not ask
    # ``_use_kernels``; under Triton's interpreter they run the PyTorch references.

    @cuda_kernel("wta_crs_draw", differentiable=False)
    def _draw_on_cuda(norms, estimate, uniforms, period, winners):
        return _draw(norms, estimate, uniforms, period, winners, with_kernel=not interpreting())

    @cuda_kernel("wta_crs_store", differentiable=False)
    def _store_on_cuda(norms, key, period):
        _store(norms, key, period, with_kernel=not interpreting())

    @cuda_kernel("wta_crs_linears", differentiable=True)
    def _linears_on_cuda(x, weights, biases, bias_of, index, rows, key, period):
        return _linears(x, weights, biases, bias_of)

    cuda_kernel("wta_crs_sample", differentiable=False)(sample)


if HAS_TRITON:
    # What each op launches eagerly on CUDA, for ``lowerings/precompile.py``: the draw (traced sampling), the
    # whole sample (opaque sampling), and the store that ``wta_crs_linears``'s backward calls.

    @precompile.warmer("wta_crs_draw")
    def _warm_draw(norms, estimate, uniforms, period, winners):
        _draw_with_kernel(norms.float().contiguous(), estimate, uniforms.float().contiguous(), period, winners)

    @precompile.warmer(sample)
    def _(x, estimate, budget, period, winners, uniforms=None):
        if budget < 1.0:  # traced, ``sample`` calls ``wta_crs_draw`` on norms Inductor computes in fp32
            if uniforms is None:
                uniforms = x.new_empty(reference.sample_size(x.shape[0], budget), dtype=torch.float32)
            _warm_draw(x.new_empty(x.shape[0], dtype=torch.float32), estimate, uniforms, period, winners)

    @precompile.warmer("wta_crs_sample")
    def _(x, estimate, budget, period, winners):
        if budget < 1.0:
            uniforms = x.new_empty(reference.sample_size(x.shape[0], budget), dtype=torch.float32)
            _sample_with_kernels(x, estimate, uniforms, period, winners)

    @precompile.warmer("wta_crs_linears")
    def _(x, weights, biases, bias_of, index, rows, key, period):
        if x.requires_grad or any(w.requires_grad for w in weights):  # else no backward runs
            tokens = x.numel() // x.shape[-1]
            values = x.new_empty(reference.MAX_POSITIONS, dtype=torch.float32)
            _update_with_kernel(values, x.new_empty(tokens, dtype=torch.float32), period)
