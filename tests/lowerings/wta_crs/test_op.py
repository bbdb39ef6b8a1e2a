"""The WTA-CRS linear op: exact outputs and input gradients, unbiased weight gradients, lower variance than
CRS, the promised saved bytes, reproducible draws. Unbiasedness is a z-test over thousands of draws."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lowerings.wta_crs import reference, reset_estimates, sampled_linears, state
from lowerings.wta_crs.op import sample

# Triton kernels run on the GPU where there is one, else in Triton's interpreter on CPU tensors (conftest.py).
KERNELS_ON = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _fresh_estimates():
    reset_estimates()
    yield
    reset_estimates()


def _heavy_tailed(rows, dim, sigma, generator, dtype=torch.float64):
    """Rows with lognormal scales: a few tokens dominate, as in real activations and gradients."""
    scales = torch.exp(sigma * torch.randn(rows, 1, generator=generator, dtype=dtype))
    return scales * torch.randn(rows, dim, generator=generator, dtype=dtype)


def _problem(rows=96, d_in=12, d_out=7, sigma=1.0, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    x = _heavy_tailed(rows, d_in, sigma, gen, dtype)
    weight = torch.randn(d_out, d_in, generator=gen, dtype=dtype)
    grad_out = _heavy_tailed(rows, d_out, sigma, gen, dtype)
    return x, weight, grad_out


def _weight_grads(x, weight, grad_out, budget, draws, winners=True, key="test", reset_each=False):
    """``draws`` independent estimates of ∂W, stacked [draws, D_out, D_in]."""
    w = weight.detach().requires_grad_()
    estimates = []
    for _ in range(draws):
        if reset_each:
            reset_estimates(key)
        out = sampled_linears(x, [w], [], [-1], budget, 0, key, winners)[0]
        (grad,) = torch.autograd.grad(out, [w], grad_out)
        estimates.append(grad)
    return torch.stack(estimates)


def _z_scores(estimates, exact):
    mean = estimates.mean(0)
    sd = estimates.std(0).clamp_min(1e-12)
    return (mean - exact) / (sd / estimates.shape[0] ** 0.5)


def test_outputs_input_and_bias_gradients_are_exact():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 25, 12, generator=gen, dtype=torch.float64, requires_grad=True)
    w1, w2 = (torch.randn(n, 12, generator=gen, dtype=torch.float64, requires_grad=True) for n in (7, 5))
    b2 = torch.randn(5, generator=gen, dtype=torch.float64, requires_grad=True)
    y1, y2 = sampled_linears(x, [w1, w2], [b2], [-1, 0], 0.3, 0, "exact", True)
    assert torch.equal(y1, F.linear(x, w1)) and torch.equal(y2, F.linear(x, w2, b2))
    index, rows = sample(x.detach().reshape(-1, 12), state.estimate("exact", x.device).values, 0.3, 25, True)
    assert index.shape == (30,) and rows.shape == (30, 12)  # k = ceil(0.3 · 100)
    g1, g2 = torch.randn_like(y1), torch.randn_like(y2)
    grad_x, grad_b = torch.autograd.grad([y1, y2], [x, b2], [g1, g2])
    torch.testing.assert_close(grad_x, g1 @ w1 + g2 @ w2, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad_b, g2.sum((0, 1)), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("case", "sigma", "winners", "reset_each"),
    [
        ("warm gradient-norm history", 1.0, True, False),
        ("no history (every draw is a first step)", 1.0, True, True),
        ("plain CRS (no winners)", 1.0, False, False),
        ("mild tails (the adaptive rule picks few winners)", 0.2, True, False),
        ("heavy tails (many winners)", 2.0, True, False),
    ],
)
def test_weight_gradient_is_unbiased(case, sigma, winners, reset_each):
    """The mean of 2000 independent estimates matches Gᵀx entry by entry (|z| < 5) and in norm."""
    x, weight, grad_out = _problem(sigma=sigma)
    exact = grad_out.t() @ x
    draws = 2000
    estimates = _weight_grads(x, weight, grad_out, 0.3, draws, winners=winners, reset_each=reset_each)
    z = _z_scores(estimates, exact)
    assert z.abs().max() < 5.0, (case, z.abs().max().item())
    mse = (estimates - exact).square().sum((1, 2)).mean()
    relative_error_of_mean = (estimates.mean(0) - exact).norm() / exact.norm()
    assert relative_error_of_mean < 4 * (mse / draws).sqrt() / exact.norm(), case


@pytest.mark.parametrize("winners", [True, False])
def test_mean_squared_error_matches_the_closed_form(winners):
    """Each draw's error has the estimator's exact variance: with residual distribution q_j = p_j / (1 − P_C)
    over the rows outside C and m = k − |C| draws, E‖Ĝ − G‖² = (Σ_{j∉C} ‖g_j‖²‖x_j‖² / q_j − ‖R‖²) / m, where R is
    those rows' exact contribution (Liu et al. 2023; CRS when C is empty). A wrong weight or a
    without-replacement draw moves the empirical value off it, not only the mean."""
    x, weight, grad_out = _problem(rows=120, sigma=1.0, seed=4)
    budget, draws = 0.3, 3000
    estimates = _weight_grads(x, weight, grad_out, budget, draws, winners=winners, key="mse", reset_each=True)
    exact = grad_out.t() @ x
    empirical = (estimates - exact).square().sum((1, 2)).mean().item()

    k = int(reference.sample_size(120, budget))
    p = reference.normalize(reference.row_norms(x).float()).double()  # no history: p ∝ ‖x_i‖
    uniforms = torch.rand(k)
    index, weight = reference.draw(p.float(), uniforms, winners)
    n = check_sample(p.float(), uniforms, index, weight, winners)  # the rule's |C| for this p
    outside = torch.ones(120, dtype=torch.bool)
    outside[index[:n]] = False
    q = p[outside] / p[outside].sum()
    g, xs = grad_out[outside], x[outside]
    residual = g.t() @ xs
    second_moment = (g.square().sum(1) * xs.square().sum(1) / q).sum()
    predicted = ((second_moment - residual.square().sum()) / (k - n)).item()
    assert winners == (n > 0)
    assert abs(empirical / predicted - 1) < 0.12, (empirical, predicted)


def test_zero_rows_and_full_budget():
    """Padding rows (all zero) never break unbiasedness; a budget of 1 saves every row and is exact."""
    x, weight, grad_out = _problem(rows=64)
    x[::3] = 0.0
    exact = grad_out.t() @ x
    z = _z_scores(_weight_grads(x, weight, grad_out, 0.25, 2000), exact)
    assert z.abs().max() < 5.0
    full = _weight_grads(x, weight, grad_out, 1.0, 2)
    torch.testing.assert_close(full[0], exact, rtol=1e-12, atol=1e-12)


def test_variance_below_plain_crs_on_heavy_tails():
    """Same budget and probabilities: WTA-CRS's mean squared error is below CRS's (the paper's claim)."""
    x, weight, grad_out = _problem(rows=256, sigma=1.0, seed=3)
    exact = grad_out.t() @ x

    def mse(winners):
        estimates = _weight_grads(x, weight, grad_out, 0.3, 600, winners=winners, key=f"v{winners}")
        return ((estimates - exact).square().sum((1, 2)).mean() / exact.square().sum()).item()

    wta, crs = mse(True), mse(False)
    assert wta < 0.8 * crs, (wta, crs)


def test_winner_count_follows_the_adaptive_rule():
    """|C| = argmin_c (1 − P_c)/(k − c): the slots of weight 1 are exactly the top-|C| rows."""
    gen = torch.Generator().manual_seed(5)
    p = torch.softmax(3 * torch.randn(200, generator=gen), 0)
    k = 40
    index, weight = reference.draw(p, torch.rand(k, generator=gen))
    top = torch.topk(p, k)
    before = torch.cat([torch.zeros(1), torch.cumsum(top.values, 0)[:-1]])
    expected = int(torch.argmin((1 - before) / (k - torch.arange(k))))
    assert expected > 0
    assert torch.equal(index[:expected], top.indices[:expected])
    assert torch.all(weight[:expected] == 1)
    residual = 1 - top.values[:expected].sum()
    torch.testing.assert_close(weight[expected:], residual / ((k - expected) * p[index[expected:]]), rtol=1e-4, atol=0)


def test_saved_tensors_are_the_sample():
    """Autograd keeps k rows and k indices (plus the parameters and the group's persistent gradient-norm
    estimate), never the whole input."""
    x = torch.randn(8, 50, 32, requires_grad=True)
    weights = [torch.nn.Parameter(torch.randn(n, 32)) for n in (16, 16, 16)]
    saved = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        sampled_linears(x, weights, [], [-1, -1, -1], 0.1, 0, "saved", True)
    parameters = {w.untyped_storage().data_ptr() for w in weights}
    parameters.add(state.estimate("saved", x.device).values.untyped_storage().data_ptr())
    activations = [t for t in saved if t.untyped_storage().data_ptr() not in parameters]
    k = 40  # ceil(0.1 · 400), shared by the three linears
    assert sorted(tuple(t.shape) for t in activations) == [(k,), (k, 32)]
    assert sum(t.numel() * t.element_size() for t in activations) == k * 32 * 4 + k * 8


def test_draws_follow_the_global_seed():
    x, weight, grad_out = _problem(rows=80)

    def one(seed):
        torch.manual_seed(seed)
        reset_estimates()
        return _weight_grads(x, weight, grad_out, 0.2, 3)

    assert torch.equal(one(7), one(7))
    assert not torch.equal(one(7), one(8))


def test_gradient_norm_estimate_tracks_positions():
    """After a step, positions with larger output gradients get larger sampling weights; unseen positions
    get the mean of the seen ones, and a fresh estimate is uniform."""
    estimate = reference.GradNormEstimate.empty(torch.device("cpu"))
    positions = reference.positions_of(40, 10, torch.device("cpu"))
    norms = (positions == 3).float() * 9 + 1
    estimate = reference.GradNormEstimate(estimate.updated(norms, 10))
    looked_up = estimate.lookup(torch.tensor([3, 4, 11]))
    torch.testing.assert_close(looked_up, torch.tensor([10.0, 1.0, 1.9]))
    fresh = reference.GradNormEstimate.empty(torch.device("cpu")).lookup(torch.tensor([0, 5]))
    torch.testing.assert_close(fresh, torch.ones(2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck(dtype):
    """The op holds no randomness (the sample is an input), so every opcheck test applies, AOT dispatch too."""
    x = torch.randn(3, 20, 8, dtype=dtype, requires_grad=True)
    w = torch.randn(6, 8, dtype=dtype, requires_grad=True)
    b = torch.randn(6, dtype=dtype, requires_grad=True)
    estimate = torch.zeros(reference.MAX_POSITIONS)
    index, rows = sample(x.detach().reshape(-1, 8), estimate, 0.5, 20, True)
    torch.library.opcheck(
        torch.ops.memopt.wta_crs_linears.default, (x, [w], [b], [0], index, rows, "tests:opcheck", 20)
    )


@pytest.mark.parametrize("budget", [0.3, 1.0])
def test_sample_op_is_sample(budget):
    """``memopt::wta_crs_sample`` (the opaque sampling of ``wta_crs_sampling="opaque"``) draws what ``sample``
    draws under the same seed, and its fake gives the same k rows."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(60, 8, generator=gen)
    estimate = torch.rand(reference.MAX_POSITIONS, generator=gen)
    torch.manual_seed(11)
    index, rows = torch.ops.memopt.wta_crs_sample(x, estimate, budget, 20, True)
    torch.manual_seed(11)
    expected_index, expected_rows = sample(x, estimate, budget, 20, True)
    assert torch.equal(index, expected_index) and torch.equal(rows, expected_rows)
    assert index.shape == (reference.sample_size(60, budget),)
    torch.library.opcheck(
        torch.ops.memopt.wta_crs_sample.default, (x, estimate, budget, 20, True),
        test_utils=("test_schema", "test_faketensor"),  # it draws: two calls differ by design
    )


@pytest.mark.parametrize("winners", [True, False])
def test_draw_opcheck(winners):
    """The draw op's schema, fake (meta) implementation and dispatch: outputs of fixed shape k."""
    gen = torch.Generator().manual_seed(3)
    norms, uniforms = torch.rand(50, generator=gen), torch.rand(12, generator=gen)
    estimate = torch.rand(reference.MAX_POSITIONS, generator=gen)
    torch.library.opcheck(torch.ops.memopt.wta_crs_draw.default, (norms, estimate, uniforms, 10, winners))


def test_draw_op_scores_rows_by_the_estimate():
    """The op draws from ‖x_i‖ · ĝ(i mod period), the reference's lookup: same uniforms, same sample."""
    gen = torch.Generator().manual_seed(4)
    norms, uniforms = torch.rand(40, generator=gen) + 0.1, torch.rand(9, generator=gen)
    estimate = torch.zeros(reference.MAX_POSITIONS)
    estimate[:5] = torch.rand(5, generator=gen) * 4
    scores = reference.sampling_scores(
        norms, reference.GradNormEstimate(estimate).lookup(reference.positions_of(40, 8, norms.device))
    )
    expected = reference.draw(reference.normalize(scores), uniforms, True)
    drawn = torch.ops.memopt.wta_crs_draw(norms, estimate, uniforms, 8, True)
    assert torch.equal(drawn[0], expected[0])
    torch.testing.assert_close(drawn[1], expected[1])


def test_draw_rejects_more_slots_than_rows():
    with pytest.raises(RuntimeError, match="more slots than rows"):
        torch.ops.memopt.wta_crs_draw(torch.rand(3), torch.zeros(reference.MAX_POSITIONS), torch.rand(4), 1, True)


@pytest.mark.parametrize(("name", "differentiable"), [
    ("wta_crs_draw", False), ("wta_crs_store", False), ("wta_crs_sample", False), ("wta_crs_linears", True)
])
def test_cuda_calls_reach_their_kernels_directly(name, differentiable):
    """On CUDA the dispatcher calls each op's kernel itself, not the custom op's Python layers (``cuda_kernel``):
    the ops without a gradient fall through autograd there; the linears keep their autograd formula."""
    pytest.importorskip("triton")
    qualname = f"memopt::{name}"
    assert torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "CUDA")
    if differentiable:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "Autograd")
        assert not torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "AutogradCUDA")
    else:
        assert torch._C._dispatch_kernel_for_dispatch_key_is_fallthrough(qualname, "AutogradCUDA")
    assert not torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "CPU")  # CPU: the custom op's own


