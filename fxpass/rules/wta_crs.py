"""WTA-CRS linear: linears whose weight gradient may be estimated save a sample of their input's rows.

Eligible: ``F.linear`` / ``addmm`` (GPT-2's Conv1D) / ``matmul`` with a weight that needs a gradient, in a
training graph (the output needs a gradient), over at least ``wta_crs_min_tokens`` token rows, and not the
language-model head (the CCE rule's territory). Linears reading the same input (Q/K/V, gate/up) form one
group and share one sample, stored once. The rewrite frees memory only if nothing else keeps the input alive
(``fxpass.liveness``): a LayerNorm or a second matmul reading it, an activation that saves its output, a graph
input or output; then it declines and says which op holds it. What it frees is then priced against
torch.compile, which may recompute the input rather than keep it (``context``). It is opt-in
(``wta_crs_budget``), since it replaces exact weight gradients by unbiased estimates (Liu et al., NeurIPS 2023).
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
from collections.abc import Mapping
from typing import Any

import torch
import torch.fx as fx

from fxpass import liveness, shapes
from fxpass.config import RECOMPUTE_US_PER_MIB, Config
from fxpass.graph import (
    ADDMM_TARGETS,
    CROSS_ENTROPY_TARGETS,
    LINEAR_TARGETS,
    LOG_SOFTMAX_TARGETS,
    MATMUL_TARGETS,
    NLL_LOSS_TARGETS,
    REPLACED_BY,
    GraphFacts,
    bind_args,
    cast_to,
    current,
    erase_unused,
    fake_mode_of,
    insert_node,
    is_call,
    is_method,
    is_param_transpose,
    position_in,
    propagate_example_value,
    tensor_value,
    view_kind,
)
from fxpass.rules.base import Decision, Rule, decide_on_saving

NAME = "wta_crs"
DEFAULT_BUDGET = 0.3  # the paper's main setting, and the budget of backend="memopt_wta"

HOW_TO_ENABLE = (
    "WTA-CRS is off: it replaces exact weight gradients by unbiased estimates, so it is opt-in; enable with "
    "options={'wta_crs_budget': 0.3}, MEMOPT_WTA_CRS_BUDGET=0.3 or backend='memopt_wta'"
)


def _weight_key(weight: fx.Node) -> str:
    """A weight's graph name, stable from run to run: the group's estimate is written by this name from the
    compiled backward, and a name with an object's address in it would change the graph's code and so miss
    AOTAutograd's cache on every start. Blocks compiled one by one lift their weights under the same names
    (``L['self'].mlp.c_proj.weight``) and so share one estimate, as blocks that share one graph do; it steers
    sampling only."""
    return weight.name if weight.op != "placeholder" else str(weight.target)


@dataclasses.dataclass(frozen=True)
class Member:
    """One linear of a group: ``out = x @ weightᵀ + bias`` (``weight`` stored [D_in, D_out] if transposed)."""

    node: fx.Node
    weight: fx.Node
    weight_is_transposed: bool
    bias: fx.Node | None


@dataclasses.dataclass(frozen=True)
class WtaMatch:
    """Linears that read the same input, or a reason why they cannot be rewritten (``blocker``)."""

    input: fx.Node
    members: tuple[Member, ...]
    period_source: fx.Node  # the tensor whose dimension -2 is the sequence length (or the input itself)
    blocker: str | None = None

    @property
    def anchor(self) -> fx.Node:
        return self.members[0].node

    @property
    def nodes(self) -> tuple[fx.Node, ...]:
        return tuple(m.node for m in self.members)

    @property
    def key(self) -> str:
        return "wta_crs:" + ",".join(_weight_key(m.weight) for m in self.members)

    def params(self) -> Mapping[str, Any]:
        x = tensor_value(self.input)
        return {
            "linears": len(self.members),
            "tokens": shapes.render(shapes.numel(x) // x.shape[-1]),
            "in_features": shapes.render(x.shape[-1]),
            "out_features": [shapes.render(_out_features(m)) for m in self.members],
            "dtype": str(_compute_dtype(self.members)).removeprefix("torch."),
        }


def _out_features(member: Member):
    weight = tensor_value(member.weight)
    return weight.shape[1] if member.weight_is_transposed else weight.shape[0]


# --- match ------------------------------------------------------------------------------------------------


def match(facts: GraphFacts) -> list[WtaMatch]:
    groups: dict[tuple[fx.Node, torch.dtype], list[Member]] = {}
    for node in facts.gm.graph.nodes:
        member = _linear(node)
        if member is not None and _trains(member) and not _feeds_a_loss(node):
            groups.setdefault((_input_of(node), tensor_value(node).dtype), []).append(member)
    return [_candidate(x, tuple(members)) for (x, _), members in groups.items()]


def _linear(node: fx.Node) -> Member | None:
    """The linear layer computed by ``node``, if it multiplies activations by a 2-D weight tensor."""
    if is_call(node, *LINEAR_TARGETS):
        bound = bind_args(node, ("input", "weight", "bias"), {"bias": None})
        if bound and "weight" in bound and isinstance(bound["weight"], fx.Node):
            return _member(node, bound["weight"], False, bound["bias"])
    elif is_call(node, *ADDMM_TARGETS):
        bound = bind_args(node, ("input", "mat1", "mat2", "beta", "alpha"), {"beta": 1, "alpha": 1})
        if bound and len(bound) == 5 and bound["beta"] == 1 and bound["alpha"] == 1:
            return _member(node, bound["mat2"], True, bound["input"])
    elif (is_call(node, *MATMUL_TARGETS) or is_method(node, "matmul", "mm")) and len(node.args) == 2:
        other = node.args[1]
        if isinstance(other, fx.Node) and is_param_transpose(other):
            return _member(node, other.args[0], False, None)
        return _member(node, other, True, None)
    return None


def _member(node: fx.Node, weight, transposed: bool, bias) -> Member | None:
    w, x = tensor_value(weight), tensor_value(_input_of(node))
    if w is None or x is None or w.dim() != 2 or x.dim() < 2 or not (x.is_floating_point() and w.is_floating_point()):
        return None
    if bias is not None and (tensor_value(bias) is None or tensor_value(bias).dim() != 1):
        return None
    return Member(node, weight, transposed, bias)


def _input_of(node: fx.Node) -> fx.Node:
    return node.args[1] if is_call(node, *ADDMM_TARGETS) else node.args[0]


def _trains(member: Member) -> bool:
    """A training graph whose weight needs a gradient (else the input is not saved for it anyway)."""
    out, weight = tensor_value(member.node), tensor_value(member.weight)
    return out is not None and out.requires_grad and weight.requires_grad


def _feeds_a_loss(node: fx.Node) -> bool:
    """The language-model head: its output reaches a cross-entropy through views and casts."""
    pending, seen = [node], set()
    while pending:
        here = pending.pop()
        for user in here.users:
            if is_call(user, *CROSS_ENTROPY_TARGETS, *NLL_LOSS_TARGETS, *LOG_SOFTMAX_TARGETS) or is_method(
                user, "log_softmax"
            ):
                return True
            if view_kind(user) is not None and user not in seen:
                seen.add(user)
                pending.append(user)
    return False


def _candidate(x: fx.Node, members: tuple[Member, ...]) -> WtaMatch:
    period_source = _sequence_source(x)
    if tensor_value(x).dtype != _compute_dtype(members):
        return WtaMatch(x, members, period_source)  # autocast: the linears saved their own cast copy of x
    holders = liveness.holders(x, excluding=[m.node for m in members])
    if holders:
        names = "; ".join(h.describe() for h in holders[:3])
        blocker = f"the input {x.name} stays alive anyway, held by {names}: sampling it frees nothing"
        return WtaMatch(x, members, period_source, blocker)
    return WtaMatch(x, members, period_source)


def _compute_dtype(members: tuple[Member, ...]) -> torch.dtype:
    """The dtype the linears computed in: their output's (autocast's dtype when it was on)."""
    return tensor_value(members[0].node).dtype


def _sequence_source(x: fx.Node) -> fx.Node:
    """A tensor whose dimension -2 is the sequence: ``x`` if 3-D or more, else what a view flattening only the
    leading dimensions read (so that the sequence length divides the number of token rows)."""
    value = tensor_value(x)
    if value.dim() >= 3:
        return x
    source = x.args[0] if view_kind(x) is not None and isinstance(x.args[0], fx.Node) else None
    found = tensor_value(source) if source is not None else None
    if found is not None and found.dim() >= 3 and shapes.proved(found.shape[-1] == value.shape[-1]):
        return source
    return x


# --- decide -----------------------------------------------------------------------------------------------


def decide(candidate: WtaMatch, config: Config) -> Decision:
    if candidate.blocker:
        return Decision(False, candidate.blocker)
    if config.wta_crs_budget is None:
        memory = memory_model(candidate, DEFAULT_BUDGET)
        verdict = shapes.clears(memory.saved, config.min_saved_bytes)
        reason = (
            f"{HOW_TO_ENABLE} (saved bytes: what budget {DEFAULT_BUDGET} would free as the graph is written; "
            "enabled, each group is priced against torch.compile)"
        )
        return Decision(False, reason, memory, verdict)
    x = tensor_value(candidate.input)
    rows = shapes.numel(x) // x.shape[-1]
    few = shapes.clears(rows, config.wta_crs_min_tokens)
    if not few.pays:
        minimum = config.wta_crs_min_tokens
        return Decision(False, f"{few.saved_hint} token rows, fewer than wta_crs_min_tokens={minimum}")
    memory = memory_model(candidate, config.wta_crs_budget)
    decision = decide_on_saving(memory, config, "weight gradients from a sample")
    return dataclasses.replace(decision, params={"sampling": config.wta_crs_sampling})


def memory_model(candidate: WtaMatch, budget: float) -> shapes.MemoryModel:
    """The input saved whole (once for the group) against k sampled rows and their indices."""
    from lowerings.wta_crs.reference import sample_size

    x = tensor_value(candidate.input)
    dtype = _compute_dtype(candidate.members)
    rows = shapes.numel(x) // x.shape[-1]
    k = sample_size(rows, budget)
    return shapes.MemoryModel(
        before={"saved: input activations [N, D_in]": shapes.nbytes(x, dtype)},
        after={
            "saved: sampled rows [k, D_in]": k * x.shape[-1] * dtype.itemsize,
            "saved: their indices [k]": k * 8,
        },
    )


# --- price ----------------------------------------------------------------------------------------------

# How far back the producers of a group's input are priced with it: enough for an activation function, a norm,
# a dropout and a residual add (GELU's tanh form is 8 nodes), not the whole residual stream.
_CONTEXT_NODES = 24
# Ops Inductor runs as kernels of their own, whose results are buffers it keeps or frees as they are: the walk
# back stops there (what such an op's backward keeps is its own business, the same on both sides).
_KERNEL_TARGETS = (*LINEAR_TARGETS, *MATMUL_TARGETS, *ADDMM_TARGETS, torch.bmm, torch.baddbmm, torch.conv1d,
                   torch.conv2d, torch.nn.functional.scaled_dot_product_attention, torch.nn.functional.embedding)


def context(candidate: WtaMatch) -> list[fx.Node]:
    """The nodes that compute the group's input (an activation function, a norm, a dropout, the views between)
    back to the kernels whose results they read, those kernels included; priced with the group
    (``fxpass.pricing``).

    Whether sampling frees anything depends on them: torch.compile's partitioner keeps the input only where it
    does not recompute it from what it saves anyway, and a kernel's result it keeps is freed only where the
    kernel's own backward does not need it. ReLU keeps its output; a linear's output feeding another linear is
    kept for that linear alone, so sampling frees it; GPT-2's tanh GELU keeps its output beside its input."""
    found: set[fx.Node] = set()
    pending = [current(candidate.input)]
    while pending and len(found) < _CONTEXT_NODES:
        node = pending.pop()
        if node in found or node.op not in ("call_function", "call_method"):
            continue
        found.add(node)
        if _recomputable(node):
            pending.extend(node.all_input_nodes)
    return [node for node in current(candidate.input).graph.nodes if node in found]


