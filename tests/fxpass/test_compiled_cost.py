"""``fxpass.compiled_cost``: what the partitioner keeps for a piece of graph, predicted on fake tensors of symbolic
sizes, equals what the compiled piece really saves (every saved tensor's storage counted by a pack hook) on CPU;
and no guard reaches the graph's own shape environment."""

from __future__ import annotations

import pytest
import sympy
import torch
import torch.nn.functional as F
from torch import fx
from torch._dynamo.source import ConstantSource
from torch._subclasses.fake_tensor import FakeTensorMode, is_fake
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from fxpass import compiled_cost, shapes


def _cross_entropy(hidden, weight, targets):
    return (F.cross_entropy(F.linear(hidden, weight).float(), targets),)


def _mlp(x, w1, w2):
    return (F.linear(F.gelu(F.linear(x, w1)), w2).sum(),)


def _attention(q, k, v):
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    return ((scores.softmax(-1) @ v).sum(),)


def _symbolic(env: ShapeEnv, name: str, hint: int) -> torch.SymInt:
    return env.create_symintnode(env.create_symbol(hint, ConstantSource(name)), hint=hint)


def measured_saved_bytes(fn, *args, backend="inductor", kept=()) -> int:
    """Bytes of the storages a compiled ``fn(*args)`` saves for its backward; its arguments' own and those of
    the tensors in ``kept`` (parameters) left out. Fake tensors the compiler saves while tracing are no step's."""
    inputs = {a.untyped_storage().data_ptr() for a in (*args, *kept) if isinstance(a, torch.Tensor)}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if is_fake(tensor):
            return tensor
        pointer = tensor.untyped_storage().data_ptr()
        if pointer not in inputs:
            storages[pointer] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        torch.compile(fn, backend=backend)(*args)
    return sum(storages.values())


CASES = {
    "cross_entropy_fp32": (_cross_entropy, lambda: (
        torch.randn(48, 32, requires_grad=True), torch.randn(300, 32, requires_grad=True), torch.randint(0, 300, (48,)),
    )),
    "cross_entropy_bf16": (_cross_entropy, lambda: (
        torch.randn(48, 32, dtype=torch.bfloat16, requires_grad=True),
        torch.randn(300, 32, dtype=torch.bfloat16, requires_grad=True), torch.randint(0, 300, (48,)),
    )),
    "mlp": (_mlp, lambda: (
        torch.randn(40, 16, requires_grad=True), torch.randn(64, 16, requires_grad=True),
        torch.randn(16, 64, requires_grad=True),
    )),
    "attention": (_attention, lambda: tuple(torch.randn(2, 3, 24, 8, requires_grad=True) for _ in range(3))),
}


@pytest.mark.parametrize("case", CASES)
def test_predicted_saved_bytes_equal_measured_inductor(case):
    fn, make = CASES[case]
    args = make()
    predicted = compiled_cost.compiled_cost(fx.symbolic_trace(fn), args)
    assert predicted.saved == measured_saved_bytes(fn, *args), predicted.saved_tensors


def test_cross_entropy_saves_its_logits_in_their_dtype_not_log_probabilities():
    """torch.compile keeps the 16-bit logits and two numbers a row, where eager keeps fp32 log-probabilities:
    the baseline a CCE rewrite is priced against."""
    env = ShapeEnv()
    with FakeTensorMode(shape_env=env):
        rows = _symbolic(env, "rows", 8192)
        hidden = torch.empty(rows, 2048, dtype=torch.bfloat16, requires_grad=True)
        weight = torch.empty(128256, 2048, dtype=torch.bfloat16, requires_grad=True)
        targets = torch.empty(rows, dtype=torch.long)
    guards = len(env.guards)
    cost = compiled_cost.compiled_cost(fx.symbolic_trace(_cross_entropy), [hidden, weight, targets])
    n = shapes.expr(rows)
    logits = n * 128256 * 2
    beyond_logits = sympy.expand(shapes.expr(cost.saved) - logits)
    assert beyond_logits.free_symbols <= {n} and shapes.hint(cost.saved) - 8192 * 128256 * 2 <= 64 * 8192
    assert shapes.hint(cost.saved) < 8192 * 128256 * 4  # not fp32 log-probabilities
    # the backward: the logits' gradient in place of the logits, then the weight's gradient beside it
    assert shapes.hint(cost.backward_peak) >= 8192 * 128256 * 2 + 128256 * 2048 * 2
    assert len(env.guards) == guards  # the partitioner's guards stay in its private shape environment


