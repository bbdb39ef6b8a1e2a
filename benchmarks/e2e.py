"""End to end: a training step of an HF model under plain ``torch.compile`` and under memopt, side by side.

    python benchmarks/e2e.py --models gpt2,llama-1b --flows loss_only,whole_model,padded --out $OUT/e2e

Each case compiles the same model (built from a config, no download) the way users do, once per backend,
in one process, and measures one forward + backward (no optimizer; fp32 weights under bf16 autocast by
default, bf16 weights with ``--precision bf16``): the median step time after warm-up, with the two backends'
steps alternating so that drift reaches both alike, tokens/s, the peak memory above what was allocated before
the step (weights and their gradients from the previous step; on CPU from the profiler's allocator events) and
the first call's time (compilation included). The table puts memopt beside torch.compile with the ratios
memopt / torch.compile.

Flows:
- ``loss_only``: ``torch.compile(lambda ids, labels: model(...).loss)``, the step that returns only the loss;
- ``whole_model``: ``torch.compile(model)``, then ``loss = out.loss`` with the output (logits) dropped;
- ``padded``: the whole model with a tokenizer-style right-padded ``attention_mask`` (every sequence but the
  first ends in 1/8 or 1/4 padding, labelled -100);
- ``fsdp`` (not in the default list): the whole model under FSDP2 in a world of one (``fully_shard`` on every
  block, then the root, as ``benchmarks/distributed.py`` wraps it; no KV cache, so the blocks share one graph).
  Each sharded block is a frame of its own, so head and loss compile as a graph alone; the two backends' steps
  alternate here, where ``distributed.py`` times its variants one after another.

``--checkpointing off,on`` adds the same cases with HF's per-layer checkpointing (``checkpoint_layers``, non-reentrant
``torch.utils.checkpoint`` around every layer), so the table shows checkpointing alone (torch.compile, on) beside
checkpointing + memopt (memopt, on), and both beside the runs without it:

    python benchmarks/e2e.py --models gpt2,llama-1b --flows loss_only --checkpointing off,on --out $OUT/e2e_ckpt
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks._common import (
    error_note,
    header,
    in_turns,
    peak_mib,
    ratio,
    release_memory,
    set_up,
    write_report,
)
from fxpass.integrations.transformers import checkpoint_layers

log = logging.getLogger("benchmarks.e2e")

MODELS = ("gpt2", "llama-1b")
FLOWS = ("loss_only", "whole_model", "padded")
FSDP_FLOW = "fsdp"  # opt-in: needs a process group, which the first such case starts (a world of one)
BACKENDS = ("torch.compile", "memopt")


@dataclasses.dataclass
class Row:
    model: str
    attention: str
    dropout: str
    flow: str
    backend: str
    tokens: int
    step_ms: float | None = None
    peak_mib: float | None = None
    first_call_s: float | None = None
    rewrites: str = ""
    error: str | None = None
    checkpointing: str = "off"

    @property
    def tokens_per_s(self) -> float | None:
        return None if self.step_ms is None else self.tokens / self.step_ms * 1e3


def build_model(
    name: str, attention: str, dropout: str, tiny: bool, checkpointing: bool = False, layers: int | None = None
):
    """An HF causal LM from its config: GPT-2 small, or Llama-3.2-1B's shape (vocabulary 128256, GQA 32/8).

    ``dropout="config"`` keeps the config's own dropout (GPT-2: 0.1 everywhere), ``"0"`` turns it off;
    ``layers`` overrides the number of blocks (shorter CPU runs)."""
    import transformers

    if name == "gpt2":
        sizes = dict(n_embd=64, n_layer=2, n_head=4, vocab_size=512, n_positions=128) if tiny else {}
        config = transformers.GPT2Config(**sizes)
        if dropout == "0":
            config.attn_pdrop = config.resid_pdrop = config.embd_pdrop = 0.0
        model_class = transformers.GPT2LMHeadModel
    elif name == "llama-1b":
        sizes = (
            dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512)
            if tiny
            else dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256)
        )
        config = transformers.LlamaConfig(
            **sizes, max_position_embeddings=8192, tie_word_embeddings=True, rope_theta=500000.0,
        )  # Llama's config has no dropout by default (attention_dropout=0.0): "config" and "0" agree
        model_class = transformers.LlamaForCausalLM
    else:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    config._attn_implementation = attention
    if layers is not None:
        config.num_hidden_layers = layers  # GPT2Config maps it to n_layer
    model = model_class(config)
    # the loss transformers falls back to, named: torch.compile without fxpass imported (whose import has Dynamo
    # skip the fallback's warning) would otherwise split head and loss into two graphs
    model.loss_type = "ForCausalLM"
    if checkpointing:  # every decoder layer recomputed in the backward, as fine-tuning setups often do
        checkpoint_layers(model, use_reentrant=False)
    return model.train()


def make_batch(vocab: int, batch: int, seq: int, padded: bool, device: torch.device, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, seq), generator=generator)
    mask = torch.ones(batch, seq, dtype=torch.long)
    if padded:
        for row in range(1, batch):
            mask[row, seq - seq // 4 * (1 + row % 2) // 2 :] = 0  # right padding of 1/8 or 1/4 of the row
    labels = torch.where(mask.bool(), ids, -100)
    return ids.to(device), labels.to(device), (mask.to(device) if padded else None)


def compiled_step(model, flow: str, backend: str, inner: str, options: dict | None = None) -> Callable:
    """The step as users write it for ``flow``, compiled by ``backend`` ("torch.compile" or "memopt")."""
    if backend == "memopt":
        from fxpass import MemoptBackend

        compile_backend = MemoptBackend(options={"inner_compiler": inner, **(options or {})})
    else:
        compile_backend = inner
    if flow == FSDP_FLOW:
        model = sharded_in_world_of_one(model)
    if flow == "loss_only":
        loss_of = torch.compile(
            lambda ids, labels, mask: model(input_ids=ids, labels=labels, attention_mask=mask).loss,
            backend=compile_backend,
        )
        return loss_of
    whole = torch.compile(model, backend=compile_backend)
    return lambda ids, labels, mask: whole(input_ids=ids, labels=labels, attention_mask=mask).loss


def sharded_in_world_of_one(model):
    """FSDP2 as ``benchmarks/distributed.py`` applies it (``shard_per_block``), in a world of one. Without the KV
    cache the blocks pass the same guards and share one graph."""
    from examples.distributed.train import shard_per_block
    from fxpass.integrations.blocks import allow_a_graph_per_block

    join_world_of_one(next(model.parameters()).device)
    model.config.use_cache = False
    allow_a_graph_per_block(model.config.num_hidden_layers)  # each sharded block is a frame of its own
    return shard_per_block(model)


def join_world_of_one(device: torch.device) -> None:
    """A process group of this process alone (NCCL on a GPU, gloo on CPU), once, left at exit. Its address is
    passed, not set in the environment, which processes spawned later would inherit."""
    import atexit

    import torch.distributed as dist

    from examples.distributed.train import free_port

    if dist.is_initialized():
        return
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                            rank=0, world_size=1)
    atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())


FORWARD_RANGE, BACKWARD_RANGE = "step.forward", "step.backward"


def _named(name: str, enabled: bool):
    return torch.profiler.record_function(name) if enabled else contextlib.nullcontext()


def training_step(
    model, step: Callable, batch, device: torch.device, autocast: bool, phases: bool = False
) -> Callable[[], torch.Tensor]:
    """One forward + backward of ``step`` on ``batch``, from zeroed (kept) gradients. ``phases`` names the two in
    a profile (``FORWARD_RANGE``, ``BACKWARD_RANGE``), for ``tools/profile_step.py --trace``."""

    def one_step():
        model.zero_grad(set_to_none=False)
        with _named(FORWARD_RANGE, phases), torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = step(*batch)
        with _named(BACKWARD_RANGE, phases):
            loss.backward()
        return loss

    return one_step


def first_call(row: Row, one_step: Callable, device: torch.device) -> None:
    """Compile (the first call, timed) and record which rewrites memopt applied; then one more step, so that
    gradients exist and every measured step starts from the same state."""
    import fxpass

    fxpass.clear_reports()
    start = time.perf_counter()
    one_step()
    _synchronize(device)
    row.first_call_s = time.perf_counter() - start
    final = {report.graph_id: report for report in fxpass.reports()}.values()
    applied = [record.rule for report in final for record in report.records if record.applied]
    row.rewrites = ", ".join(f"{rule}×{applied.count(rule)}" for rule in sorted(set(applied)))
    log.info("%s %s %s: first call %.1f s (%s)", row.model, row.flow, row.backend, row.first_call_s, row.rewrites)
    one_step()
    _synchronize(device)
    log.info("%s %s %s: second call done", row.model, row.flow, row.backend)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def step_ms(one_step: Callable, device: torch.device) -> float:
    if device.type == "cuda":
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        one_step()
        end.record()
        torch.cuda.synchronize()
        return begin.elapsed_time(end)
    begin_s = time.perf_counter()
    one_step()
    return (time.perf_counter() - begin_s) * 1e3



def measure_interleaved(steps: int, prepared: list[tuple[Row, Callable]], device: torch.device) -> None:
    """The backends' steps alternate (tc, memopt, tc, memopt, …), so that a machine's drift (a shared CPU's
    neighbours, clocks) reaches both medians alike; then each backend's peak. A backend that fails here gets its
    error and leaves the rotation; the other is still measured."""
    timed = [lambda one_step=one_step: step_ms(one_step, device) for _, one_step in prepared]
    for (row, one_step), (times, error) in zip(prepared, in_turns(steps, timed), strict=True):
        if error is not None:
            row.error = error_note(error)
            continue
        row.step_ms = statistics.median(times)
        row.peak_mib = peak_mib(one_step, device)


def run_case(name, attention, dropout, flow, args, device, checkpointing: str = "off") -> list[Row]:
    """Both backends' rows of one case: each compiles its own copy of the model (same seed), then their measured
    steps alternate (``measure_interleaved``)."""
    seq = args.seq or (2048 if name == "llama-1b" else 1024)
    size = args.batch or (4 if name == "llama-1b" else 16)
    if args.tiny:
        seq, size = min(seq, 64), min(size, 2)
    rows, prepared = [], []
    model = step = one_step = None
    try:
        for backend in BACKENDS:
            torch.manual_seed(0)
            model = build_model(name, attention, dropout, args.tiny, checkpointing == "on", args.layers).to(device)
            if args.precision == "bf16":
                model = model.to(torch.bfloat16)
            batch = make_batch(model.config.vocab_size, size, seq, flow == "padded", device)
            row = Row(name, attention, dropout, flow, backend, tokens=size * seq, checkpointing=checkpointing)
            rows.append(row)
            try:
                step = compiled_step(model, flow, backend, args.inner, json.loads(args.memopt_options))
                one_step = training_step(model, step, batch, device, args.precision == "autocast")
                first_call(row, one_step, device)
                prepared.append((row, one_step))
            except Exception as error:  # one failing case must not end the table
                row.error = error_note(error)
        measure_interleaved(args.steps, prepared, device)
    finally:
        prepared.clear()
        model = step = one_step = None  # the last model, dropped before the cache is emptied
        release_memory()
    return rows


def table(rows: list[Row]) -> str:
    """One line per case: torch.compile's and memopt's figures, and memopt / torch.compile."""
    lines = [
        "| model | attention | dropout | checkpointing | flow | tokens | torch.compile ms | memopt ms | time ratio | "
        "torch.compile tok/s | memopt tok/s | torch.compile peak MiB | memopt peak MiB | peak ratio | "
        "first call s (tc / memopt) | memopt rewrites |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    cases: dict[tuple, dict[str, Row]] = {}
    for row in rows:
        cases.setdefault((row.model, row.attention, row.dropout, row.checkpointing, row.flow), {})[row.backend] = row
    fmt = lambda value, spec: "-" if value is None else format(value, spec)  # noqa: E731
    for (model, attention, dropout, checkpointing, flow), pair in cases.items():
        base, ours = pair.get("torch.compile"), pair.get("memopt")
        get = lambda row, field: None if row is None else getattr(row, field)  # noqa: E731
        errors = "; ".join(f"{r.backend}: {r.error}" for r in pair.values() if r.error)
        lines.append(
            f"| {model} | {attention} | {dropout} | {checkpointing} | {flow} | {next(iter(pair.values())).tokens} | "
            f"{fmt(get(base, 'step_ms'), '.1f')} | {fmt(get(ours, 'step_ms'), '.1f')} | "
            f"{ratio(get(ours, 'step_ms'), get(base, 'step_ms'))} | "
            f"{fmt(get(base, 'tokens_per_s'), '.0f')} | {fmt(get(ours, 'tokens_per_s'), '.0f')} | "
            f"{fmt(get(base, 'peak_mib'), '.0f')} | {fmt(get(ours, 'peak_mib'), '.0f')} | "
            f"{ratio(get(ours, 'peak_mib'), get(base, 'peak_mib'))} | "
            f"{fmt(get(base, 'first_call_s'), '.0f')} / {fmt(get(ours, 'first_call_s'), '.0f')} | "
            f"{get(ours, 'rewrites') or '-'}{' — ' + errors if errors else ''} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--flows", default=",".join(FLOWS))
    parser.add_argument("--attention", default="sdpa", help="HF attn_implementation(s), comma-separated")
    parser.add_argument("--dropout", default="config", help='"config" (HF defaults), "0", or both comma-separated')
    parser.add_argument("--batch", type=int, default=None, help="default: 16 (GPT-2) or 4 (Llama)")
    parser.add_argument("--seq", type=int, default=None, help="default: 1024 (GPT-2) or 2048 (Llama)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--checkpointing", default="off", help='HF activation checkpointing: "off", "on" or "off,on"')
    parser.add_argument("--precision", default="autocast", choices=["autocast", "bf16", "fp32"],
                        help="autocast: fp32 weights under bf16 autocast (fine-tuning's setup); bf16: bf16 weights")
    parser.add_argument("--inner", default="inductor", help="compiler of both sides (aot_eager for a quick check)")
    parser.add_argument("--memopt-options", default="{}", help='memopt options as JSON, e.g. \'{"force": true}\'')
    parser.add_argument("--tiny", action="store_true", help="small models: check the script, not the numbers")
    parser.add_argument("--layers", type=int, default=None, help="blocks of the model (default: its config's)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=Path("benchmark_results"))
    args = parser.parse_args(argv)
    set_up(args.out)
    device = torch.device(args.device)
    rows = []
    progress = args.out / "e2e.jsonl"  # one line per case as it ends, so a run cut short keeps what it measured
    for name in args.models.split(","):
        for attention in args.attention.split(","):
            for dropout in args.dropout.split(","):
                for checkpointing in args.checkpointing.split(","):
                    for flow in args.flows.split(","):
                        for row in run_case(name, attention, dropout, flow, args, device, checkpointing):
                            rows.append(row)
                            line = json.dumps(dataclasses.asdict(row))
                            print(line, flush=True)
                            with progress.open("a") as lines:
                                lines.write(line + "\n")
    title = header(f"End-to-end training step, torch.compile vs memopt ({args.precision})", device)
    write_report(args.out, "e2e.md", f"{title}\n\n{table(rows)}")
    (args.out / "e2e.json").write_text(json.dumps([dataclasses.asdict(row) for row in rows], indent=1))
    return rows


if __name__ == "__main__":
    main()
