"""WTA-CRS fine-tuning steps: peak memory, step time and the largest batch that fits, per backend.

    python benchmarks/wta_crs.py                                    # GPT-2-medium and BERT-base shapes, seq 512
    python benchmarks/wta_crs.py --models gpt2-medium --seq 1024
    python benchmarks/wta_crs.py --models tinyllama                 # TinyLlama-1.1B's shape: SwiGLU, GQA
    python benchmarks/wta_crs.py --tiny --device cpu                # a smoke run of the script itself

Models are built from configs (random init, no downloads) and trained with AdamW under bf16 autocast. Each
variant compiles the same step: plain ``torch.compile`` (Inductor), ``torch.compile`` with AOTAutograd's
activation memory budget at 0.5 (exact recomputation, the baseline a sampled gradient must beat), memopt with
WTA-CRS off, and memopt with WTA-CRS at each budget. All variants of a model train one model and optimizer
(same weights, same batches), each through its own compiled step, and their timed steps alternate
(``_common.in_turns``), so that a machine's drift reaches every variant alike; the ratios are against
torch.compile's row (the model's first row without one). Peak = ``max_memory_allocated`` over a step (weights
and optimizer state included); "activations" = that peak minus what was allocated before the step; "saved" = the
distinct storages the step keeps for its backward (a ``saved_tensors_hooks`` pack hook; weights left out), the
measure on CPU, which has no allocator peak. The largest batch is extrapolated from the peaks at two batch sizes
(memory is linear in the batch); ``--verify-largest`` then runs steps from that batch, down by 4 % until one fits
or up by 4 % until one does not, so the figure is measured (within 4 %), not only predicted.
``--combine-budget`` adds memopt with WTA-CRS and the activation budget together.

Models: ``gpt2`` (GPT-2 small, HF's config: dropout 0.1 unless ``--dropout 0``), ``gpt2-medium`` and
``bert-base`` (dropout off unless ``--dropout config``), ``tinyllama`` and ``llama-1b`` (Llama-3.2-1B's shape:
2048 wide, 16 layers, 32/8 heads, vocabulary 128256, tied embeddings). ``--flow loss_only`` compiles
``lambda ids, labels: model(...).loss``; ``--flow whole_model`` compiles the model and takes ``.loss`` of its
output (the logits are returned, then dropped).

Each budget b has two variants: "memopt + WTA-CRS b", the rule as users get it (on CUDA it leaves groups whose
modelled step time per MiB freed exceeds ``wta_crs_max_us_per_mib``), and "memopt + WTA-CRS b, every group"
(that limit off: every group that frees memory is sampled).

WTA-CRS only pays where, at the same memory, it is faster than recomputing activations. ``--match-peak`` finds,
for each "memopt + WTA-CRS b" variant, the activation budget x for memopt (WTA-CRS off) whose activations (saved
bytes on CPU) are the largest not above the WTA-CRS variant's: a bracketing search over x in [0, 1] (at most
``--match-tries`` compiles; memopt's own row is budget 1), each probe measured as every row is. The row
"memopt + activation budget x (peak-matched to WTA-CRS b)" joins the timed rotation, and the report says which
of the two is faster at that peak. The rows of the issue that asked for it, on the H200. GPT-2 small, each command
about 4 minutes (4:13 measured for loss_only / sdpa: five compiles of 20-60 s, three variants and two probes):

    for flow in loss_only whole_model; do for attention in sdpa eager; do
        python benchmarks/wta_crs.py --models gpt2 --batch 16 --seq 1024 --flow $flow --attention $attention \\
            --budgets 0.3 --variants 'torch.compile,memopt,memopt + WTA-CRS 0.3' --match-peak --steps 10 \\
            --out $OUT/wta_gpt2_${flow}_${attention}
    done; done

GPT-2-medium (with its HF config's dropout, as GPT-2 small) and Llama-3.2-1B's shape compile for 90-115 s a
variant (Llama, measured), so they leave torch.compile out (its rows: ``benchmarks/e2e.py``) and take at most
three probes: about 6-8 minutes each, inside one 10-minute call:

    python benchmarks/wta_crs.py --models gpt2-medium --dropout config --batch 16 --seq 1024 --flow loss_only \\
        --budgets 0.3 --variants 'memopt,memopt + WTA-CRS 0.3' --match-peak --match-tries 3 --steps 10 \\
        --out $OUT/wta_gpt2_medium
    python benchmarks/wta_crs.py --models llama-1b --batch 4 --seq 2048 --flow loss_only \\
        --budgets 0.3 --variants 'memopt,memopt + WTA-CRS 0.3' --match-peak --match-tries 3 --steps 10 \\
        --out $OUT/wta_llama_1b

On CPU, a smoke run of the search (AOTAutograd without Inductor; ``force``: the rewrites pay nothing at toy sizes):

    python benchmarks/wta_crs.py --tiny --device cpu --models gpt2 --seq 64 --batch 8 --inner aot_eager \\
        --memopt-options '{"force": true}' --budgets 0.3 --variants 'memopt,memopt + WTA-CRS 0.3' --match-peak
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import math
import re
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fxpass
from benchmarks import e2e
from benchmarks._common import cuda_peak, error_note, header, in_turns, release_memory, set_up, write_report
from lowerings.wta_crs import reset_estimates

log = logging.getLogger("benchmarks.wta_crs")
GiB, MiB = 1 << 30, 1 << 20
# "every group": WTA-CRS without its time rule (wta_crs_max_us_per_mib=None), on every group that frees memory.
WTA_VARIANT = re.compile(r"memopt \+ WTA-CRS (?P<budget>[0-9.]+)(?P<every>, every group)?")
FLOWS = ("loss_only", "whole_model")


def build(name: str, tiny: bool, layers: int | None = None, attention: str = "sdpa", dropout: str | None = None):
    """(model, masked_lm) for a named configuration, random init; ``layers`` overrides the depth; ``attention``
    is HF's ``attn_implementation``: "sdpa" (their default, which memopt leaves alone) or "eager" (explicit
    scores, which memopt's flash-attention rule rewrites: every rewrite in one step). ``dropout`` None keeps this
    table's choice per model (GPT-2 small: its HF config's 0.1, as users train it; GPT-2-medium and BERT-base: off,
    as their BENCHMARKS.md rows ran), "config" every HF config's own, "0" none anywhere."""
    import transformers

    if name in ("gpt2", "llama-1b"):  # the end-to-end benchmark's models, shared so the two tables agree
        model = e2e.build_model(name, attention, "0" if dropout == "0" else "config", tiny, layers=layers)
        return model, False
    if name == "gpt2-medium":
        sizes = dict(n_layer=2, n_embd=64, n_head=2) if tiny else dict(n_layer=24, n_embd=1024, n_head=16)
        sizes["n_layer"] = layers or sizes["n_layer"]
        off = {} if dropout == "config" else dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        config = transformers.GPT2Config(
            vocab_size=50257, n_positions=1024, attn_implementation=attention, **off, **sizes,
        )
        model = transformers.GPT2LMHeadModel(config)
        model.loss_type = "ForCausalLM"
        return model, False
    if name == "tinyllama":  # TinyLlama-1.1B's shape: RMSNorm, SwiGLU MLP, grouped-query attention
        sizes = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=176, num_attention_heads=4) if tiny else {}
        config = transformers.LlamaConfig(
            vocab_size=32000, hidden_size=sizes.get("hidden_size", 2048),
            intermediate_size=sizes.get("intermediate_size", 5632),
            num_hidden_layers=layers or sizes.get("num_hidden_layers", 22),
            num_attention_heads=sizes.get("num_attention_heads", 32), num_key_value_heads=4,
            max_position_embeddings=2048, attn_implementation=attention,
        )
        return transformers.LlamaForCausalLM(config), False
    if name == "bert-base":
        sizes = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=2, intermediate_size=128) if tiny else {}
        if layers:
            sizes["num_hidden_layers"] = layers
        off = {} if dropout == "config" else dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        config = transformers.BertConfig(attn_implementation=attention, **off, **sizes)
        return transformers.BertForMaskedLM(config), True
    raise SystemExit(f"unknown model {name!r}")


