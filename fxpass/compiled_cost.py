"""What torch.compile keeps for a piece of graph: the piece partitioned the way AOTAutograd and Inductor run it.

A rewrite frees memory relative to torch.compile, not relative to eager: AOTAutograd's min-cut partitioner
recomputes cheap pointwise work in the backward instead of saving it, and Inductor fuses the rest (the
log-softmax of a cross-entropy never exists as a tensor; its logits are saved in their own 16-bit dtype).
Pricing the graph as eager runs it overstated CCE's saving at Llama-3's head 8× (8.3 GiB claimed against
1.0 GiB measured, `benchmarks/cce.py --tokens 8192 --vocab 128256 --dim 2048`). So the baseline is not a
hand-kept list per pattern: the candidate's nodes are copied into a graph of their own and handed to the same
partitioner, with the same decompositions Inductor uses, on fake tensors of symbolic sizes, and what the
partitioned forward saves is summed; the rewritten piece goes through the same machinery, so its figure is what
the custom op's autograd really saves, not what a comment says it does.

The sizes stay symbolic: each distinct size expression of the inputs becomes a symbol of a private
``ShapeEnv`` (so the partitioner's own guards never reach Dynamo's, and cause no recompile), and the results are
mapped back to the graph's symbols.

Three figures per piece (``CompiledCost``), in bytes beyond the piece's inputs:
- ``saved``: tensors the compiled forward keeps for the backward (storages not shared with an input);
- ``forward_peak``: the most alive at once inside the forward, outputs and saved tensors included;
- ``backward_peak``: the most alive at once inside the backward, beyond what was saved and the incoming
  gradients, the gradients it produces included.
The peaks model Inductor's buffers: a node is a buffer only where Inductor cannot fuse it away (an extern kernel
such as a GEMM or a custom op, a graph output or saved tensor, or the input of an extern kernel), and a freed
buffer of the same dtype and size is reused, as Inductor's wrapper code does; of the backward's inputs, only the
saved tensors AOTAutograd donates (neither graph inputs nor returned to the caller) are.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import operator
import re
from collections.abc import Sequence
from typing import Any

import sympy
import torch
from torch import fx
from torch._dynamo.source import ConstantSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv
from torch.multiprocessing.reductions import StorageWeakRef

from fxpass import shapes
from fxpass.graph import SDPA_NAMES, bind_sdpa, tensor_value
from fxpass.notes import Holding, error_note
from lowerings._library import WORKSPACES

log = logging.getLogger(__name__)

IntLike = shapes.IntLike


@dataclasses.dataclass(frozen=True)
class CompiledCost:
    """Bytes a piece of graph holds under torch.compile, beyond its inputs (module docstring)."""

    saved: IntLike
    forward_peak: IntLike
    backward_peak: IntLike
    saved_tensors: tuple[str, ...] = ()  # "name: shape dtype", for the debug report
    saved_inputs: frozenset[int] = frozenset()  # which of the piece's inputs the forward saves (views included)
    forward_holders: tuple[Holding, ...] = ()  # what is alive at each peak, by kind (hints), largest first
    backward_holders: tuple[Holding, ...] = ()
    # the forward's results to its caller that are neither saved nor inputs (a model's returned logits): a whole
    # step's caller holds them through the backward (``GraphReport.peaks``), a piece's consumer may not
    returned: IntLike = 0
    returned_largest: str = ""
    # the most an op of the piece allocates inside its kernels while it runs (``_workspace``), for the report
    workspace: IntLike = 0
    # floating-point operations of each partitioned graph, as torch's flop counter counts them (its GEMMs,
    # convolutions and attention; pointwise work is free there): recomputation shows as backward FLOPs
    forward_flops: IntLike = 0
    backward_flops: IntLike = 0

    @property
    def peak(self) -> IntLike:
        """The piece's own peak beyond its inputs, forward or backward."""
        return torch.sym_max(self.forward_peak, self.backward_peak)

    def hints(self) -> dict[str, int]:
        return {name: shapes.hint(getattr(self, name)) for name in ("saved", "forward_peak", "backward_peak")}


def extract(nodes: Sequence[fx.Node], outputs: Sequence[fx.Node]) -> tuple[fx.GraphModule, list[fx.Node]]:
    """``nodes`` (in graph order) copied into a graph of their own that returns ``outputs``; the nodes they read
    from outside become its placeholders, returned in order, so their example values can be fed to it."""
    inside = set(nodes)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs: list[fx.Node] = []

    def arg(node: fx.Node) -> fx.Node:
        if node not in env:
            if node in inside:
                raise ValueError(f"{node.name} is read before it is copied: nodes are not in graph order")
            env[node] = graph.placeholder(f"input_{len(inputs)}")
            env[node].meta = dict(node.meta)
            inputs.append(node)
        return env[node]

    owner = nodes[0].graph.owning_module
    module = fx.GraphModule(owner if owner is not None else torch.nn.Module(), graph)
    for index, node in enumerate(nodes):
        env[node] = graph.node_copy(node, arg)
        env[node]._rename(f"n{index}")  # the same piece in every layer reads as the same code (a cache key)
    graph.output(tuple(env[node] for node in outputs))
    module.recompile()
    return module, inputs


