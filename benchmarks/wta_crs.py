"""WTA-CRS fine-tuning steps: peak memory, step time and the largest batch that fits, per backend.

    python benchmarks/wta_crs.py                                    # GPT-2-medium and BERT-base shapes, seq 512
    python benchmarks/wta_crs.py --models gpt2-medium --seq 1024
    python benchmarks/wta_crs.py --models tinyllama                 # TinyLlama-1.1B's shape: SwiGLU, GQA
    python benchmarks/wta_crs.py --tiny --device cpu                # a smoke run of the script itself

Models are built from configs (random init, no downloads) and trained with AdamW under bf16 autocast. Each
variant compiles the same loss-only step: plain ``torch.compile`` (Inductor), ``torch.compile`` with
AOTAutograd's activation memory budget at 0.5 (exact recomputation, the baseline a sampled gradient must
beat), memopt with WTA-CRS off, and memopt with WTA-CRS at each budget. Peak = ``max_memory_allocated`` over
a step (weights and optimizer state included); "activations" = that peak minus what was allocated before the
step. The largest batch is extrapolated from the peaks at two batch sizes (memory is linear in the batch);
``--verify-largest`` then runs steps from that batch, down by 4 % until one fits or up by 4 % until one does
not, so the figure is measured (within 4 %), not only predicted. ``--combine-budget`` adds memopt with
WTA-CRS and the activation budget together.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fxpass
from benchmarks._common import cuda_peak, error_note, header, release_memory, set_up, write_report
from lowerings.wta_crs import reset_estimates

log = logging.getLogger("benchmarks.wta_crs")
GiB = 1 << 30


def build(name: str, tiny: bool, layers: int | None = None, attention: str = "sdpa"):
    """(model, masked_lm) for a named configuration, random init; ``layers`` overrides the depth; ``attention``
    is HF's ``attn_implementation``: "sdpa" (their default, which memopt leaves alone) or "eager" (explicit
    scores, which memopt's flash-attention rule rewrites: every rewrite in one step)."""
    import transformers

    if name == "gpt2-medium":
        sizes = dict(n_layer=2, n_embd=64, n_head=2) if tiny else dict(n_layer=24, n_embd=1024, n_head=16)
        sizes["n_layer"] = layers or sizes["n_layer"]
        config = transformers.GPT2Config(
            vocab_size=50257, n_positions=1024, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            attn_implementation=attention, **sizes,
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
        config = transformers.BertConfig(
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attn_implementation=attention, **sizes
        )
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
    memopt's backend hands its graph to the same partitioner, so the two can be combined."""
    compiled = torch.compile(fn, backend=backend, mode=mode)

    def run(*args):
        with torch._functorch.config.patch(activation_memory_budget=budget):
            return compiled(*args)

    return run


def backends(budgets: list[float], mode: str | None = None, combine: float | None = None) -> dict[str, object]:
    """Variant name → backend; ``mode`` (e.g. "reduce-overhead": CUDA graphs) applies to every variant;
    ``combine`` adds memopt with WTA-CRS at the first budget under that activation budget."""
    found: dict[str, object] = {
        "torch.compile": functools.partial(torch.compile, mode=mode),
        "torch.compile + activation budget 0.5": functools.partial(
            compile_with_activation_budget, budget=0.5, mode=mode
        ),
        "memopt": fxpass.MemoptBackend(mode=mode),
    }
    for budget in budgets:
        found[f"memopt + WTA-CRS {budget}"] = fxpass.MemoptBackend(mode=mode, options={"wta_crs_budget": budget})
    if combine is not None and budgets:
        wta = fxpass.MemoptBackend(mode=mode, options={"wta_crs_budget": budgets[0]})
        found[f"memopt + WTA-CRS {budgets[0]} + activation budget {combine}"] = functools.partial(
            compile_with_activation_budget, budget=combine, backend=wta
        )
    return found


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
    parser.add_argument("--tiny", action="store_true", help="small models: check the script, not the numbers")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=Path("benchmark_results"))