def test_kernels_match_reference():
    triton = pytest.importorskip("triton")
    del triton
    from lowerings.wta_crs import kernels

    gen = torch.Generator().manual_seed(2)
    x = torch.randn(37, 21, generator=gen)
    torch.testing.assert_close(kernels.row_norms(x.to(KERNELS_ON)).cpu(), reference.row_norms(x))
    index = torch.randint(0, 37, (11,), generator=gen)
    weight = torch.rand(11, generator=gen) + 0.5
    gathered = kernels.gather_rows(*(t.to(KERNELS_ON) for t in (x, index, weight)))
    torch.testing.assert_close(gathered.cpu(), reference.gather_rows(x, index, weight))


@pytest.mark.parametrize("seen", ["none", "some"])
def test_draw_kernel_looks_the_scores_up(seen):
    """Given row norms and the estimate, the draw kernel scores row i by ĝ(i mod period) as the reference's dozen
    ops do (unseen positions take the mean of the seen ones, 1 before any; every estimate is floored; positions
    past the last slot share it), then draws: the sample follows the estimator for those scores."""
    pytest.importorskip("triton")
    from lowerings.wta_crs import kernels

    gen = torch.Generator().manual_seed(3)
    period = reference.MAX_POSITIONS + 3  # the last rows of each sequence share the last slot
    norms = torch.rand(2 * period, generator=gen) + 0.05
    values = torch.zeros(reference.MAX_POSITIONS)
    if seen == "some":
        values[::3] = torch.rand(values[::3].shape, generator=gen) + 0.5
        values[7] = 1e-9  # below the floor
        values[-1] = 2.0
    scores = reference.sampling_scores(
        norms, reference.GradNormEstimate(values).lookup(reference.positions_of(norms.numel(), period, norms.device))
    )
    uniforms = torch.rand(900, generator=gen)
    drawn = kernels.draw(norms.to(KERNELS_ON), uniforms.to(KERNELS_ON), True, estimate=values.to(KERNELS_ON),
                         period=period)
    check_sample(scores, uniforms, *(t.cpu() for t in drawn), True)


