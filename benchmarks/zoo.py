"""Breadth: one training step of many HF model families under plain ``torch.compile`` and under memopt, side by side.

    python benchmarks/zoo.py --out $OUT/zoo                                   # GPU: every family, real widths
    python benchmarks/zoo.py --families llama,gemma2 --masks padded --out $OUT/zoo
    python benchmarks/zoo.py --tiny --device cpu --steps 1                    # CPU: which rewrites apply
    python benchmarks/zoo.py --predict-only --masks none                      # a laptop's GPU prediction

Each family is built from its config class (no download) with ``--layers`` blocks (2), its real vocabulary and the
real widths of a small public checkpoint of the family (named beside each entry of ``FAMILIES``), every dropout off
so that both backends compute the same step. Decoders are causal LMs with ``labels``; BERT a masked LM (85 % of the
labels -100); T5 an encoder-decoder with ``labels``. Each family runs twice: without ``attention_mask``, and with a
tokenizer-style right-padded one (every sequence but the first ends in 1/8 padding, labelled -100).

Per case, the whole model is compiled as users do, ``torch.compile(model, backend=...)``, once under torch.compile
(Inductor) and once under ``fxpass.MemoptBackend``, each on its own copy of the same weights, in one process; the
step is ``out = compiled(input_ids=..., attention_mask=..., labels=...); out.loss.backward()`` with the logits
returned and dropped, bf16 weights on CUDA (fp32 on CPU). Measured: the median step time after warm-up, the two
backends' steps alternating so that drift reaches both alike; the peak memory above what was allocated before the
step (weights and the previous step's gradients; on CPU from the profiler's allocator events); the first step's
loss of each (the same weights and batch: they agree). From memopt's compile, per rule ("cce", "attention",
"embedding"): how many of its candidates were rewritten, and the first reason one was declined; beside CCE's
count, the op it chose ("rowwise", "with_logits" or "chunked"), which most of a family's time ratio comes from.

The table ends with the families that miss the targets: every family gets CCE; every decoder-only LM's peak is at
most 0.7× torch.compile's at no more than 1.00× its time. A family whose classes the installed transformers lacks
gets a row saying so; a case that fails (out of memory, an exception) gets an error row and the others go on.

``--predict-only`` is the laptop's side: each step is captured, rewritten and priced for a GPU (bf16 weights,
``assume_device="cuda"``) without running it, in seconds a family; the table has memopt's decisions and the
simulated peak ratio, with what holds memopt's simulated peak where it misses.

``--tiny`` shrinks every family to a smoke test of the script (hidden 64, 4 heads, 2 KV heads, vocabulary 512,
2 × 64 tokens) and forces memopt's rewrites, which would not pay at that size: the run then shows which rewrites
match each family, not what they save.

Written into ``--out``: ``zoo.md`` (the table), ``zoo.json`` (every case), ``zoo.jsonl`` (a line per case as it
ends) and, with matplotlib installed, ``zoo.png``: each family's peak and time ratios against the targets.
``--render`` writes the same files from earlier runs' ``zoo.jsonl`` files or rendered ``zoo.md`` tables (those
kept in ``benchmarks/results/``), a case measured twice keeping its last figures:

    python benchmarks/zoo.py --render benchmarks/results/zoo-all-h100-2026-12-06.md \
        benchmarks/results/zoo-gemma-h100-2026-12-07.md --out $OUT/zoo
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import (
    error_note,
    header,
    in_turns,
    peak_mib,
    recorded_peak,
    release_memory,
    set_up,
    write_report,
)

log = logging.getLogger("benchmarks.zoo")

BACKENDS = ("torch.compile", "memopt")
RULES = ("cce", "attention", "embedding")
MASKS = ("none", "padded")
PEAK_TARGET, TIME_TARGET = 0.7, 1.00
MIB = 1 << 20
REASON_CHARS = 120


@dataclasses.dataclass(frozen=True)
class Family:
    """A family by its transformers class names (looked up when it runs, so that a version without them gives a
    row, not an ImportError) and the config sizes of one real checkpoint."""

    config: str
    model: str
    sizes: dict[str, Any]
    task: str = "causal"  # "causal" (labels = next tokens), "masked" (BERT) or "seq2seq" (T5)
    layer_keys: tuple[str, ...] = ("num_hidden_layers",)
    alternating: bool = False  # sliding and full layers alternate, so that the 2 blocks hold one of each

    @property
    def decoder(self) -> bool:
        return self.task == "causal"


FAMILIES: dict[str, Family] = {
    # openai-community/gpt2 (GPT-2 small)
    "gpt2": Family("GPT2Config", "GPT2LMHeadModel", dict(n_embd=768, n_head=12, vocab_size=50257),
                   layer_keys=("n_layer",)),
    # meta-llama/Llama-3.2-1B
    "llama": Family("LlamaConfig", "LlamaForCausalLM", dict(
        hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
        tie_word_embeddings=True)),
    # mistralai/Mistral-7B-v0.3 (no sliding window)
    "mistral": Family("MistralConfig", "MistralForCausalLM", dict(
        hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, vocab_size=32768,
        sliding_window=None)),
    # mistralai/Mixtral-8x7B-v0.1: 8 experts, 2 per token
    "mixtral": Family("MixtralConfig", "MixtralForCausalLM", dict(
        hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
        num_local_experts=8, num_experts_per_tok=2)),
    # Qwen/Qwen2.5-0.5B
    "qwen2": Family("Qwen2Config", "Qwen2ForCausalLM", dict(
        hidden_size=896, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
        tie_word_embeddings=True)),
    # Qwen/Qwen3-0.6B
    "qwen3": Family("Qwen3Config", "Qwen3ForCausalLM", dict(
        hidden_size=1024, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        vocab_size=151936, tie_word_embeddings=True)),
    # google/gemma-2b (multi-query)
    "gemma": Family("GemmaConfig", "GemmaForCausalLM", dict(
        hidden_size=2048, intermediate_size=16384, num_attention_heads=8, num_key_value_heads=1, head_dim=256,
        vocab_size=256000, tie_word_embeddings=True)),
    # google/gemma-2-2b: softcapped attention scores and logits, sliding and full layers alternating
    "gemma2": Family("Gemma2Config", "Gemma2ForCausalLM", dict(
        hidden_size=2304, intermediate_size=9216, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
        query_pre_attn_scalar=256, vocab_size=256000, sliding_window=4096, attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0, tie_word_embeddings=True)),
    # google/gemma-3-1b-pt (text only); its first five layers slide, here one sliding and one full layer
    "gemma3": Family("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        hidden_size=1152, intermediate_size=6912, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
        query_pre_attn_scalar=256, vocab_size=262144, sliding_window=512, tie_word_embeddings=True),
        alternating=True),
    # microsoft/Phi-3-mini-4k-instruct
    "phi3": Family("Phi3Config", "Phi3ForCausalLM", dict(
        hidden_size=3072, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=32, vocab_size=32064)),
    # allenai/OLMo-2-0425-1B
    "olmo2": Family("Olmo2Config", "Olmo2ForCausalLM", dict(
        hidden_size=2048, intermediate_size=8192, num_attention_heads=16, num_key_value_heads=16, vocab_size=100352)),
    # ibm-granite/granite-3.0-2b-base: its multipliers, the logits divided by 8
    "granite": Family("GraniteConfig", "GraniteForCausalLM", dict(
        hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8, vocab_size=49155,
        embedding_multiplier=12.0, logits_scaling=8.0, residual_multiplier=0.22, attention_multiplier=0.015625,
        tie_word_embeddings=True)),
    # CohereForAI/aya-23-8B, the smallest CohereForCausalLM checkpoint (Command-R is 8192 wide; Command R7B is
    # Cohere2): the logits multiplied by 1/16. 2 blocks of it are ~1.5 G parameters, 3 GiB in bf16 per copy.
    "cohere": Family("CohereConfig", "CohereForCausalLM", dict(
        hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, vocab_size=256000,
        logit_scale=0.0625, tie_word_embeddings=True)),
    # bigcode/starcoder2-3b
    "starcoder2": Family("Starcoder2Config", "Starcoder2ForCausalLM", dict(
        hidden_size=3072, intermediate_size=12288, num_attention_heads=24, num_key_value_heads=2, vocab_size=49152,
        sliding_window=4096)),
    # EleutherAI/pythia-410m
    "gpt_neox": Family("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(
        hidden_size=1024, intermediate_size=4096, num_attention_heads=16, vocab_size=50304)),
    # tiiuae/falcon-7b: multi-query, attention and MLP in parallel, 4 × hidden MLP
    "falcon": Family("FalconConfig", "FalconForCausalLM", dict(
        hidden_size=4544, num_attention_heads=71, vocab_size=65024, multi_query=True, parallel_attn=True)),
    # google-bert/bert-base-uncased
    "bert": Family("BertConfig", "BertForMaskedLM", dict(
        hidden_size=768, intermediate_size=3072, num_attention_heads=12, vocab_size=30522), task="masked"),
    # google-t5/t5-small: encoder and decoder of --layers blocks each
    "t5": Family("T5Config", "T5ForConditionalGeneration", dict(
        d_model=512, d_ff=2048, num_heads=8, d_kv=64, vocab_size=32128, pad_token_id=0, eos_token_id=1,
        decoder_start_token_id=0), task="seq2seq",  # T5Config() has no decoder start, which labels need
        layer_keys=("num_layers", "num_decoder_layers")),
}

# --tiny: each size a family sets, whatever its config calls it, shrunk; other keys (scales, caps) kept
TINY_SIZES = {
    "hidden_size": 64, "n_embd": 64, "d_model": 64, "intermediate_size": 128, "d_ff": 128,
    "num_attention_heads": 4, "n_head": 4, "num_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "d_kv": 16,
    "query_pre_attn_scalar": 16, "vocab_size": 512, "sliding_window": 32, "num_local_experts": 4,
}  # fmt: skip
TINY_BATCH, TINY_SEQ = 2, 64
LOSS_TYPES = {"causal": "ForCausalLM", "masked": "ForMaskedLM"}  # T5 computes its loss in its own forward


class MissingFamily(Exception):
    """The installed transformers lacks the family's config or model class."""