def _recomputable(node: fx.Node) -> bool:
    """Computed by Inductor-generated code (so the partitioner may recompute it, and the walk goes on to its
    inputs), not a kernel of its own: a GEMM, attention, an embedding or a custom op."""
    if is_call(node, *_KERNEL_TARGETS) or is_method(node, "matmul", "mm", "bmm"):
        return False
    target = node.target
    return not (isinstance(target, torch._ops.OpOverload) and target.namespace not in ("aten", "prims"))


# --- weigh: step time against what a group frees ------------------------------------------------------------

# What one group adds to a CUDA step before the weight-gradient work its sample saves: the draw (one Triton
# program, 51-83 µs a call at 16384 rows), the norm, gather and store kernels, and the host work of its opaque
# ops. GPT-2 small's 36 groups, 16 × 1024 (`benchmarks/tools/wta_crs_profile.py`): +139 µs of step a group on
# the H200, +389 on an H100 whose host is slower, each after about 70 µs of weight-gradient GEMMs saved.
GROUP_OVERHEAD_US = 300.0
# Matmul throughput (TFLOP/s) at which a group's smaller weight-gradient GEMMs save time: the 1.78 TFLOP that
# GPT-2's 36 groups no longer compute took 2.3-2.5 ms on both cards (the same profiles). fp32 at the H100's
# dense fp32 rate, less what a GEMM realizes.
GEMM_TFLOPS = {torch.bfloat16: 700.0, torch.float16: 700.0, torch.float32: 50.0}


