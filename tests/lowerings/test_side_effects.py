"""``lowerings._library.keep_side_effect``: an op whose output nobody reads (it writes process state) stays in
the compiled backward, as WTA-CRS's estimate store does, through either registration: FX's side-effectful
functions (where Inductor asks ``is_impure``) or an effect token."""

from __future__ import annotations

import itertools

import pytest
import torch

from lowerings import _library

_CALLS: list[str] = []
_NAMES = itertools.count()


def _op_writing_state(monkeypatch, inductor_asks_is_impure: bool):
    """A fresh op that appends its tag to _CALLS, and a linear whose backward calls it."""
    monkeypatch.setattr(_library, "_inductor_asks_is_impure", lambda: inductor_asks_is_impure)
    name = f"memopt_tests::note_{next(_NAMES)}"

    @torch.library.custom_op(name, mutates_args=())
    def note(x: torch.Tensor, tag: str) -> None:
        _CALLS.append(tag)

    note.register_fake(lambda x, tag: None)
    _library.keep_side_effect(note)

    @torch.library.custom_op(f"{name}_linear", mutates_args=())
    def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x @ w.t()

    linear.register_fake(lambda x, w: x.new_empty(x.shape[0], w.shape[0]))

    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        note(grad, "backward")
        return grad @ w, grad.t() @ x

    linear.register_autograd(backward, setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*inputs))
    return linear


@pytest.mark.parametrize("inductor_asks_is_impure", [True, False])
@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_output_less_op_runs_every_call(monkeypatch, inner, inductor_asks_is_impure):
    """In a fresh cache: the caches' keys do not cover how an op is registered, and an entry compiled while the
    op was unregistered (its call eliminated) would be served again under the same op name."""
    from torch._inductor.utils import fresh_cache

    linear = _op_writing_state(monkeypatch, inductor_asks_is_impure)
    step = torch.compile(lambda x, w: linear(x, w).relu().sum(), backend=inner, fullgraph=True)
    x, w = torch.randn(4, 3, requires_grad=True), torch.randn(5, 3, requires_grad=True)
    _CALLS.clear()
    with fresh_cache():
        for _ in range(2):
            step(x, w).backward()
    assert _CALLS == ["backward"] * 2
