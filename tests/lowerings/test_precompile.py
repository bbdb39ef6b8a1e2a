"""``lowerings/precompile.py``: which calls of a rewritten graph get their kernels compiled ahead, and how.

That a warm-up compiles exactly what the launch then asks for is checked against Triton's real sm_90 pipeline
in ``test_sm90_compile.py`` (no GPU) and, on a GPU, by the first step of a compiled model below.
"""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

import lowerings  # noqa: F401  (registers the ops and their warmers)
from lowerings import precompile
from lowerings.precompile import TensorSpec


def test_spec_keeps_what_a_launch_specializes_on():
    base = torch.rand(200)
    misaligned, aligned = TensorSpec.of(base[3:93]), TensorSpec.of(base[4:94])
    assert not misaligned.aligned and aligned.aligned  # 12 bytes off, 16 bytes off
    meta = misaligned.meta()
    assert meta.device.type == "meta" and meta.shape == (90,) and meta.stride() == (1,)
    assert meta.storage_offset() * meta.element_size() % 16 != 0
    columns = TensorSpec.of(torch.zeros(8, 64, dtype=torch.bfloat16)[:, :50])
    assert columns.meta().stride() == (64, 1) and columns.meta().shape == (8, 50)


def test_spec_keeps_requires_grad():
    spec = TensorSpec.of(torch.zeros(4, 3, requires_grad=True))
    assert spec.requires_grad and spec.meta().requires_grad


def _graph(*calls: tuple[object, tuple]) -> fx.Graph:
    """A graph of ``calls`` (target, args), tensor arguments as placeholders carrying their value."""
    graph = fx.Graph()
    for number, (target, args) in enumerate(calls):
        nodes = []
        for position, arg in enumerate(args):
            if isinstance(arg, torch.Tensor):
                node = graph.placeholder(f"x{number}_{position}")
                node.meta["val"] = arg
                nodes.append(node)
            else:
                nodes.append(arg)
        graph.call_function(target, tuple(nodes))
    return graph


def _draw_args(device: str = "cpu", rows: int = 300):
    return (torch.rand(rows, device=device), torch.zeros(4096, device=device), torch.rand(90, device=device), 60, True)


def test_calls_finds_memopt_ops_with_a_warmer_once_each():
    draw = torch.ops.memopt.wta_crs_draw.default
    graph = _graph(
        (draw, _draw_args()), (draw, _draw_args()),  # identical blocks: warmed once
        (draw, _draw_args(rows=600)),
        (torch.ops.aten.relu.default, (torch.rand(3),)),  # not memopt's
        (torch.ops.memopt.cce_checked_targets.default, (torch.zeros(4, dtype=torch.long), 10, -100)),  # no warmer
    )
    found = precompile.calls(graph, device_type="cpu")
    assert [name for name, _, _ in found] == ["wta_crs_draw", "wta_crs_draw"]
    assert {args[0].shape for _, args, _ in found} == {(300,), (600,)}
    assert precompile.calls(graph) == []  # none of them on CUDA


def test_calls_leaves_sizes_unknown_at_compile_time_to_the_launch():
    env = ShapeEnv()
    with FakeTensorMode(shape_env=env):
        norms = torch.empty(env.create_unbacked_symint())
        rest = _draw_args()[1:3]
        rest = (torch.empty(rest[0].shape), torch.empty(rest[1].shape))
    graph = _graph((torch.ops.memopt.wta_crs_draw.default, (norms, *rest, 60, True)))
    assert precompile.calls(graph, device_type="cpu") == []


def test_start_never_raises(monkeypatch):
    """Listing a graph's calls runs in the backend, outside its fallback: a failure there must cost nothing but
    the compiles at the launches."""
    monkeypatch.setattr(precompile, "enabled", lambda: True)

    def broken(graph, device_type="cuda"):
        raise TypeError("a tensor subclass without a storage offset")

    monkeypatch.setattr(precompile, "calls", broken)
    assert precompile.start(fx.GraphModule(torch.nn.Module(), fx.Graph())) is None