def batch(vocab: int, size: int, seq: int, masked_lm: bool, device, generator):
    ids = torch.randint(0, vocab, (size, seq), generator=generator).to(device)
    labels = ids.clone()
    if masked_lm:
        labels[torch.rand(size, seq, generator=generator).to(device) > 0.15] = -100
    return ids, labels


def compile_with_activation_budget(fn, budget: float, mode: str | None = None, backend="inductor"):
    """``torch.compile(fn)`` whose partitioner keeps at most ``budget`` of the activations and recomputes the
    rest (AOTAutograd's ``activation_memory_budget``): the exact, recompute-based way to trade time for memory,
    the baseline WTA-CRS must beat. The budget is read when the joint graph is partitioned, at the first call;
    memopt's backend hands its graph to the same partitioner (Inductor's, or AOTAutograd's min-cut under
    ``inner_compiler="aot_eager"``), so the two can be combined.

    The budget is no guard of Dynamo's, and Dynamo reuses a graph compiled by an *equal* backend: two
    ``torch.compile`` calls of one function with the same backend name and options compare equal, so the second
    budget would silently run the first one's graph (unless ``torch._dynamo.reset()`` ran between). A named
    ``backend`` therefore compiles through an object of its own (``OwnBackend``); a backend object passed in
    must be used for one budget only."""
    if isinstance(backend, str):
        backend, mode = OwnBackend(backend, mode), None
    compiled = torch.compile(fn, backend=backend, mode=mode)

    def run(*args, **kwargs):
        with torch._functorch.config.patch(activation_memory_budget=budget):
            return compiled(*args, **kwargs)

    return run


