"""What the backend decided and why: records, logging, tlparse artifacts and the debug dump.

Every candidate a rule looked at produces one ``RewriteRecord``, applied or not. The records of one compiled
graph form a ``GraphReport``. They reach users through four doors: the ``fxpass`` logger
(``TORCH_LOGS=+fxpass``), ``torch._logging.trace_structured`` artifacts (tlparse, ``TORCH_TRACE=dir``), the
debug directory (``MEMOPT_DEBUG_DIR`` or ``options={"debug_dir": ...}``) and the Python API (``fxpass.reports()``,
``fxpass.explain``).
"""

from __future__ import annotations

import collections
import dataclasses
import difflib
import itertools
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

from fxpass import shapes
from fxpass.notes import INTERNAL, Holding
from fxpass.shapes import format_bytes

log = logging.getLogger(__name__)

SCHEMA_VERSION = 2  # 2: saved_bytes is what a rewrite frees against torch.compile where against_compile is set
_HISTORY: collections.deque[GraphReport] = collections.deque(maxlen=64)
_GRAPH_COUNTER = itertools.count()


@dataclasses.dataclass(frozen=True)
class RewriteRecord:
    """One candidate and the decision on it. The JSON schema of ``report.json`` (docs/usage.md)."""

    rule: str
    applied: bool
    reason: str
    nodes: tuple[str, ...]
    source: str | None
    saved_bytes: str | None
    saved_bytes_hint: int | None
    proof: str | None
    params: dict[str, Any]
    memory: dict[str, dict[str, str]] | None = None  # the memory model of the graph as written (eager's)
    against_compile: dict[str, Any] | None = None  # fxpass.pricing.Priced.describe(): saved_bytes' source

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"nodes": list(self.nodes)}


def _both(figures: dict[str, int]) -> str:
    """torch.compile's and memopt's figures, as the step summary prints them."""
    return f"{format_bytes(figures['torch.compile'])} and {format_bytes(figures['memopt'])}"


