"""torch.compile's modes around memopt's rewritten graphs: ``max-autotune`` (CPU and GPU) and
``reduce-overhead`` (CUDA graphs: the rewritten graphs record and replay, dropout draws anew on every replay).

WTA-CRS's fresh draws under CUDA-graph replays are pinned in ``tests/lowerings/wta_crs/test_cuda.py``
(``test_fresh_and_reproducible_draws[reduce-overhead]``).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import fxpass

pytestmark = [pytest.mark.slow, pytest.mark.isa_sensitive]

SCALE = 0.25


def attention_and_loss(x, weight, targets, q, k, v, p: float = 0.0):
    """Causal attention (mask from ``tril``) with dropout, and a classifier's cross-entropy."""
    t = q.shape[-2]
    scores = (q @ k.transpose(-1, -2)) * SCALE
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    out = F.dropout(scores.softmax(-1), p, training=True) @ v
    return F.cross_entropy(F.linear(x, weight), targets) + out.float().square().mean(), out


def inputs(device: str, dtype=torch.float32, t: int = 16):
    generator = torch.Generator().manual_seed(0)
    make = lambda *shape: torch.randn(*shape, generator=generator).to(device, dtype).requires_grad_()  # noqa: E731
    targets = torch.randint(0, 64, (32,), generator=generator).to(device)
    return make(32, 16), make(64, 16), targets, make(2, 2, t, 16), make(2, 2, t, 16), make(2, 2, t, 16)


def loss_and_grads(fn, args) -> list[torch.Tensor]:
    loss, out = fn(*args)
    leaves = [a for a in args if a.requires_grad]
    return [t.detach().clone() for t in (loss, out, *torch.autograd.grad(loss, leaves))]  # replays overwrite


def applied() -> list[str]:
    return sorted(r.rule for report in fxpass.reports() for r in report.records if r.applied)


def test_max_autotune_on_cpu():
    """Inductor's max-autotune on CPU compiles the rewritten graph; the step equals eager's."""
    args = inputs("cpu")
    backend = fxpass.MemoptBackend(mode="max-autotune", options={"force": True, "strict": True})
    got = loss_and_grads(torch.compile(attention_and_loss, backend=backend, fullgraph=True), args)
    assert applied() == ["attention", "cce"]
    for actual, expected in zip(got, loss_and_grads(attention_and_loss, args), strict=True):
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def _cuda_graph_step(mode: str, memopt: bool, p: float, dtype=torch.bfloat16):
    backend = fxpass.MemoptBackend(mode=mode, options={"force": True, "strict": True}) if memopt else "inductor"
    kwargs = {} if memopt else {"mode": mode}
    return torch.compile(lambda *a: attention_and_loss(*a, p=p), backend=backend, fullgraph=True, **kwargs)


def _replays(step, args, n: int = 4) -> list[list[torch.Tensor]]:
    results = []
    for _ in range(n):  # call 1 warms up, call 2 records, later calls replay
        torch.compiler.cudagraph_mark_step_begin()
        results.append(loss_and_grads(step, args))
    return results


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_cuda_graphs_replay_matches_plain_compile(mode):
    """Dropout off: memopt's rewritten graph, recorded and replayed, equals plain torch.compile's under the same
    mode (bf16, the flash kernel's tolerance)."""
    args = inputs("cuda", torch.bfloat16, t=128)
    ours = _replays(_cuda_graph_step(mode, True, 0.0), args)
    assert applied() == ["attention", "cce"]
    assert counters["inductor"]["cudagraph_skips"] == 0, "the rewritten graph was not recorded"
    theirs = _replays(_cuda_graph_step(mode, False, 0.0), args)
    for replay in (1, 3):
        for actual, expected in zip(ours[replay], theirs[replay], strict=True):
            torch.testing.assert_close(actual.float(), expected.float(), rtol=2e-2, atol=2e-2)
    for actual, expected in zip(ours[3], ours[2], strict=True):  # replays of a deterministic step agree
        torch.testing.assert_close(actual, expected)


@pytest.mark.gpu
def test_cuda_graph_replays_draw_fresh_dropout():
    """Each replay of the recorded graph draws a new dropout mask: outputs of two replays differ, and each
    replay keeps about 1 - p of the probabilities (the output's scale stays that of no dropout)."""
    args = inputs("cuda", torch.float32, t=128)
    step = _cuda_graph_step("reduce-overhead", True, 0.5, torch.float32)
    runs = _replays(step, args, n=5)
    assert applied() == ["attention", "cce"]
    assert counters["inductor"]["cudagraph_skips"] == 0
    outputs = [run[1] for run in runs[2:]]
    for first, second in itertools.pairwise(outputs):
        assert not torch.equal(first, second), "a replay reused the previous dropout mask"
    plain = attention_and_loss(*args, p=0.0)[1].detach()
    for out in outputs:
        ratio = (out.norm() / plain.norm()).item()
        assert 0.5 < ratio < 2.0, ratio
