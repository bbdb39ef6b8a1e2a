"""Fine-tune a Hugging Face causal language model with memopt: what it rewrites, and what that saves.

    pip install -e ".[hf]"
    python examples/finetune_hf.py                                 # a small GPT-2 from its config, no download
    python examples/finetune_hf.py --model gpt2 --wta-budget 0.3   # a hub name or a local checkpoint, WTA-CRS on

The text is the running Python's standard library (the demo's data). With ``--model`` the checkpoint's own
tokenizer encodes it; without, the demo's word tokenizer does and a GPT-2 is built from a config with that
vocabulary (random init). The whole model is compiled in place, as for HF's ``Trainer``:
``fxpass.integrations.transformers.compile_model(model)`` (memopt; it also sets a ``loss_type`` transformers
recognises, whose absence would break the graph) and ``model.compile()`` (plain ``torch.compile``). A step is
``model(input_ids=ids, labels=ids).loss``; the output's logits are dropped. Attention runs HF's "eager"
implementation, the code memopt rewrites into its flash kernel; the loss is HF's causal-LM loss, which memopt
rewrites into cut cross-entropy with the logits returned beside it (``memopt.cce_with_logits``: computed once,
never saved for backward, their gradient re-attached outside the graph). A copy of the model trains
the same steps under plain ``torch.compile`` so both can be compared: memopt's decisions, the bytes autograd
saves for backward (and, on CUDA, the peak), the losses.
"""

from __future__ import annotations

import argparse
import copy
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fxpass
from examples.train_gpt import Run, build_dataset, get_batch, measure_memory, stdlib_sources, warm_up
from fxpass.integrations.transformers import compile_model, missing_loss_type
from fxpass.shapes import format_bytes

log = logging.getLogger("finetune_hf")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="hub name or local path (default: GPT-2 from a config)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=None, help="default 5e-5 with --model, 1e-3 from a config")
    parser.add_argument("--wta-budget", type=float, default=None, help="turn WTA-CRS on at this budget")
    parser.add_argument("--vocab-size", type=int, default=8192, help="word vocabulary without --model")
    parser.add_argument("--n-layer", type=int, default=2, help="layers of the GPT-2 built without --model")
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--data-mb", type=float, default=2.0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def load(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.Tensor]:
    """(model with eager attention, training tokens)."""
    import transformers

    if args.model:
        tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="eager")
        text = "\n".join(stdlib_sources(int(args.data_mb * 1e6)))
        tokens = torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)
    else:
        data = build_dataset(args.data_mb, args.vocab_size)
        config = transformers.GPT2Config(
            vocab_size=data.tokenizer.vocab_size, n_positions=max(1024, args.seq_len), n_layer=args.n_layer,
            n_embd=args.n_embd, n_head=args.n_head, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            attn_implementation="eager", bos_token_id=0, eos_token_id=0,
        )
        torch.manual_seed(args.seed)
        model = transformers.GPT2LMHeadModel(config)
        tokens = data.train
    return model, tokens


def compile_in_place(name: str, model: torch.nn.Module, options: dict[str, Any] | None) -> None:
    """memopt: ``compile_model`` (which sets ``loss_type`` where transformers knows none); plain
    ``torch.compile``: ``model.compile()``, with the same ``loss_type``, so both runs compute the same loss
    in one graph."""
    if name == "memopt":
        compile_model(model, options=options)
        return
    loss_type = missing_loss_type(model)
    if loss_type is not None:
        model.loss_type = loss_type
    model.compile()


def train(name: str, model, options, tokens, args, device) -> dict[str, Any]:
    """Compile the whole model in place (memopt with ``options``, or plain ``torch.compile``), train
    ``--steps`` steps with the demo's ``Run`` (AdamW, gradients clipped at 1.0); losses, saved bytes, CUDA
    peak, time per step."""
    model = model.to(device).train()
    compile_in_place(name, model, options)

    def step(ids: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids, labels=ids).loss  # HF shifts the labels; the output's logits are dropped

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    run = Run(name, model, step, optimizer)
    batches = torch.Generator().manual_seed(args.seed)
    ids, _ = get_batch(tokens, args.batch_size, args.seq_len, batches, device)
    warm_up(run, ids, ids)  # compile first: its tracing would be counted otherwise
    memory = measure_memory([run], ids, ids)
    for _ in range(args.steps):
        ids, _ = get_batch(tokens, args.batch_size, args.seq_len, batches, device)
        run.train_step(ids, ids)
    return {"losses": run.losses, "saved_bytes": memory["saved_tensor_bytes"][run.name],
            "peak_bytes": memory["peak_bytes"].get(run.name), "ms_per_step": 1000 * run.seconds / max(1, args.steps)}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the example; returns what it printed."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    device = torch.device(args.device)
    args.lr = args.lr or (5e-5 if args.model else 1e-3)
    model, tokens = load(args)
    options = {} if args.wta_budget is None else {"wta_crs_budget": args.wta_budget}
    fxpass.clear_reports()
    baseline_model = copy.deepcopy(model)
    results = {"memopt": train("memopt", model, options, tokens, args, device)}
    reports = list({report.graph_id: report for report in fxpass.reports()}.values())  # the last of recompiles
    results["torch.compile"] = train("torch.compile", baseline_model, None, tokens, args, device)

    for report in reports:
        print(report.table())
    applied = sorted({r.rule for report in reports for r in report.applied})
    print(f"\nrewritten: {', '.join(applied) or 'nothing'}")
    print("\n| | memopt | torch.compile |\n|---|---|---|")
    ours, theirs = results["memopt"], results["torch.compile"]
    for label, key in (("tensors saved for backward", "saved_bytes"), ("CUDA peak, one step", "peak_bytes")):
        if ours[key] is not None:
            print(f"| {label} | {format_bytes(ours[key])} | {format_bytes(theirs[key])} |")
    print(f"| time per step | {ours['ms_per_step']:.0f} ms | {theirs['ms_per_step']:.0f} ms |")
    print(f"| loss, first → last step | {ours['losses'][0]:.4f} → {ours['losses'][-1]:.4f} "
          f"| {theirs['losses'][0]:.4f} → {theirs['losses'][-1]:.4f} |")
    return {"results": results, "applied": applied, "reports": reports}


if __name__ == "__main__":
    main()