def test_full_budget_is_exact():
    """Budget 1 keeps every row with weight 1: the weight gradient is the exact one."""
    x, weight, grad_out = _problem(rows=40)
    (estimate,) = _weight_grads(x, weight, grad_out, 1.0, 1)
    torch.testing.assert_close(estimate, grad_out.t() @ x, rtol=1e-12, atol=1e-12)


def test_positions_past_the_last_slot_share_it():
    """Sequences longer than MAX_POSITIONS: the last slot averages every position from it on."""
    period = reference.MAX_POSITIONS + 2
    norms = torch.arange(2 * period, dtype=torch.float32) % period  # two sequences; norm = position
    estimate = reference.GradNormEstimate.empty(torch.device("cpu"))
    estimate = reference.GradNormEstimate(estimate.updated(norms, period))
    last = reference.MAX_POSITIONS - 1
    assert estimate.values[5] == 5
    torch.testing.assert_close(estimate.values[last], torch.tensor(float(last + 1)))  # mean of last, last+1, last+2


@pytest.mark.parametrize(
    ("period", "sequences", "seen"),
    [(12, 5, False), (12, 5, True), (1, 37, True), (reference.MAX_POSITIONS + 5, 2, True)],
)
def test_update_estimate_kernel_is_the_reference_update(period, sequences, seen):
    """One launch folds a step's row norms into the estimate in place as the reference's update does: per-position
    means over the sequences, the tail past the last slot averaged into it, the moving average where a position
    was seen, untouched slots beyond the period (flat tokens: one position)."""
    pytest.importorskip("triton")
    from lowerings.wta_crs import kernels

    gen = torch.Generator().manual_seed(period + sequences)
    norms = torch.rand(period * sequences, generator=gen) * 3
    values = torch.zeros(reference.MAX_POSITIONS)
    if seen:
        values[::2] = torch.rand(values[::2].shape, generator=gen) + 0.5
    expected = reference.GradNormEstimate(values.clone()).updated(norms, period)
    target = values.to(KERNELS_ON)
    kernels.update_estimate(target, norms.to(KERNELS_ON), period, reference.EMA_DECAY)
    torch.testing.assert_close(target.cpu(), expected, rtol=1e-5, atol=1e-6)


