"""Is memopt's memory model true? What it predicts against what the compiled steps really keep, per model and per
rule, side by side in one process.

    python benchmarks/memory_model.py --out $OUT/memory_model                         # GPU: the models below
    python benchmarks/memory_model.py --models gpt2,llama-1b --layers 2 --batch 8 --seq 1024
    PYTHONPATH=. python benchmarks/memory_model.py --tiny --device cpu                # CPU: saved bytes only
    python benchmarks/memory_model.py --predict-only --device cpu --per-rule gpt2     # a laptop's GPU prediction

For each model (a loss-only training step, ``model(ids, labels=ids).loss``, bf16 weights on CUDA; "demo" is the
README demo's GPT at its defaults; Granite and Starcoder2 are built as ``benchmarks/zoo.py`` builds them):
- **saved bytes**: ``fxpass.explain(step)``'s prediction of what the compiled forward keeps for the backward,
  whole step, under torch.compile and under memopt, before the step runs, against the bytes the compiled steps
  save (every saved tensor's storage, counted by a pack hook; parameters and inputs aside). Target: ±10 % (or
  16 MiB).
- **peak** (CUDA): the drop of the step's peak memory that memopt's records predict (the saved-for-backward
  savings of every applied rewrite, plus the largest transient saving: one piece runs at a time) against the
  measured drop of ``max_memory_allocated`` from torch.compile's step to memopt's. Each rule alone and all
  together. Target: ±20 %. A second prediction simulates the whole step under each backend
  (``Explanation.peak_bytes``: Inductor-like buffers of the partitioned forward and backward, memopt's kernel
  buffers added) and subtracts.

``--predict-only`` is the laptop's side: each step is captured and priced for a GPU (``assume_device="cuda"``,
bf16 weights, the demo at its CUDA defaults) without running it, so real widths take seconds on a CPU; the
measured columns stay empty, to be read beside a GPU run's. Only the step's first graph is seen (the models here
compile into one).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fxpass
from benchmarks._common import ratio, recorded_peak, release_memory, set_up

log = logging.getLogger("memory_model")

MIB = 1 << 20
RULE_SETS = {"all": (), "cce": ("attention", "wta_crs"), "attention": ("cce", "wta_crs")}


def build(name: str, layers: int, tiny: bool, seq: int = 1024):
    """An HF causal LM from its config (no download), ``layers`` blocks, its real vocabulary unless ``tiny``; a name
    this list lacks is one of ``benchmarks/zoo.py``'s families."""
    import transformers

    small = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                 vocab_size=4096)
    families = {
        "gpt2": (transformers.GPT2Config, transformers.GPT2LMHeadModel,
                 dict(n_embd=64, n_head=4, vocab_size=4096) if tiny else {}),
        "llama-1b": (transformers.LlamaConfig, transformers.LlamaForCausalLM, small if tiny else dict(
            hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8,
            vocab_size=128256, tie_word_embeddings=True)),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, small if tiny else dict(
            hidden_size=1024, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8,
            head_dim=128, vocab_size=151936, tie_word_embeddings=True)),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, small if tiny else dict(
            hidden_size=1024, intermediate_size=3584, num_attention_heads=16, num_key_value_heads=8,
            vocab_size=32768)),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM, small if tiny else dict(
            hidden_size=1024, intermediate_size=4096, num_attention_heads=16, num_key_value_heads=16,
            vocab_size=32064)),
    }
    if name not in families:  # the zoo's families (Granite, Starcoder2, ...) at their real widths
        from benchmarks import zoo

        return zoo.build_model(name, layers, tiny, seq=seq, device=torch.device("cpu"), dtype=torch.float32)
    config_class, model_class, sizes = families[name]
    config = config_class(**sizes, attn_implementation="sdpa" if name != "gpt2" else "eager")
    config.num_hidden_layers = layers
    for key in ("attn_pdrop", "resid_pdrop", "embd_pdrop", "attention_dropout"):
        if hasattr(config, key):
            setattr(config, key, 0.0)
    model = model_class(config)
    model.loss_type = "ForCausalLM"
    return model.train()


