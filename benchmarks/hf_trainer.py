"""HF ``Trainer`` with ``bf16=True``: ``TrainingArguments(torch_compile=True)`` (Inductor) against memopt's route.

    python benchmarks/hf_trainer.py --out benchmark_results/hf_trainer     # GPT-2 small and Llama-3.2-1B's shape
    python benchmarks/hf_trainer.py --models gpt2 --variants torch.compile/sdpa,memopt/eager
    python benchmarks/hf_trainer.py --smoke --out /tmp/hf_trainer           # CPU, tiny configs: checks the script

On an H200 a variant takes one to three minutes (mostly Inductor's compile); run one model a call where a
call has a time limit. Each result is also appended to ``hf_trainer.partial.jsonl`` as soon as it exists.

Each variant trains a fresh model built from a config (random init, no download, dropout 0) on synthetic token
rows of full length (labels = inputs, no padding) with a real ``transformers.Trainer``: ``bf16=True`` (autocast
over fp32 weights), the default AdamW, ``max_steps = warmup + steps``. Variants are ``<route>/<attention>``:
``torch.compile`` is ``TrainingArguments(torch_compile=True)`` (accelerate wraps the model in
``torch.compile(backend="inductor")``); ``memopt`` is ``fxpass.integrations.transformers.compile_model`` before
the Trainer, torch_compile left off; the attention is HF's ``attn_implementation`` (``sdpa``, their default,
which memopt leaves as is, or ``eager``, which memopt rewrites into its flash kernel).

Step time: the median interval between consecutive ``on_step_end`` callbacks after the warm-up steps (compile,
optimizer state), the device synchronized at each, so it includes data loading, clipping and the optimizer.
Peak: ``torch.cuda.max_memory_allocated`` over the measured steps (weights, gradients and AdamW state included).
The ratio column divides by the first ``torch.compile`` variant of the same model. ``--memory-history DIR``
records the first measured step's allocations and writes where they peaked and what was alive there
(``_common.peak_breakdown``); ``--optim`` picks the Trainer's optimizer (``adamw_torch_fused`` against the
default, to see whether the optimizer step is where a step peaks).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fxpass
from benchmarks._common import error_note, header, peak_breakdown, release_memory, set_up, write_report

log = logging.getLogger("benchmarks.hf_trainer")
GiB = 1 << 30
MODELS = ("gpt2", "llama-3.2-1b")
VARIANTS = ("torch.compile/sdpa", "memopt/sdpa", "memopt/eager")
BATCH = {"gpt2": (16, 1024), "llama-3.2-1b": (4, 2048)}  # (rows, tokens a row)
SMOKE_BATCH, SMOKE_VOCAB = (2, 16), 384


@dataclasses.dataclass
class Result:
    model: str
    variant: str
    batch: int
    seq: int
    step_ms: float | None = None
    tokens_per_s: float | None = None
    peak_gib: float | None = None
    peak_ratio: float | None = None  # peak / the first torch.compile variant's peak (same model)
    # forward + backward only: AdamW's update of a large model can set the step's peak, which no rewrite touches
    train_peak_gib: float | None = None
    train_peak_ratio: float | None = None
    warmup_s: float | None = None
    losses: list[float] = dataclasses.field(default_factory=list)
    rewrites: dict[str, int] = dataclasses.field(default_factory=dict)  # rule -> applied, over memopt's graphs
    note: str = ""


def build_model(name: str, attention: str, smoke: bool, dropout: float):
    """A causal LM from a config: GPT-2 small, or Llama-3.2-1B's shape; with ``smoke`` a tiny one of each."""
    import transformers

    if name == "gpt2":
        sizes = dict(n_embd=32, n_layer=2, n_head=2, vocab_size=SMOKE_VOCAB) if smoke else {}
        config = transformers.GPT2Config(
            n_positions=1024, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, **sizes
        )
        return transformers.GPT2LMHeadModel._from_config(config, attn_implementation=attention)
    if name == "llama-3.2-1b":
        sizes = dict(
            vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
            num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        )
        if smoke:
            sizes = dict(
                vocab_size=SMOKE_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            )
        config = transformers.LlamaConfig(
            max_position_embeddings=8192 if not smoke else 64, rope_theta=500000.0, tie_word_embeddings=True,
            attention_dropout=dropout, bos_token_id=1, eos_token_id=2, **sizes,
        )
        return transformers.LlamaForCausalLM._from_config(config, attn_implementation=attention)
    raise SystemExit(f"unknown model {name!r}; choose from {', '.join(MODELS)}")