@dataclasses.dataclass
class Run:
    """One backend's figures for one case."""

    backend: str
    step_ms: float | None = None
    peak_mib: float | None = None
    loss: float | None = None
    first_call_s: float | None = None
    error: str | None = None


@dataclasses.dataclass
class Case:
    """One family with one kind of mask: both backends' runs and memopt's decisions."""

    family: str
    mask: str
    decoder: bool
    tokens: int = 0
    attention_implementation: str | None = None
    rules: dict[str, str] = dataclasses.field(default_factory=dict)  # rule: "applied N/M"
    declined: dict[str, str] = dataclasses.field(default_factory=dict)  # rule: its first decline reason, whole
    # the CCE op(s) memopt chose ("rowwise", "with_logits", "chunked"): what a time ratio mostly comes from
    cce_variant: str = ""
    graphs: int | None = None  # graphs memopt compiled for the step (more than one: graph breaks)
    # memopt's simulation of the step's peak beyond its inputs (``fxpass.Explanation.peak_bytes``), MiB per
    # backend, and what holds memopt's simulated peak (``GraphReport.at_peak``): the model's side of the table
    simulated_mib: dict[str, float] | None = None
    held_by: str = ""
    runs: dict[str, Run] = dataclasses.field(default_factory=dict)
    note: str = ""
    # the run's first report line (date, device, torch, transformers): a table rendered later from these lines,
    # on another machine, names where they were measured, not where they were rendered
    measured_on: str = ""
    # ratios ("peak_mib", "step_ms", "simulated") of a case read back from a rendered table, whose rounded figures
    # may give another ratio than the one the run printed (and which keeps no simulated MiB): they win
    ratios: dict[str, float] = dataclasses.field(default_factory=dict)

    def figure(self, backend: str, field: str) -> float | None:
        run = self.runs.get(backend)
        return None if run is None else getattr(run, field)

    def ratio(self, field: str) -> float | None:
        if field in self.ratios:
            return self.ratios[field]
        ours, theirs = self.figure("memopt", field), self.figure("torch.compile", field)
        return None if ours is None or not theirs else ours / theirs

    def simulated_ratio(self) -> float | None:
        if "simulated" in self.ratios:
            return self.ratios["simulated"]
        sim = self.simulated_mib or {}
        return sim["memopt"] / sim["torch.compile"] if sim.get("torch.compile") else None

    def applied(self, rule: str) -> int:
        summary = self.rules.get(rule, "")
        return int(summary.split()[1].split("/")[0]) if summary.startswith("applied ") else 0


