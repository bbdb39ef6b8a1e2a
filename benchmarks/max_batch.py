"""The largest batch that runs under a memory cap, and the tokens/s at it, per way of compiling a training step.

    python benchmarks/max_batch.py --models llama-1b --flows loss_only --caps 40 --out $OUT/max_batch
    python benchmarks/max_batch.py --models gpt2,llama-1b --flows loss_only,whole_model --caps 40,card \\
        --configs torch.compile,torch.compile+checkpointing,torch.compile+budget0.5,liger,memopt,memopt+wta
    python benchmarks/max_batch.py --tiny --device cpu --inner aot_eager --configs torch.compile,memopt \\
        --memopt-options '{"force": true}'                                  # a smoke run of the script itself

People pick a batch size by what fits. This finds, for each configuration, the largest integer batch whose
training step runs under a cap on the CUDA allocator (``torch.cuda.set_per_process_memory_fraction``: a number of
GiB, or ``card`` for the whole card), at the model's own sequence length (GPT-2 1024, the Llama-3.2-1B shape 2048),
and times the step there. The step is ``benchmarks/e2e.py``'s: its models (built from configs, no download), its
batches and its forward + backward (no optimizer), with bf16 weights by default (``--precision``), SDPA attention,
the flows ``loss_only`` and ``whole_model``.

**Trials.** One configuration at one batch size is a trial, and each runs in a fresh subprocess
(``python -m benchmarks.max_batch --trial SPEC``): an out-of-memory step leaves the allocator fragmented and
compiled state behind, which would lower every later trial's ceiling. The trial sets the cap, builds the model on
the device, compiles at static shapes, runs two warm-up steps (the first compiles) and ``--steps`` timed ones, and
prints one JSON line: whether it fit, the peak (``max_memory_allocated``, weights and gradients included) over the
timed steps and over the whole trial, the median step time, tokens/s, and the out-of-memory message if it failed.

**Search.** Each trial compiles, so the search is frugal: trials at two small batches (``--probes``, per model by
default) fit the line peak ≈ a + b·batch through the whole-trial peaks, the line predicts the largest batch under
the cap, and that batch is tried; then its neighbour, one up after a success (or further, where the line refitted
through the two largest batches that ran predicts more) and one down after a failure, until a batch that runs sits
next to one that does not. ``--max-trials`` (5) caps the trials of one configuration; a row that hit it says so,
and so does one stopped by ``--time-limit``, which starts no trial that the longest one so far would carry past it.
``--parallel-probes N`` runs the probes of all configurations of a model, flow and cap N at a time on the one GPU
first (compiling is mostly CPU work, and small batches leave room for several): their peaks are each process's own,
their times are not, and a probe that ran out of memory there is run again alone. Every later trial runs alone.
A search usually takes four trials, and each compiles afresh: the Llama-3.2-1B shape's first call took 28-42 s in
``benchmarks/e2e.py`` (its ``first call s`` column), so plan a few minutes of GPU time per configuration.

**Configurations** are data (``CONFIGURATIONS``): a compiler ("torch.compile", "memopt", or "eager" for none),
memopt options, AOTAutograd's ``activation_memory_budget`` (patched through ``torch._functorch.config.patch`` around
the step's calls, as ``benchmarks/wta_crs.py`` does: it is read when the first call compiles), HF's per-layer
gradient checkpointing (``e2e.build_model(checkpointing=True)``) and Liger's patch of the model
(``liger_kernel.transformers.apply_liger_kernel_to_llama(model=...)``; ``liger`` runs the patched model eager, as
Liger is used with HF's Trainer, ``liger+compile`` compiles it). Configurations of one group, the activation
budgets, share one row of the table: the best, by tokens/s at its largest batch; the JSON file keeps all of them.
``memopt+budget`` is ``memory_budget=0.5``; ``memopt+fit`` gives memopt the cap itself, in bytes, less the weights,
their gradients and a tenth for fragmentation (``CAP``), the budget of a user who fills the card.
``--memopt-config 'NAME={"option": value}'`` adds a memopt configuration by its options. A memopt option that
fxpass rejects makes the row "not available (unknown memopt option ...)" rather than a failure, and so does Liger
where it has no patch for the model (GPT-2) or is not installed.

**Output** (under ``--out``): ``max_batch.md``, a header (card, torch/triton/transformers versions, commit) and one
row per model, flow, cap and configuration: the largest batch, tokens/s at it, its ratio to torch.compile's
tokens/s at torch.compile's own largest batch, the peak at it, and the trials (each batch tried, ✗ where it did
not run); ``max_batch.json``, every row with its trials; ``max_batch.jsonl``, one line per trial as it ends, so a
run cut short keeps what it measured. ``--merge A.jsonl B.jsonl`` renders the table of several runs' lines.

**On CPU** there is no allocator cap to run into, so each configuration runs one trial at its first probe batch
(the row's note says so): the script, its subprocesses and its table are checked, not the numbers. With a GPU,
``--tiny --caps 1`` runs the whole search on small models.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import importlib.util
import json
import logging
import math
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks import e2e
from benchmarks._common import cpu_peak, error_note, set_up, write_report

log = logging.getLogger("benchmarks.max_batch")
ROOT = Path(__file__).resolve().parents[1]
GiB = 1 << 30
MARKER = "MAX_BATCH_TRIAL "  # the trial's result line on its stdout, apart from anything else printed there
FLOWS = ("loss_only", "whole_model")
SEQ = {"gpt2": 1024, "llama-1b": 2048}
TINY_SEQ = 64
PROBES = {"gpt2": (4, 8), "llama-1b": (2, 4)}  # small enough to run under any cap tried, large enough to extrapolate
TITLES = {"gpt2": "GPT-2", "llama-1b": "Llama"}
LIGER_PATCHES = {"llama-1b": "apply_liger_kernel_to_llama"}
BASELINE = "torch.compile"
CUT_SHORT = "cut short by the time limit"
# ``memory_budget=CAP`` (the ``memopt+fit`` row): the trial's cap less the weights, their gradients and a tenth of
# the cap for the allocator's fragmentation, in bytes: the budget a user who fills the card would give
CAP = "cap"
FRAGMENTATION = 0.1  # a trial the time limit ended: no result, never recorded


@dataclasses.dataclass
class Configuration:
    """One way to build and compile the step. ``compiler``: "torch.compile", "memopt", or "eager" (no compile);
    ``options``: memopt's; ``group``: configurations that are one knob's values, which the table shows as one
    row, their best."""

    name: str
    compiler: str = "torch.compile"
    options: dict = dataclasses.field(default_factory=dict)
    activation_budget: float | None = None
    checkpointing: bool = False
    liger: bool = False
    group: str | None = None


def known_configurations() -> dict[str, Configuration]:
    """Every configuration by name. memopt's rows name only options: one that fxpass does not know yet
    (``memory_budget``) makes its row "not available" until it does."""
    found = [
        Configuration("torch.compile"),
        Configuration("torch.compile+checkpointing", checkpointing=True),
        *(
            Configuration(f"torch.compile+budget{b:g}", activation_budget=b, group="torch.compile+activation budget")
            for b in (0.7, 0.5, 0.3)
        ),
        Configuration("liger", compiler="eager", liger=True),
        Configuration("liger+compile", liger=True),
        Configuration("memopt", compiler="memopt"),
        Configuration("memopt+wta", compiler="memopt", options={"wta_crs_budget": 0.3}),
        Configuration("memopt+budget", compiler="memopt", options={"memory_budget": 0.5}),
        Configuration("memopt+budget+wta", compiler="memopt", options={"memory_budget": 0.5, "wta_crs_budget": 0.3}),
        Configuration("memopt+fit", compiler="memopt", options={"memory_budget": CAP}),
    ]
    return {configuration.name: configuration for configuration in found}


CONFIGURATIONS = known_configurations()
DEFAULT_CONFIGS = (
    "torch.compile,torch.compile+checkpointing,torch.compile+budget0.7,torch.compile+budget0.5,"
    "torch.compile+budget0.3,liger,memopt,memopt+budget,memopt+fit,memopt+budget+wta,memopt+wta"
)


def memopt_configuration(text: str) -> Configuration:
    """``--memopt-config``'s ``NAME=JSON``: a memopt configuration with those options."""
    name, _, options = text.partition("=")
    if not name or not options:
        raise argparse.ArgumentTypeError(f"expected NAME={{json options}}, got {text!r}")
    return Configuration(name.strip(), compiler="memopt", options=json.loads(options))