class OwnBackend:
    """A named backend ("inductor", "aot_eager") as an object equal to no other, so that Dynamo compiles afresh
    for it instead of reusing a graph compiled by another ``torch.compile`` of the same name
    (``compile_with_activation_budget``)."""

    def __init__(self, name: str, mode: str | None = None) -> None:
        from torch._dynamo.backends.registry import lookup_backend

        inductor = name == "inductor"
        self.compile = torch._TorchCompileInductorWrapper(mode, None, None) if inductor else lookup_backend(name)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        return self.compile(gm, example_inputs)

    def reset(self) -> None:
        """Called by ``torch._dynamo.reset()``: Inductor's wrapper drops its CUDA-graph trees."""
        if hasattr(self.compile, "reset"):
            self.compile.reset()


def backends(
    budgets: list[float],
    mode: str | None = None,
    combine: float | None = None,
    inner: str = "inductor",
    memopt_options: Mapping[str, object] | None = None,
) -> dict[str, object]:
    """Variant name → backend; ``mode`` (e.g. "reduce-overhead": CUDA graphs) applies to every variant;
    ``combine`` adds memopt with WTA-CRS at the first budget under that activation budget. ``inner`` is the
    compiler behind every variant ("aot_eager" skips Inductor: CPU smoke runs); ``memopt_options`` go to every
    memopt variant."""
    plain: dict[str, object] = dict(mode=mode) if inner == "inductor" else dict(backend=inner)
    found: dict[str, object] = {
        "torch.compile": functools.partial(torch.compile, **plain),
        "torch.compile + activation budget 0.5": functools.partial(
            compile_with_activation_budget, budget=0.5, mode=mode, backend=inner
        ),
        "memopt": memopt(mode, inner, memopt_options),
    }
    for budget in budgets:
        found[f"memopt + WTA-CRS {budget}"] = memopt(mode, inner, memopt_options, budget)
        every = {**(memopt_options or {}), "wta_crs_max_us_per_mib": None}
        found[f"memopt + WTA-CRS {budget}, every group"] = memopt(mode, inner, every, budget)
    if combine is not None and budgets:
        wta = memopt(mode, inner, memopt_options, budgets[0])
        found[f"memopt + WTA-CRS {budgets[0]} + activation budget {combine}"] = functools.partial(
            compile_with_activation_budget, budget=combine, backend=wta
        )
    return found


def memopt(
    mode: str | None, inner: str, options: Mapping[str, object] | None = None, wta_budget: float | None = None
) -> fxpass.MemoptBackend:
    """A fresh memopt backend (WTA-CRS at ``wta_budget``, off when None): fresh, because Dynamo reuses what one
    backend object compiled whatever else changed since."""
    chosen = dict(options or {})
    if inner != "inductor":
        chosen["inner_compiler"] = inner
    if wta_budget is not None:
        chosen["wta_crs_budget"] = wta_budget
    return fxpass.MemoptBackend(mode=mode, options=chosen)


def recompute(budget: float, args) -> functools.partial:
    """memopt, WTA-CRS off, under AOTAutograd's activation budget ``budget``: what WTA-CRS is matched against."""
    backend = memopt(args.mode, args.inner, json.loads(args.memopt_options))
    return functools.partial(compile_with_activation_budget, budget=budget, backend=backend)


@dataclasses.dataclass
class Result:
    model: str
    variant: str
    batch: int
    seq: int
    step_ms: float | None = None
    peak_gib: float | None = None
    activations_gib: float | None = None
    max_batch: int | None = None
    largest_run: int | None = None
    wta_groups: int = 0
    note: str = ""
    saved_mib: float | None = None


@dataclasses.dataclass
class PeakMatch:
    """One WTA-CRS variant beside memopt under the activation budget whose memory is the largest not above its own.

    ``tried``: budget → the memory compared (activations on CUDA, saved bytes elsewhere), in the order measured
    (budget 1 is memopt's own row where it ran); ``budget`` None: not even budget 0 reached WTA-CRS's memory, and
    ``recompute`` is budget 0's row."""

    wta: Result
    recompute: Result | None
    budget: float | None
    tried: dict[float, float]


def add_model_arguments(parser: argparse.ArgumentParser, layers: int, batch: int) -> None:
    """The model, its depth, the batch and the WTA-CRS budget, for the scripts that study one cut-down model."""
    parser.add_argument("--model", default="gpt2-medium")
    parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--batch", type=int, default=batch)
    parser.add_argument("--budget", type=float, default=0.3)