@dataclasses.dataclass
class GraphReport:
    """The records of one compiled graph, with its code before and after the rewrites when kept."""

    graph_id: str
    records: list[RewriteRecord]
    before: str | None = None
    after: str | None = None
    graph_module: fx.GraphModule | None = dataclasses.field(default=None, repr=False)
    # the whole graph priced as torch.compile runs it, as captured and as rewritten (fxpass.compiled_cost's
    # step_costs), where the backend was asked to (fxpass.explain)
    step: dict[str, Any] | None = dataclasses.field(default=None, repr=False)
    # the memory budget's plan (fxpass.budget.BudgetPlan: str() summarizes, to_json()), or a note saying why none
    # was made, where a budget was asked for
    budget: Any = None

    def step_summary(self) -> str | None:
        """The graph's saved-for-backward bytes and peak under torch.compile and under memopt, one line."""
        if self.step is None:
            return None
        if "error" in self.step:
            return f"whole graph not priced: {self.step['error']}"
        held, loss_only = (_both(self.peaks(held)) for held in (True, False))
        # a graph that returns only its loss differs by the loss's own bytes: nothing to tell
        dropped = "" if loss_only == held else (
            f" ({loss_only} where the caller keeps only the loss, not the returned logits, through the backward)"
        )
        saved = {name: cost.hints()["saved"] for name, cost in self.step.items()}
        return (
            f"saved for the backward: {format_bytes(saved['torch.compile'])} under torch.compile, "
            f"{format_bytes(saved['memopt'])} under memopt; the graph's own peak beyond its inputs: {held}"
            f"{dropped}\n{self.at_peak('memopt')}"
        )

    def peaks(self, returned_held: bool = True) -> dict[str, int] | None:
        """The graph's simulated peak beyond its inputs (hints), forward or backward, under torch.compile and
        under memopt (``_phases``). ``returned_held``: whether the caller holds what the graph returns through the
        backward (``out = model(...); out.loss.backward()``), or lets it go after the forward (``loss =
        model(...).loss``). torch.compile's returned logits are the ones it saves, so only memopt's peak can
        differ: its CCE ops return logits they do not save."""
        if self.step is None or "error" in self.step:
            return None
        return {name: max(phase[0] for phase in self._phases(name, returned_held))
                for name in ("torch.compile", "memopt")}

    def _phases(self, name: str, returned_held: bool = True) -> list[tuple[int, str, list[Holding]]]:
        """The candidates for ``name``'s peak: (bytes, where, what holds them). The tensors the graph returns (a
        model's logits) are alive at the forward's end, and through the backward where the caller holds them
        (``returned_held``). What memopt's ops allocate inside their kernels is charged at each op's own node
        (``compiled_cost._workspace``)."""
        cost = self.step[name]
        hints = cost.hints()
        returned = shapes.hint(cost.returned) if returned_held else 0
        given = [Holding("returned to the caller", returned, cost.returned_largest)] if returned else []
        return [
            (hints["forward_peak"], "forward", list(cost.forward_holders)),
            (hints["backward_peak"] + returned, "backward", [*cost.backward_holders, *given]),
        ]

    def at_peak(self, name: str) -> str | None:
        """Where ``name``'s ("torch.compile" or "memopt") simulated peak is and what holds it, one line: names
        what sets a step's peak, and so what no rewrite reached."""
        if self.step is None or "error" in self.step:
            return None
        _, where, holders = max(self._phases(name), key=lambda phase: phase[0])
        holders = sorted(holders, key=lambda h: -h.bytes)
        return f"{name}'s peak is in the {where}: {'; '.join(map(str, holders)) or 'nothing'}"

    @property
    def applied(self) -> list[RewriteRecord]:
        return [r for r in self.records if r.applied]

    @property
    def saved_bytes_hint(self) -> int:
        """Saved tensors add up; checkpointed regions' transient peaks come one region at a time (the largest)."""
        regions = [r.saved_bytes_hint or 0 for r in self.applied if "checkpointed_region" in r.params]
        saved = sum(r.saved_bytes_hint or 0 for r in self.applied if "checkpointed_region" not in r.params)
        return saved + max(regions, default=0)

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA_VERSION,
            "graph": self.graph_id,
            "torch": torch.__version__,
            "rewrites": [r.to_json() for r in self.records],
            **({} if self.budget is None else {"budget": _budget_json(self.budget)}),
        }

    def table(self) -> str:
        """A markdown table of the decisions; records with the same rule, outcome and reason share a row."""
        lines = [
            "| rule | applied | where | frees vs torch.compile (hint) | proof | reason |",
            "|---|---|---|---|---|---|",
        ]
        for group in _grouped(self.records):
            r = group[0]
            saved = format_bytes(sum(g.saved_bytes_hint or 0 for g in group)) if r.saved_bytes_hint is not None else "-"
            where = _short_source(r.source) + (f" (+{len(group) - 1} more)" if len(group) > 1 else "")
            lines.append(
                f"| {r.rule} | {'yes' if r.applied else 'no'} | {where} | {saved} | {r.proof or '-'} | {r.reason} |"
            )
        return "\n".join(lines)

    def summary(self) -> str:
        applied = self.applied
        head = (
            f"memopt graph {self.graph_id}: {len(applied)} of {len(self.records)} candidates rewritten, "
            f"about {format_bytes(self.saved_bytes_hint)} saved at the example shapes"
        )
        step = self.step_summary()
        head = head + (f"\n{step}" if step else "")
        if self.budget is not None:
            head += f"\n{self.budget}"
        return head + ("\n\n" + self.table() if self.records else "")

    def to_markdown(self) -> str:
        parts = [f"# memopt report: graph {self.graph_id}", "", self.summary(), ""]
        for index, r in enumerate(self.records):
            parts += [f"## {index}. {r.rule}: {'applied' if r.applied else 'declined'}", "", f"- reason: {r.reason}"]
            parts += [f"- source: `{r.source}`", f"- nodes: {', '.join(r.nodes)}"]
            if r.saved_bytes is not None:
                against = "against torch.compile" if r.against_compile is not None else "against the graph as written"
                parts.append(
                    f"- frees {against}: `{r.saved_bytes}` (= {r.saved_bytes_hint} at the hint, {r.proof})"
                )
            if r.against_compile is not None:
                c = r.against_compile
                parts.append(f"  - saved for the backward: `{c['saved']}`; transient: `{c['transient']}`")
                parts.append(f"  - torch.compile keeps: {', '.join(c['torch.compile keeps']) or 'nothing'}")
                parts.append(f"  - memopt keeps: {', '.join(c['memopt keeps']) or 'nothing'}")
                parts.append(f"  - {INTERNAL}: `{c[INTERNAL]}`")
            if r.memory:
                parts.append("- the graph as written (eager's accounting):")
            for side in ("before", "after"):
                for name, value in (r.memory or {}).get(side, {}).items():
                    parts.append(f"  - {side}: {name}: `{value}`")
            parts += [f"- params: `{json.dumps(r.params, default=str)}`", ""]
        if self.before is not None and self.after is not None:
            diff = difflib.unified_diff(
                self.before.splitlines(), self.after.splitlines(), "before.py", "after.py", lineterm="", n=2
            )
            parts += ["## graph diff", "", "```diff", *diff, "```", ""]
        return "\n".join(parts)