def check_sample(scores: torch.Tensor, uniforms: torch.Tensor, index: torch.Tensor, weight: torch.Tensor,
                 winners: bool) -> int:
    """Check one draw against the estimator's definition in float64; returns |C|.

    Winners (the leading slots of weight 1) must be the |C| most probable rows, with |C| minimizing the paper's
    score (1 − P_c)/(k − c) up to fp32 resolution: near the optimum the score is flat, so an fp32 sum may
    settle a row or two away from the float64 argmin (the sorted fp32 reference does too), and any C fixed
    before the draw keeps the estimate unbiased. Every other slot must land on the row whose float64 residual
    cumulative interval holds its target u · residual mass (up to fp32 rounding of the sums), with weight
    (1 − P_C) / ((k − |C|) · p)."""
    scores, uniforms, index, weight = (t.detach().cpu() for t in (scores, uniforms, index, weight))
    rows, k = scores.numel(), uniforms.numel()
    p = scores.double() / scores.double().sum()
    # |C| < k always; a lone last draw from a one-row residual also weighs exactly 1
    n = min(int(torch.cumprod((weight == 1).int(), 0).sum()), k - 1) if winners else 0
    ordered = torch.sort(p, descending=True).values
    if n:
        assert p[index[:n]].min() >= ordered[n - 1] * (1 - 1e-6)  # the most probable rows
        assert index[:n].unique().numel() == n
    before = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(ordered[: k - 1], 0)])
    score = (1 - before).clamp_min(0) / (k - torch.arange(k))
    if winners:
        assert score[n] <= score.min() * (1 + 1e-5), (n, int(score.argmin()))
    is_winner = torch.zeros(rows, dtype=torch.bool)
    is_winner[index[:n]] = True
    residual = torch.where(is_winner, 0.0, p)
    mass = residual.sum()
    upper = torch.cumsum(residual, 0)
    lower = upper - residual
    drawn = index[n:]
    target = uniforms[n:].double() * mass
    slack = 1e-5 * mass
    assert torch.all((lower[drawn] - slack <= target) & (target <= upper[drawn] + slack))
    torch.testing.assert_close(weight[n:].double(), mass / ((k - n) * p[drawn]), rtol=1e-4, atol=0)
    return n


