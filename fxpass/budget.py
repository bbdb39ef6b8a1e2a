"""Fitting a compiled graph into a memory budget (the ``memory_budget`` option) by recomputation.

memopt simulates the partitioned graph on fake tensors (``fxpass.compiled_cost``, the step simulation
``fxpass.explain`` prints), so it can search, before anything runs, for the recomputation whose simulated peak
meets a budget, and compile under it. The recomputation itself is torch's: AOTAutograd's min-cut partitioner
decides what the backward recomputes; memopt only chooses what to ask of it, in two forms.

- **Its knapsack.** ``torch._functorch.config.activation_memory_budget`` (a fraction of the activations the
  default partition saves; part of AOTAutograd's cache key) has the partitioner recompute the activations with
  the fewest FLOPs per byte first. Pointwise work goes first, GEMM outputs last: at a real depth the setting that
  reaches a low peak recomputes every block's forward at the start of the backward, all at once (the Llama-3.2-1B
  shape at 4×2048 simulated at 0.53× torch.compile's peak at best, and higher at 0.0).
- **Whole blocks, as ``torch.utils.checkpoint`` would.** The nodes of a repeated block (a ``ModuleList``'s
  children: decoder layers) are tagged ``CheckpointPolicy.MUST_RECOMPUTE`` with an ``ac_graph_id`` of their own,
  the tags Dynamo's checkpoint regions carry; the partitioner's ``cleanup_recompute_tags`` then keeps each block's
  output, read by the next block, and the backward recomputes one block at a time. A node read by untagged work is
  tagged ``MUST_SAVE``: the boundary is kept, not recomputed twice. Tags are node meta, which AOTAutograd's cache
  key leaves out, so the graph module carries a digest of them (``PLAN_ATTRIBUTE``, hashed with its ``__dict__``).

Each form is priced by the same simulation; where both meet the budget, the plan takes the one whose recomputed
FLOPs (torch's flop counter over the partitioned backward, ``CompiledCost.backward_flops``) are fewer. A graph with
checkpointed regions of its own (HF's gradient checkpointing) gets no block tags: its blocks are recomputed
already. The search runs in a shape environment of its own and tags nodes after Dynamo has built its guards: it
adds no guard to the user's graph.

The budget is the graph's own peak beyond its inputs (parameters, buffers, the batch), as ``fxpass.explain``
and the benchmarks count it, with returned tensors held through the backward: in bytes, or as a fraction of
torch.compile's simulated peak for the same graph. It is decided at the example shapes; at other shapes the same
blocks are recomputed and the setting recomputes the same share of the activations.

A step of several graphs (graph breaks, blocks compiled one by one) is planned graph by graph, each at the budget
as given: a fraction holds each graph to that fraction of torch.compile's peak for it, which holds the step to it
too where the graphs' saved tensors add up (blocks compiled one by one save theirs one after another), so a
fraction is the way to give a budget to such a step. A budget in bytes is each graph's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import operator
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from fxpass import checkpoint, shapes
from fxpass.compiled_cost import CompiledCost, _module_path, compiled_cost, partitioned_under
from fxpass.graph import bind_args, bind_sdpa, copy_graph
from fxpass.notes import error_note

log = logging.getLogger(__name__)

# The search stops when the setting is known to within this (AOTAutograd's knapsack rounds it anyway).
RESOLUTION = 1 / 64
# The graph module's attribute holding a digest of the recomputation tags: AOTAutograd's cache key hashes the
# module's ``__dict__`` but not its nodes' meta, so without it a tagged graph would hit an untagged one's entry.
PLAN_ATTRIBUTE = "_memopt_recompute_plan"
# The ids memopt's block tags start from (Dynamo numbers its own checkpoint regions from 1).
AC_GRAPH_ID_BASE = 1 << 20
WHOLE_GRAPH = "the whole graph"


@dataclasses.dataclass(frozen=True)
class BudgetPlan:
    """What memopt did to fit a graph into its budget, for the report."""

    requested: int | float  # as the user gave it: bytes, or a fraction of torch.compile's peak
    budget: int  # in bytes
    torch_compile: int  # torch.compile's simulated peak for the graph
    before: int  # memopt's simulated peak with the exact rewrites alone
    after: int  # with the plan
    activation_memory_budget: float | None  # the setting compiled under; None: the partitioner's own
    met: bool
    reason: str
    recomputed_blocks: tuple[str, ...] = ()  # blocks tagged for recomputation, by module path
    blocks: int = 0  # repeated blocks the graph has
    added_flops: int = 0  # the modelled cost: FLOPs the backward recomputes beyond the exact rewrites'
    step_flops: int = 0  # the graph's forward and backward FLOPs with the exact rewrites alone
    # WTA-CRS linears added where exact measures fell short (the user opted in with ``wta_crs_budget``), and
    # the lowest simulated peak the exact measures reached
    wta_crs_linears: int = 0
    exact_after: int | None = None
    # the simulations the plan chose from, as ``step_costs`` gives them: {"torch.compile": CompiledCost, "memopt":
    # CompiledCost under the plan}, so that pricing the step again (``explain``) costs nothing
    costs: dict[str, CompiledCost] = dataclasses.field(default_factory=dict, repr=False, compare=False)

    def to_json(self) -> dict[str, Any]:
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self) if field.name != "costs"}

    @property
    def measures(self) -> list[str]:
        """Each measure the plan adds, in words."""
        added = []
        if self.recomputed_blocks:
            added.append(f"recompute {_blocks_text(self.recomputed_blocks)} ({len(self.recomputed_blocks)} of "
                         f"{max(self.blocks, len(self.recomputed_blocks))} blocks)")
        if self.activation_memory_budget is not None:
            added.append(f"recomputation at activation_memory_budget={self.activation_memory_budget:g}")
        if self.wta_crs_linears:
            added.append(f"WTA-CRS on {self.wta_crs_linears} linears (exact measures reached "
                         f"{_mib(self.exact_after or 0)})")
        return added

    def __str__(self) -> str:
        setting = " and ".join(self.measures) or "nothing added"
        cost = ""
        if self.added_flops:
            share = f", {100 * self.added_flops / self.step_flops:.0f} % of the step's" if self.step_flops else ""
            cost = f"; +{self.added_flops / 1e9:.1f} GFLOP recomputed{share}"
        return (f"memory budget {_mib(self.budget)}: {setting}; simulated peak {_mib(self.before)} → "
                f"{_mib(self.after)} (torch.compile {_mib(self.torch_compile)}){cost}; {self.reason}")


def _mib(value: int) -> str:
    return f"{value / 2**20:.1f} MiB"


def _blocks_text(names: Sequence[str]) -> str:
    """"model.layers.0–11" for consecutive children of one container, else the names."""
    if len(names) > 1:
        parts = [re.fullmatch(r"(.*)\.(\d+)", name) for name in names]
        if all(parts) and len({part[1] for part in parts}) == 1:
            indices = [int(part[2]) for part in parts]
            if indices == list(range(indices[0], indices[0] + len(indices))):
                return f"{parts[0][1]}.{indices[0]}–{indices[-1]}"
    return ", ".join(names)


def graph_peak(cost: CompiledCost) -> int:
    """A graph's simulated peak beyond its inputs with what it returns held through the backward (hints): the
    figure ``GraphReport.peaks`` gives."""
    hints = cost.hints()
    return max(hints["forward_peak"], hints["backward_peak"] + shapes.hint(cost.returned))


def blocks(graph: fx.Graph) -> dict[str, list[fx.Node]]:
    """The graph's repeated blocks, in order: the nodes run inside each child of the module container with the
    most numbered children, all of one class (a ``ModuleList`` of decoder layers: "model.layers.0", ...), read
    from Dynamo's ``nn_module_stack``; {} where no container has two."""
    found: dict[str, dict[int, list[fx.Node]]] = {}
    kinds: dict[str, set[Any]] = {}
    for node in graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        for path, kind in (node.meta.get("nn_module_stack") or {}).values():
            match = re.fullmatch(r"(.*)\.(\d+)", _module_path(path))
            if match:  # the outermost numbered module the node runs in
                found.setdefault(match[1], {}).setdefault(int(match[2]), []).append(node)
                kinds.setdefault(match[1], set()).add(kind)
                break
    # repeated blocks are children of one kind (a Sequential's Linear, GELU, Linear are not)
    repeated = [name for name in found if len(found[name]) >= 2 and len(kinds[name]) == 1]
    if not repeated:
        return {}
    container = max(repeated, key=lambda name: len(found[name]))
    return {f"{container}.{index}": nodes for index, nodes in sorted(found[container].items())}