def add_step_arguments(parser: argparse.ArgumentParser) -> None:
    """The options ``training_step`` and ``backends`` read, for every script that builds the step."""
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--mode", default=None, help='torch.compile mode for every variant, e.g. "reduce-overhead"')
    parser.add_argument("--attention", default="sdpa", choices=["sdpa", "eager"], help="HF attn_implementation")
    parser.add_argument("--flow", default="loss_only", choices=FLOWS, help="compile the loss alone or the model")
    parser.add_argument("--dropout", default=None, choices=["config", "0"],
                        help="each model's choice (see build); config: HF's own everywhere; 0: none")
    parser.add_argument("--tiny", action="store_true", help="small models: check the script, not the numbers")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=Path("benchmark_results"))


@dataclasses.dataclass
class Trainee:
    """A model and its optimizer, which every variant's compiled step trains in turn: one set of weights and
    optimizer state in memory however many variants are compared, so that each peak counts them once."""

    name: str
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    masked_lm: bool


def trainee(name: str, args, device: torch.device, layers: int | None = None) -> Trainee:
    """A fresh model (seed 0) with AdamW; gradient-norm estimates and memopt's reports start afresh."""
    torch.manual_seed(0)
    reset_estimates()
    fxpass.clear_reports()
    model, masked_lm = build(name, args.tiny, layers, args.attention, args.dropout)
    positions = getattr(model.config, "n_positions", None) or getattr(model.config, "max_position_embeddings", None)
    if positions is not None and args.seq > positions:
        raise SystemExit(f"--seq {args.seq} exceeds {name}'s {positions} positions{' (--tiny)' if args.tiny else ''}")
    model.to(device).train()
    return Trainee(name, model, torch.optim.AdamW(model.parameters(), lr=1e-5), masked_lm)


