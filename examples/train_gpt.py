"""Train a small GPT on Python's own standard library with memopt, next to plain ``torch.compile``.

    pip install -e .                          # once: registers the "memopt" backend for torch.compile
    python examples/train_gpt.py              # 300 steps on CUDA if there is one, else on the CPU
    python examples/train_gpt.py --steps 50 --no-compare

What it shows:

1. memopt's rewrite report: the model is compiled as it is (``torch.compile(model, backend="memopt")``) and
   its forward returns ``(logits, loss)``. The nanoGPT loss ``cross_entropy(lm_head(x).view(-1, V), ...)``
   becomes one op that computes the N×V logits once, returns them and saves none of them for backward (cut
   cross-entropy): on the CPU ``torch.ops.memopt.cce_rowwise``, which takes the loss's gradients from them in the
   forward, on CUDA ``torch.ops.memopt.cce_with_logits``, which recomputes them in the backward. The training
   step drops the logits, so they die at once.
   The causal attention becomes ``torch.ops.memopt.flash_attention``. The report says why for each.
2. The memory one training step needs, estimated by memopt and measured: the tensors autograd saves for
   backward (and, on CUDA, the peak allocated), with memopt and with plain ``torch.compile`` (Inductor).
3. That memopt trains the same: with ``--compare`` (the default) a second copy of the model, from the same
   initial weights and on the same batches, trains under plain ``torch.compile``; the losses are printed
   side by side.

The data is the running Python's standard library: its ``*.py`` files in a fixed order, capped at
``--data-mb``, split into words by a regex; the most frequent words become the vocabulary, with a byte
fallback for the rest. A vocabulary of 8192 words (32768 on CUDA) makes the LM head's logits the largest
activation of the model, which is where cut cross-entropy saves memory. No download, nothing beyond torch,
tqdm and the standard library.
"""

from __future__ import annotations

import argparse
import collections
import copy
import dataclasses
import importlib.metadata
import logging
import re
import sys
import sysconfig
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fxpass
from examples.gpt import GPT, GPTConfig
from fxpass.shapes import format_bytes

log = logging.getLogger("train_gpt")

Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# Model and data sizes when not given on the command line: (cpu, cuda). On a CPU a step computes 2048 × 8192
# logits (twice with --compare): about the smallest LM head for which memopt's memory model says the rewrite pays
# off against the CPU op's own chunked working set; 300 steps of both runs take about 3 minutes on 2 cores.
DEVICE_DEFAULTS: dict[str, tuple[Any, Any]] = {
    "batch_size": (16, 32),
    "seq_len": (128, 256),
    "vocab_size": (8192, 32768),
    "n_layer": (2, 4),
    "n_head": (4, 6),
    "n_embd": (128, 384),
    "data_mb": (4.0, 16.0),
}