def compiled_cost(
    module: fx.GraphModule, example_inputs: Sequence[torch.Tensor], device: str | None = None,
    to_caller: frozenset[int] | None = None,
) -> CompiledCost:
    """``module`` (returning a tuple) partitioned as torch.compile would, on inputs shaped like
    ``example_inputs`` (fake tensors with the graph's symbolic sizes, or real ones); its figures in the
    symbols of ``example_inputs``. ``device``: the device type whose Inductor runs it (default: the inputs'),
    for what Inductor does on a GPU only (``_padded_gemms``). ``to_caller``: which of its outputs reach the
    step's caller (``CompiledCost.returned``; default: all, as for a whole graph)."""
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._inductor import config as inductor_config
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.virtualized import V

    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env, allow_non_fake_inputs=False)
    back: dict[sympy.Symbol, sympy.Expr] = {}
    fresh = [_refake(value, mode, env, back) for value in example_inputs]
    graphs: dict[str, fx.GraphModule] = {}
    target_env = graph_env(example_inputs)

    def partition(joint, joint_inputs, **kwargs):
        # kept here: the backward compiler runs only at the first backward call
        graphs["forward"], graphs["backward"] = _inductor_partition()(joint, joint_inputs, **kwargs)
        return graphs["forward"], graphs["backward"]

    def forward_only(gm: fx.GraphModule, _inputs):
        graphs.setdefault("forward", gm)
        return gm

    outputs = len(module.graph.find_nodes(op="output")[0].args[0])
    gpu = (device or _device_type(example_inputs)) == "cuda"
    if gpu and _device_type(example_inputs) != "cuda":  # a laptop's graph, priced as a GPU runs it
        module = with_cuda_sdpa_grouping(module)
    # Inductor's joint-graph passes read the fake mode from its virtualized handler (the random-seed pass of a
    # graph with dropout or ``torch.rand`` enters it). Its shape padding stays off: on a GPU (not from a laptop)
    # it would benchmark each GEMM on the device while pricing and write its padding into the joint graph, in a
    # form whose buffers ``_peak`` undercounts (GPT-2's head on the H200: benchmarks/memory_model.py). With it
    # off, ``_padded_gemms`` models the padding, alike on a GPU and from a laptop.
    with (
        torch._guards.tracing(None), mode, V.set_fake_mode(mode),
        inductor_config.patch(shape_padding=False),
    ):
        aot_module_simplified(
            module, fresh, fw_compiler=forward_only, partition_fn=partition, decompositions=select_decomp_table(),
        )
    device_type = "cuda" if gpu else "cpu"
    if "backward" not in graphs:  # nothing needs a gradient: nothing is saved
        inside = _workspaces(graphs["forward"], device_type)
        peak, holders = _peak(graphs["forward"], set(), outputs_from=0, gpu=gpu, inside=inside)
        return CompiledCost(0, _to_graph(peak, back, target_env), 0, forward_holders=holders,
                            workspace=_to_graph(_largest(inside), back, target_env),
                            forward_flops=_to_graph(_flops(graphs["forward"]), back, target_env))
    forward, backward = graphs["forward"], graphs["backward"]
    saved_nodes = _saved_nodes(forward, backward)
    primals = [_storage(n) for n in forward.graph.find_nodes(op="placeholder")]  # None for a SymInt input
    index_of = {storage: index for index, storage in enumerate(primals) if storage is not None}
    inputs = set(index_of)
    saved = _sum_storages([n for n in saved_nodes if _storage(n) not in inputs])
    taken = inputs | {_storage(n) for n in saved_nodes}
    given = [n for i, n in enumerate(forward.graph.find_nodes(op="output")[0].args[0][:outputs])
             if (to_caller is None or i in to_caller) and isinstance(n, fx.Node) and _is_tensor(n)]
    results = [n for n in given if _storage(n) not in taken]
    returned = _sum_storages(results)
    returned_largest = _describe(max(results, key=lambda n: shapes.hint(_storage_bytes(n)))) if results else ""
    described = tuple(_describe(n) for n in saved_nodes if _storage(n) not in inputs)
    saved_inputs = frozenset(index_of[_storage(n)] for n in saved_nodes if _storage(n) in inputs)
    forward_inside, backward_inside = _workspaces(forward, device_type), _workspaces(backward, device_type)
    forward_peak, forward_holders = _peak(forward, inputs, outputs_from=outputs, gpu=gpu, inside=forward_inside)
    # In the backward the saved activations and incoming gradients are alive from its start and die at their last
    # use; the forward's inputs are not counted. Inductor writes in place into a saved buffer AOTAutograd donates
    # to the backward: one neither an input nor given to the caller (which holds it), never an incoming gradient
    # (``collect_bw_donated_buffer_idxs``). So torch.compile's head that returns its logits computes their
    # gradient into a fresh buffer, beside the logits and the zeros autograd hands the returned logits.
    of_inputs = {n.name for n in saved_nodes if _storage(n) in inputs}  # the inputs, or views of them, saved
    held = {_storage(n) for n in backward.graph.find_nodes(op="placeholder") if n.name in of_inputs}
    kept_by_caller = {_storage(n) for n in given}
    donated = {n.name for n in saved_nodes if _storage(n) not in inputs and _storage(n) not in kept_by_caller}
    # what the caller holds stays alive through the whole backward, past its last use there
    pinned = {n.name for n in saved_nodes if _storage(n) in kept_by_caller and _storage(n) not in inputs}
    backward_peak, backward_holders = _peak(backward, held, outputs_from=0, live_from_start=True, gpu=gpu,
                                            donated=donated, pinned=pinned, inside=backward_inside)
    return CompiledCost(
        _to_graph(saved, back, target_env), _to_graph(forward_peak, back, target_env),
        _to_graph(backward_peak, back, target_env), described, saved_inputs, forward_holders, backward_holders,
        _to_graph(returned, back, target_env), returned_largest,
        _to_graph(_largest({**forward_inside, **backward_inside}), back, target_env),
        _to_graph(_flops(forward), back, target_env), _to_graph(_flops(backward), back, target_env),
    )