class Tokens(torch.utils.data.Dataset):
    """Uniform random token rows of full length; the labels are the inputs (the model shifts them)."""

    def __init__(self, rows: int, seq: int, vocab: int, seed: int = 0) -> None:
        self.ids = torch.randint(0, vocab, (rows, seq), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def step_timer(warmup: int, history: Path | None = None):
    """A ``TrainerCallback`` recording the end time of every optimizer step and, after ``warmup`` steps, the CUDA
    peak of the whole run and that of forward + backward alone (up to each optimizer step). With ``history``, the
    first measured step's allocations are recorded and where they peaked is written there as text."""
    import transformers

    class StepTimer(transformers.TrainerCallback):
        def __init__(self) -> None:
            self.ends: list[float] = []
            self.peak: int | None = None
            self.train_peak: int | None = None
            self.start = time.perf_counter()
            self.recording_from: int | None = None

        def _measuring(self) -> bool:
            return len(self.ends) >= warmup and torch.cuda.is_available()

        def on_step_begin(self, args, state, control, **kwargs):
            if self._measuring():
                self.peak = max(self.peak or 0, torch.cuda.max_memory_allocated())
                torch.cuda.reset_peak_memory_stats()
                if history is not None and len(self.ends) == warmup:
                    torch.cuda.synchronize()
                    self.recording_from = torch.cuda.memory_allocated()
                    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            if self._measuring():
                self.train_peak = max(self.train_peak or 0, torch.cuda.max_memory_allocated())

        def on_step_end(self, args, state, control, **kwargs):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.ends.append(time.perf_counter())
            if self.recording_from is not None:
                trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
                torch.cuda.memory._record_memory_history(enabled=None)
                history.write_text(peak_breakdown(trace, self.recording_from) + "\n")
                self.recording_from = None
            if len(self.ends) == warmup and torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()

        def on_train_end(self, args, state, control, **kwargs):
            if self._measuring():
                torch.cuda.synchronize()
                self.peak = max(self.peak or 0, torch.cuda.max_memory_allocated())

    return StepTimer()


def applied_rewrites() -> dict[str, int]:
    """Applied decisions per rule, over the latest report of each graph memopt compiled."""
    counts: dict[str, int] = {}
    for report in {r.graph_id: r for r in fxpass.reports()}.values():
        for record in report.applied:
            counts[record.rule] = counts.get(record.rule, 0) + 1
    return counts


def memopt_options(args: argparse.Namespace) -> dict[str, Any]:
    """memopt's options: the smoke run forces rewrites that do not pay at its toy sizes."""
    options: dict[str, Any] = {"inner_compiler": args.compiler}
    if args.smoke:
        options["force"] = True
    return options


def run_variant(name: str, variant: str, args: argparse.Namespace, out: Path) -> Result:
    """Train ``warmup + steps`` Trainer steps of one model under one variant; its timings, peak and rewrites."""
    import transformers

    from fxpass.integrations.transformers import compile_model, missing_loss_type

    route, attention = variant.split("/")
    rows, seq = SMOKE_BATCH if args.smoke else BATCH[name]
    result = Result(name, variant, rows, seq)
    torch.manual_seed(0)
    fxpass.clear_reports()
    model = build_model(name, attention, args.smoke, args.dropout)
    # Every route gets the loss type compile_model sets: GPT-2's None makes transformers warn, which breaks
    # torch.compile's graph too, and makes the Trainer count num_items_in_batch over unshifted labels.
    model.loss_type = missing_loss_type(model) or model.loss_type
    if route == "memopt":
        compile_model(model, options=memopt_options(args))
    elif route != "torch.compile":
        raise SystemExit(f"unknown route {route!r} in {variant!r}: torch.compile or memopt")
    history = None
    if args.memory_history is not None:
        args.memory_history.mkdir(parents=True, exist_ok=True)
        history = args.memory_history / f"{name}-{variant.replace('/', '-')}-peak.md"
    timer = step_timer(args.warmup, history)
    steps = args.warmup + args.steps
    training = transformers.TrainingArguments(
        output_dir=str(out / "trainer"), max_steps=steps, per_device_train_batch_size=rows, bf16=True,
        gradient_accumulation_steps=args.grad_accum, torch_compile=route == "torch.compile",
        torch_compile_backend=args.compiler if route == "torch.compile" else None, logging_steps=1,
        save_strategy="no", report_to=[], seed=0, dataloader_num_workers=0, use_cpu=not torch.cuda.is_available(),
        **({"optim": args.optim} if args.optim else {}),
    )
    data = Tokens(rows * args.grad_accum * steps, seq, model.config.vocab_size)
    trainer = transformers.Trainer(model=model, args=training, train_dataset=data, callbacks=[timer])
    try:
        trainer.train()
        intervals = [b - a for a, b in zip(timer.ends[args.warmup - 1 :], timer.ends[args.warmup :], strict=False)]
        result.warmup_s = timer.ends[args.warmup - 1] - timer.start
        result.step_ms = 1000 * statistics.median(intervals) if intervals else None
        tokens = rows * seq * args.grad_accum
        result.tokens_per_s = tokens / (result.step_ms / 1000) if result.step_ms else None
        result.peak_gib = timer.peak / GiB if timer.peak is not None else None
        result.train_peak_gib = timer.train_peak / GiB if timer.train_peak is not None else None
        result.losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    except torch.OutOfMemoryError:
        result.note = "out of memory"
    except Exception as error:
        result.note = error_note(error)
        log.exception("%s / %s failed", name, variant)
    finally:
        result.rewrites = applied_rewrites() if route == "memopt" else {}
        del trainer, model
        release_memory()
    log.info("%s", result)
    return result


def with_ratios(results: list[Result]) -> list[Result]:
    """Fill the ratios: each peak over the first torch.compile variant's peak for the same model."""
    for field in ("peak_gib", "train_peak_gib"):
        baselines: dict[str, float] = {}
        for r in results:
            if r.variant.startswith("torch.compile") and getattr(r, field) and r.model not in baselines:
                baselines[r.model] = getattr(r, field)
        for r in results:
            if getattr(r, field) and r.model in baselines:
                setattr(r, field.replace("_gib", "_ratio"), getattr(r, field) / baselines[r.model])
    return results


def table(results: Sequence[Result]) -> str:
    fmt = lambda v, spec: "—" if v is None else format(v, spec)  # noqa: E731
    lines = [
        "| model | variant | batch × seq | step (ms) | tokens/s | peak (GiB) | peak / torch.compile "
        "| forward + backward peak (GiB) | its / torch.compile's | warm-up (s) | rewrites applied | final loss "
        "| note |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        rewrites = ", ".join(f"{rule} {count}" for rule, count in sorted(r.rewrites.items())) or "—"
        loss = fmt(r.losses[-1] if r.losses else None, ".4f")
        lines.append(
            f"| {r.model} | {r.variant} | {r.batch} × {r.seq} | {fmt(r.step_ms, '.1f')} | {fmt(r.tokens_per_s, '.0f')} "
            f"| {fmt(r.peak_gib, '.2f')} | {fmt(r.peak_ratio, '.2f')} | {fmt(r.train_peak_gib, '.2f')} "
            f"| {fmt(r.train_peak_ratio, '.2f')} | {fmt(r.warmup_s, '.0f')} | {rewrites} "
            f"| {loss} | {r.note} |"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--variants", default=",".join(VARIANTS), help="<torch.compile|memopt>/<sdpa|eager>, ...")
    parser.add_argument("--warmup", type=int, default=3, help="steps before timing (compile, optimizer state)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--grad-accum", type=int, default=1, help="gradient_accumulation_steps")
    parser.add_argument("--dropout", type=float, default=0.0, help="the models' dropout probabilities")
    parser.add_argument(
        "--compiler", default=None, help='the compiler under both routes: "inductor" (default), "aot_eager" (smoke)'
    )
    parser.add_argument("--smoke", action="store_true", help="tiny configs, 2 steps, aot_eager: checks the script")
    parser.add_argument(
        "--memory-history", type=Path, default=None,
        help="record the first measured step's CUDA allocations; where they peaked goes under DIR",
    )
    parser.add_argument("--optim", default=None, help="TrainingArguments.optim (default: the Trainer's AdamW)")
    parser.add_argument("--out", type=Path, default=Path("benchmark_results"))
    args = parser.parse_args(argv)
    if args.smoke:
        args.warmup, args.steps = 1, 1
    args.compiler = args.compiler or ("aot_eager" if args.smoke else "inductor")
    return args


def main(argv: Sequence[str] | None = None) -> list[Result]:
    args = parse_args(argv)
    set_up(args.out, quiet_rules=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.models.split(","):
            for variant in args.variants.split(","):
                results.append(run_variant(name, variant, args, Path(scratch)))
                with (args.out / "hf_trainer.partial.jsonl").open("a") as partial:  # survives a time limit
                    partial.write(json.dumps(dataclasses.asdict(results[-1])) + "\n")
    with_ratios(results)
    (args.out / "hf_trainer.json").write_text(json.dumps([dataclasses.asdict(r) for r in results], indent=2))
    title = header("HF Trainer step, bf16=True", device)
    title += f", {args.compiler}, gradient accumulation {args.grad_accum}"
    title += " (smoke: tiny configs, forced rewrites)" if args.smoke else ""
    write_report(args.out, "hf_trainer.md", title + "\n\n" + table(results))
    return results


if __name__ == "__main__":
    main()