def _grouped(records: list[RewriteRecord]) -> list[list[RewriteRecord]]:
    groups: dict[tuple[str, bool, str], list[RewriteRecord]] = {}
    for record in records:
        groups.setdefault((record.rule, record.applied, record.reason), []).append(record)
    return list(groups.values())


def _short_source(source: str | None) -> str:
    if not source:
        return "-"
    file, _, line = source.rpartition(":")
    return f"{Path(file).name}:{line}"


def current_graph_id() -> str:
    """Dynamo's compile id ("frame/attempt") when compiling, else a process-wide counter.

    Dynamo's DDP optimizer calls the backend once per gradient bucket's piece of one captured graph, all under
    one compile id: the second piece on is "id.2", "id.3", …, so that reports keyed by id keep every piece."""
    try:
        from torch._guards import CompileContext

        context = CompileContext.try_get()
        compile_id = context.compile_id if context is not None else None
    except Exception:  # pragma: no cover - private API moved
        context = compile_id = None
    if compile_id is None:
        return f"g{next(_GRAPH_COUNTER)}"
    # counted on the context itself: after torch._dynamo.reset() a new compile may reuse an old id's text
    piece = getattr(context, "_memopt_pieces", 0) + 1
    try:
        context._memopt_pieces = piece
    except AttributeError:  # pragma: no cover - a context that takes no attributes: ids as Dynamo gives them
        return str(compile_id)
    return str(compile_id) if piece == 1 else f"{compile_id}.{piece}"


def graph_code(gm: fx.GraphModule) -> str:
    return gm.print_readable(print_output=False, include_stride=False, include_device=True)


def tracing_enabled() -> bool:
    """Whether tlparse structured tracing (TORCH_TRACE) is on, so graph code is worth rendering.

    torch always installs a lazy trace handler (it removes itself on first use when there is no trace
    directory), and test runners add their own handlers, so handlers alone prove nothing: tracing is on when
    torch's handler has a directory or the trace variables are set.
    """
    if os.environ.get("TORCH_TRACE") or os.environ.get("TORCH_DTRACE"):
        return True
    try:
        from torch._logging import _internal
    except ImportError:  # pragma: no cover - private API moved
        return False
    handler = getattr(_internal, "LOG_TRACE_HANDLER", None)
    return handler in _internal.trace_log.handlers and getattr(handler, "root_dir", None) is not None


def _budget_json(budget: Any) -> dict[str, Any]:
    return budget.to_json() if hasattr(budget, "to_json") else {"note": str(budget)}


def publish(report: GraphReport, debug_dir: str | None) -> None:
    """Send a report through every door: logger, counters, tlparse, debug dir and the in-process history."""
    _HISTORY.append(report)
    counters = torch._dynamo.utils.counters["memopt"]
    for r in report.records:
        counters[f"{r.rule}_{'applied' if r.applied else 'declined'}"] += 1
        log.debug("%s %s at %s: %s", r.rule, "applied" if r.applied else "declined", r.source, r.reason)
    if report.records:
        log.info("%s", report.summary())
    torch._logging.trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": "memopt_report", "encoding": "json"},
        payload_fn=lambda: json.dumps(report.to_json(), default=str),
    )
    if report.after is not None:
        torch._logging.trace_structured(
            "artifact",
            metadata_fn=lambda: {"name": "memopt_after_rewrite", "encoding": "string"},
            payload_fn=lambda: report.after,
        )
    if debug_dir:
        write_debug_dir(report, Path(debug_dir))


def write_debug_dir(report: GraphReport, root: Path) -> Path:
    """Write before.py, after.py, report.json and report.md for one graph; return its folder."""
    folder = _fresh_folder(root, "graph_" + re.sub(r"[^0-9A-Za-z]+", "_", report.graph_id))
    if report.before is not None:
        (folder / "before.py").write_text(report.before)
    if report.after is not None:
        (folder / "after.py").write_text(report.after)
    (folder / "report.json").write_text(json.dumps(report.to_json(), indent=2, default=str) + "\n")
    (folder / "report.md").write_text(report.to_markdown())
    log.info("memopt debug dump for graph %s written to %s", report.graph_id, folder)
    return folder


def _fresh_folder(root: Path, name: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for suffix in itertools.count():
        folder = root / (name if suffix == 0 else f"{name}.{suffix}")
        try:
            folder.mkdir()
            return folder
        except FileExistsError:
            continue
    raise AssertionError("unreachable")


def reports() -> list[GraphReport]:
    """Reports of the graphs memopt compiled in this process, oldest first (the last 64)."""
    return list(_HISTORY)


def clear_reports() -> None:
    _HISTORY.clear()