def _flops(gm: fx.GraphModule) -> IntLike:
    """The graph's FLOPs by torch's own formulas (``torch.utils.flop_counter``), read from its nodes' fake values
    instead of running it; ops it has no formula for (or whose formula cannot read the arguments) count nothing."""
    from torch.utils.flop_counter import flop_registry

    total: IntLike = 0
    for node in gm.graph.nodes:
        formula = flop_registry.get(getattr(node.target, "overloadpacket", None))
        if node.op != "call_function" or formula is None or "val" not in node.meta:
            continue
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda arg: arg.meta.get("val"))
        try:
            total = total + formula(*args, **kwargs, out_val=node.meta["val"])
        except Exception:  # a formula that cannot read these arguments: the FLOPs model only, never the pricing
            log.debug("no FLOPs for %s", node.format_node(), exc_info=True)
    return total


# ``F.scaled_dot_product_attention(..., enable_gqa=True)`` with fewer key/value heads than query heads: on CUDA
# SDPA's composite repeats the keys and values for the query heads before its cuDNN, efficient or math kernel
# (``pre_process_group_query_attention_input`` in ATen's attention.cpp), so the compiled step saves the repeated
# copies; on CPU its flash kernel reads the groups as they are. The Llama-3.2-1B shape compiled whole kept 32
# [4, 8, 4, 2048, 64] bf16 copies on an H100 (1 GiB, `e2e-llama-whole-peak-contents-h100-2026-12-07.md`) that a
# laptop's simulation did not see.
def with_cuda_sdpa_grouping(module: fx.GraphModule) -> fx.GraphModule:
    """``module`` with each grouped SDPA call's keys and values repeated for the query heads, as CUDA's SDPA
    does, so that a graph traced on CPU is partitioned as a GPU runs it; ``module`` itself where there is none.
    A copy: the user's graph is not touched."""
    if not any(_grouped_sdpa(node) for node in module.graph.nodes):
        return module
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in module.graph.nodes:
        groups = _grouped_sdpa(node)
        env[node] = graph.node_copy(node, lambda n: env[n])
        if groups:
            _repeat_keys_and_values(graph, env[node], groups)
    copied = fx.GraphModule(module, graph)
    copied.recompile()
    return copied


def _grouped_sdpa(node: fx.Node) -> int:
    """The query heads per key/value head of an SDPA call with ``enable_gqa=True`` (0 where it is not one, or
    the head counts are not constants)."""
    bound = bind_sdpa(node)
    if bound is None or not bound["enable_gqa"]:
        return 0
    values = [tensor_value(bound[name]) for name in ("query", "key")]
    if not all(v is not None and v.dim() >= 3 for v in values):
        return 0
    heads, kv_heads = (shapes.constant(v.shape[-3]) for v in values)
    if not heads or not kv_heads or heads == kv_heads or heads % kv_heads:
        return 0
    return heads // kv_heads


def _repeat_keys_and_values(graph: fx.Graph, sdpa: fx.Node, groups: int) -> None:
    """Rewrite ``sdpa`` (in ``graph``) to read its key and value repeated ``groups`` times over the head dim,
    ``enable_gqa`` off: the call CUDA's composite makes."""
    bound = bind_sdpa(sdpa)
    with graph.inserting_before(sdpa):
        key, value = (graph.call_method("repeat_interleave", (bound[name], groups), {"dim": -3})
                      for name in ("key", "value"))
    for repeated in (key, value):
        repeated.meta = {k: v for k, v in sdpa.meta.items() if k not in ("example_value", "val")}
    sdpa.args = (bound["query"], key, value)
    sdpa.kwargs = {**{name: bound[name] for name in SDPA_NAMES[3:]}, "enable_gqa": False}


