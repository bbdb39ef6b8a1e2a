"""Run every enabled rule over one graph: match, decide, apply, and record each decision.

A rule that raises leaves the graph as it was before that rule, records why and warns once (``strict``
re-raises); the user's model must never break because a rewrite failed.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Sequence
from typing import Any

import torch.fx as fx

import lowerings  # noqa: F401  (registers torch.ops.memopt.*, which rewritten graphs call)
from fxpass import checkpoint, pricing, shapes
from fxpass.config import Config
from fxpass.graph import GraphFacts, canonicalize_operator_methods, copy_graph, source_location
from fxpass.notes import error_note
from fxpass.report import GraphReport, RewriteRecord, current_graph_id, graph_code
from fxpass.rules import RULES, Decision, Rule
from fxpass.rules.base import decide_against_compile

log = logging.getLogger(__name__)
_WARNED: set[tuple[str, str]] = set()


class RewriteFailedWarning(UserWarning):
    """A rule raised, or the rewritten graph failed to compile; memopt left the graph as it was."""


def rewrite_graph(
    gm: fx.GraphModule, config: Config, keep_code: bool = False, example_inputs: Sequence[Any] = ()
) -> GraphReport:
    """Rewrite ``gm`` in place with every enabled rule; return what was decided.

    ``example_inputs`` (the backend's real inputs) let rules read constant buffers such as a causal mask.
    """
    report = GraphReport(current_graph_id(), [], before=graph_code(gm) if keep_code else None)
    canonicalize_operator_methods(gm.graph)
    for rule in RULES:
        if config.rule_enabled(rule.name):
            report.records.extend(_run_rule(rule, gm, config, example_inputs))
    for region in checkpoint.regions(gm, example_inputs):
        canonicalize_operator_methods(region.body.graph)
        for rule in RULES:
            if config.rule_enabled(rule.name):
                report.records.extend(_run_rule(rule, region.body, config, region.example_inputs, region))
        region.body.recompile()
    gm.recompile()
    if keep_code:
        report.after = graph_code(gm)
    return report


def _run_rule(
    rule: Rule,
    gm: fx.GraphModule,
    config: Config,
    example_inputs: Sequence[Any],
    region: checkpoint.Region | None = None,
) -> list[RewriteRecord]:
    """Match, decide and apply one rule on ``gm`` (a checkpointed ``region``'s body when one is given)."""
    saved_graph = copy_graph(gm.graph)
    records: list[RewriteRecord] = []
    try:
        for candidate in rule.match(GraphFacts(gm, example_inputs)):
            decision = rule.decide(candidate, config)
            if region is None:
                decision = _against_compile(rule, candidate, decision, config)
            else:
                decision = checkpoint.decide_in_region(rule.name, decision, region)
            if decision.apply and rule.weigh is not None and not config.force:
                decision = rule.weigh(candidate, decision, config)
            records.append(_record(rule.name, candidate, decision, config, region, rule.priced_on))
            if decision.apply:
                rule.apply(gm, candidate, decision.config or config)
        gm.graph.lint()
    except Exception as error:
        if config.strict:
            raise
        gm.graph = saved_graph
        reason = f"rule failed and was skipped: {type(error).__name__}: {error}"
        warn_once(rule.name, reason)
        log.debug("memopt rule %s failed", rule.name, exc_info=True)
        records = [undone(r, "undone: the rule failed later on this graph") for r in records]
        params = {"checkpointed_region": region.name} if region is not None else {}
        records.append(RewriteRecord(rule.name, False, reason, (), None, None, None, None, params))
    return records


def undone(record: RewriteRecord, reason: str) -> RewriteRecord:
    """``record`` marked as not applied after all, with why."""
    if not record.applied:
        return record
    return dataclasses.replace(record, applied=False, reason=reason)


# Rules whose pieces are priced against torch.compile (all of them: WTA-CRS with the producers of its input as
# context, since whether torch.compile keeps that input or recomputes it from theirs decides what sampling frees).
PRICED_RULES = ("cce", "attention", "wta_crs", "embedding")


def _against_compile(rule: Rule, candidate, decision: Decision, config: Config) -> Decision:
    """``decision`` taken again on what the rewrite frees against torch.compile (``fxpass.pricing``), where it
    was taken on a memory model (not declined outright) and pricing is on; the graph-as-written figure is kept
    in the record. Where the rule weighs variants (``Rule.choose``), each is priced and the chosen one decided
    and applied. A piece that cannot be priced keeps the decision as it was, with why."""
    if config.pricing != "compile" or rule.name not in PRICED_RULES or not decision.what:
        return decision  # (``what`` is set where the decision was taken on the memory model alone)
    trials: dict[Config, tuple[Decision, pricing.Priced]] = {}

    def priced_under(trial: Config) -> tuple[Decision, pricing.Priced]:
        if trial not in trials:
            taken = decision if trial == config else rule.decide(candidate, trial)
            context = rule.context(candidate) if rule.context is not None else ()
            trials[trial] = taken, pricing.price(rule, candidate, trial, context)
        return trials[trial]

    try:
        choice = rule.choose(candidate, config, priced_under) if rule.choose is not None else None
        chosen, why = choice if choice is not None else (config, "")
        taken, priced = priced_under(chosen)
    except Exception as error:  # a piece the partitioner cannot take: the rewrite itself is not at fault
        log.debug("memopt could not price %s against torch.compile", rule.name, exc_info=True)
        note = f"priced as the graph is written (against torch.compile: {error_note(error)})"
        return dataclasses.replace(decision, reason=f"{decision.reason}; {note}")
    if choice is not None:
        taken = dataclasses.replace(taken, config=chosen, params={**taken.params, "variant_reason": why})
    return decide_against_compile(taken, priced, config, rule.priced_on)


def _record(
    rule: str, candidate, decision: Decision, config: Config, region: checkpoint.Region | None = None,
    figure: str = "peak",
) -> RewriteRecord:
    memory, verdict = decision.memory, decision.verdict
    params = {**candidate.params(), **decision.params}
    if region is not None:  # the saving is a transient peak of that region (fxpass/checkpoint.py)
        params["checkpointed_region"] = region.name
    if config.assume_device is not None:  # the decision was taken for that device's implementation
        params["assume_device"] = config.assume_device
    priced = decision.priced
    if priced is not None:
        saved_bytes = shapes.render(getattr(priced, figure))
    else:
        saved_bytes = shapes.render(memory.saved) if memory is not None else None
    return RewriteRecord(
        rule=rule,
        applied=decision.apply,
        reason=decision.reason,
        nodes=tuple(node.name for node in candidate.nodes),
        source=source_location(candidate.anchor),
        saved_bytes=saved_bytes,
        saved_bytes_hint=verdict.saved_hint if verdict is not None else None,
        proof=verdict.proof if verdict is not None else None,
        params=params,
        memory=memory.describe() if memory is not None else None,
        against_compile=priced.describe() if priced is not None else None,
    )


def warn_once(rule: str, reason: str) -> None:
    if (rule, reason) in _WARNED:
        return
    _WARNED.add((rule, reason))
    warnings.warn(f"memopt: {rule}: {reason}", RewriteFailedWarning, stacklevel=2)