def test_extract_copies_nodes_and_makes_outside_reads_inputs():
    traced = fx.symbolic_trace(_mlp)
    nodes = [n for n in traced.graph.nodes if n.op == "call_function"]
    first_linear, gelu = nodes[0], nodes[1]
    piece, inputs = compiled_cost.extract([gelu], [gelu])
    assert inputs == [first_linear]
    assert [n.op for n in piece.graph.nodes] == ["placeholder", "call_function", "output"]
    with pytest.raises(ValueError, match="graph order"):
        compiled_cost.extract([nodes[2], nodes[1]], [nodes[2]])


def _head_cost(vocab: int, dim: int, device: str | None) -> compiled_cost.CompiledCost:
    hidden = torch.randn(1024, dim, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(vocab, dim, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, vocab, (1024,))
    gm = fx.symbolic_trace(lambda h, w, t: (F.cross_entropy(F.linear(h, w), t),))
    return compiled_cost.compiled_cost(gm, [hidden, weight, targets], device)


def test_gpu_pads_a_compute_bound_gemm_off_a_multiple_of_8():
    """On a GPU Inductor pads a vocabulary of 4001 to 4008 for the classifier's GEMM: the forward holds the
    classifier's padded copy and the padded logits (1024 × 4008 bf16 each); the backward pads the logit
    gradient for its two GEMMs. A CPU compile pads nothing, nor does a GPU at a vocabulary of 4000."""
    cpu, gpu = _head_cost(4001, 1024, None), _head_cost(4001, 1024, "cuda")
    assert shapes.hint(gpu.forward_peak) == 2 * 1024 * 4008 * 2
    assert shapes.hint(cpu.forward_peak) == shapes.hint(cpu.saved)  # the logits, kept
    assert shapes.hint(gpu.backward_peak) > shapes.hint(cpu.backward_peak) + 1024 * 4008 * 2
    assert gpu.saved == cpu.saved
    assert _head_cost(4000, 1024, "cuda").hints() == _head_cost(4000, 1024, None).hints()


def test_gpu_leaves_a_memory_bound_gemm_unpadded():
    """At a width of 64 the classifier's GEMMs are memory-bound: Inductor does not pad them."""
    assert _head_cost(4001, 64, "cuda").hints() == _head_cost(4001, 64, None).hints()


def test_what_holds_each_peak_adds_up_to_it():
    """Each peak comes with what is alive there, by kind: the figures add up to the peak, and the backward of a
    head names the weight's gradient it produces; on a GPU the padded copies are named."""
    for device in (None, "cuda"):
        cost = _head_cost(4001, 1024, device)
        for peak, holders in ((cost.forward_peak, cost.forward_holders), (cost.backward_peak, cost.backward_holders)):
            assert sum(h.bytes for h in holders) == shapes.hint(peak), holders
            assert [h.bytes for h in holders] == sorted((h.bytes for h in holders), reverse=True)
        kinds = {h.kind: h for h in cost.backward_holders}
        assert kinds["gradients"].bytes >= 4001 * 1024 * 2 and "[4001, 1024]" in kinds["gradients"].largest
    assert "padded GEMM operands" in {h.kind for h in _head_cost(4001, 1024, "cuda").forward_holders}
    assert cost.hints()["backward_peak"] > cost.hints()["forward_peak"]  # the head peaks in its backward


def test_returned_counts_what_the_caller_gets_and_the_backward_does_not_keep():
    """A step's returned tensor that is not saved for the backward (a model's logits beside its loss) is held by
    the caller through the backward: ``returned`` is its bytes; a saved one is not counted twice."""

    def step(x, w):
        y = x @ w
        return y.sum(), y * 2  # the sum's gradient needs neither y nor y * 2

    def saved(x, w):
        y = (x @ w).tanh()
        return y.sum(), y  # tanh's gradient reads y: saved and returned, counted once

    args = (torch.randn(64, 32, requires_grad=True), torch.randn(32, 48, requires_grad=True))
    cost = compiled_cost.compiled_cost(fx.symbolic_trace(step), args)
    assert shapes.hint(cost.returned) == 64 * 48 * 4 + 4 and "[64, 48] float32" in cost.returned_largest
    assert shapes.hint(compiled_cost.compiled_cost(fx.symbolic_trace(saved), args).returned) == 4  # the sum


def test_the_gradient_of_returned_logits_takes_a_fresh_buffer():
    """AOTAutograd donates to the backward only saved tensors the caller does not hold, never an incoming
    gradient: where the head returns its logits, their gradient is a third logits-sized buffer beside the saved
    logits and the zeros autograd hands them; where it returns the loss alone it is written in place of the
    saved logits."""
    hidden = torch.randn(256, 64, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(1000, 64, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, 1000, (256,))

    def returned(h, w, t):
        logits = F.linear(h, w)
        return F.cross_entropy(logits, t), logits

    def loss_only(h, w, t):
        return (F.cross_entropy(F.linear(h, w), t),)

    logits = 256 * 1000 * 2
    held = compiled_cost.compiled_cost(fx.symbolic_trace(returned), [hidden, weight, targets])
    alone = compiled_cost.compiled_cost(fx.symbolic_trace(loss_only), [hidden, weight, targets])
    assert held.hints()["backward_peak"] >= 3 * logits > alone.hints()["backward_peak"] >= logits
    assert {h.kind for h in held.backward_holders} >= {"saved for the backward", "incoming gradients", "temporaries"}


def test_an_embedding_gradient_accumulates_in_one_fp32_buffer():
    """A 16-bit embedding's backward scatters its rows' gradients into one fp32 [V, D] buffer (the zeros it starts
    from fused into it), then rounds it to the weight's dtype: the backward peaks at both, 6 bytes an element.
    Counting the zeros apart (a scatter taken for a GEMM-like kernel) or fusing the scatter away (as if it were
    pointwise) misprices a tied classifier's step by a gigabyte at Llama-3.2-1B's vocabulary."""
    vocab, dim = 4000, 256
    ids = torch.randint(0, vocab, (8, 128))
    weight = torch.randn(vocab, dim, dtype=torch.bfloat16, requires_grad=True)
    cost = compiled_cost.compiled_cost(fx.symbolic_trace(lambda i, w: (F.embedding(i, w).float().sum(),)), [ids, weight])
    assert cost.hints()["backward_peak"] == vocab * dim * (4 + 2)
    kinds = {h.kind: h for h in cost.backward_holders}
    assert "float32" in kinds["temporaries"].largest and kinds["gradients"].bytes == vocab * dim * 2


def test_each_result_of_a_several_result_kernel_is_a_buffer():
    """SDPA's backward writes dQ, dK and dV into buffers of their own, alive until the fused kernel that reads them
    (here the sum that makes x's gradient), and written while the kernel's inputs are alive: all three count at
    the backward's peak. Fused away, they had put memopt's simulated peak 190 MiB under the one measured on the H100 (the
    Llama-3.2-1B shape's two attention backwards), and a tied classifier's ∂C, read at the backward's end, was
    missing from every point before."""
    x = torch.randn(2, 4, 64, 16, requires_grad=True)

    def step(x):
        return (F.scaled_dot_product_attention(x.sin(), x.cos(), x.exp(), is_causal=True).sum(),)

    cost = compiled_cost.compiled_cost(fx.symbolic_trace(step), [x])
    size = x.numel() * 4
    holders = {h.kind: h for h in cost.backward_holders}
    assert holders["temporaries"].bytes == 3 * size, cost.backward_holders  # dQ, dK, dV
    # written while the kernel's inputs are alive, never in place of one: the peak is all that was saved, plus them
    assert cost.hints()["backward_peak"] == cost.hints()["saved"] + 3 * size + 4  # and the incoming gradient


def test_the_results_of_a_split_are_views_of_one_buffer():
    """q, k and v split from one projection are one storage, counted once wherever they are alive: in the forward
    that reads them, and in the backward, where each is a saved tensor of its own. Each counted as a buffer of that
    storage's size, they held the demo's simulated backward 132 MiB above its saved tensors
    (`benchmarks/memory_model.py`)."""
    x, w = torch.randn(256, 32), torch.randn(32, 96)

    def attention(x, w):
        q, k, v = (x @ w).split(32, dim=-1)
        return ((q @ k.t()) @ v,)

    projection, scores, out = 256 * 96 * 4, 256 * 256 * 4, 256 * 32 * 4
    forward = compiled_cost.compiled_cost(fx.symbolic_trace(attention), [x, w])
    assert forward.hints()["forward_peak"] == projection + scores + out  # at the second GEMM

    w.requires_grad_(True)
    cost = compiled_cost.compiled_cost(fx.symbolic_trace(attention), [x, w])
    assert cost.hints()["saved"] == projection + scores
    at_peak = {h.kind: h.bytes for h in cost.backward_holders}
    assert at_peak["saved for the backward"] == projection, cost.backward_holders  # q, k and v: one buffer


def test_on_a_gpu_a_kernel_reading_an_input_at_two_indices_does_not_write_over_it():
    """A gated MLP's backward reads the saved gate_up projection as its gate half and its up half, and writes
    their gradients as one [N, 2F] buffer of the projection's size. Inductor's CPU kernels write it over the
    dying projection; on a GPU Inductor writes in place only over an input read at one index
    (``single_index_in_fused_node``), so the gradient is a fresh buffer: what held Phi-3's peak on the H100
    (`benchmarks/results/memory-model-peak-llama-phi3-h100-2026-12-05.md`)."""
    x, w = torch.randn(256, 64), torch.randn(64, 256, requires_grad=True)

    def mlp(x, w):
        gate, up = (x @ w).chunk(2, dim=-1)
        return (torch.nn.functional.silu(gate) * up,)

    projection = 256 * 256 * 4
    cpu = compiled_cost.compiled_cost(fx.symbolic_trace(mlp), [x, w])
    gpu = compiled_cost.compiled_cost(fx.symbolic_trace(mlp), [x, w], device="cuda")
    assert cpu.hints()["backward_peak"] == projection + projection // 2  # the projection and the incoming gradient
    assert gpu.hints()["backward_peak"] == cpu.hints()["backward_peak"] + projection


def test_holders_name_the_op_and_module_of_the_users_model():
    """What holds a peak is named after the op and module of the model it comes from (what Dynamo recorded), so a
    record says which layer's tensor it is; a backward buffer after the forward op it differentiates."""

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = torch.nn.Linear(16, 64), torch.nn.Linear(64, 16)

        def forward(self, x):
            return self.down(F.silu(self.up(x)))

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList([Block(), Block()])

        def forward(self, x):
            for layer in self.layers:
                x = x + layer(x)
            return x.sum()

    captured = {}

    def backend(gm, inputs):
        captured["gm"] = gm
        return gm

    torch.compile(Model(), backend=backend)(torch.randn(8, 16))
    gm = captured["gm"]
    values = [compiled_cost._placeholder_value(n) for n in gm.graph.find_nodes(op="placeholder")]
    cost = compiled_cost.compiled_cost(gm, values)
    held = {holding.kind: holding.largest for holding in cost.backward_holders}
    assert held["saved for the backward"].endswith("[8, 64] float32, from silu in layers.0"), held
    assert held["gradients"].endswith(", from the backward of linear in layers.0.down"), held
    assert compiled_cost._module_path("L['self'].model.layers[1].mlp") == "model.layers.1.mlp"
    assert compiled_cost._module_path("L['self']") == ""


def test_a_laptop_prices_grouped_sdpa_with_the_repeated_heads_cuda_saves():
    """``enable_gqa=True`` with 2 key/value heads for 8 query heads: on CPU SDPA reads the groups as they are, on
    CUDA its composite repeats keys and values for the query heads first, so the step saves the repeated copies.
    Priced for a GPU from a CPU (``assume_device="cuda"``) the saved bytes grow by exactly those copies beyond the
    grouped ones, and the user's graph keeps its call as written."""
    import fxpass
    from fxpass.graph import SDPA_TARGETS

    batch, heads, kv_heads, length, dim = 2, 8, 2, 256, 32

    def attention(x, wq, wk, wv):
        q = (x @ wq).view(batch, length, heads, dim).transpose(1, 2)
        k = (x @ wk).view(batch, length, kv_heads, dim).transpose(1, 2)
        v = (x @ wv).view(batch, length, kv_heads, dim).transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum()

    x = torch.randn(batch * length, 64)
    weights = [torch.randn(64, n * dim, requires_grad=True) for n in (heads, kv_heads, kv_heads)]
    cpu = fxpass.explain(attention, x, *weights, execute=False).graphs[0]
    gpu = fxpass.explain(attention, x, *weights, execute=False, assume_device="cuda").graphs[0]
    grown = gpu.step["torch.compile"].hints()["saved"] - cpu.step["torch.compile"].hints()["saved"]
    assert grown == 2 * batch * (heads - kv_heads) * length * dim * 4
    repeated = [t for t in gpu.step["torch.compile"].saved_tensors if f"[{batch}, {heads}, {length}, {dim}]" in t]
    assert len(repeated) == 4  # q, the repeated k and v, the output
    (sdpa,) = [n for n in gpu.graph_module.graph.nodes if n.target in SDPA_TARGETS]
    assert sdpa.kwargs["enable_gqa"] is True
    assert compiled_cost.with_cuda_sdpa_grouping(gpu.graph_module) is not gpu.graph_module


def test_flops_are_the_gemms_of_each_partitioned_graph():
    """torch's flop-counter formulas over the partitioned graphs: the forward's one [64, 32] @ [32, 16] GEMM, and
    the backward's two (the gradients of both operands); recomputation would show as more backward FLOPs."""

    def step(x, w):
        return ((x @ w).relu(),)

    x, w = torch.randn(64, 32, requires_grad=True), torch.randn(32, 16, requires_grad=True)
    cost = compiled_cost.compiled_cost(fx.symbolic_trace(step), [x, w])
    assert shapes.hint(cost.forward_flops) == 2 * 64 * 32 * 16
    assert shapes.hint(cost.backward_flops) == 2 * (2 * 64 * 32 * 16)
