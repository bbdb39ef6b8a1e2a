"""WTA-CRS on a CUDA device: Triton kernels, fresh and reproducible draws under CUDA graphs, less memory."""

from __future__ import annotations

import functools

import pytest
import torch

import fxpass
from lowerings.wta_crs import reference, reset_estimates
from tests.fxpass.rules.test_wta_crs import ON, Block

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_match_reference(dtype):
    from lowerings.wta_crs import kernels

    x = torch.randn(1000, 777, device="cuda", dtype=dtype)
    torch.testing.assert_close(kernels.row_norms(x), reference.row_norms(x), rtol=1e-5, atol=1e-4)
    index = torch.randint(0, 1000, (300,), device="cuda")
    weight = torch.rand(300, device="cuda") + 0.5
    torch.testing.assert_close(kernels.gather_rows(x, index, weight), reference.gather_rows(x, index, weight))


@pytest.mark.parametrize(("rows", "budget", "spread"), [(16384, 0.3, 1.0), (65536, 0.1, 2.0), (5000, 0.5, 0.0)])
def test_draw_kernel_follows_the_estimator(rows, budget, spread):
    """The compiled one-program draw at training sizes, against the estimator's float64 definition."""
    from lowerings.wta_crs import kernels
    from tests.lowerings.wta_crs.test_op import check_sample

    gen = torch.Generator(device="cuda").manual_seed(rows)
    scores = torch.exp(spread * torch.randn(rows, device="cuda", generator=gen))
    uniforms = torch.rand(int(reference.sample_size(rows, budget)), device="cuda", generator=gen)
    n = check_sample(scores, uniforms, *kernels.draw(scores, uniforms, True), True)
    assert spread == 0 or n > 0


@pytest.mark.parametrize("winners", [True, False])
def test_weight_gradient_is_unbiased_through_the_kernels(winners):
    """Eager CUDA calls sample with the Triton kernels (norms, draw, gather): the mean of 2000 estimates
    matches Gᵀx entry by entry (|z| < 5), as the CPU reference does in test_op.py."""
    from tests.lowerings.wta_crs.test_op import _problem, _weight_grads, _z_scores

    x, weight, grad_out = (t.cuda() for t in _problem(sigma=1.5))
    estimates = _weight_grads(x, weight, grad_out, 0.3, 2000, winners=winners, key=f"cuda{winners}")
    z = _z_scores(estimates, grad_out.t() @ x)
    assert z.abs().max() < 5.0, z.abs().max().item()


def test_direct_kernels_match_the_custom_op_implementations():
    """The CUDA kernels the dispatcher calls directly (``cuda_kernel``) compute what the custom ops' own
    implementations compute: the same sample from the same uniforms, the same estimate update, the same outputs."""
    from lowerings.wta_crs import state

    custom = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)
    gen = torch.Generator(device="cuda").manual_seed(7)
    norms = torch.rand(4096, device="cuda", generator=gen) + 0.1
    uniforms = torch.rand(1229, device="cuda", generator=gen)
    estimate = torch.rand(reference.MAX_POSITIONS, device="cuda", generator=gen)
    draw = torch.ops.memopt.wta_crs_draw.default
    direct, implemented = draw(norms, estimate, uniforms, 512, True), draw.redispatch(custom, norms, estimate,
                                                                                     uniforms, 512, True)
    assert torch.equal(direct[0], implemented[0]) and torch.equal(direct[1], implemented[1])

    store = torch.ops.memopt.wta_crs_store.default
    for key, call in (("tests:direct", store), ("tests:custom", functools.partial(store.redispatch, custom))):
        call(norms, key, 512)
        call(norms * 2, key, 512)
    torch.testing.assert_close(state.estimate("tests:direct", "cuda").values,
                               state.estimate("tests:custom", "cuda").values)
    assert state.estimate("tests:direct", "cuda").values[:512].gt(0).all()
    reset_estimates()

    x = torch.randn(2, 64, 32, device="cuda", generator=gen)
    weight, bias = torch.randn(48, 32, device="cuda", generator=gen), torch.randn(48, device="cuda", generator=gen)
    index, rows = torch.arange(10, device="cuda"), x.reshape(-1, 32)[:10]
    args = (x, [weight], [bias], [0], index, rows, "tests:direct", 64)
    linears = torch.ops.memopt.wta_crs_linears.default
    torch.testing.assert_close(linears(*args)[0], linears.redispatch(custom, *args)[0])