@dataclasses.dataclass(frozen=True)
class StepCost:
    """A group's modelled change of a CUDA step's time, µs: its fixed cost less the GEMM work it saves."""

    overhead_us: float
    gemm_saved_us: float

    @property
    def extra_us(self) -> float:
        return self.overhead_us - self.gemm_saved_us


def step_cost(candidate: WtaMatch, budget: float) -> StepCost:
    """What sampling ``candidate`` at ``budget`` adds to a CUDA step, at the shapes' hints.

    The weight gradients shrink from 2·N·D_in·ΣD_out FLOPs to 2·k·D_in·ΣD_out; the rest is a cost per group
    (``GROUP_OVERHEAD_US``) that hardly depends on the widths. So wide layers pay for themselves (the
    Llama-3.2-1B shape's MLP: its sampled step was faster than memopt's alone), narrow ones do not (GPT-2's
    768-wide inputs)."""
    from lowerings.wta_crs.reference import sample_size

    x = tensor_value(candidate.input)
    rows = shapes.hint(shapes.numel(x) // x.shape[-1])
    skipped = rows - shapes.hint(sample_size(rows, budget))
    width = sum(shapes.hint(_out_features(member)) for member in candidate.members)
    flops = 2 * skipped * shapes.hint(x.shape[-1]) * width
    throughput = GEMM_TFLOPS.get(_compute_dtype(candidate.members), GEMM_TFLOPS[torch.float32])
    return StepCost(GROUP_OVERHEAD_US, flops / (throughput * 1e6))


def weigh(candidate: WtaMatch, decision: Decision, config: Config) -> Decision:
    """On CUDA, decline a group whose extra step time per MiB it frees (against torch.compile where priced)
    exceeds ``config.wta_crs_max_us_per_mib``: recomputation, exact, frees memory cheaper there."""
    limit = config.wta_crs_max_us_per_mib
    device = config.memory_device(tensor_value(candidate.input).device)
    if limit is None or config.wta_crs_budget is None or device.type != "cuda":
        return decision
    cost = step_cost(candidate, config.wta_crs_budget)
    freed = decision.verdict.saved_hint  # the figure the decision weighed: against torch.compile where priced
    freed_mib = max(freed, 0) / 2**20
    figures = (f"its step cost modelled at {cost.overhead_us:.0f} µs (draw and host work) less "
               f"{cost.gemm_saved_us:.0f} µs of weight-gradient GEMMs its sample skips")
    params = {**decision.params, "extra_step_us": round(cost.extra_us, 1)}
    if cost.extra_us <= 0:
        return dataclasses.replace(decision, reason=f"{decision.reason}; no slower: {figures}", params=params)
    rate = cost.extra_us / freed_mib if freed_mib > 0 else float("inf")
    if rate <= limit:
        reason = f"{decision.reason}; {figures}: {rate:.1f} µs a MiB freed, within wta_crs_max_us_per_mib={limit:g}"
        return dataclasses.replace(decision, reason=reason, params=params)
    reason = (
        f"dearer in time than recomputation: {figures}, {cost.extra_us:.0f} µs a step for the "
        f"{shapes.format_bytes(freed)} it frees against torch.compile, {rate:.1f} µs a MiB, above "
        f"wta_crs_max_us_per_mib={limit:g} (recomputation: about {RECOMPUTE_US_PER_MIB:g} µs a MiB); "
        "left to torch.compile"
    )
    return dataclasses.replace(decision, apply=False, reason=reason, params=params)


# --- apply ------------------------------------------------------------------------------------------------


def apply(gm: fx.GraphModule, candidate: WtaMatch, config: Config) -> None:
    from lowerings.wta_crs.op import sample

    graph = gm.graph
    candidate = dataclasses.replace(
        candidate, input=current(candidate.input), period_source=current(candidate.period_source)
    )
    first = min(candidate.nodes, key=position_in(graph))
    fake_mode = fake_mode_of([candidate.input, first])

    def add(op: str, target: Any, *args: Any) -> fx.Node:
        return insert_node(graph, op, target, args, meta_from=first, fake_mode=fake_mode)

    dtype = _compute_dtype(candidate.members)
    with graph.inserting_before(first):
        weights, biases, bias_of = [], [], []
        for member in candidate.members:
            weight = cast_to(add, member.weight, dtype)
            weights.append(add("call_method", "t", weight) if member.weight_is_transposed else weight)
            bias_of.append(len(biases) if member.bias is not None else -1)
            if member.bias is not None:
                biases.append(cast_to(add, member.bias, dtype))
        x = cast_to(add, candidate.input, dtype)
        estimate = _estimate_node(gm, candidate, fake_mode, first)
        period = _period_arg(add, candidate)
        tokens = add("call_method", "flatten", add("call_method", "detach", x), 0, -2)
        budget = float(config.wta_crs_budget)
        if config.wta_crs_sampling == "traced":
            uniforms = _shared_uniforms(gm, add, tokens, budget, fake_mode)
            drawn = add("call_function", sample, tokens, estimate, budget, period, config.wta_crs_winners,
                        *([uniforms] if uniforms is not None else []))
        else:
            drawn = add("call_function", torch.ops.memopt.wta_crs_sample.default, tokens, estimate, budget, period,
                        config.wta_crs_winners)
        index, rows = (add("call_function", operator.getitem, drawn, i) for i in range(2))
        fused = add(
            "call_function",
            torch.ops.memopt.wta_crs_linears.default,
            x, weights, biases, bias_of, index, rows, candidate.key, period,
        )
        outputs = [add("call_function", operator.getitem, fused, i) for i in range(len(candidate.members))]
    for member, output in zip(candidate.members, outputs, strict=True):
        member.node.replace_all_uses_with(output)
        member.node.meta[REPLACED_BY] = output
    erase_unused(candidate.nodes)


# Meta key of the graph's one ``torch.rand`` that every traced group's uniforms are sliced from: its length so far.
_UNIFORMS = "memopt_wta_uniforms"
# Slices start at multiples of 4 floats: Triton specializes a pointer argument on 16-byte alignment, so slices at
# odd offsets compiled the draw kernel a second time.
_ALIGN = 4


def _shared_uniforms(gm: fx.GraphModule, add, tokens: fx.Node, budget: float, fake_mode) -> fx.Node | None:
    """This group's k uniforms, a slice of one ``torch.rand`` at the top of the graph that grows by k per group
    (rounded up to 4 floats).

    Inductor writes a random call's seed index into its kernel's source as a constant, so a ``torch.rand`` per
    group gave every group random kernels of its own to compile, fused with the layer around them (on CPU, two
    blocks: 8 random kernels and 8 distinct draw kernels; sliced from one call, 1 and 1). Slices of one call
    leave the groups of identical layers identical. None where k is not a constant (``sample`` draws its own)."""
    from lowerings.wta_crs.reference import sample_size

    value = tensor_value(tokens)
    k = shapes.constant(sample_size(value.shape[0], budget)) if budget < 1.0 else None
    if k is None:
        return None
    graph = gm.graph
    source = next((node for node in graph.nodes if _UNIFORMS in node.meta), None)
    if source is None:
        with graph.inserting_before(next(node for node in graph.nodes if node.op != "placeholder")):
            source = graph.call_function(torch.rand, ((0,),), {"device": value.device})
        source.meta[_UNIFORMS] = 0
    offset = -(-source.meta[_UNIFORMS] // _ALIGN) * _ALIGN  # every slice 16-byte aligned: one draw kernel
    source.args = ((offset + k,),)
    source.meta[_UNIFORMS] = offset + k
    propagate_example_value(source, fake_mode)
    return add("call_method", "narrow", source, 0, offset, k)


def _estimate_node(gm: fx.GraphModule, candidate: WtaMatch, fake_mode, first: fx.Node) -> fx.Node:
    """The group's gradient-norm estimate as a buffer of the graph module, so that AOTAutograd lifts it as an
    input (the backward updates it in place) and CUDA graphs read it at a fixed address. Created now, outside
    any capture; recompiles of the same model reuse it (``lowerings/wta_crs/state.py``)."""
    from lowerings.wta_crs.state import estimate

    values = estimate(candidate.key, tensor_value(candidate.input).device).values
    name = next(f"memopt_wta_estimate_{i}" for i in itertools.count() if not hasattr(gm, f"memopt_wta_estimate_{i}"))
    gm.register_buffer(name, values)
    if isinstance(getattr(gm, "_param_name_to_source", None), dict):
        # AOTAutograd maps each lifted parameter or buffer of a Dynamo graph to where Dynamo found it; this one
        # was never in user code, so it gets a source of its own (read only to deduplicate inputs).
        from torch._dynamo.source import ConstantSource

        gm._param_name_to_source[name] = ConstantSource(name)
    node = gm.graph.get_attr(name)
    node.meta.update({k: v for k, v in first.meta.items() if k in ("stack_trace", "nn_module_stack")})
    node.meta["example_value"] = fake_mode.from_tensor(values, static_shapes=True)
    return node


def _period_arg(add, candidate: WtaMatch):
    """Sequence length for positions: a constant, or a size node when it is symbolic (1 for flat tokens)."""
    source = tensor_value(candidate.period_source)
    if source.dim() < 3:
        return 1
    constant = shapes.constant(source.shape[-2])
    return constant if constant is not None else add("call_method", "size", candidate.period_source, -2)


RULE = Rule(name=NAME, match=match, decide=decide, apply=apply, context=context, priced_on="saved", weigh=weigh)