def compiled_loss(model: torch.nn.Module, backend, flow: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``(ids, labels) → loss`` compiled by ``backend`` as ``flow`` says: the loss alone ("loss_only"), or the
    whole model, whose output's logits are then dropped ("whole_model")."""

    def compiled(fn):
        return backend(fn) if isinstance(backend, functools.partial) else torch.compile(fn, backend=backend)

    if flow == "loss_only":
        return compiled(lambda ids, labels: model(input_ids=ids, labels=labels).loss)
    whole = compiled(model)
    return lambda ids, labels: whole(input_ids=ids, labels=labels).loss


def step_of(trained: Trainee, backend, args, device: torch.device) -> Callable[[int], None]:
    """``train_step(batch size)``: one compiled AdamW step of ``trained`` under bf16 autocast, on batches from a
    generator of its own (seed 0), so every variant sees the same batches. The batch dimension is marked
    dynamic: two batch sizes share one graph."""
    step = compiled_loss(trained.model, backend, args.flow)
    generator = torch.Generator().manual_seed(0)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    vocab = trained.model.config.vocab_size

    def train_step(size: int) -> None:
        ids, labels = batch(vocab, size, args.seq, trained.masked_lm, device, generator)
        torch._dynamo.mark_dynamic(ids, 0)
        torch._dynamo.mark_dynamic(labels, 0)
        with autocast:
            loss = step(ids, labels)
        loss.backward()
        trained.optimizer.step()
        trained.optimizer.zero_grad(set_to_none=True)

    return train_step


def training_step(name: str, backend, args, device: torch.device, layers: int | None = None):
    """(train_step(batch size), optimizer) for a fresh model: one compiled AdamW step under bf16 autocast.

    Seeds, gradient-norm estimates and memopt's reports start afresh, so every variant sees the same weights
    and batches. The batch dimension is marked dynamic: two batch sizes share one graph."""
    trained = trainee(name, args, device, layers)
    return step_of(trained, backend, args, device), trained.optimizer


def wta_groups() -> int:
    """Groups of linears WTA-CRS rewrote, over the latest report of each graph."""
    latest = {report.graph_id: report for report in fxpass.reports()}.values()
    return sum(r.rule == "wta_crs" and r.applied for report in latest for r in report.records)


def saved_bytes(fn: Callable[[], None], skip: set[int]) -> int:
    """Bytes of the distinct storages ``fn`` saves for backward, those whose address is in ``skip`` (the
    weights, alive anyway) left out: what a step keeps from its forward to its backward, on any device."""
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in skip:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn()
    return sum(storages.values())


def measure_memory(trained: Trainee, train_step: Callable[[int], None], result: Result, args, device) -> None:
    """``result``'s peak, activations and extrapolated largest batch (CUDA), and its saved bytes (any device)."""
    weights = {p.untyped_storage().data_ptr() for p in trained.model.parameters()}
    result.saved_mib = saved_bytes(lambda: train_step(args.batch), weights) / MiB
    if device.type != "cuda":
        return
    half = max(1, args.batch // 2)
    _, small_peak, _ = cuda_peak(lambda: train_step(half))
    _, peak, before = cuda_peak(lambda: train_step(args.batch))
    result.peak_gib, result.activations_gib = peak / GiB, (peak - before) / GiB
    if peak > small_peak and args.batch > half:
        per_sample = (peak - small_peak) / (args.batch - half)
        capacity = 0.95 * torch.cuda.get_device_properties(device).total_memory
        result.max_batch = int(args.batch + (capacity - peak) / per_sample)


Prepared = tuple[Result, Callable[[int], None] | None]


def prepare(trained: Trainee, variant: str, backend, args, device: torch.device) -> Prepared:
    """Compile ``variant``'s step on the shared model and measure its memory: (its row, its step for the timed
    rotation, None if it failed: its note says why)."""
    result = Result(trained.name, variant, args.batch, args.seq)
    fxpass.clear_reports()
    train_step: Callable[[int], None] | None = step_of(trained, backend, args, device)
    try:
        start = time.perf_counter()
        for _ in range(2):  # compile, then let the optimizer state appear
            train_step(args.batch)
        log.info("%s / %s: compiled and warmed up in %.0f s", trained.name, variant, time.perf_counter() - start)
        result.wta_groups = wta_groups()
        measure_memory(trained, train_step, result, args, device)
    except torch.OutOfMemoryError:
        result.note, train_step = "out of memory", None
    except Exception as error:
        result.note, train_step = error_note(error), None
        log.exception("%s / %s failed", trained.name, variant)
    if train_step is None:
        trained.optimizer.zero_grad(set_to_none=True)  # a step that failed midway leaves its gradients
        release_memory(forget_compiled=False)
    log.info("%s", result)
    return result, train_step


def footprint(result: Result, device: torch.device) -> float | None:
    """What the peak match compares, in bytes: the step's activations (its peak above what was allocated before
    it) on CUDA; elsewhere, without an allocator peak, the bytes it saves for backward."""
    if device.type == "cuda":
        return None if result.activations_gib is None else result.activations_gib * GiB
    return None if result.saved_mib is None else result.saved_mib * MiB


def matched_budget(
    measure: Callable[[float], float],
    target: float,
    known: Mapping[float, float] | None = None,
    tries: int = 6,
    close: float = 0.02,
) -> tuple[float | None, dict[float, float]]:
    """The largest activation budget x in [0, 1] tried whose ``measure(x)`` (a memory) is not above ``target``,
    and every budget tried → its memory (``known`` ones first, in the order measured); None if none was.

    Memory grows with the budget, by steps (the partitioner's choices are discrete), so this keeps a bracket
    [largest budget within the target, smallest above it] and probes inside it where a straight line between
    its ends meets the target (just below it, kept off the ends), until a probe comes within ``close`` of the
    target from below, a probe raises the bracket's bottom but not its memory (a flat stretch: what is left is
    where the jump lies), the bracket is 1/64 wide, or ``tries`` probes are spent. With nothing within the target
    yet, the line runs through the two lowest budgets above it, and the last probe is budget 0. Budget 1 (memopt
    as it is) comes first: known, as memopt's own row, or measured. Each probe is a compile, hence the few."""
    points = dict(known or {})
    for left in range(tries, 0, -1):
        budget = next_budget(points, target, close, last=left == 1)
        if budget is None:
            break
        points[budget] = measure(budget)
    within = [budget for budget, memory in points.items() if memory <= target]
    return (max(within) if within else None), points


def next_budget(points: Mapping[float, float], target: float, close: float, last: bool) -> float | None:
    """``matched_budget``'s next probe, None when it is done (see there)."""
    if 1.0 not in points:
        return 1.0
    aim = target * (1 - close / 2)
    low = max((b for b, memory in points.items() if memory <= target), default=None)
    if low == 1.0 or (low is not None and points[low] >= (1 - close) * target) or _flat_raise(points, low, close):
        return None
    above = sorted(b for b, memory in points.items() if memory > target and (low is None or b > low))
    high = above[0]
    if low is None:
        if last or high <= 1 / 64:
            return None if 0.0 in points else 0.0
        guess = _line(points, above[1], high, aim) if len(above) > 1 else high * aim / points[high]
        budget = round(high / 2 if guess >= high else max(guess, 0.0), 3)
        if budget in points:
            return None if 0.0 in points else 0.0
    else:
        if high - low <= 1 / 64:
            return None
        margin = (high - low) / 8
        budget = round(min(max(_line(points, low, high, aim), low + margin), high - margin), 3)
    return None if budget in points else budget


def _flat_raise(points: Mapping[float, float], low: float | None, close: float) -> bool:
    """Whether the latest probe raised the largest budget within the target without raising its memory: the
    memory is flat up to it, and the jump above the target lies between it and the bracket's top, where further
    probes would only locate the jump (AOTAutograd's knapsack below budget 1 may keep less than its default
    partition at 1 keeps: a jump at 1 itself)."""
    latest = next(reversed(points), None)
    if low is None or latest != low:
        return False
    return any(b < low and math.isclose(memory, points[low], rel_tol=close / 4) for b, memory in points.items())


def _line(points: Mapping[float, float], a: float, b: float, aim: float) -> float:
    """The budget where the straight line through budgets ``a`` and ``b``'s memories reaches ``aim``; their
    middle where the line is flat, falls, or runs through a failed probe (infinite memory): such memories say
    nothing about where the target lies."""
    rise = points[b] - points[a]
    if not math.isfinite(rise) or rise == 0 or (rise > 0) != (b > a):
        return (a + b) / 2
    return a + (aim - points[a]) * (b - a) / rise


def match_peak(
    trained: Trainee, wta: Result, known: Mapping[float, float], args, device
) -> tuple[PeakMatch, Prepared | None]:
    """Search the activation budget whose memory matches ``wta``'s (``matched_budget``, each probe a compile on
    the shared model): the match, and the chosen probe's row and step for the timed rotation (None where no probe
    was chosen: budget 1 is memopt's own row, or budget 0 was never reached). The other probes' steps are
    dropped; their graphs stay in Dynamo's cache, unused, until the model's variants are done."""
    target = footprint(wta, device)
    assert target is not None, wta
    probes: dict[float, Prepared] = {}

    def measure(budget: float) -> float:
        variant = f"memopt + activation budget {budget:g}"
        probes[budget] = prepare(trained, variant, recompute(budget, args), args, device)
        memory = footprint(probes[budget][0], device)
        return math.inf if memory is None else memory

    budget, tried = matched_budget(measure, target, known, tries=args.match_tries)
    log.info("%s / %s: %s; activation budget → memory %s; chosen %s", trained.name, wta.variant, _bytes(target),
             {b: _bytes(m) for b, m in tried.items()}, budget)
    chosen = probes.get(0.0 if budget is None else budget)
    for row, _ in probes.values():
        if chosen is None or row is not chosen[0]:
            record(args.out, row)  # done: the chosen one is recorded once timed
    if chosen is not None:
        matched = wta.variant.removeprefix("memopt + ")
        chosen[0].variant = f"memopt + activation budget {budget or 0:g} (peak-matched to {matched})"
    return PeakMatch(wta, None if chosen is None else chosen[0], budget, tried), chosen


def _bytes(amount: float) -> str:
    return f"{amount / GiB:.2f} GiB" if amount >= GiB else f"{amount / MiB:.2f} MiB"


def time_in_turns(prepared: list[Prepared], args, device: torch.device) -> None:
    """Every step that compiled, one of each in turn, ``args.steps`` times after one untimed round (the allocator
    settles after the other variants' compiles): each row's median. A step that fails here gets its note and
    leaves the rotation; the others go on."""
    running = [(result, step) for result, step in prepared if step is not None]
    timed = [lambda step=step: e2e.step_ms(lambda: step(args.batch), device) for _, step in running]
    in_turns(1, timed)
    for (result, _), (times, error) in zip(running, in_turns(args.steps, timed), strict=True):
        if error is not None:
            result.note = "out of memory" if isinstance(error, torch.OutOfMemoryError) else error_note(error)
        elif times:
            result.step_ms = statistics.median(times)


def run_model(name: str, chosen: dict[str, object], args, device: torch.device) -> tuple[list[Result], list[PeakMatch]]:
    """One model's rows and peak matches (``measure_model``); then its compiled graphs and memory go."""
    start = time.perf_counter()
    try:
        return measure_model(name, chosen, args, device)
    finally:
        release_memory()
        log.info("%s: all variants done in %.0f s", name, time.perf_counter() - start)


def measure_model(
    name: str, chosen: dict[str, object], args, device: torch.device
) -> tuple[list[Result], list[PeakMatch]]:
    """Every variant compiled on one shared model and measured, the peak matches searched, then all timed in
    turns (``time_in_turns``) and, with ``--verify-largest``, their largest batches run."""
    trained = trainee(name, args, device)
    prepared: list[Prepared] = []
    for variant, backend in chosen.items():
        prepared.append(prepare(trained, variant, backend, args, device))
    matches = match_peak_of(trained, prepared, args, device) if args.match_peak else []
    time_in_turns(prepared, args, device)
    if args.verify_largest and device.type == "cuda":
        for result, step in prepared:
            if step is not None and result.max_batch:
                result.largest_run = largest_that_runs(runs_without_oom(step), result.max_batch)
    for result, _ in prepared:
        record(args.out, result)
    return [result for result, _ in prepared], matches


def match_peak_of(trained: Trainee, prepared: list[Prepared], args, device: torch.device) -> list[PeakMatch]:
    """A peak match for each WTA-CRS variant that ran, its chosen probe appended to ``prepared``; memopt's own row,
    where it ran, is budget 1's point."""
    memopt_row = next((r for r, step in prepared if r.variant == "memopt" and step is not None), None)
    own = None if memopt_row is None else footprint(memopt_row, device)
    known = {} if own is None else {1.0: own}
    matches = []
    for result, step in list(prepared):
        if WTA_VARIANT.fullmatch(result.variant) and step is not None:
            match, probe = match_peak(trained, result, known, args, device)
            if probe is not None:
                prepared.append(probe)
            elif match.budget == 1.0:
                match.recompute = memopt_row
            matches.append(match)
    return matches


def record(out: Path, result: Result) -> None:
    """Append a finished row to the partial log, which survives a time limit: a model's rows once timed, its
    peak-match probes not chosen (never timed) once their search ends."""
    with (out / "wta_crs.partial.jsonl").open("a") as partial:
        partial.write(json.dumps(dataclasses.asdict(result)) + "\n")


def largest_that_runs(runs, estimate: int, step: float = 0.04, tries: int = 5) -> int | None:
    """The largest batch, within a factor ``1 + step``, for which ``runs(batch)`` is true, searched from
    ``estimate``: down in steps of ``step`` until one runs, or up until one does not. None if nothing tried
    ran. ``runs`` is a training step that answers False when it runs out of memory."""
    size = estimate
    if runs(size):
        for _ in range(tries):
            larger = max(size + 1, int(size * (1 + step)))
            if not runs(larger):
                break
            size = larger
        return size
    for _ in range(tries):
        size = int(size * (1 - step))
        if size >= 1 and runs(size):
            return size
    return None


def runs_without_oom(train_step):
    """``train_step`` as a predicate: True if a step at that batch completes, False if it runs out of device
    memory (the cached blocks it left are released; the compiled graph stays: the batch dimension is dynamic)."""

    def runs(size: int) -> bool:
        try:
            train_step(size)
            torch.cuda.synchronize()
            return True
        except torch.OutOfMemoryError:
            release_memory(forget_compiled=False)
            return False

    return runs


def _ratio(value: float | None, base: float | None) -> str:
    return "—" if value is None or not base else f"{value / base:.2f}"


def table(results: list[Result]) -> str:
    """The rows as markdown; step and peak ratios are against the model's torch.compile row (else its first)."""
    fmt = lambda v, spec: "—" if v is None else format(v, spec)  # noqa: E731
    lines = [
        "| model | variant | batch × seq | step (ms) | step ratio | peak (GiB) | peak ratio | activations (GiB) "
        "| saved (MiB) | largest batch (extrapolated) | largest batch run | WTA-CRS groups | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        same = [other for other in results if other.model == r.model]
        base = next((other for other in same if other.variant == "torch.compile"), same[0])
        lines.append(
            f"| {r.model} | {r.variant} | {r.batch} × {r.seq} | {fmt(r.step_ms, '.1f')} "
            f"| {_ratio(r.step_ms, base.step_ms)} | {fmt(r.peak_gib, '.2f')} | {_ratio(r.peak_gib, base.peak_gib)} "
            f"| {fmt(r.activations_gib, '.2f')} | {fmt(r.saved_mib, '.2f')} | {fmt(r.max_batch, 'd')} "
            f"| {fmt(r.largest_run, 'd')} | {r.wta_groups} | {r.note} |"
        )
    return "\n".join(lines)


def match_line(match: PeakMatch, device: torch.device) -> str:
    """One sentence per WTA-CRS variant: its time and memory, recomputation's at the matched memory, the ratio
    and which is faster there."""
    wta, other = match.wta, match.recompute
    label = wta.variant.removeprefix("memopt + ")
    tried = ", ".join(f"{budget:g} → {_bytes(memory)}" for budget, memory in match.tried.items())
    what = "activations" if device.type == "cuda" else "saved"
    searched = f" (activation budgets tried, {what}: {tried})"
    if other is None or other.step_ms is None or wta.step_ms is None:
        note = other.note if other is not None else "no probe ran"
        return f"{wta.model}, {label}: no timed comparison ({wta.note or note}){searched}"
    ratio = wta.step_ms / other.step_ms
    if match.budget is None:
        return (
            f"{wta.model}, {label}: {wta.step_ms:.1f} ms at {_memory(wta, device)}; even activation budget 0 keeps "
            f"more ({_memory(other, device)}, {other.step_ms:.1f} ms): no recomputation reaches WTA-CRS's memory; "
            f"WTA-CRS is {ratio:.2f}× budget 0's time{searched}"
        )
    verdict_text = verdict(ratio, _memory_value(wta, device)[0], _memory_value(other, device)[0])
    return (
        f"{wta.model}, {label}: {wta.step_ms:.1f} ms at {_memory(wta, device)}; recomputation at the matched peak "
        f"(activation budget {match.budget:g}): {other.step_ms:.1f} ms at {_memory(other, device)}; WTA-CRS is "
        f"{ratio:.2f}× its time: {verdict_text}{searched}"
    )


# Memories within this fraction of each other count as one peak: the search's staircase rarely lands closer.
SAME_PEAK = 0.03


def verdict(ratio: float, wta_memory: float | None, recompute_memory: float | None) -> str:
    """Which tool serves that peak. The matched recomputation keeps at most WTA-CRS's memory, often less (its
    budgets move memory in steps): where it keeps clearly less yet runs slower, neither dominates."""
    if ratio >= 1:
        return "recomputation wins (no slower, at a peak no higher)"
    if wta_memory and recompute_memory is not None and recompute_memory < (1 - SAME_PEAK) * wta_memory:
        lower = 1 - recompute_memory / wta_memory
        return (f"neither wins: WTA-CRS is faster, recomputation's memory {100 * lower:.0f} % lower "
                "(no activation budget tried lands between)")
    return "WTA-CRS wins (faster at the same peak)"


def _memory_value(result: Result, device: torch.device) -> tuple[float | None, str]:
    """The memory a row is compared by, with its unit: the peak on CUDA, the bytes saved for backward elsewhere."""
    if device.type == "cuda" and result.peak_gib is not None:
        return result.peak_gib, "GiB"
    return result.saved_mib, "MiB saved"


def _memory(result: Result, device: torch.device) -> str:
    value, unit = _memory_value(result, device)
    return f"{value:.2f} {unit}" if value is not None else "—"


def variant_names(text: str) -> list[str]:
    """``--variants``' names: split at commas, except the one inside "memopt + WTA-CRS b, every group"."""
    return [name.strip() for name in re.split(r",(?! every group)", text)]


def main(argv: list[str] | None = None) -> list[Result]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="gpt2-medium,bert-base")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--budgets", default="0.3,0.1")
    parser.add_argument("--variants", default=None, help="comma-separated variant names, run in that order")
    parser.add_argument("--steps", type=int, default=5, help="timed steps of each variant, in turns")
    parser.add_argument("--verify-largest", action="store_true", help="run a step at the extrapolated largest batch")
    parser.add_argument("--combine-budget", type=float, default=None, help="add WTA-CRS under this activation budget")
    parser.add_argument("--match-peak", action="store_true",
                        help="add memopt under the activation budget whose memory matches each WTA-CRS variant's")
    parser.add_argument("--match-tries", type=int, default=6, help="the most compiles one peak match may take")
    parser.add_argument("--inner", default="inductor", choices=["inductor", "aot_eager"],
                        help="the compiler behind every variant (aot_eager: CPU smoke runs)")
    parser.add_argument("--memopt-options", default="{}", help="JSON options for every memopt variant")
    add_step_arguments(parser)
    args = parser.parse_args(argv)
    set_up(args.out)
    device = torch.device(args.device)
    budgets = [float(b) for b in args.budgets.split(",") if b]
    chosen = backends(budgets, args.mode, args.combine_budget, args.inner, json.loads(args.memopt_options))
    if args.variants:
        chosen = {k: chosen[k] for k in variant_names(args.variants) if k in chosen}  # in the order given
    logging.getLogger("fxpass").setLevel(logging.WARNING)  # the per-graph decision tables: see the debug dir
    results, matches = [], []
    # every variant and peak-match probe of a model compiles the same function: more graphs than Dynamo's default
    with torch._dynamo.config.patch(recompile_limit=max(64, torch._dynamo.config.recompile_limit)):
        for name in args.models.split(","):
            rows, found = run_model(name, chosen, args, device)
            results += rows
            matches += found
    title = header("WTA-CRS fine-tuning step", device)
    dropout = {"0": ", dropout off", "config": ", HF configs' dropout"}.get(args.dropout, "")
    title += f", bf16 autocast, AdamW, {args.flow}, {args.attention} attention{dropout}"
    title += f"{', ' + args.inner if args.inner != 'inductor' else ''}{' (tiny models)' if args.tiny else ''}"
    (args.out / "wta_crs.json").write_text(json.dumps([dataclasses.asdict(r) for r in results], indent=2))
    if matches:
        (args.out / "wta_crs_matches.json").write_text(json.dumps([_match_json(m) for m in matches], indent=2))
    lines = [f"- {match_line(match, device)}" for match in matches]
    write_report(args.out, "wta_crs.md", "\n".join([title, "", table(results), *(["", *lines] if lines else [])]))
    return results


def _match_json(match: PeakMatch) -> dict:
    return {
        "model": match.wta.model, "wta": match.wta.variant, "budget": match.budget,
        "recompute": None if match.recompute is None else match.recompute.variant,
        "tried": {f"{budget:g}": memory for budget, memory in match.tried.items()},
    }


if __name__ == "__main__":
    main()