def transformers_version() -> str:
    import transformers

    return ".".join(transformers.__version__.split(".")[:2])


def family_classes(family: Family) -> tuple[type, type]:
    """The family's config and model classes; ``MissingFamily`` where this transformers has not got them."""
    import transformers

    found = {name: getattr(transformers, name, None) for name in (family.config, family.model)}
    missing = [name for name, cls in found.items() if cls is None]
    if missing:
        raise MissingFamily(f"not in transformers {transformers_version()} ({', '.join(missing)})")
    return found[family.config], found[family.model]


def config_sizes(family: Family, layers: int, tiny: bool) -> dict[str, Any]:
    """The keyword arguments of the family's config: its checkpoint's sizes (or their tiny stand-ins) and the
    number of blocks, given at construction because configs derive per-layer lists (``layer_types``) from it."""
    sizes = {key: TINY_SIZES.get(key, value) if tiny else value for key, value in family.sizes.items()}
    sizes.update(dict.fromkeys(family.layer_keys, layers))
    if family.alternating:
        sizes["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    return sizes


def without_dropout(config) -> None:
    """Every dropout probability the config has, 0: dropout draws differ between two compiled graphs, and the
    backends must compute the same step for their losses and memory to be compared."""
    for key, value in config.to_dict().items():
        if ("dropout" in key or "pdrop" in key) and isinstance(value, int | float) and not isinstance(value, bool):
            setattr(config, key, 0.0)


def tokens_within(config) -> None:
    """Special token ids inside a tiny vocabulary (an embedding's ``padding_idx`` must be one of its rows)."""
    for key in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value >= config.vocab_size:
            setattr(config, key, config.vocab_size - 1)


def long_enough(config, seq: int) -> None:
    """Position tables of at least ``seq`` entries (BERT's end at 512; the benchmark's sequences are longer)."""
    for key in ("max_position_embeddings", "n_positions"):
        if isinstance(getattr(config, key, None), int) and getattr(config, key) < seq:
            setattr(config, key, seq)


def build_model(name: str, layers: int, tiny: bool, seq: int, device: torch.device, dtype: torch.dtype):
    """The family's model in training mode, its weights drawn from seed 0 on ``device`` (both backends' copies
    are the same), in ``dtype``."""
    family = FAMILIES[name]
    config_class, model_class = family_classes(family)
    config = config_class(**config_sizes(family, layers, tiny))
    without_dropout(config)
    long_enough(config, seq)
    if tiny:
        tokens_within(config)
    torch.manual_seed(0)
    with torch.device(device):
        model = model_class(config)
    if family.task in LOSS_TYPES:
        # the loss named: without it transformers warns as it falls back, and the warning would split head and
        # loss into two graphs under torch.compile (fxpass's import silences it for memopt's side only)
        model.loss_type = LOSS_TYPES[family.task]
    return model.to(dtype).train()


def make_batch(task: str, vocab: int, batch: int, seq: int, padded: bool, device: torch.device) -> dict:
    """The step's keyword arguments: random token ids, labels for the task, -100 on padding, and a right-padded
    ``attention_mask`` (every sequence but the first ends in 1/8 padding) where ``padded``."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (batch, seq), generator=generator)
    mask = torch.ones(batch, seq, dtype=torch.long)
    if padded:
        mask[1:, seq - seq // 8 :] = 0
    # T5's decoder predicts a sequence of its own; the others, their input
    targets = torch.randint(3, vocab, (batch, seq), generator=generator) if task == "seq2seq" else ids
    labels = torch.where(mask.bool(), targets, -100)
    if task == "masked":  # 15 % of the positions predicted, as BERT's collator picks them
        labels = torch.where(torch.rand(batch, seq, generator=generator) < 0.15, labels, -100)
    inputs = {"input_ids": ids, "labels": labels, "attention_mask": mask if padded else None}
    return {key: value.to(device) for key, value in inputs.items() if value is not None}


def compiled_step(model, inputs: dict, backend: str, inner: str, options: dict, sink: Callable) -> Callable:
    """One training step as users write it: the whole model compiled, the output's loss backpropagated while the
    output (logits included) is still alive, gradients zeroed in place before. Returns the loss, detached."""
    if backend == "memopt":
        from fxpass import MemoptBackend

        # price_steps: the step simulated under both backends beside what is measured (a few seconds of compile)
        compile_backend = MemoptBackend(options={"inner_compiler": inner, **options}, sink=sink, price_steps=True)
    else:
        compile_backend = inner
    compiled = torch.compile(model, backend=compile_backend)

    def step() -> torch.Tensor:
        model.zero_grad(set_to_none=False)
        out = compiled(**inputs)
        out.loss.backward()
        return out.loss.detach()

    return step


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def first_calls(run: Run, step: Callable, device: torch.device) -> None:
    """The compiling call, timed, with its loss; then one more, so that gradients exist and every measured step
    starts from the same state."""
    start = time.perf_counter()
    loss = step()
    synchronize(device)
    run.first_call_s = time.perf_counter() - start
    run.loss = float(loss)
    step()
    synchronize(device)


def timed(step: Callable, device: torch.device) -> Callable[[], float]:
    """``step`` as a call that returns its time in ms (CUDA events on a GPU)."""

    def call() -> float:
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            step()
            end.record()
            torch.cuda.synchronize(device)
            return begin.elapsed_time(end)
        begin_s = time.perf_counter()
        step()
        return (time.perf_counter() - begin_s) * 1e3

    return call



def final_reports(reports: list) -> list:
    """One report per compiled frame: Dynamo's compile ids are "frame/attempt", and a recompiled frame's latest
    graph is the one that runs."""
    by_frame = {str(report.graph_id).split("/")[0]: report for report in reports}
    return list(by_frame.values())


def shortened(reason: str) -> str:
    """A decline reason cut for the table's note (zoo.json keeps it whole); no "|" to break the row."""
    flat = reason.replace("|", "/")
    return flat if len(flat) <= REASON_CHARS else flat[: REASON_CHARS - 1] + "…"


def record_rules(case: Case, reports: list) -> None:
    """Per rule, "applied N/M" over memopt's final graphs, and the first reason a candidate was declined; the
    step's simulated peaks and what holds memopt's."""
    from fxpass import Explanation

    final = final_reports(reports)
    if not final:  # memopt compiled nothing (it failed first): no decisions to show
        return
    case.graphs = len(final)
    peaks = Explanation(final, None).peak_bytes()
    if peaks is not None:
        case.simulated_mib = {backend: peak / MIB for backend, peak in peaks.items()}
        case.held_by = " / ".join(report.at_peak("memopt") for report in final)
    for rule in RULES:
        records = [record for report in final for record in report.records if record.rule == rule]
        case.rules[rule] = f"applied {sum(record.applied for record in records)}/{len(records)}"
        if rule == "cce":
            chosen = {str(record.params["variant"]) for record in records
                      if record.applied and "variant" in record.params}
            case.cce_variant = ", ".join(sorted(chosen))
        declined = next((record.reason for record in records if not record.applied), None)
        if declined is not None:
            case.declined[rule] = " ".join(declined.split())


def measure(case: Case, prepared: list[tuple[Run, Callable]], steps: int, device: torch.device,
            breakdown: Path | None = None) -> None:
    """The backends' steps in turns (``in_turns``), then each one's peak; a backend that fails leaves the
    rotation with its error and the other is still measured. ``breakdown``: a folder for what was alive at each
    backend's CUDA peak (``_common.recorded_peak``)."""
    calls = [timed(step, device) for _, step in prepared]
    for (run, step), (times, error) in zip(prepared, in_turns(steps, calls), strict=True):
        if error is not None:
            run.error = error_note(error)
            continue
        run.step_ms = statistics.median(times)
        try:
            run.peak_mib = peak_mib(step, device)
            if breakdown is not None and device.type == "cuda":
                recorded_peak(step, device, breakdown / f"peak-{case.family}-{case.mask}-{run.backend}.md")
        except Exception as failure:
            run.error = error_note(failure)
        log.info("%s %s %s: %.1f ms, peak %s MiB", case.family, case.mask, run.backend, run.step_ms,
                 "-" if run.peak_mib is None else f"{run.peak_mib:.0f}")


# Blocks of every family's model (the table's "2 layers at real widths"); profile_step's zoo steps use it too.
LAYERS = 2


def step_dtype(device: torch.device) -> torch.dtype:
    """The weights' dtype of a zoo step: bf16 on a GPU, fp32 on CPU (whose bf16 GEMMs are slow)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def model_and_batch(case: Case, args, device: torch.device, dtype: torch.dtype) -> tuple[torch.nn.Module, dict]:
    """The case's model and the step's keyword arguments (``--tiny`` caps the tokens); notes the tokens and the
    attention implementation on ``case``."""
    seq, batch = (min(args.seq, TINY_SEQ), min(args.batch, TINY_BATCH)) if args.tiny else (args.seq, args.batch)
    model = build_model(case.family, args.layers, args.tiny, seq, device, dtype)
    case.tokens = batch * seq
    case.attention_implementation = getattr(model.config, "_attn_implementation", None)
    inputs = make_batch(FAMILIES[case.family].task, model.config.vocab_size, batch, seq, case.mask == "padded", device)
    return model, inputs


def prepare(case: Case, backend: str, args, device: torch.device, options: dict, reports: list):
    """Build, compile and warm up one backend's copy; its run (with the error, if one was raised) and its step,
    which is None where it failed."""
    run = case.runs[backend] = Run(backend)
    try:
        model, inputs = model_and_batch(case, args, device, step_dtype(device))
        step = compiled_step(model, inputs, backend, args.inner, options, reports.append)
        first_calls(run, step, device)
        log.info("%s %s %s: first call %.1f s, loss %.4f", case.family, case.mask, backend, run.first_call_s, run.loss)
        return run, step
    except Exception as error:  # one failing backend or case must not end the table
        log.exception("%s %s %s failed", case.family, case.mask, backend)
        run.error = error_note(error)
        return run, None


def run_case(name: str, mask: str, args, device: torch.device, options: dict) -> Case:
    """Both backends on one family and mask: each compiles its own copy of the model, then their measured steps
    alternate. Memory (and Dynamo's graphs) are released afterwards, whatever happened."""
    family = FAMILIES[name]
    case = Case(name, mask, family.decoder)
    reports: list = []
    prepared: list[tuple[Run, Callable]] = []
    try:
        family_classes(family)
        if args.predict_only:
            predict(case, args, options)
            return case
        prepared = [prepare(case, backend, args, device, options, reports) for backend in BACKENDS]
        prepared = [(run, step) for run, step in prepared if step is not None]  # no local keeps a model alive
        record_rules(case, reports)
        reports.clear()  # the reports hold their graph modules
        measure(case, prepared, args.steps, device, args.out if args.breakdown else None)
    except MissingFamily as missing:
        case.note = str(missing)
    finally:
        reports.clear()
        prepared.clear()
        release_memory()
        case.note = note(case)
    return case


def predict(case: Case, args, options: dict) -> None:
    """The laptop's side: the family's step captured, rewritten and priced for a GPU (bf16 weights,
    ``assume_device="cuda"``) without running it (``fxpass.explain(..., execute=False)``); the measured columns
    stay empty. Only the step's first graph is seen (every family here compiles into one)."""
    import fxpass

    torch._dynamo.reset()
    model, inputs = model_and_batch(case, args, torch.device("cpu"), torch.bfloat16)
    explanation = fxpass.explain(lambda **batch: model(**batch), options=options, assume_device="cuda",
                                 execute=False, **inputs)
    record_rules(case, explanation.graphs)


def note(case: Case) -> str:
    """What the table's note column says: the family's absence, errors, declines, graph breaks, eager attention."""
    parts = [case.note] if case.note else []
    parts += [f"{run.backend}: {run.error}" for run in case.runs.values() if run.error]
    parts += [f"{rule} declined: {shortened(reason)}" for rule, reason in case.declined.items()]
    if case.graphs is not None and case.graphs > 1:
        parts.append(f"{case.graphs} graphs")
    if case.attention_implementation not in (None, "sdpa"):
        parts.append(f"{case.attention_implementation} attention")
    return "; ".join(parts)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(cases: list[Case]) -> str:
    lines = [
        "| family | mask | CCE | attention | embedding | peak torch.compile MiB | peak memopt MiB | peak ratio | "
        "simulated peak ratio | step torch.compile ms | step memopt ms | time ratio | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for case in cases:
        figures = [
            _fmt(case.figure("torch.compile", "peak_mib"), ".0f"), _fmt(case.figure("memopt", "peak_mib"), ".0f"),
            _fmt(case.ratio("peak_mib"), ".2f"), _fmt(case.simulated_ratio(), ".2f"),
            _fmt(case.figure("torch.compile", "step_ms"), ".1f"),
            _fmt(case.figure("memopt", "step_ms"), ".1f"), _fmt(case.ratio("step_ms"), ".2f"),
        ]
        rules = [case.rules.get(rule, "-") for rule in RULES]
        if case.cce_variant:
            rules[RULES.index("cce")] += f" ({case.cce_variant})"
        lines.append(f"| {case.family} | {case.mask} | {' | '.join(rules + figures)} | {case.note or '-'} |")
    return "\n".join(lines)


def misses(case: Case) -> list[str]:
    """Why a case misses the targets: no CCE; for a decoder, a peak above 0.7× torch.compile's or a time above
    1.00× (or no figures to tell)."""
    found = [] if case.applied("cce") else ["no CCE"]
    if case.decoder:
        peak, time_ = case.ratio("peak_mib"), case.ratio("step_ms")
        simulated = case.simulated_ratio()
        if peak is None and time_ is None and simulated is not None:  # predicted only (``--predict-only``)
            if simulated > PEAK_TARGET:
                found.append(f"simulated peak {simulated:.2f}×")
        elif peak is None or time_ is None:
            found.append("not measured")
        else:
            if peak > PEAK_TARGET:
                found.append(f"peak {peak:.2f}×")
            if time_ > TIME_TARGET:
                found.append(f"time {time_:.2f}×")
    return [f"{item} ({case.mask})" for item in found]


def targets_line(cases: list[Case]) -> str:
    by_family: dict[str, list[str]] = {}
    for case in cases:
        by_family.setdefault(case.family, []).extend(misses(case))
    missed = [f"{family} ({', '.join(items)})" for family, items in by_family.items() if items]
    held = [f"- {case.family} ({case.mask}): {case.held_by}" for case in cases
            if case.held_by and any("peak" in item for item in misses(case))]
    return (
        f"Families missing the targets (every family gets CCE; every decoder's peak ≤ {PEAK_TARGET}× torch.compile's "
        f"at ≤ {TIME_TARGET:.2f}× its time): {'; '.join(missed) if missed else 'none'}"
        + ("\n\nWhat holds memopt's peak where it misses (the simulation):\n" + "\n".join(held) if held else "")
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default=",".join(FAMILIES), help="comma-separated names of FAMILIES")
    parser.add_argument("--masks", default=",".join(MASKS), help='"none", "padded" or both')
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--steps", type=int, default=10, help="measured steps per backend, after two warm-up steps")
    parser.add_argument("--tiny", action="store_true", help="tiny widths: check the script and the rewrites' reach")
    parser.add_argument("--predict-only", action="store_true",
                        help="no run: each step priced for a GPU from this machine (the simulated column alone)")
    parser.add_argument("--inner", default="inductor", help="compiler of both sides (aot_eager for a quick check)")
    parser.add_argument("--memopt-options", default="{}", help='memopt options as JSON; --tiny adds {"force": true}')
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--breakdown", action="store_true", help="CUDA: what is alive at each backend's peak, to --out")
    parser.add_argument("--out", type=Path, default=Path("benchmark_results"))
    parser.add_argument("--render", type=Path, nargs="+", default=None,
                        help="no run: write zoo.md (and zoo.png) from these zoo.jsonl files or rendered zoo.md tables")
    args = parser.parse_args(argv)
    unknown = [name for name in args.families.split(",") if name not in FAMILIES]
    if unknown:
        parser.error(f"unknown families {unknown}; known: {', '.join(FAMILIES)}")
    return args


def load_cases(paths: list[Path]) -> list[Case]:
    """The cases of earlier runs, in order: ``zoo.jsonl`` lines, or the rows of a rendered table (a ``.md`` file);
    a case measured twice keeps its latest figures."""
    cases: dict[tuple[str, str], Case] = {}
    for path in paths:
        if path.suffix == ".md":
            found = cases_of_table(path.read_text())
        else:
            found = []
            for line in path.read_text().splitlines():
                fields = json.loads(line)
                runs = {backend: Run(**run) for backend, run in fields.pop("runs").items()}
                found.append(Case(**fields, runs=runs))
        for case in found:
            cases[case.family, case.mask] = case
    return list(cases.values())


def _number(cell: str) -> float | None:
    return None if cell in ("", "-") else float(cell)


def cases_of_table(text: str) -> list[Case]:
    """The cases of a table that ``table`` rendered, read back: rules, CCE op, figures, ratios, note and what holds a
    missed peak; where each case was measured is the file's first line (its title). A ratio is the one its row's
    figures give where that rounds to the ratio shown (0.704 for a peak shown as 0.70: a miss stays a miss), else
    the one shown (the run divided unrounded times)."""
    lines = text.splitlines()
    measured_on = lines[0].lstrip("#").strip() if lines else ""
    header = next((index for index, line in enumerate(lines) if line.startswith("| family | mask |")), None)
    if header is None:
        raise ValueError("no zoo table here: no line starts with '| family | mask |'")
    names = [cell.strip() for cell in lines[header].strip("|").split("|")]
    held = dict(re.findall(r"^- (\S+ \(\w+\)): (.+)$", text, re.MULTILINE))
    cases = []
    for line in lines[header + 2:]:
        if not line.startswith("|"):
            break
        row = dict(zip(names, (cell.strip() for cell in line.strip("|").split("|", len(names) - 1)), strict=True))
        family = row["family"]
        rules = {rule: row[label] for rule, label in zip(RULES, ("CCE", "attention", "embedding"), strict=True)
                 if row[label] != "-"}
        variant = re.search(r" \((\w+)\)$", rules.get("cce", ""))
        if variant:
            rules["cce"] = rules["cce"][:variant.start()]
        runs = {backend: Run(backend, step_ms=_number(row[f"step {backend} ms"]),
                             peak_mib=_number(row[f"peak {backend} MiB"])) for backend in BACKENDS}
        if all(run.step_ms is None and run.peak_mib is None for run in runs.values()):
            runs = {}
        decoder = FAMILIES[family].decoder if family in FAMILIES else True
        case = Case(family, row["mask"], decoder, rules=rules, cce_variant=variant.group(1) if variant else "",
                    runs=runs, note="" if row["note"] == "-" else row["note"],
                    held_by=held.get(f"{family} ({row['mask']})", ""), measured_on=measured_on)
        for field, label in (("peak_mib", "peak ratio"), ("step_ms", "time ratio"),
                             ("simulated", "simulated peak ratio")):
            shown = _number(row[label])
            given = None if field == "simulated" else case.ratio(field)  # a table keeps no simulated MiB
            if shown is not None:
                case.ratios[field] = given if given is not None and f"{given:.2f}" == row[label] else shown
        cases.append(case)
    return cases


def run_title(args: argparse.Namespace, device: torch.device) -> str:
    precision = "bf16 weights" if device.type == "cuda" else "fp32"
    if args.predict_only:
        precision = "bf16 weights; predicted for a GPU, nothing run"
    return header(f"Model zoo, a training step under torch.compile and memopt ({precision}, {args.layers} layers, "
                  f"transformers {transformers_version()})", device)


def report_title(cases: list[Case]) -> str:
    """The table's title: the first line of the run that measured its cases, or of each run where a table is
    rendered from several (``--render``)."""
    titles = list(dict.fromkeys(case.measured_on or "(a run that did not record where it ran)" for case in cases))
    return titles[0] if len(titles) == 1 else "Model zoo, rendered from these runs:\n" + "\n".join(
        f"- {title}" for title in titles)


def plot(cases: list[Case], path: Path) -> bool:
    """Each family's peak and time ratios against torch.compile, a bar per mask, with the targets drawn as lines
    (they apply to decoder-only LMs; the others are starred). False, and no file, without matplotlib or without
    a measured figure (``--predict-only``)."""
    measured = [case for case in cases if case.ratio("peak_mib") is not None or case.ratio("step_ms") is not None]
    if not measured:
        return False
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib missing: no plot")
        return False
    order = list(FAMILIES)
    families = sorted(dict.fromkeys(case.family for case in measured),
                      key=lambda name: order.index(name) if name in order else len(order))
    masks = [mask for mask in MASKS if any(case.mask == mask for case in measured)]
    width = 0.8 / len(masks)
    fig, axes = plt.subplots(2, 1, figsize=(max(8.0, 0.7 * len(families) + 2), 8), sharex=True)
    panels = (("peak_mib", "peak, memopt ÷ torch.compile", PEAK_TARGET),
              ("step_ms", "step time, memopt ÷ torch.compile", TIME_TARGET))
    for ax, (field, label, target) in zip(axes, panels, strict=True):
        for index, mask in enumerate(masks):
            by_family = {case.family: case.ratio(field) for case in measured if case.mask == mask}
            xs = [x for x, family in enumerate(families) if by_family.get(family) is not None]
            heights = [by_family[families[x]] for x in xs]
            offset = (index - (len(masks) - 1) / 2) * width
            bars = ax.bar([x + offset for x in xs], heights, width, label=f"mask: {mask}", color=f"C{index}")
            ax.bar_label(bars, fmt="%.2f", fontsize=6, rotation=90, padding=2)
        ax.axhline(target, color="C3", linestyle="--", linewidth=1, label=f"target {target:.2f}×")
        top = max((case.ratio(field) or 0.0) for case in measured)
        ax.set(ylabel=label, ylim=(0, max(top, target) * 1.18))
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8, loc="upper left", ncols=len(masks) + 1)
    decoders = {case.family: case.decoder for case in measured}
    axes[-1].set_xticks(range(len(families)),
                        [family if decoders[family] else f"{family}*" for family in families], rotation=45)
    axes[0].set_title("\n".join(dict.fromkeys(case.measured_on or "(where not recorded)" for case in measured)),
                      fontsize=8)
    if not all(decoders.values()):
        fig.text(0.01, 0.005, "* not a decoder-only LM: the targets apply to decoders", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def report(cases: list[Case], out: Path) -> None:
    title = report_title(cases)
    write_report(out, "zoo.md", f"{title}\n\n{table(cases)}\n\n{targets_line(cases)}")
    (out / "zoo.json").write_text(json.dumps([dataclasses.asdict(case) for case in cases], indent=1))
    plot(cases, out / "zoo.png")


def main(argv: list[str] | None = None) -> list[Case]:
    args = parse_args(argv)
    set_up(args.out, quiet_rules=True)
    device = torch.device(args.device)
    if args.render:
        cases = load_cases(args.render)
        report(cases, args.out)
        return cases
    options = json.loads(args.memopt_options)
    if args.tiny:
        options.setdefault("force", True)  # tiny sizes: no rewrite would pay, and the run is about which match
    cases = []
    progress = args.out / "zoo.jsonl"  # a line per case as it ends: a run cut short keeps what it measured
    title = run_title(args, device)
    for name in args.families.split(","):
        for mask in args.masks.split(","):
            case = run_case(name, mask, args, device, options)
            case.measured_on = title
            cases.append(case)
            with progress.open("a") as lines:
                lines.write(json.dumps(dataclasses.asdict(case)) + "\n")
    report(cases, args.out)
    return cases


if __name__ == "__main__":
    main()