def partitioned_under(setting: float | None) -> contextlib.AbstractContextManager:
    """AOTAutograd's partitioner set to recompute at ``activation_memory_budget=setting`` (None: its own): read
    while a graph is partitioned, and part of AOTAutograd's cache key."""
    if setting is None:
        return contextlib.nullcontext()
    return torch._functorch.config.patch(activation_memory_budget=setting)


def step_costs(
    original: fx.GraphModule, rewritten: fx.GraphModule, device: str | None = None, recompute: float | None = None
) -> dict[str, Any]:
    """A whole captured graph priced as torch.compile runs it, as Dynamo captured it and as memopt rewrote it:
    ``{"torch.compile": CompiledCost, "memopt": CompiledCost}``, or ``{"error": why}`` where the partitioner
    cannot take it. Placeholders are fed their example values; memopt's ops' own kernel buffers are charged at
    their nodes (``_workspace``). ``device``: as for ``compiled_cost``. ``recompute``: the
    ``activation_memory_budget`` memopt compiles its graph under (a memory budget's plan, ``fxpass.budget``)."""
    costs: dict[str, Any] = {}
    try:
        for name, gm in (("torch.compile", original), ("memopt", rewritten)):
            values = [_placeholder_value(n) for n in gm.graph.find_nodes(op="placeholder")]
            with partitioned_under(recompute if name == "memopt" else None):
                costs[name] = compiled_cost(gm, values, device)
    except Exception as error:  # a graph the partitioner cannot take; the compile itself goes on
        log.debug("memopt could not price a whole graph", exc_info=True)
        return {"error": error_note(error)}
    return costs


def _device_type(values: Sequence[Any]) -> str | None:
    return next((v.device.type for v in values if isinstance(v, torch.Tensor)), None)


def _placeholder_value(node: fx.Node) -> Any:
    return node.meta.get("example_value", node.meta.get("val"))


def _inductor_partition():
    """Inductor's own partition function: its joint-graph passes (which, among others, replace a softmax
    attention written out by SDPA: torch.compile then saves its output and log-sum-exp, not the T×T
    probabilities), then the min-cut partitioner."""
    from torch._inductor import compile_fx

    inductor = getattr(compile_fx, "partition_fn", None)
    if inductor is not None:
        return inductor
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    def passes_then_min_cut(joint, joint_inputs, **kwargs):
        joint = compile_fx._recursive_joint_graph_passes(joint) or joint
        return min_cut_rematerialization_partition(joint, joint_inputs, compiler="inductor", **kwargs)

    return passes_then_min_cut


def _refake(value, mode: FakeTensorMode, env: ShapeEnv, back: dict[sympy.Symbol, sympy.Expr]):
    """A fake tensor of ``value``'s dtype, device and requires_grad in ``mode``, contiguous, each symbolic size
    a symbol of ``env`` (one per distinct expression, with its hint); ``back`` maps the new symbols to the old
    expressions."""
    if isinstance(value, torch.SymInt):
        return _resize(value, env, back)
    if not isinstance(value, torch.Tensor):
        return value
    sizes = [_resize(size, env, back) for size in value.shape]
    with mode:
        fake = torch.empty(sizes, dtype=value.dtype, device=value.device)
    if value.requires_grad:
        fake.requires_grad_(True)
    return fake


def _resize(size, env: ShapeEnv, back: dict[sympy.Symbol, sympy.Expr]):
    """``size`` in the private ``env``: an int where constant, else the SymInt of one symbol per distinct
    expression (with its hint)."""
    constant = shapes.constant(size)
    if constant is not None:
        return constant
    expr = shapes.expr(size)
    symbol = next((s for s, e in back.items() if e == expr), None)
    if symbol is None:
        source = ConstantSource(f"memopt_size_{len(back)}")
        symbol = env.create_symbol(shapes.hint(size), source, dynamic_dim=DimDynamic.DYNAMIC)
        back[symbol] = expr
    return env.create_symintnode(symbol, hint=shapes.hint(size))


def _to_graph(value: IntLike, back: dict[sympy.Symbol, sympy.Expr], target: ShapeEnv | None) -> IntLike:
    """A figure in the private symbols as the graph's: an int where constant, else a SymInt of the graph's
    ``ShapeEnv`` (made from the expression, so no guard) with the same hint."""
    if not isinstance(value, torch.SymInt):
        return int(value)
    expr = shapes.expr(value).xreplace(back)
    if expr.is_number or target is None:
        return shapes.hint(value) if not expr.is_number else int(expr)
    return target.create_symintnode(expr, hint=shapes.hint(value))


def graph_env(example_inputs: Sequence) -> ShapeEnv | None:
    for value in example_inputs:
        if isinstance(value, torch.Tensor):
            for size in value.shape:
                if isinstance(size, torch.SymInt):
                    return size.node.shape_env
    return None