# what each ``wta_crs_sampling`` mode leaves in the compiled forward: traced, the opaque draw with the rest of the
# sample fused around it; opaque, one sample call per group
SAMPLING_CALLS = {"traced": "torch.ops.memopt.wta_crs_draw.default", "opaque": "torch.ops.memopt.wta_crs_sample.default"}


@pytest.mark.parametrize("sampling", sorted(SAMPLING_CALLS))
def test_compiled_step_draws_with_the_kernel(sampling):
    """The compiled forward calls the opaque draw (the one-program kernel, nothing for Inductor to analyse or
    compile), itself or inside the opaque sample: no sort runs on the GPU. The mode is pinned: the test must not
    depend on ``MEMOPT_WTA_CRS_SAMPLING`` in the environment."""
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    block = Block().cuda()
    options = ON | {"force": True, "wta_crs_sampling": sampling}
    step = torch.compile(lambda x: block(x).square().sum(), backend=fxpass.MemoptBackend(options=options))
    x = torch.randn(4, 64, 16, device="cuda")
    _, code = run_and_get_code(lambda: step(x).backward())
    code = "\n".join(code)
    assert SAMPLING_CALLS[sampling] in code
    assert "aten.topk" not in code and "aten.sort" not in code


def _weight_grads_over_steps(mode: str | None, sampling: str, seed: int, steps: int = 3) -> list[torch.Tensor]:
    torch.manual_seed(0)
    block = Block().cuda()
    backend = fxpass.MemoptBackend(mode=mode, options=ON | {"force": True, "wta_crs_sampling": sampling})
    step = torch.compile(lambda x: block(x).square().sum(), backend=backend)
    x = torch.randn(4, 64, 16, device="cuda")
    torch.manual_seed(seed)
    reset_estimates()
    grads = []
    for _ in range(steps):
        block.zero_grad(set_to_none=True)
        step(x).backward()
        grads.append(block.q.weight.grad.clone())
    return grads


@pytest.mark.parametrize("sampling", sorted(SAMPLING_CALLS))
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_fresh_and_reproducible_draws(mode, sampling):
    """Each step draws a new sample (also when CUDA graphs replay the step); the same seed, the same draws.

    Same draws give the same gradients up to the GPU's non-deterministic reductions (~1e-6); different draws
    differ by the estimator's own variance (order 1).
    """
    first = _weight_grads_over_steps(mode, sampling, seed=1)
    again = _weight_grads_over_steps(mode, sampling, seed=1)
    other = _weight_grads_over_steps(mode, sampling, seed=2)

    def distance(a, b):
        return ((a - b).norm() / a.norm()).item()

    assert distance(first[1], first[2]) > 1e-2
    for a, b in zip(first, again, strict=True):
        assert distance(a, b) < 1e-4
    assert distance(first[2], other[2]) > 1e-2


class _ResidualMLP(torch.nn.Module):
    """Pre-LN MLP blocks on a residual stream, as in a transformer's feed-forward half."""

    def __init__(self, dim: int, blocks: int):
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(
                torch.nn.LayerNorm(dim), torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim)
            )
            for _ in range(blocks)
        )

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


def test_memory_held_for_backward_drops():
    """Six MLP blocks at 8k tokens: the activations held between forward and backward, and with them the
    step's peak, fall when the linears keep 30 % of their inputs' rows (LayerNorm and GELU outputs)."""

    def measure(options) -> tuple[int, int]:
        torch.manual_seed(0)
        model = _ResidualMLP(1024, blocks=6).cuda()
        step = torch.compile(lambda x: model(x).float().square().mean(), backend=fxpass.MemoptBackend(options=options))
        x = torch.randn(8, 1024, 1024, device="cuda", requires_grad=True)
        for _ in range(2):  # the first call compiles; the second is measured
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = step(x)
            held = torch.cuda.memory_allocated() - base
            loss.backward()
            torch.cuda.synchronize()
            x.grad = None
            model.zero_grad(set_to_none=True)
        return held, torch.cuda.max_memory_allocated() - base

    (held_sampled, peak_sampled), (held_exact, peak_exact) = measure({"wta_crs_budget": 0.3, "wta_crs_max_us_per_mib": None}), measure({})
    assert held_sampled < 0.8 * held_exact, (held_sampled, held_exact)
    assert peak_sampled < 0.85 * peak_exact, (peak_sampled, peak_exact)
