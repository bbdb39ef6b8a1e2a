"""The ``torch.compile`` backend: rewrite Dynamo's graph before AOTAutograd, then compile it.

The rewrite must happen before AOTAutograd because two of memopt's rewrites change what autograd saves for
backward; after AOTAutograd the saved set is fixed. ``torch.compile(model, backend="memopt")`` finds this
module through the ``torch_dynamo_backends`` entry point; nothing here registers the name in code (doing
both raises "duplicate name" in Dynamo's registry).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.fx as fx

from fxpass import budget, checkpoint, returned_logits
from fxpass.cache import SOURCE_KEYED_PASS, cacheable_functions
from fxpass.compiled_cost import partitioned_under, step_costs
from fxpass.config import Config, ConfigError
from fxpass.graph import copy_graph
from fxpass.notes import error_note
from fxpass.report import GraphReport, RewriteRecord, publish, tracing_enabled
from fxpass.rewrite import rewrite_graph, undone, warn_once
from fxpass.rules.wta_crs import HOW_TO_ENABLE
from lowerings import precompile

log = logging.getLogger(__name__)


def dynamo_control_flow() -> tuple[type[BaseException], ...]:
    """Exceptions by which Dynamo steers its own tracing, not failures: they must reach Dynamo untouched.

    ``RestartAnalysis`` and its subclasses ask Dynamo to trace the frame again (Inductor's scalar-tensorify
    pass raises ``TensorifyScalarRestartAnalysis`` from inside AOTAutograd after specializing a float input);
    ``SkipFrame`` asks it to run the frame eagerly. Catching them as compile failures would compile this
    attempt's graph without rewrites, and the retraced graph would never reach the backend. Every other
    exception, ``Unsupported`` and ``BackendCompilerFailed`` included, may come from a rewrite and falls back.
    """
    from torch._dynamo.exc import RestartAnalysis, SkipFrame

    return (RestartAnalysis, SkipFrame)


def split_options(options: Mapping[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Separate memopt's keys from Inductor config keys; reject keys that are neither."""
    from torch._inductor import config as inductor_config

    inductor_keys = set(inductor_config.get_config_copy())
    ours, inductor = {}, {}
    for key, value in (options or {}).items():
        if key in Config.option_names():
            ours[key] = value
        elif key.replace("-", "_") in inductor_keys:
            inductor[key] = value
        else:
            close = difflib.get_close_matches(key, [*Config.option_names(), *inductor_keys], n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(
                f"unknown option {key!r}{hint} (memopt options: {', '.join(Config.option_names())}; "
                "other keys must be Inductor config names)"
            )
    return ours, inductor


class MemoptBackend:
    """One configured backend: ``MemoptBackend(options={...})`` is usable as ``torch.compile(backend=...)``.

    ``torch.compile`` accepts either ``mode=`` or ``options=``, not both; to combine a mode with memopt
    options, pass ``backend=MemoptBackend(mode="max-autotune", options={...})``.

    Args:
        mode: torch.compile's mode ("reduce-overhead", "max-autotune", ...), applied to Inductor.
        options: memopt keys (see ``Config``) and Inductor config keys, as in ``torch.compile(options=)``.
        sink: called with each graph's report (``fxpass.explain`` collects reports this way).
        keep_code: render the graph code before and after rewriting even without a debug dir or trace.
        price_steps: price each whole graph as torch.compile runs it, before and after the rewrites
            (``fxpass.compiled_cost``): what ``fxpass.explain`` prints as the step's saved bytes. It traces
            each graph twice more, so compiling for training leaves it off.
    """

    def __init__(
        self,
        mode: str | None = None,
        options: Mapping[str, Any] | None = None,
        *,
        sink: Callable[[GraphReport], None] | None = None,
        keep_code: bool = False,
        price_steps: bool = False,
    ) -> None:
        memopt_options, self.inductor_options = split_options(options)
        self.price_steps = price_steps
        self.config = Config.from_options(memopt_options)
        self.mode = mode
        self.sink = sink
        self.keep_code = keep_code
        self._inductor = None

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable:
        keep_code = self.keep_code or bool(self.config.debug_dir) or tracing_enabled()
        original = copy_graph(gm.graph)
        bodies = {region.name: copy_graph(region.body.graph) for region in checkpoint.regions(gm)}
        gm.meta[returned_logits.WRAPPED_KEY] = True  # this backend re-attaches returned logits (returned_logits.py)
        if self.config.memory_budget is not None:
            report = self._fit(gm, original, example_inputs, keep_code, bodies)
        else:
            report = rewrite_graph(gm, self.config, keep_code=keep_code, example_inputs=example_inputs)
        if self.price_steps and isinstance(report.budget, budget.BudgetPlan):
            report.step = report.budget.costs  # priced as the plan compiles it, by the plan's own search
        elif self.price_steps:
            report.step = step_costs(
                fx.GraphModule(gm, copy_graph(original)), gm, self.config.assume_device, _setting(report)
            )
        if report.applied and self.config.precompile:  # opaque ops' kernels compile while Inductor compiles
            precompile.start(gm)
        superseded = False
        try:
            compiled = self._compile_or_fall_back(gm, original, report, example_inputs, bodies)
            extra = returned_logits.output_count(gm.graph) - returned_logits.output_count(original)
            return returned_logits.attach(compiled, returned_logits.returned_logits(gm.graph), extra)
        except dynamo_control_flow() as signal:
            # Dynamo traces the frame again (or runs it eagerly): this graph is never run, and the next attempt
            # gets its own report, so this one is not published (counters would count its rewrites twice).
            superseded = True
            log.debug("memopt: Dynamo %s; this graph's report is dropped", type(signal).__name__)
            raise
        finally:
            if not superseded:
                self._publish(report, gm)

    def _fit(
        self, gm: fx.GraphModule, original: fx.Graph, example_inputs: list[Any], keep_code: bool,
        bodies: Mapping[str, fx.Graph],
    ) -> GraphReport:
        """Rewrite ``gm`` and plan its memory budget (``fxpass.budget``). Where the user opted into WTA-CRS
        (``wta_crs_budget``), its sampled weight gradients are a measure like recomputation: left out where the
        exact rewrites meet the budget alone; otherwise the graph with them is planned too, and taken where it
        meets the budget at fewer recomputed FLOPs than the exact graph (sampling costs no time), or reaches a lower
        peak where neither meets it. Graphs with checkpointed regions keep WTA-CRS as its option says (inside a
        region it declines anyway)."""
        config = self.config
        approximate = config.wta_crs_budget is not None and not bodies
        exact = dataclasses.replace(config, wta_crs_budget=None) if approximate else config
        report = self._rewrite_and_plan(gm, original, exact, example_inputs, keep_code)
        plan = report.budget
        if approximate and isinstance(plan, budget.BudgetPlan) and not (plan.met and not plan.measures):
            rewritten = gm.graph
            gm.graph = copy_graph(original)
            sampled = self._rewrite_and_plan(gm, original, config, example_inputs, keep_code)
            if _sampling_is_better(sampled, plan):
                sampled.budget = budget.with_wta_crs(sampled.budget, plan, sampled.records)
                budget.apply(gm, sampled.budget)
                return sampled
            gm.graph = rewritten  # the exact graph back, with its report and plan (no second rewrite or plan)
            gm.recompile()
        if approximate:
            met = isinstance(report.budget, budget.BudgetPlan) and report.budget.met
            report.records = [_not_needed(record, met) for record in report.records]
        budget.apply(gm, report.budget)
        return report

    def _rewrite_and_plan(
        self, gm: fx.GraphModule, original: fx.Graph, config: Config, example_inputs: list[Any], keep_code: bool
    ) -> GraphReport:
        report = rewrite_graph(gm, config, keep_code=keep_code, example_inputs=example_inputs)
        report.budget = budget.plan_or_note(
            fx.GraphModule(gm, copy_graph(original)), gm, example_inputs, config.memory_budget, config.assume_device,
            config.strict,
        )
        return report

    def _publish(self, report: GraphReport, gm: fx.GraphModule) -> None:
        if self.sink is not None:
            report.graph_module = gm
            self.sink(report)
        publish(report, self.config.debug_dir)

    def _compile_or_fall_back(
        self,
        gm: fx.GraphModule,
        original: fx.Graph,
        report: GraphReport,
        example_inputs: list[Any],
        bodies: Mapping[str, fx.Graph] | None = None,
    ) -> Callable:
        """Compile the rewritten graph; if that raises, compile the graph as Dynamo captured it and warn.

        A kernel that fails to build for this GPU, say, must not stop the user's training (``strict`` raises).
        Dynamo's control-flow exceptions (``dynamo_control_flow``) are no failure and pass through. Inductor
        compiles the backward at the first backward call, so a failure there is not caught here."""
        try:
            with _recomputation(report):
                return self._compile(gm, example_inputs)
        except dynamo_control_flow():
            raise
        except Exception as error:
            if self.config.strict or not report.applied:
                raise
            reason = f"compiling the rewritten graph failed ({error_note(error)}); compiled it without the rewrites"
            log.debug("memopt: compiling the rewritten graph failed", exc_info=True)
            warn_once("backend", reason)
            report.records = [undone(r, f"undone: {reason}") for r in report.records]
            gm.graph = original
            for name, graph in (bodies or {}).items():  # checkpointed regions' bodies were rewritten in place
                body = getattr(gm, name)
                body.graph = graph
                body.recompile()
            gm.recompile()
            budget.apply(gm, report.budget)
            with _recomputation(report):
                return self._compile(gm, example_inputs)

    def _compile(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable:
        inner = self.config.inner_compiler
        if inner == "eager":
            return gm.forward
        if inner == "aot_eager":
            from torch._dynamo.backends.registry import lookup_backend

            return lookup_backend("aot_eager")(gm, example_inputs)
        if self._inductor is None:
            # Inductor's own wrapper applies ``mode`` and validates config keys exactly as torch.compile does.
            self._inductor = torch._TorchCompileInductorWrapper(self.mode, self._inductor_patches(), dynamic=None)
        marked = cacheable_functions(gm)
        if not marked:
            return self._inductor(gm, example_inputs)
        from torch._inductor import config as inductor_config

        # memopt's own functions in the graph would make the AOTAutograd cache bypass it (fxpass/cache.py)
        with inductor_config.patch(
            unsafe_marked_cacheable_functions={**inductor_config.unsafe_marked_cacheable_functions, **marked}
        ):
            return self._inductor(gm, example_inputs)

    def _inductor_patches(self) -> dict[str, Any]:
        """The user's Inductor options, plus a cache key on memopt's sources unless that slot is taken."""
        from torch._inductor import config as inductor_config

        patches = dict(self.inductor_options)
        if "post_grad_custom_pre_pass" not in patches and inductor_config.post_grad_custom_pre_pass is None:
            patches["post_grad_custom_pre_pass"] = SOURCE_KEYED_PASS
        return patches

    def reset(self) -> None:
        """Called by ``torch._dynamo.reset()``: drop CUDA-graph trees recorded under reduce-overhead."""
        if self._inductor is not None:
            self._inductor.reset()


def _sampling_is_better(sampled: GraphReport, exact: budget.BudgetPlan) -> bool:
    """Whether the graph with WTA-CRS linears fits its budget better than the exact graph: it meets the budget
    at fewer recomputed FLOPs (or where the exact one does not), or neither meets it and it reaches lower."""
    plan = sampled.budget
    if not isinstance(plan, budget.BudgetPlan) or not any(r.rule == "wta_crs" and r.applied for r in sampled.records):
        return False
    if plan.met:
        return not exact.met or plan.added_flops < exact.added_flops
    return not exact.met and plan.after < exact.after


def _not_needed(record: RewriteRecord, met: bool) -> RewriteRecord:
    """A WTA-CRS record of the exact graph, saying why sampling was left out although the user opted in."""
    if record.rule != "wta_crs" or record.applied or not record.reason.startswith(HOW_TO_ENABLE):
        return record
    why = ("exact measures meet the memory budget at no more recomputation" if met
           else "the memory budget is not met, and sampling would not lower the simulated peak")
    return dataclasses.replace(record, reason=f"WTA-CRS opted in but not used: {why} (memory_budget decides)")


def _setting(report: GraphReport) -> float | None:
    """The ``activation_memory_budget`` the graph's budget plan compiles it under, if any."""
    plan = report.budget
    return plan.activation_memory_budget if isinstance(plan, budget.BudgetPlan) else None


def _recomputation(report: GraphReport) -> contextlib.AbstractContextManager:
    """The budget plan's recomputation while the graph compiles (AOTAutograd partitions inside the call)."""
    return partitioned_under(_setting(report))


def memopt_backend(
    gm: fx.GraphModule, example_inputs: list[Any], mode: str | None = None, options: Mapping[str, Any] | None = None
) -> Callable:
    """``torch.compile(model, backend=memopt_backend, mode=..., options={...})`` or ``backend="memopt"``."""
    return MemoptBackend(mode, options)(gm, example_inputs)


def memopt_wta_backend(
    gm: fx.GraphModule, example_inputs: list[Any], mode: str | None = None, options: Mapping[str, Any] | None = None
) -> Callable:
    """``backend="memopt_wta"``: memopt with WTA-CRS linears on at budget 0.3, for string-only users."""
    from fxpass.rules.wta_crs import DEFAULT_BUDGET

    return MemoptBackend(mode, {"wta_crs_budget": DEFAULT_BUDGET, **(options or {})})(gm, example_inputs)


def _reset() -> None:
    """Called by ``torch._dynamo.reset()``; the function form cannot know the mode, so reset when CUDA is up."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        from torch._inductor.cudagraph_trees import reset_cudagraph_trees

        reset_cudagraph_trees()


memopt_backend.reset = _reset  # type: ignore[attr-defined]
memopt_wta_backend.reset = _reset  # type: ignore[attr-defined]