def _saved_nodes(forward: fx.GraphModule, backward: fx.GraphModule) -> list[fx.Node]:
    """The forward's outputs the backward reads: the saved tensors (the backward's placeholders, less the
    tangents, are named after them)."""
    wanted = {n.name for n in backward.graph.find_nodes(op="placeholder") if not n.name.startswith("tangents")}
    results = forward.graph.find_nodes(op="output")[0].args[0]
    return [n for n in results if isinstance(n, fx.Node) and n.name in wanted and _is_tensor(n)]


def _is_tensor(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def _storage(node: fx.Node) -> StorageWeakRef | None:
    value = node.meta.get("val")
    return StorageWeakRef(value.untyped_storage()) if isinstance(value, torch.Tensor) else None


def _storage_bytes(node: fx.Node) -> IntLike:
    value = node.meta["val"]
    return shapes.nbytes(value) if _is_dense(value) else value.untyped_storage().nbytes()


def _is_dense(value: torch.Tensor) -> bool:
    return value.storage_offset() == 0 and value.is_contiguous()


def _sum_storages(nodes: Sequence[fx.Node]) -> IntLike:
    total: IntLike = 0
    seen = set()
    for node in nodes:
        storage = _storage(node)
        if storage in seen:
            continue
        seen.add(storage)
        total = total + _storage_bytes(node)
    return total


def _describe(node: fx.Node) -> str:
    """A buffer as the records show it: its node, shape and dtype, then where in the user's model it comes from."""
    value = node.meta["val"]
    dims = ", ".join(shapes.render(s) for s in value.shape)
    where = _provenance(node)
    return f"{node.name}: [{dims}] {str(value.dtype).removeprefix('torch.')}" + (f", {where}" if where else "")


def _provenance(node: fx.Node) -> str:
    """The op and module of the user's model a node comes from ("from silu in model.layers.1.mlp"), read from
    what Dynamo recorded and AOTAutograd carries to the partitioned graphs (a backward node: the forward op it
    differentiates, "from the backward of linear in lm_head"); "" where nothing was recorded. A node's name alone
    ("view_18") says nothing of which layer's tensor holds a peak."""
    meta = node.meta
    recorded_forward = meta.get("fwd_nn_module_stack") or meta.get("fwd_source_fn_stack")
    backward = "nn_module_stack" not in meta and bool(recorded_forward)
    modules = meta.get("nn_module_stack") or meta.get("fwd_nn_module_stack") or {}
    sources = meta.get("source_fn_stack") or meta.get("fwd_source_fn_stack") or []
    path = _module_path(next(reversed(modules.values()))[0]) if modules else ""
    op = re.sub(r"_\d+$", "", str(sources[-1][0])) if sources else ""
    what = " in ".join(part for part in (op, path) if part)
    if not what:
        return ""
    return f"from the backward of {what}" if backward else f"from {what}"


def _module_path(path: str) -> str:
    """Dynamo's module path without its root, a local or a global ("L['self'].model.layers[1].mlp" →
    "model.layers.1.mlp")."""
    path = re.sub(r"^[LG]\['[^']*'\]\.?", "", path)
    path = re.sub(r"\._modules\['([^']*)'\]", r".\1", path)
    return re.sub(r"\[(\d+)\]", r".\1", path).lstrip(".")


# Ops Inductor runs as kernels of their own rather than fusing: their inputs and outputs are buffers.
_EXTERN_PACKETS = {
    "mm", "addmm", "bmm", "baddbmm", "convolution", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_flash_attention_forward", "_efficient_attention_forward", "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention_backward", "_scaled_dot_product_cudnn_attention_backward",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_flash_attention_backward", "_efficient_attention_backward", "sort", "topk", "cumsum",
    "embedding_dense_backward",
}
# Scatters: Inductor writes the indexed values into a buffer made from the destination (a fresh one where the
# destination is a fused zeros, as in an embedding's or a tied classifier's fp32 weight gradient), reading the
# values and indices through fused loads; so the result is a buffer, its operands need not be. (torch 2.13's
# embedding backward decomposes to ``_unsafe_masked_index_put_accumulate``, 2.11's to ``index_put``.)
_SCATTER_PACKETS = {
    "index_put", "_unsafe_index_put", "_unsafe_masked_index_put_accumulate", "index_put_", "scatter",
    "scatter_add", "scatter_reduce", "index_add",
}
_VIEWS = {"view", "_unsafe_view", "reshape", "permute", "t", "transpose", "expand", "squeeze", "unsqueeze",
          "slice", "select", "alias", "as_strided", "split", "split_with_sizes", "unbind", "view_as", "detach"}


def _packet(node: fx.Node) -> str | None:
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return None
    return target.overloadpacket.__name__


def _is_extern(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    target = node.target
    if isinstance(target, torch._ops.OpOverload) and target.namespace not in ("aten", "prims"):
        return True  # custom ops (memopt's among them) run as they are
    return _packet(node) in _EXTERN_PACKETS


def _is_view(node: fx.Node) -> bool:
    """A view op, or one result of a view op with several (``split``, ``unbind``): a view of the same storage.
    (The three results of the demo's q, k, v ``split``, each counted as a buffer the size of that storage, held
    its simulated forward 144 MiB above what the H200 measured.)"""
    if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        return _packet(node.args[0]) in _VIEWS
    return _packet(node) in _VIEWS


def _buffers(gm: fx.GraphModule, outputs_from: int) -> set[fx.Node]:
    """The nodes Inductor materializes: extern kernels' results and inputs (through views), scatters' results,
    the graph's outputs from index ``outputs_from`` on (saved tensors in a forward, gradients in a backward) and
    what they view."""
    materialized: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if _is_extern(node):
            materialized.update(_root(a) for a in node.all_input_nodes if _is_tensor(a))
            # An op with several results (SDPA's backward: dQ, dK, dV; memopt's loss backward: ∂E, ∂C) writes each
            # into a buffer of its own, alive until its last reader, even where that reader is a fused kernel
            # (dQ into the rotary embedding's backward; a tied classifier's ∂C into the final sum with the
            # embedding's gradient, at the backward's end).
            materialized.update([node] if _is_tensor(node) else [u for u in node.users if _is_tensor(u)])
        elif _is_tensor(node) and _packet(node) in _SCATTER_PACKETS:
            materialized.add(node)
    results = gm.graph.find_nodes(op="output")[0].args[0]
    materialized.update(_root(n) for n in results[outputs_from:] if isinstance(n, fx.Node) and _is_tensor(n))
    return {n for n in materialized if n.op == "call_function" and not _is_view(n)}


def _peak(
    gm: fx.GraphModule, held: set, outputs_from: int, live_from_start: bool = False, gpu: bool = False,
    donated: set[str] = frozenset(), pinned: set[str] = frozenset(), inside: dict[fx.Node, IntLike] | None = None,
) -> tuple[IntLike, tuple[Holding, ...]]:
    """The most bytes alive at once in ``gm``'s buffers (``_buffers``), storages in ``held`` (its inputs) not
    counted, and what holds them there (``_holdings``). A fused kernel runs where its result is materialized and
    reads every buffer behind the fused nodes it consists of, so a buffer lives until the last such kernel; a
    fused kernel whose input buffer dies there and has its dtype and size writes in place, as Inductor's in-place
    buffer reuse does. Sizes are compared on their hints; the figure at the highest point is returned as an
    expression. On a GPU (``gpu``) a GEMM Inductor pads reads padded copies of its operands instead
    (``_padded_gemms``). Of the graph's inputs, only those named in ``donated`` are written in place; those
    named in ``pinned`` live to the end (the caller holds them). ``inside``: the workspaces of ``gm``'s ops
    (``_workspaces``), each alive beside that op's results."""
    buffers = _buffers(gm, outputs_from)
    padded = _padded_gemms(gm) if gpu else {}
    if live_from_start:
        buffers |= {n for n in gm.graph.find_nodes(op="placeholder") if _is_tensor(n)}
    nodes = list(gm.graph.nodes)
    reads: dict[fx.Node, set[fx.Node]] = {}  # the buffers a node's value is computed from, through fused nodes
    # how a node's fused kernel reaches each of those buffers: the buffer itself or the views of it it reads
    ways: dict[fx.Node, dict[fx.Node, set[fx.Node]]] = {}
    last_use: dict[fx.Node, int] = {}
    position = {node: index for index, node in enumerate(nodes)}
    # The copies of one tensor padded for several GEMMs come out of one fused kernel, run before the first of
    # them (GPT-2's logit gradient, padded for its two GEMMs: three V-wide buffers at once on the H200).
    first_pad: dict[fx.Node, int] = {}
    for gemm, plan in padded.items():
        for source, _ in plan.operands:
            first_pad[source] = min(first_pad.get(source, position[gemm]), position[gemm])
    born: dict[int, list[tuple[tuple[str, str], IntLike]]] = {}
    for index, node in enumerate(nodes):
        behind, access = set(), {}
        for arg in node.all_input_nodes:
            if _root(arg) in buffers:
                behind.add(_root(arg))
                access.setdefault(_root(arg), set()).add(arg)
            else:
                behind |= reads.get(arg, set())
                for buffer, through in ways.get(arg, {}).items():
                    access.setdefault(buffer, set()).update(through)
        ways[node] = access
        if node in padded:  # reads its operands' padded copies, made where the first of them is
            for source, size in padded[node].operands:
                behind.discard(source)
                copy = ("padded copy", f"{source.name} for {node.name}")
                born.setdefault(first_pad[source], []).append((copy, size))
                last_use[copy] = index
        reads[node] = behind
        if node in buffers or node.op == "output":
            for buffer in behind:
                last_use[buffer] = index
    for source, index in first_pad.items():
        last_use[source] = max(last_use.get(source, index), index)
    kept = {_root(n) for n in gm.graph.find_nodes(op="output")[0].args[0] if isinstance(n, fx.Node)}
    kept |= {n for n in gm.graph.find_nodes(op="placeholder") if n.name in pinned}
    shared = _share_storages(nodes, buffers, last_use, kept, position)
    # An op's workspace is alive beside its results (buffers born at its getitems, right after it)
    workspaces: dict[int, tuple[IntLike, str]] = {}
    for node, size in (inside or {}).items():
        results = [position[u] for u in node.users if u.target is operator.getitem]
        workspaces[max(results, default=position[node])] = (size, node.name)
    live: dict[Any, IntLike] = {}
    best: IntLike = 0
    at_best: dict[Any, IntLike] = {}
    for index, node in enumerate(nodes):
        for copy, size in born.get(index, ()):
            live[copy] = size
        if node in buffers and _storage(node) not in held:
            size = padded[node].output if node in padded else shared.get(node, _storage_bytes(node))
            # an extern kernel writes its results into fresh buffers, never in place of its inputs
            extern = _is_extern(node) or (node.target is operator.getitem and _is_extern(node.args[0]))
            # (in the graph's order: a set's order follows the nodes' addresses, and differed between runs)
            # On a GPU Inductor writes in place only over an input its fused kernel reads at one index
            # (``single_index_in_fused_node``): not over Phi-3's gate_up, read as its gate and its up halves
            # by their gradients' kernel.
            donor = None if extern else next(
                (b for b in sorted(reads[node], key=position.__getitem__)
                 if b in live and last_use.get(b) == index and b not in kept
                 and not (gpu and len(ways[node].get(b, ())) > 1)
                 and (b.op != "placeholder" or b.name in donated)
                 and b.meta["val"].dtype == node.meta["val"].dtype and shapes.expr(live[b]) == shapes.expr(size)),
                None,
            )
            live[node] = live.pop(donor) if donor is not None else size
        working, op = workspaces.get(index, (0, None))
        current: IntLike = sum(live.values()) + working
        if shapes.hint(current) > shapes.hint(best):
            best, at_best = current, {**live, (_INSIDE, op): working} if op is not None else dict(live)
        for dead in [b for b in live if last_use.get(b, index) <= index and b not in kept]:
            del live[dead]
    return best, _holdings(gm, at_best, outputs_from, backward=live_from_start)


def _share_storages(
    nodes: list[fx.Node], buffers: set[fx.Node], last_use: dict, kept: set[fx.Node], position: dict[fx.Node, int]
) -> dict[fx.Node, IntLike]:
    """Buffers of one storage are one allocation (the saved q, k and v of one ``split``, each a placeholder of the
    backward, counted three times held the demo's simulated backward 132 MiB above its saved tensors): the first
    stands for the others, which leave ``buffers``, alive until the last of them is read and kept where any is.
    Returns the storage's bytes by standing buffer, the largest any of them sees (a dense view at its start
    sees only its own part)."""
    first_of: dict[Any, fx.Node] = {}
    sizes: dict[fx.Node, IntLike] = {}
    for node in nodes:
        if node not in buffers or (storage := _storage(node)) is None:
            continue
        owner = first_of.setdefault(storage, node)
        if owner is node:
            continue
        last_use[owner] = max(last_use.get(owner, position[owner]), last_use.get(node, position[node]))
        if node in kept:
            kept.add(owner)
        buffers.discard(node)
        sizes[owner] = max(sizes.get(owner, _storage_bytes(owner)), _storage_bytes(node), key=shapes.hint)
    return sizes


_INSIDE = "inside"  # the key of an op's workspace among a peak's buffers


def _workspace(node: fx.Node, device_type: str) -> IntLike:
    """Bytes ``node``'s op allocates inside its kernels while it runs (``lowerings._library.WORKSPACES``), on
    ``device_type``'s implementation; 0 for every op that registers none."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return 0
    function = WORKSPACES.get(target._schema.name)
    if function is None:
        return 0

    def value(arg: Any) -> Any:
        return arg.meta.get("val") if isinstance(arg, fx.Node) else arg

    kwargs = {name: value(arg) for name, arg in node.kwargs.items()}
    return function(device_type, *[value(arg) for arg in node.args], **kwargs)


def _workspaces(gm: fx.GraphModule, device_type: str) -> dict[fx.Node, IntLike]:
    """The ops of ``gm`` that allocate inside their kernels (``_workspace``), with those bytes: evaluated once
    per graph, for ``_peak`` and for the largest the report shows."""
    return {node: size for node in gm.graph.nodes if shapes.hint(size := _workspace(node, device_type))}


def _largest(sizes: dict[fx.Node, IntLike]) -> IntLike:
    return max(sizes.values(), key=shapes.hint, default=0)


def _holdings(
    gm: fx.GraphModule, live: dict[Any, IntLike], outputs_from: int, backward: bool
) -> tuple[Holding, ...]:
    """``live`` (buffer -> bytes at a peak) grouped by kind, largest kind first. A backward's placeholders are
    the saved tensors and the incoming gradients (``tangents_*``); its outputs are gradients; a forward's outputs
    from ``outputs_from`` on (where above 0) are what it saves."""
    results = gm.graph.find_nodes(op="output")[0].args[0]
    ends = {_root(n): i for i, n in enumerate(results) if isinstance(n, fx.Node)}

    def kind(key: Any) -> str:
        if isinstance(key, tuple):
            return "inside memopt's kernels" if key[0] == _INSIDE else "padded GEMM operands"
        if key.op == "placeholder":
            return "incoming gradients" if key.name.startswith("tangents") else "saved for the backward"
        if key in ends:
            if backward:
                return "gradients"
            return "saved for the backward" if 0 < outputs_from <= ends[key] else "outputs"
        return "temporaries"

    groups: dict[str, list[tuple[int, str]]] = {}
    for key, size in live.items():
        if isinstance(key, tuple):
            name = key[1] if key[0] == _INSIDE else f"padded copy of {key[1]}"
        else:
            name = _describe(key)
        groups.setdefault(kind(key), []).append((shapes.hint(size), name))
    held = [Holding(k, sum(b for b, _ in v), max(v)[1]) for k, v in groups.items()]
    return tuple(sorted(held, key=lambda h: -h.bytes))


# Inductor's shape padding (torch/_inductor/fx_passes/pad_mm.py), on a GPU: a GEMM whose static M, K or N is not a
# multiple of 8 elements (16-bit) or 4 (fp32) may run on copies of its operands padded to one, its output padded
# and sliced. Inductor pads where the GEMM is compute-bound (arithmetic intensity MNK / (MK + NK + MN) above half
# the GPU's FLOP-to-byte ratio) and a benchmark on the GPU finds the padded GEMM faster; from a laptop the
# benchmark cannot run, so every compute-bound one is assumed padded (it padded GPT-2's head, V = 50257, on the
# H200: benchmarks/results/memory-model-peak-gpt2-cce-torch-compile-h200-2026-12-05.md). The balance is
# Hopper's (H100: 989 dense bf16 TFLOP/s over 3.35 TB/s, halved as Inductor does; fp32 67 TFLOP/s).
_ALIGNMENT = {torch.float16: 8, torch.bfloat16: 8, torch.float32: 4}
_MACHINE_BALANCE = {torch.float16: 148.0, torch.bfloat16: 148.0, torch.float32: 10.0}


@dataclasses.dataclass(frozen=True)
class _Padding:
    """A GEMM Inductor pads: the buffers whose padded copies it reads (and the copies' bytes), its output's bytes."""

    operands: tuple[tuple[fx.Node, IntLike], ...]
    output: IntLike


def _padded_gemms(gm: fx.GraphModule) -> dict[fx.Node, _Padding]:
    padded = {}
    for node in gm.graph.nodes:
        plan = _padding(node)
        if plan is not None:
            padded[node] = plan
    return padded


def _padding(node: fx.Node) -> _Padding | None:
    """How Inductor pads ``node`` on a GPU, if it is an ``mm``, ``addmm`` or ``bmm`` it pads (comment above)."""
    packet = _packet(node)
    if packet not in ("mm", "addmm", "bmm") or node.op != "call_function":
        return None
    mat1, mat2 = node.args[1:3] if packet == "addmm" else node.args[:2]
    if not (isinstance(mat1, fx.Node) and isinstance(mat2, fx.Node) and _is_tensor(mat1) and _is_tensor(mat2)):
        return None
    a, b = mat1.meta["val"], mat2.meta["val"]
    align = _ALIGNMENT.get(a.dtype)
    if align is None or b.dtype != a.dtype:
        return None
    batch = [a.shape[0]] if packet == "bmm" else []
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    extra = {name: _pad_length(size, align) for name, size in (("m", m), ("k", k), ("n", n))}
    if not any(extra.values()):
        return None
    hm, hk, hn = (shapes.hint(size) for size in (m, k, n))
    if hm * hk * hn <= _MACHINE_BALANCE[a.dtype] * (hm * hk + hk * hn + hm * hn):
        return None  # memory-bound: Inductor does not pad it
    itemsize = a.dtype.itemsize
    whole = 1
    for size in batch:
        whole = whole * size
    operands = []
    if extra["m"] or extra["k"]:
        operands.append((_root(mat1), whole * (m + extra["m"]) * (k + extra["k"]) * itemsize))
    if extra["k"] or extra["n"]:
        operands.append((_root(mat2), whole * (k + extra["k"]) * (n + extra["n"]) * itemsize))
    output = whole * (m + extra["m"]) * (n + extra["n"]) * node.meta["val"].dtype.itemsize
    return _Padding(tuple(operands), output)


def _pad_length(size: IntLike, align: int) -> int:
    """Elements Inductor adds to a dimension: none to a symbolic one or one of size 1, as pad_mm does."""
    constant = shapes.constant(size)
    if constant is None or constant == 1 or constant % align == 0:
        return 0
    return align - constant % align


def _root(node: fx.Node) -> fx.Node:
    while _is_view(node) and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node