def _candidates(graph: fx.Graph) -> dict[str, list[fx.Node]]:
    """What block recomputation may tag: the repeated blocks, else the graph's whole forward as one."""
    found = blocks(graph)
    if found:
        return found
    work = [n for n in graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    return {WHOLE_GRAPH: work} if work else {}


def tag_blocks(gm: fx.GraphModule, names: Sequence[str]) -> None:
    """Tag the nodes of the blocks ``names`` of ``gm`` for recomputation, as ``torch.utils.checkpoint`` tags a
    region's (module docstring), and key the module's compiled artifacts on the tags (``PLAN_ATTRIBUTE``)."""
    if not names:
        return
    found = _candidates(gm.graph)
    tagged = {node: index for index, name in enumerate(names) for node in found[name]}
    for node, index in tagged.items():
        # a value read by untagged work (the next block, the head, the output) is the boundary the region keeps;
        # a random draw is kept too: drawn again in the backward it would differ from the forward's
        boundary = any(user not in tagged for user in node.users)
        keep = boundary or draws_randomly(node)
        node.meta["recompute"] = CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.MUST_RECOMPUTE
        node.meta["ac_graph_id"] = AC_GRAPH_ID_BASE + index
    setattr(gm, PLAN_ATTRIBUTE, hashlib.sha256("\n".join(names).encode()).hexdigest()[:16])


# Dynamo's spellings of random draws. Recomputed under Inductor, a dropout's mask came out different from the
# forward's (GPT-2 with dropout 0.1, 4 blocks recomputed: gradients off by 0.06, where torch's own checkpointing
# of the same blocks matched): Inductor's random-seed pass gives the recomputed draw seeds of its own.
_RANDOM_FUNCTIONS = frozenset({
    torch.nn.functional.dropout, torch.nn.functional.dropout1d, torch.nn.functional.dropout2d,
    torch.nn.functional.dropout3d, torch.nn.functional.alpha_dropout, torch.nn.functional.feature_alpha_dropout,
    torch.dropout, torch.bernoulli, torch.rand, torch.randn, torch.randint, torch.rand_like, torch.randn_like,
    torch.randint_like, torch.randperm, torch.normal, torch.poisson, torch.multinomial,
})
_RANDOM_METHODS = frozenset({
    "bernoulli", "bernoulli_", "uniform_", "normal_", "exponential_", "random_", "geometric_", "log_normal_",
    "cauchy_",
})


# The knapsack is left out of a graph that draws random numbers: under Inductor on CPU (torch 2.13), GPT-2 with
# SDPA's attention dropout at activation_memory_budget=0.5, torch.compile alone, gave gradients 0.008 off the
# unbudgeted step's, where the masks should have been the forward's.
RANDOM_NOTE = (
    "; the partitioner's knapsack left out: the graph draws random numbers, which it recomputed differently "
    "(SDPA's dropout under Inductor)"
)


def draws_randomly(node: fx.Node) -> bool:
    """Whether ``node`` draws from torch's generator (a dropout, ``torch.rand``), or is one of memopt's ops that
    draws inside (attention with dropout, whose seed it draws; WTA-CRS's opaque sampling). WTA-CRS's linears are
    not: they sample rows by uniform numbers drawn apart (``torch.rand``), which are kept."""
    if node.op == "call_method":
        return node.target in _RANDOM_METHODS
    if node.op != "call_function":
        return False
    target = node.target
    if target in _RANDOM_FUNCTIONS:
        return True
    sdpa = bind_sdpa(node)
    if sdpa is not None:
        return _may_drop(sdpa["dropout_p"])
    if target is operator.getitem:  # a result of a draw is kept with it
        return isinstance(node.args[0], fx.Node) and draws_randomly(node.args[0])
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        if target.namespace == "memopt":
            name = target.__name__.split(".")[0]
            return name in ("wta_crs_sample", "wta_crs_draw") or (name == "flash_attention" and _drops_out(node))
        return torch.Tag.nondeterministic_seeded in getattr(target, "tags", ())
    return False


def _samples_rows(node: fx.Node) -> bool:
    """Whether ``node`` is a draw only WTA-CRS's linears read (their rows' uniform numbers): drawn again, it gives
    another unbiased sample, not a wrong gradient, so it does not keep the knapsack out."""
    readers = [user.target for user in node.users]
    return bool(readers) and all(
        isinstance(target, torch._ops.OpOverload) and target.namespace == "memopt"
        and target.__name__.startswith("wta_crs") for target in readers
    )


def _drops_out(node: fx.Node) -> bool:
    """Whether memopt's attention op ``node`` draws a dropout mask, its arguments bound by the op's schema."""
    schema = getattr(node.target, "_schema", None) or node.target.default._schema
    bound = bind_args(node, [argument.name for argument in schema.arguments])
    return bound is None or _may_drop(bound.get("dropout_p", 0.0))


def _may_drop(probability: Any) -> bool:
    """A dropout probability above 0, or one traced (not known here: assume it draws)."""
    return not isinstance(probability, (int, float)) or probability > 0


def apply(gm: fx.GraphModule, plan: BudgetPlan | str | None) -> None:
    """Carry ``plan``'s block tags onto ``gm`` before it compiles (the setting is patched around the call)."""
    if isinstance(plan, BudgetPlan):
        tag_blocks(gm, plan.recomputed_blocks)


@dataclasses.dataclass(frozen=True)
class _Priced:
    peak: int
    flops: int
    cost: CompiledCost


def _price(
    gm: fx.GraphModule, example_inputs: Sequence[Any], device: str | None, setting: float, names: Sequence[str]
) -> _Priced:
    """The graph's simulated peak and FLOPs when the blocks ``names`` are recomputed and AOTAutograd partitions
    it under ``activation_memory_budget=setting``."""
    module = gm
    if names:
        module = fx.GraphModule(gm, copy_graph(gm.graph))
        tag_blocks(module, names)
    with partitioned_under(setting):
        cost = compiled_cost(module, list(example_inputs), device)
    return _Priced(graph_peak(cost), shapes.hint(cost.forward_flops) + shapes.hint(cost.backward_flops), cost)


# The settings tried first; the search then bisects between the largest that meets the budget and the next above.
GRID = (1.0, 0.75, 0.5, 0.25, 0.0)
# Where the graph has blocks to recompute, the settings below 0.5 recompute GEMM outputs across the whole graph at
# once, and block recomputation does better at fewer FLOPs: they are not tried, and the setting is bisected more
# coarsely (each step simulates the whole graph again; the Llama-3.2-1B shape's took 20-30 s on 2 cores).
GRID_WITH_BLOCKS = (1.0, 0.5)
RESOLUTION_WITH_BLOCKS = 1 / 8


def search(
    peak_at: Callable[[float], int], budget: int, resolution: float = RESOLUTION, grid: Sequence[float] = GRID,
) -> tuple[float, int, bool]:
    """The setting to compile under, its simulated peak, and whether that meets ``budget``: the largest setting
    in [0, 1] found within the budget (fewest activations recomputed), else the one with the lowest peak.

    The peak does not always fall with the setting: recomputing every activation can bring them all back at once
    at the start of the backward (a small MLP's simulated peak at 0.0 was its peak at 1.0, at 0.5 0.73× it). So
    the settings of ``grid`` are tried first, then the interval above the largest one within the budget is
    bisected to ``resolution``."""
    peaks = {setting: peak_at(setting) for setting in grid}
    within = [setting for setting in grid if peaks[setting] <= budget]
    if not within:
        lowest = min(grid, key=lambda setting: (peaks[setting], -setting))
        return lowest, peaks[lowest], False
    low = max(within)
    high = min((setting for setting in grid if setting > low), default=low)
    while high - low > resolution:
        middle = (low + high) / 2
        peaks[middle] = peak_at(middle)
        low, high = (middle, high) if peaks[middle] <= budget else (low, middle)
    return low, peaks[low], True


def fewest_blocks(peak_of: Callable[[int], int], count: int, before: int, budget: int) -> int | None:
    """The fewest of ``count`` blocks whose recomputation brings the peak (``peak_of(k)``, ``peak_of(0)`` being
    ``before``) within ``budget``; None where all of them do not. Each recomputed block frees about the same
    bytes, so the count is interpolated from all of them, then stepped to where k meets it and k - 1 does not."""
    every = peak_of(count)
    if every > budget:
        return None
    freed = max(before - every, 1)
    blocks_needed = min(max(math.ceil(count * (before - budget) / freed), 1), count)
    while True:
        if peak_of(blocks_needed) <= budget:
            if blocks_needed == 1 or peak_of(blocks_needed - 1) > budget:
                return blocks_needed
            blocks_needed -= 1
        else:
            blocks_needed += 1


def plan(
    original: fx.GraphModule, rewritten: fx.GraphModule, example_inputs: Sequence[Any], requested: int | float,
    device: str | None = None,
) -> BudgetPlan:
    """Price the graph as torch.compile and as memopt compile it; where memopt's simulated peak is over the
    budget, find the recomputation that brings it within at the fewest recomputed FLOPs, or the lowest peak
    recomputation reaches."""
    baseline = _price(original, example_inputs, device, 1.0, ())
    torch_compile = baseline.peak
    budget = int(requested * torch_compile) if isinstance(requested, float) else requested
    priced: dict[tuple[float, tuple[str, ...]], _Priced] = {}

    def price(setting: float, names: Sequence[str] = ()) -> _Priced:
        key = (setting, tuple(names))
        if key not in priced:
            priced[key] = _price(rewritten, example_inputs, device, setting, names)
        return priced[key]

    start = price(1.0)
    before = start.peak
    found = [] if checkpoint.regions(rewritten) else list(_candidates(rewritten.graph))
    count = len(found) if found != [WHOLE_GRAPH] else 0

    def done(key: tuple[float, tuple[str, ...]], met: bool, reason: str) -> BudgetPlan:
        setting, names = key
        return BudgetPlan(
            requested, budget, torch_compile, before, priced[key].peak, None if setting == 1.0 else setting, met,
            reason, names, count, max(priced[key].flops - start.flops, 0), start.flops,
            costs={"torch.compile": baseline.cost, "memopt": priced[key].cost},
        )

    if before <= budget:
        return done((1.0, ()), True, "the exact rewrites meet it")
    met: list[tuple[float, tuple[str, ...]]] = []
    knapsack = not any(draws_randomly(node) and not _samples_rows(node) for node in rewritten.graph.nodes)
    note = "" if knapsack else RANDOM_NOTE
    if knapsack:
        grid, resolution = (GRID_WITH_BLOCKS, RESOLUTION_WITH_BLOCKS) if count else (GRID, RESOLUTION)
        setting, _, within = search(lambda value: price(value).peak, budget, resolution, grid)
        if within:
            met.append((setting, ()))
    if found:
        fewest = fewest_blocks(lambda k: price(1.0, found[:k]).peak, len(found), before, budget)
        if fewest is not None:
            met.append((1.0, tuple(found[:fewest])))
        elif knapsack:  # every block recomputed and the knapsack on what is left
            for value in GRID[2:]:
                price(value, found)
    if met:
        best = min(met, key=lambda key: (priced[key].flops, -priced[key].peak))
        how = "block recomputation" if best[1] else "the partitioner's knapsack"
        return done(best, True, f"met by {how}{note}")
    lowest = min(priced, key=lambda key: (priced[key].peak, priced[key].flops))
    if priced[lowest].peak >= before:
        return done((1.0, ()), False, (
            f"not met: recomputation does not lower the simulated peak ({_mib(before - budget)} over); nothing "
            f"added{note}"))
    return done(lowest, False, (
        f"not met: the lowest peak recomputation reaches is {_mib(priced[lowest].peak)}, "
        f"{_mib(priced[lowest].peak - budget)} over; compiled with that{note}"))


def with_wta_crs(sampled: BudgetPlan, exact: BudgetPlan, records: Sequence[Any]) -> BudgetPlan:
    """The plan of the graph with WTA-CRS linears, told against the exact graph's: its ``before`` is the exact
    rewrites' peak, and it names the linears sampled and the lowest peak the exact measures reached."""
    linears = sum(1 for record in records if record.rule == "wta_crs" and record.applied)
    how = "met with WTA-CRS" if sampled.met else sampled.reason
    return dataclasses.replace(
        sampled, before=exact.before, wta_crs_linears=linears, exact_after=exact.after, reason=how,
        torch_compile=exact.torch_compile,
    )


def plan_or_note(
    original: fx.GraphModule, rewritten: fx.GraphModule, example_inputs: Sequence[Any], requested: int | float,
    device: str | None, strict: bool,
) -> BudgetPlan | str:
    """``plan``, or why none was made: a graph the simulation cannot take keeps torch.compile's partition (a
    budget is a wish, never a reason to fail the user's compile; ``strict`` raises)."""
    try:
        return plan(original, rewritten, example_inputs, requested, device)
    except Exception as error:
        if strict:
            raise
        log.debug("memopt could not plan the memory budget", exc_info=True)
        return f"memory budget not planned: the graph could not be simulated ({error_note(error)})"