@dataclasses.dataclass
class Row:
    model: str
    rules: str
    predicted_saved: dict[str, int] | None = None  # torch.compile, memopt
    measured_saved: dict[str, int] | None = None
    predicted_drop: int | None = None
    simulated_drop: int | None = None  # the whole step simulated under each backend (``Explanation.peak_bytes``)
    simulated_peak: dict[str, int] | None = None  # torch.compile, memopt: beyond the step's inputs
    measured_peak: dict[str, int] | None = None
    measured_drop: int | None = None
    error: str | None = None


def measure(step, ids, backend, kept, device: torch.device, breakdown: Path | None = None) -> tuple[int, int | None]:
    """(bytes of the storages the compiled step saves for its backward, counted by a pack hook with ``kept`` and
    ``ids`` aside; on CUDA the step's peak bytes above what was allocated before it, warm). Fake tensors saved
    while compiling are no step's. ``breakdown``: where to write what was alive at the CUDA peak, by the line of
    generated code that allocated it (``_common.recorded_peak``)."""
    from torch._subclasses.fake_tensor import is_fake

    skip = {t.untyped_storage().data_ptr() for t in (*kept, ids)}
    storages: dict[int, int] = {}

    def pack(tensor):
        if not is_fake(tensor) and tensor.untyped_storage().data_ptr() not in skip:
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    compiled = torch.compile(step, backend=backend)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = compiled(ids)
    loss.backward()
    del loss
    if device.type != "cuda":
        return sum(storages.values()), None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    compiled(ids).backward()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    if breakdown is not None:
        recorded_peak(lambda: compiled(ids).backward(), device, breakdown)
    return sum(storages.values()), peak


def predicted_drop(explanation: fxpass.Explanation) -> int:
    """The step's peak drop the records predict: every applied rewrite's saved-for-backward saving, plus the
    largest transient saving (one piece runs at a time; a language model's head, at the backward's start)."""
    priced = [r.against_compile for r in explanation.applied if r.against_compile is not None]
    return sum(p["saved_hint"] for p in priced) + max((p["transient_hint"] for p in priced), default=0)


def predict(step, ids, options: dict) -> fxpass.Explanation:
    """``fxpass.explain``'s figures for ``step`` on a GPU, without running it (``execute=False``)."""
    torch._dynamo.reset()
    return fxpass.explain(step, ids, options=options, assume_device="cuda", execute=False)


def demo(device: torch.device, tiny: bool, defaults_for: torch.device | None = None):
    """The README demo's model (``examples/train_gpt.py``) at its defaults for ``defaults_for`` (``device``'s
    unless given), and its step."""
    from examples import train_gpt

    args = train_gpt.parse_args(["--device", device.type])
    train_gpt.fill_device_defaults(args, defaults_for or device)
    vocab = 512 if tiny else args.vocab_size
    model = train_gpt.build_model(args, vocab, device).train()
    return model, vocab, args.batch_size, args.seq_len, lambda ids: model(ids, ids)[1]


def _loss_step(model):
    return lambda ids: model(input_ids=ids, labels=ids).loss