# --- command line ----------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line; sizes left unset get the defaults of the chosen device (``DEVICE_DEFAULTS``)."""
    parser = argparse.ArgumentParser(
        description="Train a small GPT on the Python standard library with torch.compile(backend='memopt').",
    )
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps (default 300)")
    parser.add_argument("--batch-size", type=int, default=None, help="sequences per step (cpu 16, cuda 32)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (cpu 128, cuda 256)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: cuda if available")
    parser.add_argument(
        "--compare",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also train a copy under plain torch.compile (Inductor) and print both losses (default: on)",
    )
    parser.add_argument("--seed", type=int, default=0, help="weights and data order (default 0)")
    parser.add_argument(
        "--vocab-size", type=int, default=None, help="256 byte tokens + the most frequent words (cpu 8192, cuda 32768)"
    )
    parser.add_argument("--n-layer", type=int, default=None, help="transformer blocks (cpu 2, cuda 4)")
    parser.add_argument("--n-head", type=int, default=None, help="attention heads (cpu 4, cuda 6)")
    parser.add_argument("--n-embd", type=int, default=None, help="model width (cpu 128, cuda 384)")
    parser.add_argument("--data-mb", type=float, default=None, help="MB of standard-library source (cpu 4, cuda 16)")
    parser.add_argument("--lr", type=float, default=2e-3, help="AdamW learning rate (default 2e-3)")
    parser.add_argument("--eval-batches", type=int, default=4, help="validation batches per evaluation (default 4)")
    parser.add_argument("--checkpoints", type=int, default=4, help="loss table rows after step 1 (default 4)")
    parser.add_argument(
        "--threads", type=int, default=None, help="CPU threads (torch.set_num_threads); fewer help on a busy machine"
    )
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="tqdm bar (default on)")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging (memopt's decisions too)")
    return parser.parse_args(argv)


def resolve_device(name: str) -> torch.device:
    """``auto`` is CUDA when available, else CPU; asking for CUDA without one is an error."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available (torch.cuda.is_available() is False)")
    return torch.device(name)


def fill_device_defaults(args: argparse.Namespace, device: torch.device) -> None:
    """Give every size the user left unset its default for ``device``."""
    column = 1 if device.type == "cuda" else 0
    for name, values in DEVICE_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, values[column])


def setup_logging(verbose: bool) -> None:
    """Diagnostics go through ``logging`` to stderr; the tables go to stdout with ``print``."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    log.setLevel(logging.DEBUG if verbose else logging.INFO)
    if verbose:
        logging.getLogger("fxpass").setLevel(logging.DEBUG)


# --- data ------------------------------------------------------------------------------------------------


def stdlib_sources(max_bytes: int) -> list[str]:
    """Texts of the standard library's ``*.py`` files, up to ``max_bytes`` characters.

    The order is by a CRC32 of each file's relative path: fixed for a Python version, yet a mix of the
    whole library (alphabetical order would stop at the ``encodings`` code tables).
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    relative = [
        p.relative_to(root).as_posix()
        for p in root.rglob("*.py")
        if not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts)
    ]
    relative.sort(key=lambda name: (zlib.crc32(name.encode()), name))
    texts, total = [], 0
    for name in relative:
        if total >= max_bytes:
            break
        texts.append((root / name).read_bytes().decode("utf-8", errors="replace"))
        total += len(texts[-1])
    if len(texts) < 2:
        raise SystemExit(f"need at least two *.py files under {root} (found {len(texts)}); raise --data-mb")
    return texts


# GPT-2-style pre-tokenization: words and punctuation runs keep one leading space; indentation is a token.
WORD_PATTERN = re.compile(r" ?\w+| ?[^\w\s]+|\s+(?!\S)|\s+")


@dataclasses.dataclass
class WordTokenizer:
    """Ids 0-255 are bytes (the fallback for rare words); ids from 256 are the most frequent words."""

    words: list[str]

    @classmethod
    def fit(cls, text: str, vocab_size: int) -> WordTokenizer:
        """Keep the ``vocab_size - 256`` most frequent regex words of ``text`` (ties broken by first use)."""
        if vocab_size <= 256:
            raise SystemExit(f"--vocab-size must exceed the 256 byte tokens, got {vocab_size}")
        counts = collections.Counter(WORD_PATTERN.findall(text))
        return cls([word for word, _ in counts.most_common(vocab_size - 256)])

    def __post_init__(self) -> None:
        self.index = {word: 256 + i for i, word in enumerate(self.words)}

    @property
    def vocab_size(self) -> int:
        return 256 + len(self.words)

    def encode(self, text: str) -> list[int]:
        """Word ids, or the UTF-8 bytes of words outside the vocabulary."""
        ids: list[int] = []
        for word in WORD_PATTERN.findall(text):
            token = self.index.get(word)
            if token is None:
                ids.extend(word.encode("utf-8"))
            else:
                ids.append(token)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``; runs of byte tokens are decoded together as UTF-8."""
        out, pending = [], bytearray()
        for token in ids:
            if token < 256:
                pending.append(token)
                continue
            out.append(pending.decode("utf-8", errors="replace"))
            pending.clear()
            out.append(self.words[token - 256])
        out.append(pending.decode("utf-8", errors="replace"))
        return "".join(out)


@dataclasses.dataclass
class Dataset:
    """Token ids of the training and validation text, and the tokenizer that made them."""

    train: torch.Tensor
    val: torch.Tensor
    tokenizer: WordTokenizer
    files: int
    chars: int


def build_dataset(data_mb: float, vocab_size: int, val_every: int = 10) -> Dataset:
    """Tokenize the standard library; every ``val_every``-th file is held out for validation."""
    texts = stdlib_sources(int(data_mb * 1e6))
    held_out = set(range(val_every - 1, len(texts), val_every)) or {len(texts) - 1}
    train_text = "\n".join(text for i, text in enumerate(texts) if i not in held_out)
    val_text = "\n".join(texts[i] for i in sorted(held_out))
    tokenizer = WordTokenizer.fit(train_text, vocab_size)
    train = torch.tensor(tokenizer.encode(train_text), dtype=torch.long)
    val = torch.tensor(tokenizer.encode(val_text), dtype=torch.long)
    return Dataset(train, val, tokenizer, len(texts), sum(len(text) for text in texts))


def get_batch(
    data: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of ``seq_len`` tokens and the same windows shifted by one (the next-token targets)."""
    starts = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=generator)
    x = torch.stack([data[s : s + seq_len] for s in starts.tolist()])
    y = torch.stack([data[s + 1 : s + 1 + seq_len] for s in starts.tolist()])
    return x.to(device), y.to(device)


def eval_batches(
    data: torch.Tensor, n_batches: int, batch_size: int, seq_len: int, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed, evenly spaced validation windows, so every evaluation sees the same tokens."""
    count = n_batches * batch_size
    if len(data) < seq_len + 2:
        raise SystemExit(f"validation split has {len(data)} tokens, fewer than --seq-len {seq_len}; raise --data-mb")
    starts = torch.linspace(0, len(data) - seq_len - 1, count).long().tolist()
    batches = []
    for i in range(0, count, batch_size):
        chunk = starts[i : i + batch_size]
        x = torch.stack([data[s : s + seq_len] for s in chunk])
        y = torch.stack([data[s + 1 : s + 1 + seq_len] for s in chunk])
        batches.append((x.to(device), y.to(device)))
    return batches


# --- training --------------------------------------------------------------------------------------------


def memopt_backend_name() -> str | Callable:
    """``"memopt"`` when the package is installed (entry point); otherwise the backend function itself."""
    if importlib.metadata.entry_points(group="torch_dynamo_backends", name="memopt"):
        return "memopt"
    log.warning("the 'memopt' backend entry point is not installed (pip install -e .); using fxpass.memopt_backend")
    return fxpass.memopt_backend


def build_model(args: argparse.Namespace, vocab_size: int, device: torch.device) -> GPT:
    """``examples.gpt.GPT`` at the command line's sizes, initialized from ``--seed``."""
    config = GPTConfig(
        vocab_size=vocab_size,
        block_size=args.seq_len,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
        dropout=0.0,
    )
    torch.manual_seed(args.seed)
    model = GPT(config).to(device)
    log.info("model: %s, %.2fM parameters, on %s", config, sum(p.numel() for p in model.parameters()) / 1e6, device)
    return model


def make_step(compiled: Callable[..., tuple[torch.Tensor, torch.Tensor]]) -> Step:
    """The training step's forward: the compiled model's loss; the logits it returns beside it are dropped."""

    def step(idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        _, loss = compiled(idx, targets)
        return loss

    return step


@dataclasses.dataclass
class Run:
    """One model trained under one backend: ``step`` runs the compiled model and returns its loss."""

    name: str
    model: GPT
    step: Step
    optimizer: torch.optim.Optimizer
    losses: list[float] = dataclasses.field(default_factory=list)
    seconds: float = 0.0

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """One optimizer step on (x, y); returns the loss before the update."""
        start = time.perf_counter()
        loss = self.step(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        value = loss.item()
        self.seconds += time.perf_counter() - start
        self.losses.append(value)
        return value


def make_run(name: str, model: GPT, backend: str | Callable, lr: float) -> Run:
    """An AdamW run of ``model`` compiled as it is with ``backend``.

    ``torch.compile(model)`` wraps the module (its parameters are shared); ``model`` itself stays eager, which
    the evaluation uses.
    """
    compiled = torch.compile(model, backend=backend)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    return Run(name, model, make_step(compiled), optimizer)


def start_compiler(device: torch.device) -> None:
    """Compile a trivial step once, so that the compile times below compare the two backends alone: the first
    compile in a process also pays Inductor's start-up (its code generator and C++ toolchain, AOTAutograd's
    imports), which would otherwise be charged to whichever backend warms up first."""
    trivial = torch.compile(lambda t: (t * 2.0).sum(), backend="inductor")
    trivial(torch.ones(8, device=device, requires_grad=True)).backward()


def warm_up(run: Run, x: torch.Tensor, y: torch.Tensor) -> float:
    """Compile forward and backward with one step that does not update the weights; returns seconds."""
    slow = " (tens of seconds on a CPU)" if x.device.type == "cpu" else ""
    log.info("compiling the %s step, forward and backward%s", run.name, slow)
    start = time.perf_counter()
    run.step(x, y).backward()
    run.model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def saved_tensor_bytes(step: Step, x: torch.Tensor, y: torch.Tensor) -> int:
    """Bytes of the tensors autograd saves for backward in one step: the sum over unique storages."""
    storages: dict[tuple[str, int], int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        storages[(str(tensor.device), storage.data_ptr())] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = step(x, y)
    loss.backward()
    return sum(storages.values())


def cuda_peak_bytes(run: Run, x: torch.Tensor, y: torch.Tensor) -> int:
    """``torch.cuda.max_memory_allocated()`` over one forward and backward (statistics reset before)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    run.step(x, y).backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def measure_memory(runs: Sequence[Run], x: torch.Tensor, y: torch.Tensor) -> dict[str, dict[str, int]]:
    """Saved-for-backward bytes (and the CUDA peak) of one step of each run on the same batch, no update."""
    memory: dict[str, dict[str, int]] = {"saved_tensor_bytes": {}, "peak_bytes": {}}
    for run in runs:
        memory["saved_tensor_bytes"][run.name] = saved_tensor_bytes(run.step, x, y)
        run.model.zero_grad(set_to_none=True)
        if x.device.type == "cuda":
            memory["peak_bytes"][run.name] = cuda_peak_bytes(run, x, y)
            run.model.zero_grad(set_to_none=True)
    return memory


@torch.no_grad()
def evaluate(model: GPT, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean validation loss, computed eagerly (no compile, no autograd)."""
    model.eval()
    losses = [model(x, y)[1].item() for x, y in batches]
    model.train()
    return sum(losses) / len(losses)


def checkpoint_steps(steps: int, count: int) -> list[int]:
    """The first step, then ``count`` evenly spaced steps ending with the last one."""
    return sorted({1} | {max(1, round(steps * (i + 1) / count)) for i in range(max(1, count))})


def train(
    runs: Sequence[Run],
    data: torch.Tensor,
    val_batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    args: argparse.Namespace,
    device: torch.device,
) -> list[dict[str, Any]]:
    """Train every run on the same batches; at each checkpoint record the step's loss and the validation loss."""
    generator = torch.Generator().manual_seed(args.seed + 1)
    marks = checkpoint_steps(args.steps, args.checkpoints) if args.steps > 0 else []
    checkpoints: list[dict[str, Any]] = []
    bar = tqdm(range(1, args.steps + 1), desc="training", unit="step", disable=not args.progress)
    for step in bar:
        x, y = get_batch(data, args.batch_size, args.seq_len, generator, device)
        for run in runs:
            run.train_step(x, y)
        bar.set_postfix({run.name: f"{run.losses[-1]:.3f}" for run in runs})
        if step in marks:
            checkpoints.append(
                {
                    "step": step,
                    "train": {run.name: run.losses[-1] for run in runs},
                    "val": {run.name: evaluate(run.model, val_batches) for run in runs},
                }
            )
    bar.close()
    return checkpoints


# --- output ----------------------------------------------------------------------------------------------


def report_summaries() -> list[dict[str, Any]]:
    """memopt's reports of this run's graphs, as plain data."""
    return [
        {
            "graph": report.graph_id,
            "summary": report.summary(),
            "applied": len(report.applied),
            "saved_bytes_hint": report.saved_bytes_hint,
            # the part of it that is tensors no longer saved for the backward, priced against torch.compile
            "saved_for_backward_hint": sum(
                r.against_compile["saved_hint"] for r in report.applied if r.against_compile is not None
            ),
            "records": [record.to_json() for record in report.records],
        }
        for report in fxpass.reports()
    ]


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def memory_table(memory: dict[str, dict[str, int]], estimated: dict[str, int]) -> str:
    """Estimated and measured memory of one step, memopt next to plain torch.compile: each measured row under the
    row memopt's report estimated for it before the step ran."""
    rows: list[list[str]] = []
    for key, label, guess in (
        ("saved_tensor_bytes", "tensors saved for backward", "saved_for_backward"),
        ("peak_bytes", "CUDA peak allocated", "peak"),
    ):
        values = memory[key]
        if "memopt" in values and "torch.compile" in values:
            rows.append([f"{label}: estimated by memopt's report", "-", "-", format_bytes(estimated[guess])])
            ours, theirs = values["memopt"], values["torch.compile"]
            share = f" ({(theirs - ours) / theirs:.0%})" if theirs else ""
            rows.append([f"{label}: measured", format_bytes(ours), format_bytes(theirs),
                         format_bytes(theirs - ours) + share])
    return table(["one training step", "memopt", "torch.compile", "saved"], rows)


def loss_table(checkpoints: list[dict[str, Any]], compare: bool) -> str:
    """Train and validation losses at each checkpoint, both runs side by side."""
    header = ["step", "memopt train", "memopt val"]
    if compare:
        header += ["torch.compile train", "torch.compile val", "|Δ train|"]
    rows = []
    for point in checkpoints:
        row = [point["step"], f"{point['train']['memopt']:.4f}", f"{point['val']['memopt']:.4f}"]
        if compare:
            delta = abs(point["train"]["memopt"] - point["train"]["torch.compile"])
            row += [f"{point['train']['torch.compile']:.4f}", f"{point['val']['torch.compile']:.4f}", f"{delta:.2e}"]
        rows.append(row)
    return table(header, rows)


def print_report(reports: Sequence[dict[str, Any]]) -> None:
    """Each compiled graph's decisions: what was rewritten, why, and the estimated saving."""
    print("\n== memopt rewrite report ==")
    for report in reports:
        print(report["summary"])
    if not reports:
        print("memopt compiled no graph")
    elif not any(report["applied"] for report in reports):
        log.warning("memopt rewrote nothing; the reasons are in the table above")


def print_memory(
    memory: dict[str, dict[str, int]], estimated: dict[str, int], args: argparse.Namespace, vocab: int
) -> None:
    """The memory table, headed by the step's shape and the size its logits would have."""
    tokens = args.batch_size * args.seq_len
    print(
        f"\n== memory: batch {args.batch_size} × {args.seq_len} = {tokens} tokens, vocabulary {vocab}: "
        f"fp32 logits are {format_bytes(tokens * vocab * 4)} =="
    )
    print(memory_table(memory, estimated))
    print(
        "estimated: what memopt's report says each rewrite frees against torch.compile (the partitioner's saved "
        "tensors, and the peak with the ops' own buffers);\nmeasured: the tensors autograd keeps from forward to "
        "backward (unique storages) and the CUDA allocator's peak."
    )


def print_losses(checkpoints: list[dict[str, Any]], args: argparse.Namespace, device: torch.device, n_val: int) -> None:
    """The loss table (nothing when no step was trained)."""
    if checkpoints:
        print(f"\n== loss, {args.steps} steps on {device.type} (val: mean of {n_val} held-out batches) ==")
        print(loss_table(checkpoints, args.compare))


def print_times(runs: Sequence[Run], compile_seconds: dict[str, float]) -> None:
    """Compile time and mean training-step time of each run."""
    rows = [
        [run.name, f"{compile_seconds[run.name]:.1f} s", f"{1e3 * run.seconds / max(1, len(run.losses)):.0f} ms"]
        for run in runs
    ]
    print("\n== time ==")
    print(table(["backend", "compile (first step)", "per training step"], rows))


# --- main ------------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the demo; returns every number it printed."""
    args = parse_args(argv)
    setup_logging(args.verbose)
    device = resolve_device(args.device)
    fill_device_defaults(args, device)
    if args.threads:
        torch.set_num_threads(args.threads)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 matmuls, as nanoGPT does; both runs alike

    started = time.perf_counter()
    log.info("tokenizing up to %.1f MB of the standard library's *.py files", args.data_mb)
    data = build_dataset(args.data_mb, args.vocab_size)
    log.info(
        "%d files, %d train / %d val tokens, vocabulary %d",
        data.files,
        len(data.train),
        len(data.val),
        data.tokenizer.vocab_size,
    )
    model = build_model(args, data.tokenizer.vocab_size, device)
    config = model.config

    fxpass.clear_reports()
    runs = [make_run("memopt", model, memopt_backend_name(), args.lr)]
    # Plain torch.compile: always built for the memory measurement; trained only with --compare.
    runs.append(make_run("torch.compile", copy.deepcopy(model), "inductor", args.lr))

    x, y = get_batch(data.train, args.batch_size, args.seq_len, torch.Generator().manual_seed(args.seed), device)
    start_compiler(device)
    compile_seconds = {run.name: warm_up(run, x, y) for run in runs}
    memory = measure_memory(runs, x, y)
    if not args.compare:
        runs.pop()

    val_batches = eval_batches(data.val, args.eval_batches, args.batch_size, args.seq_len, device)
    checkpoints = train(runs, data.train, val_batches, args, device)
    reports = report_summaries()
    estimated = sum(report["saved_bytes_hint"] for report in reports)
    estimates = {"peak": estimated, "saved_for_backward": sum(r["saved_for_backward_hint"] for r in reports)}
    applied = sum(report["applied"] for report in reports)
    logits_bytes = args.batch_size * args.seq_len * config.vocab_size * 4

    print_report(reports)
    print_memory(memory, estimates, args, config.vocab_size)
    print_losses(checkpoints, args, device, len(val_batches))
    print_times(runs, compile_seconds)
    total_seconds = time.perf_counter() - started
    print(f"\ntotal {total_seconds:.0f} s")

    final = checkpoints[-1] if checkpoints else None
    return {
        "device": device.type,
        "args": vars(args),
        "model": dataclasses.asdict(config),
        "data": {
            "files": data.files,
            "chars": data.chars,
            "train_tokens": len(data.train),
            "val_tokens": len(data.val),
            "vocab_size": data.tokenizer.vocab_size,
        },
        "report": reports,
        "applied": applied,
        "estimated_saved_bytes": estimated,
        "logits_bytes": logits_bytes,
        "memory": memory,
        "losses": {run.name: run.losses for run in runs},
        "checkpoints": checkpoints,
        "final": final,
        "seconds": {
            "compile": compile_seconds,
            "train": {run.name: run.seconds for run in runs},
            "total": total_seconds,
        },
    }


if __name__ == "__main__":
    main()