def test_warm_reports_calls_that_failed_without_raising():
    spec = TensorSpec.of(torch.rand(8))
    calls = [("wta_crs_draw", (spec, "not a tensor", spec, 1, True), ())]
    assert precompile.warm(calls) == 0  # logged, not raised: the launch compiles it as without precompiling


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_first_step_compiles_no_memopt_kernel_after_the_warm_up(monkeypatch):
    """A whole model with the opaque ops of every rewrite (CCE over returned logits, WTA-CRS's traced sample and
    store): once the background warm-up is done, its first forward + backward JIT-compiles none of memopt's
    kernels (the backward runs on autograd's own thread), and the warm-up compiled no specialization twice. The
    backend below waits for the warm-up before the first run, which training never does."""
    import threading

    from triton.runtime.jit import JITFunction

    from examples.gpt import GPT, GPTConfig
    from fxpass import MemoptBackend

    memopt = MemoptBackend(options={"wta_crs_budget": 0.3, "force": True})
    warmed: list[int] = []

    def backend(gm, example_inputs):
        compiled = memopt(gm, example_inputs)
        warmed.append(precompile.wait(timeout=600))
        return compiled

    at_launch: list[str] = []
    specializations: list[tuple[str, str]] = []  # (kernel, Triton's cache key) of every memopt compile
    compile_once = JITFunction._do_compile

    def recording(self, key, *args, **kwargs):
        warming = threading.current_thread().name.startswith(precompile.THREAD_NAME)
        if self.fn.__module__.startswith("lowerings."):
            specializations.append((self.fn.__name__, str(key)))
            if not warming:
                at_launch.append(self.fn.__name__)
        return compile_once(self, key, *args, **kwargs)

    monkeypatch.setattr(JITFunction, "_do_compile", recording)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=1000, block_size=64, n_layer=2, n_head=2, n_embd=64)).cuda()
    tokens = torch.randint(0, 1000, (4, 64), device="cuda")
    with torch.autocast("cuda", torch.bfloat16):
        _, loss = torch.compile(model, backend=backend)(tokens, tokens)
    loss.backward()
    torch.cuda.synchronize()
    assert sum(warmed) >= 3, warmed  # the CCE backward, the draw, the store
    assert at_launch == [], f"compiled at their launch: {at_launch}"
    twice = sorted({kernel for kernel, _ in specializations if specializations.count((kernel, _)) > 1})
    assert twice == [], f"one specialization compiled twice: {twice}"  # the draw, before compile_lock


def test_interleaved_takes_one_call_per_warmer_each_round():
    todo = [("sample", (768,), ()), ("sample", (3072,), ()), ("linears", (1,), ()), ("linears", (2,), ()),
            ("linears", (3,), ()), ("cce", (0,), ())]
    assert precompile.interleaved(todo) == [todo[0], todo[2], todo[5], todo[1], todo[3], todo[4]]


def test_start_computes_tritons_key_on_the_calling_thread(monkeypatch):
    """Triton's key of its own install is a Python loop over libtriton's megabytes: each warm-up thread computing
    it beside the busy main thread waited for the GIL at every read (`benchmarks/first_call.py`, warm). It is
    computed once, before the threads start."""
    import threading

    cache = pytest.importorskip("triton.runtime.cache")
    threads: list[str] = []
    monkeypatch.setattr(cache, "triton_key", lambda: threads.append(threading.current_thread().name))
    monkeypatch.setattr(precompile, "enabled", lambda: True)
    draw = torch.ops.memopt.wta_crs_draw.default
    found = precompile.calls(_graph((draw, _draw_args())), device_type="cpu")
    monkeypatch.setattr(precompile, "calls", lambda graph: found)
    monkeypatch.setattr(precompile, "warm", lambda todo, index: len(todo))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    futures = precompile.start(fx.GraphModule(torch.nn.Module(), fx.Graph()))
    assert futures and precompile.wait(timeout=60) == 1
    assert threads == [threading.main_thread().name]