def run(name: str, args, device: torch.device) -> list[Row]:
    if name == "demo":
        defaults_for = torch.device("cuda") if args.predict_only else None
        model, vocab, batch, seq, step = demo(device, args.tiny, defaults_for)
    else:
        model = build(name, args.layers, args.tiny, args.seq).to(device)
        vocab, batch, seq, step = model.config.vocab_size, args.batch, args.seq, _loss_step(model)

    if args.precision == "bf16":
        model = model.to(torch.bfloat16)
    ids = torch.randint(0, vocab, (batch, seq), device=device)
    params = [*model.parameters(), *model.buffers()]  # graph inputs: not what the step saves

    rows = []
    sets = args.rule_sets.split(",") if name in args.per_rule.split(",") else ["all"]
    for rules in sets:
        disabled = RULE_SETS[rules]
        row = Row(name, rules)
        options = {"disable": ",".join(disabled)} if disabled else {}
        backend = fxpass.MemoptBackend(options=options)
        try:
            release_memory()
            if args.predict_only:
                explanation = predict(step, ids, options)
            else:
                explanation = fxpass.explain(step, ids, options=options)
            row.predicted_saved = explanation.saved_bytes()
            row.predicted_drop = predicted_drop(explanation)
            peaks = explanation.peak_bytes()
            row.simulated_drop = None if peaks is None else peaks["torch.compile"] - peaks["memopt"]
            row.simulated_peak = peaks
            if args.predict_only:
                rows.append(row)
                continue
            measured = {}
            for variant, compiler in (("torch.compile", "inductor"), ("memopt", backend)):
                model.zero_grad(set_to_none=True)
                release_memory()
                breakdown = args.out / f"peak-{name}-{rules}-{variant}.md" if args.breakdown and args.out else None
                measured[variant] = measure(step, ids, compiler, params, device, breakdown)
            model.zero_grad(set_to_none=True)
            row.measured_saved = {variant: saved for variant, (saved, _) in measured.items()}
            if device.type == "cuda":
                row.measured_drop = measured["torch.compile"][1] - measured["memopt"][1]
                row.measured_peak = {variant: peak for variant, (_, peak) in measured.items()}
        except Exception as error:  # one failing case leaves the others measured
            log.exception("%s / %s failed", name, rules)
            row.error = f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"
        rows.append(row)
        log.info("%s", row)
    del model
    release_memory()
    return rows


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / MIB:.1f}"


def table(rows: list[Row]) -> str:
    lines = [
        "| model | rules | saved, torch.compile: predicted / measured MiB | ratio | saved, memopt: predicted / "
        "measured MiB | ratio | peak drop: records / measured MiB | ratio | peak drop: whole step simulated MiB | "
        "ratio |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.error:
            lines.append(f"| {r.model} | {r.rules} | error: {r.error} | | | | | | | |")
            continue
        p, m = r.predicted_saved or {}, r.measured_saved or {}
        lines.append(
            f"| {r.model} | {r.rules} | {_mib(p.get('torch.compile'))} / {_mib(m.get('torch.compile'))} | "
            f"{ratio(p.get('torch.compile'), m.get('torch.compile'))} | {_mib(p.get('memopt'))} / "
            f"{_mib(m.get('memopt'))} | {ratio(p.get('memopt'), m.get('memopt'))} | {_mib(r.predicted_drop)} / "
            f"{_mib(r.measured_drop)} | {ratio(r.predicted_drop, r.measured_drop)} | {_mib(r.simulated_drop)} | "
            f"{ratio(r.simulated_drop, r.measured_drop)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="demo,gpt2,llama-1b,qwen3,mistral,phi3,granite,starcoder2")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--rule-sets", default="all,cce,attention", help="for the --per-rule models")
    parser.add_argument("--per-rule", default="gpt2,llama-1b", help="models measured with each rule alone too")
    parser.add_argument("--tiny", action="store_true", help="tiny configs (a smoke run of the script)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--precision", choices=["bf16", "fp32"], default=None, help="weights (default: bf16 on CUDA)")
    parser.add_argument("--breakdown", action="store_true", help="CUDA: what is alive at each step's peak, to --out")
    parser.add_argument("--predict-only", action="store_true",
                        help="price each step for a GPU without running it (the laptop's prediction)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    set_up(args.out, quiet_rules=True)
    device = torch.device(args.device)
    args.precision = args.precision or ("bf16" if device.type == "cuda" or args.predict_only else "fp32")
    rows = [row for name in args.models.split(",") for row in run(name, args, device)]
    text = table(rows)
    print(text)
    if args.out is not None:
        (args.out / "memory_model.md").write_text(text + "\n")
        (args.out / "memory_model.json").write_text(json.dumps([dataclasses.asdict(r) for r in rows], indent=1))
    return rows


if __name__ == "__main__":
    main()