def unavailable(configuration: Configuration, model: str, memopt_options: Mapping) -> str | None:
    """Why ``configuration`` cannot run on ``model`` at all, as the row's note, or None. Asked in the parent,
    before any trial, so that a row that cannot exist costs no compile."""
    if configuration.liger:
        if model not in LIGER_PATCHES:
            return f"not available (Liger has no {TITLES.get(model, model)} patch)"
        if importlib.util.find_spec("liger_kernel") is None:
            return "not available (liger-kernel is not installed)"
    if configuration.compiler == "memopt":
        from fxpass import Config, ConfigError, MemoptBackend

        options = {**memopt_options, **configuration.options}
        if options.get("memory_budget") == CAP:
            options["memory_budget"] = 0.5  # resolved in the trial; the check needs a value
        try:
            MemoptBackend(options=options)  # fxpass's own check of the keys and values
        except ConfigError as error:
            unknown = [key for key in options if key not in Config.option_names()]
            if unknown:
                return f"not available (unknown memopt option {', '.join(unknown)})"
            return f"not available ({error_note(error)})"
    return None


# ----------------------------------------------------------------------------------------------- one trial


@dataclasses.dataclass
class TrialSpec:
    """Everything a trial subprocess needs, passed to it as JSON."""

    model: str
    flow: str
    cap: str  # GiB as text, or "card"
    configuration: dict
    batch: int
    seq: int
    steps: int = 5
    device: str = "cuda"
    inner: str = "inductor"
    precision: str = "bf16"
    dropout: str = "config"
    tiny: bool = False
    memopt_options: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Trial:
    """One trial's result. ``peak_bytes``: ``max_memory_allocated`` over the timed steps (what a training loop
    holds; on CPU the profiler's peak of one step above what was allocated before it); ``trial_peak_bytes``: over
    the whole trial, compile and warm-up included (what the cap must hold; the search fits its line to it);
    ``cap_bytes``: the allocator's limit (None on CPU). ``error`` is a failure other than out-of-memory: no batch
    of that configuration would run. ``shared``: the trial ran beside others on the GPU (``--parallel-probes``),
    so its time is not its own; its peaks are (each process's allocator counts its own)."""

    batch: int
    fits: bool
    oom: str | None = None
    error: str | None = None
    peak_bytes: int | None = None
    trial_peak_bytes: int | None = None
    reserved_bytes: int | None = None
    cap_bytes: int | None = None
    step_ms: float | None = None
    tokens_per_s: float | None = None
    first_call_s: float | None = None
    rewrites: str = ""
    duration_s: float | None = None
    reason: str = ""
    shared: bool = False  # ran beside other trials on the GPU (``--parallel-probes``): its time is not its own
    environment: dict = dataclasses.field(default_factory=dict)