def training_step(name: str, backend, args, device: torch.device, layers: int | None = None):
    """(train_step(batch size), optimizer) for a fresh model: one compiled AdamW step under bf16 autocast.

    Seeds, gradient-norm estimates and memopt's reports start afresh, so every variant sees the same weights
    and batches. The batch dimension is marked dynamic: two batch sizes share one graph."""
    torch.manual_seed(0)
    reset_estimates()
    fxpass.clear_reports()
    model, masked_lm = build(name, args.tiny, layers, args.attention)
    model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    vocab = model.config.vocab_size
    loss_of = lambda ids, labels: model(input_ids=ids, labels=labels).loss  # noqa: E731
    step = backend(loss_of) if isinstance(backend, functools.partial) else torch.compile(loss_of, backend=backend)
    generator = torch.Generator().manual_seed(0)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)

    def train_step(size: int) -> None:
        ids, labels = batch(vocab, size, args.seq, masked_lm, device, generator)
        torch._dynamo.mark_dynamic(ids, 0)
        torch._dynamo.mark_dynamic(labels, 0)
        with autocast:
            loss = step(ids, labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return train_step, optimizer


def wta_groups() -> int:
    """Groups of linears WTA-CRS rewrote, over the latest report of each graph."""
    latest = {report.graph_id: report for report in fxpass.reports()}.values()
    return sum(r.rule == "wta_crs" and r.applied for report in latest for r in report.records)


def measure(name: str, variant: str, backend, args, device) -> Result:
    result = Result(name, variant, args.batch, args.seq)
    train_step, optimizer = training_step(name, backend, args, device)

    def peak_of(size: int) -> tuple[int, int]:
        if device.type != "cuda":
            return 0, 0
        _, peak, before = cuda_peak(lambda: train_step(size))
        return peak, peak - before

    try:
        start = time.perf_counter()
        for _ in range(2):  # compile, then let the optimizer state appear
            train_step(args.batch)
        log.info("%s / %s: compiled and warmed up in %.0f s", name, variant, time.perf_counter() - start)
        small_peak, _ = peak_of(max(1, args.batch // 2))
        peak, activations = peak_of(args.batch)
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            train_step(args.batch)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(1000 * (time.perf_counter() - start))
        result.step_ms = statistics.median(times)
        result.peak_gib, result.activations_gib = peak / GiB, activations / GiB
        if device.type == "cuda" and peak > small_peak:
            per_sample = (peak - small_peak) / (args.batch - max(1, args.batch // 2))
            capacity = 0.95 * torch.cuda.get_device_properties(device).total_memory
            result.max_batch = int(args.batch + (capacity - peak) / per_sample)
            if args.verify_largest:
                result.largest_run = largest_that_runs(runs_without_oom(train_step), result.max_batch)
        result.wta_groups = wta_groups()
    except torch.OutOfMemoryError:
        result.note = "out of memory"
    except Exception as error:
        result.note = error_note(error)
        log.exception("%s / %s failed", name, variant)
    finally:
        optimizer.state.clear()
        release_memory()
    log.info("%s", result)
    return result


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


def table(results: list[Result]) -> str:
    fmt = lambda v, spec: "—" if v is None else format(v, spec)  # noqa: E731
    lines = [
        "| model | variant | batch × seq | step (ms) | peak (GiB) | activations (GiB) | largest batch (extrapolated) "
        "| largest batch run | WTA-CRS groups | note |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.model} | {r.variant} | {r.batch} × {r.seq} | {fmt(r.step_ms, '.1f')} | {fmt(r.peak_gib, '.2f')} "
            f"| {fmt(r.activations_gib, '.2f')} | {fmt(r.max_batch, 'd')} | {fmt(r.largest_run, 'd')} "
            f"| {r.wta_groups} | {r.note} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[Result]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="gpt2-medium,bert-base")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--budgets", default="0.3,0.1")
    parser.add_argument("--variants", default=None, help="comma-separated variant names, run in that order")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--verify-largest", action="store_true", help="run a step at the extrapolated largest batch")
    parser.add_argument("--combine-budget", type=float, default=None, help="add WTA-CRS under this activation budget")
    add_step_arguments(parser)
    args = parser.parse_args(argv)
    set_up(args.out)
    device = torch.device(args.device)
    chosen = backends([float(b) for b in args.budgets.split(",") if b], args.mode, args.combine_budget)
    if args.variants:
        chosen = {k: chosen[k] for k in args.variants.split(",") if k in chosen}  # in the order given
    logging.getLogger("fxpass").setLevel(logging.WARNING)  # the per-graph decision tables: see the debug dir
    results = []
    for name in args.models.split(","):
        for variant, backend in chosen.items():
            results.append(measure(name, variant, backend, args, device))
            with (args.out / "wta_crs.partial.jsonl").open("a") as partial:  # survives a time limit
                partial.write(json.dumps(dataclasses.asdict(results[-1])) + "\n")
    title = header("WTA-CRS fine-tuning step", device)
    title += f", bf16 autocast, AdamW, {args.attention} attention{' (tiny models)' if args.tiny else ''}"
    (args.out / "wta_crs.json").write_text(json.dumps([dataclasses.asdict(r) for r in results], indent=2))
    write_report(args.out, "wta_crs.md", title + "\n\n" + table(results))
    return results


if __name__ == "__main__":
    main()