@pytest.mark.parametrize("winners", [True, False])
@pytest.mark.parametrize(
    ("rows", "k", "spread"), [(300, 90, 3.0), (2500, 250, 1.0), (64, 64, 2.0), (50, 7, 0.0), (65536, 6554, 2.0)]
)
def test_draw_kernel_follows_the_estimator(rows, k, spread, winners):
    """The one-program Triton draw (several blocks of 1024 rows from 2500 on) against the estimator's float64
    definition; the sorted fp32 reference passes the same check (it may settle on another near-optimal |C|)."""
    pytest.importorskip("triton")
    from lowerings.wta_crs import kernels

    gen = torch.Generator().manual_seed(rows + k)
    scores = torch.exp(spread * torch.randn(rows, generator=gen))
    uniforms = torch.rand(k, generator=gen)
    drawn = (t.cpu() for t in kernels.draw(scores.to(KERNELS_ON), uniforms.to(KERNELS_ON), winners))
    n = check_sample(scores, uniforms, *drawn, winners)
    assert not winners or spread == 0 or n > 0  # the cases exercise both slot kinds
    check_sample(scores, uniforms, *reference.draw(reference.normalize(scores), uniforms, winners), winners)


@pytest.mark.parametrize("winners", [True, False])
def test_every_tuned_draw_launch_follows_the_estimator(winners):
    """Each launch ``kernels.DRAW_LAUNCHES`` picks by row count (one tile over every row, or several) draws a
    sample the estimator's float64 definition accepts, and the table serves every row count."""
    pytest.importorskip("triton")
    from lowerings.wta_crs import kernels

    gen = torch.Generator().manual_seed(7)
    scores = torch.exp(torch.randn(2500, generator=gen))
    uniforms = torch.rand(250, generator=gen)
    for _, block, warps in kernels.DRAW_LAUNCHES:
        launch = {"BLOCK": block, "num_warps": warps}
        drawn = kernels.draw(scores.to(KERNELS_ON), uniforms.to(KERNELS_ON), winners, launch=launch)
        check_sample(scores, uniforms, *(t.cpu() for t in drawn), winners)
    assert [kernels.draw_launch(n)["BLOCK"] for n in (1, 8192, 8193, 16384, 10**9)] == [4096, 4096, 8192, 8192, 1024]


def test_draw_kernel_when_a_few_rows_hold_all_the_mass():
    """One row with ~all the probability: the threshold's set jumps past k (1 − mass rounds to 0 in fp32); the
    kernel keeps the last set with a slot left to draw, as the sorted rule does."""
    pytest.importorskip("triton")
    from lowerings.wta_crs import kernels

    scores = torch.tensor([1e30, 1.0, 1.0, 0.0])
    uniforms = torch.tensor([0.25, 0.75])
    index, weight = (t.cpu() for t in kernels.draw(scores.to(KERNELS_ON), uniforms.to(KERNELS_ON), True))
    assert index[0] == 0 and weight[0] == 1
    expected_index, expected_weight = reference.draw(reference.normalize(scores), uniforms, True)
    assert torch.equal(index, expected_index)
    torch.testing.assert_close(weight, expected_weight)