def cap_bytes(cap: str, total: int) -> int:
    """The allocator limit ``cap`` stands for on a card of ``total`` bytes: GiB, or the whole card."""
    return total if cap == "card" else min(total, int(float(cap) * GiB))


def environment(device: torch.device) -> dict:
    """The card and the versions that the header names, read where the step runs."""
    import transformers
    import triton

    found = {"torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__}
    if importlib.util.find_spec("liger_kernel") is not None:
        from importlib.metadata import version

        found["liger-kernel"] = version("liger-kernel")
    found["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return found


def build_step(spec: TrialSpec, device: torch.device) -> tuple[Callable[[], torch.Tensor], e2e.Row]:
    """The configuration's model and training step at the spec's batch (``e2e``'s building blocks), and the e2e
    row that its first call fills. The model is built on the device (its factory calls under ``torch.device``):
    no CPU initialisation of a billion weights, no host copy."""
    configuration = Configuration(**spec.configuration)
    with device:
        model = e2e.build_model(spec.model, "sdpa", spec.dropout, spec.tiny, configuration.checkpointing)
    if configuration.liger:
        import liger_kernel.transformers

        getattr(liger_kernel.transformers, LIGER_PATCHES[spec.model])(model=model)
    if spec.precision == "bf16":
        model = model.to(torch.bfloat16)
    batch = e2e.make_batch(model.config.vocab_size, spec.batch, spec.seq, False, device)
    if configuration.compiler == "eager":
        def step(ids, labels, mask):
            return model(input_ids=ids, labels=labels, attention_mask=mask).loss
    else:
        backend = "memopt" if configuration.compiler == "memopt" else "torch.compile"
        options = resolved_options({**spec.memopt_options, **configuration.options}, spec, model, device)
        step = e2e.compiled_step(model, spec.flow, backend, spec.inner, options)
    if configuration.activation_budget is not None:
        step = under_activation_budget(step, configuration.activation_budget)
    row = e2e.Row(spec.model, "sdpa", spec.dropout, spec.flow, configuration.name, spec.batch * spec.seq)
    return e2e.training_step(model, step, batch, device, spec.precision == "autocast"), row


def resolved_options(options: dict, spec: TrialSpec, model: torch.nn.Module, device: torch.device) -> dict:
    """``options`` with ``memory_budget=CAP`` in bytes (``CAP``); on CPU, where there is no cap, 0.5."""
    if options.get("memory_budget") != CAP:
        return options
    if device.type != "cuda":
        return {**options, "memory_budget": 0.5}
    cap = cap_bytes(spec.cap, torch.cuda.get_device_properties(device).total_memory)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return {**options, "memory_budget": max(int(cap * (1 - FRAGMENTATION)) - 2 * weights, 1)}


def under_activation_budget(step: Callable, budget: float) -> Callable:
    """``step`` with AOTAutograd's activation budget set around each call: the partitioner reads it when the
    first call compiles, and the patch leaves the setting as it was between calls."""

    def run(*args):
        with torch._functorch.config.patch(activation_memory_budget=budget):
            return step(*args)

    return run


def run_trial(spec: TrialSpec) -> Trial:
    """One trial, in this process: set the cap, build, compile, warm up, time. Running out of memory anywhere
    (the build, the compile, a step) is a result, not a failure."""
    device = torch.device(spec.device)
    start = time.perf_counter()
    trial = Trial(spec.batch, fits=False, environment=environment(device))
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        trial.cap_bytes = cap_bytes(spec.cap, total)
        torch.cuda.set_per_process_memory_fraction(trial.cap_bytes / total, device)
    try:
        one_step, row = build_step(spec, device)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the fp32 weights the bf16 copy replaced
            torch.cuda.reset_peak_memory_stats(device)
        e2e.first_call(row, one_step, device)
        trial.first_call_s, trial.rewrites = row.first_call_s, row.rewrites
        measure(trial, one_step, spec, device)
        trial.fits = True
    except Exception as error:
        if is_out_of_memory(error):
            trial.oom = one_line(error)
        else:
            trial.error = one_line(error)
            log.exception("trial %s", spec)
    trial.duration_s = time.perf_counter() - start
    return trial


def measure(trial: Trial, one_step: Callable[[], torch.Tensor], spec: TrialSpec, device: torch.device) -> None:
    """The timed steps' median and tokens/s, and the peaks: over the timed steps, and over the whole trial."""
    if device.type == "cuda":
        warm_peak = torch.cuda.max_memory_allocated(device)
        warm_reserved = torch.cuda.max_memory_reserved(device)
        torch.cuda.reset_peak_memory_stats(device)
    times = [e2e.step_ms(one_step, device) for _ in range(spec.steps)]
    trial.step_ms = statistics.median(times)
    trial.tokens_per_s = spec.batch * spec.seq / trial.step_ms * 1e3
    if device.type == "cuda":
        trial.peak_bytes = torch.cuda.max_memory_allocated(device)
        trial.trial_peak_bytes = max(warm_peak, trial.peak_bytes)
        trial.reserved_bytes = max(warm_reserved, torch.cuda.max_memory_reserved(device))
    else:
        _, trial.peak_bytes = cpu_peak(one_step)
        trial.trial_peak_bytes = trial.peak_bytes


def is_out_of_memory(error: BaseException | None) -> bool:
    """Whether ``error`` is the device running out of memory, also where a compiler wrapped it (Inductor's
    benchmarking of kernels allocates too)."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower():
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


def one_line(error: BaseException, limit: int = 400) -> str:
    """An exception's type and first line, longer than ``error_note``'s: CUDA's out-of-memory line names what
    was asked for, the cap and what PyTorch held."""
    first = (str(error).splitlines() or [""])[0]
    return f"{type(error).__name__}: {first[:limit]}"


def trial_main(text: str) -> None:
    """``--trial``: run one trial from its JSON spec and print its result line."""
    set_up(None, quiet_rules=True)
    trial = run_trial(TrialSpec(**json.loads(text)))
    print(MARKER + json.dumps(dataclasses.asdict(trial)), flush=True)


# ----------------------------------------------------------------------------------------------- the search


def fitted_line(trials: Sequence[Trial]) -> tuple[float, float] | None:
    """(a, b) of peak ≈ a + b·batch through the two largest batches that ran (nearest the cap, where the line is
    used), None without two such batches with peaks."""
    ran = sorted((t for t in trials if t.fits and t.trial_peak_bytes is not None), key=lambda t: t.batch)
    if len(ran) < 2:
        return None
    low, high = ran[-2], ran[-1]
    slope = (high.trial_peak_bytes - low.trial_peak_bytes) / (high.batch - low.batch)
    return high.trial_peak_bytes - slope * high.batch, slope


def predicted_batch(trials: Sequence[Trial]) -> int | None:
    """The largest batch whose fitted peak stays under the cap, None where there is no line or it does not
    rise (the peak did not grow with the batch: nothing to extrapolate)."""
    line = fitted_line(trials)
    cap = next((t.cap_bytes for t in reversed(trials) if t.cap_bytes), None)
    if line is None or cap is None or line[1] <= 0:
        return None
    a, b = line
    return math.floor((cap - a) / b)


def bounds(trials: Sequence[Trial]) -> tuple[int, int | None]:
    """(largest batch that ran, 0 if none; smallest that did not, None if none)."""
    lo = max((t.batch for t in trials if t.fits), default=0)
    hi = min((t.batch for t in trials if not t.fits), default=None)
    return lo, hi


def next_batch(trials: Sequence[Trial], probes: Sequence[int]) -> tuple[int, str] | None:
    """The next batch to try and why, or None when the search is done: a batch that ran sits next to one that did
    not (or batch 1 did not run), or a failure below a success makes the boundary ill-defined."""
    lo, hi = bounds(trials)
    if hi is not None and hi <= lo + 1:
        return None
    tried = {t.batch for t in trials}
    for probe in probes:
        if probe not in tried and probe > lo and (hi is None or probe < hi):
            return probe, "probe"
    guess = predicted_batch(trials)
    if guess is None:  # no line: double up, or halve the gap down
        return (max(2 * lo, 1), "doubled") if hi is None else ((lo + hi) // 2, "halved")
    if guess <= lo:
        return lo + 1, "step up"
    if hi is not None and guess >= hi:
        return hi - 1, "step down"
    return guess, "predicted"


def search(run: Callable[[int, str], Trial], probes: Sequence[int], max_trials: int,
           may_start: Callable[[], bool] = lambda: True, trials: Sequence[Trial] = ()) -> list[Trial]:
    """The trials of one configuration's search (``next_batch``), at most ``max_trials``, going on from
    ``trials`` (probes already run); ``may_start`` says whether time is left for another. A failure that is not
    out-of-memory ends it: no batch would run."""
    trials = list(trials)
    if any(t.error is not None for t in trials):
        return trials
    while len(trials) < max_trials and may_start():
        chosen = next_batch(trials, probes)
        if chosen is None:
            break
        trial = run(*chosen)
        trials.append(trial)
        if trial.error is not None:
            break
    return trials


# ----------------------------------------------------------------------------------------------- rows


@dataclasses.dataclass
class Outcome:
    """One configuration's row: its largest batch that ran and the trial there."""

    model: str
    flow: str
    cap: str
    configuration: str
    group: str | None
    largest: int | None
    at: Trial | None
    trials: list[Trial]
    note: str = ""


def outcome(key: Mapping, trials: list[Trial], max_trials: int, cpu: bool = False, note: str = "") -> Outcome:
    """The row a configuration's trials make (``note``: one given, "not available" say), with a note where the
    boundary was not located: why, and where it lies."""
    lo, _ = bounds(trials)
    at = next((t for t in trials if t.fits and t.batch == lo), None)
    note = note or search_note(trials, max_trials, cpu)
    if at is not None and at.shared:
        note = "; ".join(filter(None, [note, "tokens/s from a trial that shared the GPU"]))
    return Outcome(key["model"], key["flow"], key["cap"], key["configuration"], key.get("group"),
                   lo or None, at, trials, note)


def search_note(trials: list[Trial], max_trials: int, cpu: bool) -> str:
    """What a reader of the row must know about its search: empty where the boundary was found."""
    lo, hi = bounds(trials)
    error = next((t.error for t in trials if t.error), None)
    if error is not None:
        return f"failed: {error}"
    if cpu:
        return "one trial (CPU: no memory cap)"
    if hi == 1 and lo == 0:
        return "batch 1 does not fit"
    if hi is not None and hi <= lo:
        return f"batch {hi} did not run below batch {lo}, which did"
    if hi is not None and hi == lo + 1:
        return ""
    where = f"{lo} ran, {hi} did not" if hi is not None else f"{lo} ran, nothing larger tried"
    why = f"trial cap ({max_trials}) hit" if len(trials) >= max_trials else "stopped by the time limit"
    guess = predicted_batch(trials)
    useful = guess is not None and (hi is None or guess < hi)  # a line past a failure says nothing more
    return f"{why}: {where}" + (f"; the line through the largest two predicts {guess}" if useful else "")


def best_of_groups(rows: list[Outcome]) -> list[Outcome]:
    """The table's rows: a group's configurations (one knob's values) folded into their best by tokens/s at the
    largest batch, where the group's first member stood, its note listing each value's batch; ungrouped rows as
    they are."""
    members: dict[tuple, list[Outcome]] = {}
    for row in rows:
        if row.group is not None:
            members.setdefault((row.model, row.flow, row.cap, row.group), []).append(row)
    shown: list[Outcome] = []
    for row in rows:
        group = members.pop((row.model, row.flow, row.cap, row.group), None) if row.group is not None else [row]
        if group is None:  # a later member of a group already shown
            continue
        if row.group is None:
            shown.append(row)
            continue
        best = max(group, key=lambda r: (r.at.tokens_per_s if r.at and r.at.tokens_per_s else -1, r.largest or 0))
        each = "; ".join(f"{m.configuration}: {m.largest or '-'}" + (f" ({m.note})" if m.note else "") for m in group)
        shown.append(dataclasses.replace(best, configuration=f"{row.group} (best: {best.configuration})",
                                         note=f"batch per value: {each}"))
    return shown


def _gib(amount: int | None) -> str:
    return "-" if amount is None else f"{amount / GiB:.2f}"


def _cap_label(row: Outcome) -> str:
    cap = next((t.cap_bytes for t in row.trials if t.cap_bytes), None)
    if row.trials and cap is None:
        return "none (CPU)"
    if row.cap == "card":
        return "card" if cap is None else f"card ({cap / GiB:.1f} GiB)"
    return f"{row.cap} GiB"


def _trials_text(trials: list[Trial]) -> str:
    return "-" if not trials else f"{len(trials)}: " + ", ".join(f"{t.batch}{'' if t.fits else '✗'}" for t in trials)


def table(rows: list[Outcome]) -> str:
    """The markdown table; the ratio is tokens/s over torch.compile's at its own largest batch (same model, flow
    and cap)."""
    lines = [
        "| model | flow | cap | configuration | largest batch | tokens/s at it | vs torch.compile | peak GiB at it "
        "| trials (batch, ✗: did not run) | note |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = {(r.model, r.flow, r.cap): r for r in rows if r.configuration == BASELINE}
    for row in best_of_groups(rows):
        reference = base.get((row.model, row.flow, row.cap))
        speed = row.at.tokens_per_s if row.at else None
        theirs = reference.at.tokens_per_s if reference and reference.at else None
        ratio = "-" if speed is None or not theirs else f"{speed / theirs:.2f}"
        lines.append(
            f"| {row.model} | {row.flow} | {_cap_label(row)} | {row.configuration} | {row.largest or '-'} "
            f"| {'-' if speed is None else f'{speed:.0f}'} | {ratio} | {_gib(row.at.peak_bytes if row.at else None)} "
            f"| {_trials_text(row.trials)} | {row.note} |"
        )
    return "\n".join(lines)


def header(lines: list[dict]) -> str:
    """The report's first line, from what the trials read where they ran (the parent never touches the GPU, so
    that the whole card is the trials')."""
    seen = next((line["trial"]["environment"] for line in lines if line.get("trial", {}).get("environment")), {})
    commit = next((line["commit"] for line in lines if line.get("commit")), "unknown")
    date = next((line["date"] for line in lines if line.get("date")), time.strftime("%Y-%m-%d"))
    versions = ", ".join(f"{name} {seen[name]}" for name in ("torch", "triton", "transformers", "liger-kernel")
                         if name in seen)
    where = ", ".join(filter(None, [seen.get("device", "unknown device"), versions]))
    return f"Largest batch under a memory cap, and tokens/s at it, {date}, {where}, commit {commit}"


def git_commit() -> str:
    """``MEMOPT_COMMIT`` where set (a run from a copy of a commit's tree, which has no git of its own), else the
    checkout's commit, "+changes" where the tree differs from it; "unknown" outside a git checkout."""
    if os.environ.get("MEMOPT_COMMIT"):
        return os.environ["MEMOPT_COMMIT"]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("+changes" if dirty else "")


def outcomes_of(lines: Iterable[dict]) -> list[Outcome]:
    """Rows from result lines (this run's or several runs' ``max_batch.jsonl``): each model, flow and cap in the
    order first seen, its configurations in ``--configs``' order."""
    lines = list(lines)
    cases = list(dict.fromkeys((line["model"], line["flow"], line["cap"]) for line in lines))
    lines.sort(key=lambda line: (cases.index((line["model"], line["flow"], line["cap"])), line.get("index", 0)))
    order: dict[tuple, dict] = {}
    for line in lines:
        key = (line["model"], line["flow"], line["cap"], line["configuration"])
        entry = order.setdefault(key, {"key": line, "trials": [], "note": "", "max_trials": 0, "cpu": False})
        if line["kind"] == "unavailable":
            entry["note"] = line["note"]
        else:
            entry["trials"].append(Trial(**line["trial"]))
            entry["max_trials"] = line["max_trials"]
            entry["cpu"] = line.get("device") == "cpu"
    return [outcome(e["key"], e["trials"], e["max_trials"], e["cpu"], e["note"]) for e in order.values()]


# ----------------------------------------------------------------------------------------------- the parent


class Runner:
    """Starts trials as subprocesses, logs each as a line of ``max_batch.jsonl``, and keeps the time limit."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.start = time.perf_counter()
        self.longest = 0.0  # the longest trial that ran alone
        self.longest_shared = 0.0  # the longest that shared the GPU: the estimate until one ran alone
        self.lines: list[dict] = []
        self.commit = git_commit()
        self.date = time.strftime("%Y-%m-%d")
        self.stopped = False
        self.lock = threading.Lock()

    def may_start(self) -> bool:
        """Whether a trial as long as the longest so far still ends inside ``--time-limit``."""
        if self.args.time_limit is None:
            return True
        left = self.args.time_limit - (time.perf_counter() - self.start)
        longest = self.longest or self.longest_shared
        if left < 1.1 * longest or left <= 0:
            if not self.stopped:
                log.info("time limit: %.0f s left, the longest trial took %.0f s; no more trials", left, longest)
            self.stopped = True
        return not self.stopped

    def record(self, line: dict) -> None:
        line = {**line, "commit": self.commit, "date": self.date, "device": self.args.device}
        with self.lock:
            self.lines.append(line)
            with (self.args.out / "max_batch.jsonl").open("a") as out:
                out.write(json.dumps(line) + "\n")

    def trial(self, key: dict, configuration: Configuration, batch: int, reason: str, shared: bool = False,
              record: bool = True) -> Trial:
        """One trial in a fresh subprocess; a subprocess that crashes or outlives its time is a failed trial.
        ``record``: its line now (a shared probe's waits: it may be run again alone)."""
        args = self.args
        spec = TrialSpec(key["model"], key["flow"], key["cap"], dataclasses.asdict(configuration), batch,
                         key["seq"], args.steps, args.device, args.inner, args.precision, args.dropout, args.tiny,
                         json.loads(args.memopt_options))
        log.info("trial: %s %s cap %s %s, batch %d (%s)", key["model"], key["flow"], key["cap"],
                 configuration.name, batch, reason)
        started = time.perf_counter()
        timeout = args.trial_timeout
        limited = args.time_limit is not None and args.time_limit - (started - self.start) < timeout
        if limited:
            timeout = max(1.0, args.time_limit - (started - self.start))
        trial = spawn(spec, timeout)
        trial.reason, trial.shared = reason, shared
        took = time.perf_counter() - started
        if shared:  # a shared trial's time says little about one alone
            self.longest_shared = max(self.longest_shared, took)
        else:
            self.longest = max(self.longest, took)
        log.info("  → %s %s batch %d: %s", key["model"], configuration.name, batch, describe(trial))
        if limited and trial.error is not None and trial.error.startswith("trial ran past"):
            self.stopped = True  # cut short by the time limit: no result, and the row says it was stopped
            trial.error = CUT_SHORT
            return trial
        if record:
            self.record_trial(key, trial)
        return trial

    def record_trial(self, key: dict, trial: Trial) -> None:
        self.record({"kind": "trial", **key, "max_trials": self.args.max_trials, "trial": dataclasses.asdict(trial)})

    def probes(self, model: str) -> tuple[int, ...]:
        return self.args.probes or (PROBES.get(model, (2, 4)) if not self.args.tiny else (2, 4))

    def case(self, key: dict, configurations: list[Configuration]) -> None:
        """Every configuration's row for one model, flow and cap: "not available", one trial on CPU, or the
        search, after the probes of all of them where ``--parallel-probes`` shares the GPU among them."""
        ready = []
        for index, configuration in enumerate(configurations):
            row_key = {**key, "configuration": configuration.name, "group": configuration.group, "index": index}
            why = unavailable(configuration, key["model"], json.loads(self.args.memopt_options))
            if why is None:
                ready.append((row_key, configuration))
            else:
                log.info("%s %s: %s", key["model"], configuration.name, why)
                self.record({"kind": "unavailable", **row_key, "note": why})
        probes = self.probes(key["model"])
        cpu = self.args.device == "cpu"
        shared = self.shared_probes(ready, probes) if self.args.parallel_probes > 1 and not cpu else {}
        for row_key, configuration in ready:
            begun = shared.get(configuration.name, [])
            if not begun and not self.may_start():
                self.record({"kind": "unavailable", **row_key, "note": "not measured (time limit)"})
            elif cpu:
                self.trial(row_key, configuration, probes[0], "probe")
            else:
                run = functools.partial(self.trial, row_key, configuration)
                search(run, probes, self.args.max_trials, self.may_start, begun)

    def shared_probes(self, ready: list[tuple[dict, Configuration]], probes: Sequence[int]) -> dict[str, list[Trial]]:
        """The probe trials of every configuration, ``--parallel-probes`` at a time on the one GPU: each compiles
        for tens of seconds, mostly on the CPU, and the probes' small batches leave room for several. Their
        peaks are each process's own; their times are marked shared. A probe that did not run is run again
        alone, since a neighbour may have held the memory it lacked."""
        jobs = [(row_key, configuration, batch) for row_key, configuration in ready for batch in probes]

        def run(job: tuple[dict, Configuration, int]) -> Trial | None:
            return self.trial(*job, "probe, GPU shared", shared=True, record=False) if self.may_start() else None

        with concurrent.futures.ThreadPoolExecutor(self.args.parallel_probes) as pool:
            results = list(pool.map(run, jobs))
        found: dict[str, list[Trial]] = {}
        for (row_key, configuration, batch), trial in zip(jobs, results, strict=True):
            failed_alone = any(not t.fits and not t.shared for t in found.get(configuration.name, []))
            if trial is not None and trial.oom is not None and not failed_alone and self.may_start():
                trial = self.trial(row_key, configuration, batch, "probe, again alone", record=False)
            if trial is not None and trial.error != CUT_SHORT:
                self.record_trial(row_key, trial)
                found.setdefault(configuration.name, []).append(trial)
        return found


def describe(trial: Trial) -> str:
    """A trial as one log line."""
    took = "" if trial.duration_s is None else f", {trial.duration_s:.0f} s"
    if not trial.fits:
        return f"does not run ({trial.oom or trial.error}){took}"
    speed = "-" if trial.tokens_per_s is None else f"{trial.tokens_per_s:.0f}"
    return (f"runs, {speed} tokens/s, peak {_gib(trial.peak_bytes)} GiB "
            f"(whole trial {_gib(trial.trial_peak_bytes)} GiB){took}")


def spawn(spec: TrialSpec, timeout: float) -> Trial:
    """Run ``python -m benchmarks.max_batch --trial SPEC`` and read its result line; its log goes to ours."""
    command = [sys.executable, "-m", "benchmarks.max_batch", "--trial", json.dumps(dataclasses.asdict(spec))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return Trial(spec.batch, fits=False, error=f"trial ran past {timeout:.0f} s", duration_s=timeout)
    found = [line for line in done.stdout.splitlines() if line.startswith(MARKER)]
    for line in done.stdout.splitlines():
        if not line.startswith(MARKER):
            print(line)
    if not found:
        return Trial(spec.batch, fits=False, error=f"trial exited with {done.returncode} and no result line")
    return Trial(**json.loads(found[-1][len(MARKER):]))


def write_outputs(out: Path, lines: list[dict]) -> list[Outcome]:
    """``max_batch.md`` (the header and table) and ``max_batch.json`` (every row with its trials)."""
    rows = outcomes_of(lines)
    write_report(out, "max_batch.md", f"{header(lines)}\n\n{table(rows)}")
    (out / "max_batch.json").write_text(json.dumps([dataclasses.asdict(row) for row in rows], indent=1))
    return rows


def chosen_configurations(args: argparse.Namespace) -> list[Configuration]:
    """``--configs`` in the order given, with ``--memopt-config``'s added to those known."""
    known = {**CONFIGURATIONS, **{c.name: c for c in args.memopt_config}}
    names = [name.strip() for name in args.configs.split(",") if name.strip()]
    missing = [name for name in names if name not in known]
    if missing:
        raise SystemExit(f"unknown configurations {missing}; known: {', '.join(known)}")
    return [known[name] for name in names] + [c for c in args.memopt_config if c.name not in names]


def parser() -> argparse.ArgumentParser:
    found = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    found.add_argument("--models", default="gpt2,llama-1b")
    found.add_argument("--flows", default=",".join(FLOWS))
    found.add_argument("--caps", default="40,card", help="allocator caps: GiB, or card (the whole card)")
    found.add_argument("--configs", default=DEFAULT_CONFIGS, help=f"known: {', '.join(CONFIGURATIONS)}")
    found.add_argument("--memopt-config", type=memopt_configuration, action="append", default=[],
                       help='another memopt configuration, NAME={"option": value} (repeatable)')
    found.add_argument("--memopt-options", default="{}", help="JSON options for every memopt configuration")
    found.add_argument("--probes", type=lambda s: tuple(int(b) for b in s.split(",")), default=None,
                       help="the two small batches the line is fitted to (default per model: GPT-2 4,8; Llama 2,4)")
    found.add_argument("--max-trials", type=int, default=5, help="the most trials one configuration's search takes")
    found.add_argument("--parallel-probes", type=int, default=1,
                       help="probe trials run at once on the GPU (their batches are small; timed trials run alone)")
    found.add_argument("--steps", type=int, default=5, help="timed steps per trial, after two warm-up steps")
    found.add_argument("--time-limit", type=float, default=None, help="seconds: start no trial that would pass it")
    found.add_argument("--trial-timeout", type=float, default=600.0, help="seconds one trial may take")
    found.add_argument("--precision", default="bf16", choices=["autocast", "bf16", "fp32"],
                       help="e2e.py's: bf16 weights (default), fp32 weights under bf16 autocast, or fp32")
    found.add_argument("--dropout", default="config", help='"config" (HF defaults: GPT-2 0.1) or "0"')
    found.add_argument("--inner", default="inductor", help="compiler behind every compiled configuration")
    found.add_argument("--tiny", action="store_true", help="small models: check the script, not the numbers")
    found.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    found.add_argument("--out", type=Path, default=Path("benchmark_results"))
    found.add_argument("--merge", type=Path, nargs="+", default=None,
                       help="render the table of these max_batch.jsonl files (no trials)")
    found.add_argument("--trial", default=None, help=argparse.SUPPRESS)
    return found


def main(argv: list[str] | None = None) -> list[Outcome]:
    args = parser().parse_args(argv)
    if args.trial is not None:
        trial_main(args.trial)
        return []
    set_up(args.out, needs_cuda=None)
    if args.merge:
        lines = [json.loads(text) for path in args.merge for text in path.read_text().splitlines() if text]
        return write_outputs(args.out, lines)
    runner = Runner(args)
    configurations = chosen_configurations(args)
    for model in args.models.split(","):
        seq = TINY_SEQ if args.tiny else SEQ[model]
        for flow in args.flows.split(","):
            for cap in args.caps.split(","):
                runner.case({"model": model, "flow": flow, "cap": cap, "seq": seq}, configurations)
    return write_outputs(args.out, runner.lines)


if __name__ == "__main__":
    main()
