"""One training step of a causal LM under DDP or FSDP2, compiled with and without memopt, on every rank.

    python -m examples.distributed.train --parallel ddp --out OUT                 # 2 CPU processes over gloo
    torchrun --nproc-per-node 2 -m examples.distributed.train --parallel fsdp --model gpt2 --full --out OUT

Each rank builds the same model (one seed), wraps it (``DistributedDataParallel``, or ``fully_shard`` on
every block and then on the root), compiles it once per variant, runs one forward + backward on its own
batch and writes ``OUT/rank<r>.pt`` (loss and full gradients per variant; FSDP2's sharded gradients are
gathered) and ``OUT/rank<r>.json`` (the losses and memopt's decisions on that rank, graph by graph).
The tests compare the files: gradients equal across ranks (they were all-reduced) and memopt's equal the
baseline's. ``benchmarks/distributed.py`` reuses the pieces to time the step.

Compile layouts (``--compile``):
- ``whole``: ``torch.compile(wrapped)``. Under DDP, Dynamo's DDP optimizer splits the graph at gradient-bucket
  boundaries and calls the backend once per piece; under FSDP2 the graph breaks at each sharded module's hooks.
- ``blocks``: each block compiled on its own (``compile_blocks``), the classifier and loss in one compiled
  graph (``HeadLoss``), the root (DDP or ``fully_shard``) around ``HeadLoss``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import socket
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

log = logging.getLogger(__name__)

VARIANTS = ("torch.compile", "memopt")


@dataclasses.dataclass(frozen=True)
class Setup:
    """What one run compares; every rank receives the same one."""

    parallel: str = "ddp"  # "ddp" or "fsdp"
    compile: str = "whole"  # "whole" or "blocks"
    model: str = "gpt2"  # "gpt2" or "llama-1b"
    full: bool = False  # the real sizes (GPT-2 small, Llama-3.2-1B's shape); else hidden 32, 2 layers
    attention: str = "eager"  # HF attn_implementation
    inner: str = "aot_eager"  # compiler of both variants: "inductor" or "aot_eager"
    mode: str | None = None  # torch.compile mode (Inductor only)
    bucket_mb: float | None = None  # DDP bucket_cap_mb; None: DDP's default (25 MiB)
    optimize_ddp: bool | str = True  # torch._dynamo.config.optimize_ddp: True (split), False, "python_reducer"
    batch: int = 2
    seq: int = 16
    autocast: bool = False  # bf16 autocast around the forward
    options: dict[str, Any] = dataclasses.field(default_factory=dict)  # memopt options ("force" for tiny sizes)
    variants: tuple[str, ...] = VARIANTS


def build_model(name: str, full: bool, attention: str) -> nn.Module:
    """An HF causal LM from its config, dropout off (so both variants see the same computation), without the KV
    cache: a training step reads none, and without it the blocks pass the same guards and share one graph (one
    compile instead of one per block)."""
    if full:
        from benchmarks.e2e import build_model as build_full

        model = build_full(name, attention, "0", tiny=False)
        model.config.use_cache = False
        return model
    import transformers

    if name == "gpt2":
        config = transformers.GPT2Config(
            n_embd=32, n_layer=2, n_head=2, vocab_size=128, n_positions=64, attn_pdrop=0.0, resid_pdrop=0.0,
            embd_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        )
        model_class = transformers.GPT2LMHeadModel
    elif name == "llama-1b":
        config = transformers.LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128, tie_word_embeddings=True, bos_token_id=0, eos_token_id=0,
        )
        model_class = transformers.LlamaForCausalLM
    else:
        raise ValueError(f"unknown model {name!r}")
    config._attn_implementation = attention
    config.use_cache = False
    model = model_class(config)
    # the loss transformers falls back to, named: torch.compile without fxpass imported (whose import has Dynamo
    # skip the fallback's warning) would otherwise split head and loss into two graphs
    model.loss_type = "ForCausalLM"
    return model.train()


def make_batch(vocab: int, batch: int, seq: int, rank: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Each rank its own tokens, so the all-reduce has something to average."""
    generator = torch.Generator().manual_seed(1000 + rank)
    ids = torch.randint(0, vocab, (batch, seq), generator=generator)
    return ids.to(device), ids.to(device)


def backend_for(variant: str, setup: Setup) -> tuple[Callable | str, dict[str, Any]]:
    """(backend, other torch.compile arguments) of ``variant``: plain torch.compile with the setup's inner
    compiler and mode, or memopt (``memopt+wta``: WTA-CRS at budget 0.3 unless the options set one)."""
    from fxpass import MemoptBackend

    if variant == "torch.compile":
        return setup.inner, ({"mode": setup.mode} if setup.mode else {})
    options = {"inner_compiler": setup.inner, **setup.options}
    if variant == "memopt+wta":
        options.setdefault("wta_crs_budget", 0.3)
    elif variant != "memopt":
        raise ValueError(f"unknown variant {variant!r}; known: torch.compile, memopt, memopt+wta")
    return MemoptBackend(setup.mode, options), {}


def wrap(model: nn.Module, setup: Setup, device: torch.device) -> nn.Module:
    """DDP around the model, or FSDP2: ``fully_shard`` on each block, then on the root."""
    if setup.parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        kwargs: dict[str, Any] = {}
        if setup.bucket_mb is not None:
            kwargs["bucket_cap_mb"] = setup.bucket_mb
            # Dynamo's DDP optimizer sizes its first bucket by this constant, not by DDP's argument, and
            # refuses a first bucket larger than the others: keep both at the asked size.
            dist._DEFAULT_FIRST_BUCKET_BYTES = min(dist._DEFAULT_FIRST_BUCKET_BYTES, int(setup.bucket_mb * 2**20))
        ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids, **kwargs)
    if setup.parallel == "fsdp":
        return shard_per_block(model)
    raise ValueError(f"unknown parallelism {setup.parallel!r}")


def shard_per_block(model: nn.Module) -> nn.Module:
    """FSDP2: ``fully_shard`` on each block (of the model inside ``HeadLoss``), then on the root."""
    from torch.distributed.fsdp import fully_shard

    from fxpass.integrations.blocks import find_blocks

    inner = model.model if hasattr(model, "loss_of_hidden") else model
    for _, block in find_blocks(inner):
        fully_shard(block)
    fully_shard(model)
    return model


def compiled_step(variant: str, setup: Setup, device: torch.device) -> tuple[nn.Module, Callable]:
    """(the model, a function of (ids, labels) returning the loss), built the way ``setup`` says."""
    from fxpass.integrations.blocks import HeadLoss, allow_a_graph_per_block, compile_blocks

    torch.manual_seed(0)
    torch._dynamo.config.optimize_ddp = setup.optimize_ddp
    model = build_model(setup.model, setup.full, setup.attention).to(device)
    allow_a_graph_per_block(getattr(model.config, "num_hidden_layers", 0))  # FSDP2 makes each block a frame
    backend, kwargs = backend_for(variant, setup)
    if setup.compile == "whole":
        wrapped = wrap(model, setup, device)
        compiled = torch.compile(wrapped, backend=backend, **kwargs)
        return model, lambda ids, labels: compiled(input_ids=ids, labels=labels).loss
    if setup.compile == "blocks":
        compile_blocks(model, backend=backend, **kwargs)
        wrapped = wrap(HeadLoss(model, backend=backend, **kwargs), setup, device)
        return model, lambda ids, labels: wrapped(ids, labels)
    raise ValueError(f"unknown compile layout {setup.compile!r}")


def full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient, whole: FSDP2's DTensor shards are gathered (a collective: all ranks call)."""
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad
        if grad is not None and hasattr(grad, "full_tensor"):
            grad = grad.full_tensor()
        grads[name] = None if grad is None else grad.detach().float().cpu()
    return grads


def record_json(report) -> dict[str, Any]:
    return {
        "graph": report.graph_id,
        "records": [
            {"rule": r.rule, "applied": r.applied, "reason": r.reason,
             "causal": r.params.get("causal"), "variant": r.params.get("variant"),
             "saved_bytes_hint": r.saved_bytes_hint}
            for r in report.records
        ],
    }


def one_step(step: Callable, batch: tuple[torch.Tensor, ...], setup: Setup, device: torch.device) -> torch.Tensor:
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if setup.autocast else nullcontext()
    with autocast:
        loss = step(*batch)
    loss.backward()
    return loss


def run_variant(variant: str, setup: Setup, rank: int, device: torch.device) -> tuple[dict, dict]:
    """One step of one variant: ({loss, grads}, this rank's report)."""
    import fxpass

    torch._dynamo.reset()
    fxpass.clear_reports()
    model, step = compiled_step(variant, setup, device)
    vocab = model.config.vocab_size
    loss = one_step(step, make_batch(vocab, setup.batch, setup.seq, rank, device), setup, device)
    graphs = [record_json(r) for r in fxpass.reports()]
    applied = sorted(r["rule"] for g in graphs for r in g["records"] if r["applied"])
    log.info("rank %d %s: loss %.6f, applied %s", rank, variant, loss.item(), applied)
    result = {"loss": loss.detach().float().cpu(), "grads": full_grads(model)}
    return result, {"loss": loss.item(), "graphs": graphs, "applied": applied}


def init(rank: int, world: int, port: int) -> torch.device:
    """Join the process group: NCCL on a GPU per rank, gloo on CPU."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
        return device
    torch.set_num_threads(1)
    return torch.device("cpu")


def worker(rank: int, world: int, port: int, setup: Setup, out: str) -> None:
    """One rank: every variant in turn, then its files."""
    logging.basicConfig(level=logging.INFO, format=f"[rank{rank}] %(message)s")
    device = init(rank, world, port)
    try:
        results, reports = {}, {"rank": rank, "world": world, "setup": dataclasses.asdict(setup), "variants": {}}
        for variant in setup.variants:
            results[variant], reports["variants"][variant] = run_variant(variant, setup, rank, device)
        Path(out).mkdir(parents=True, exist_ok=True)
        torch.save(results, Path(out) / f"rank{rank}.pt")
        (Path(out) / f"rank{rank}.json").write_text(json.dumps(reports, indent=1))
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(setup: Setup, out: Path, world: int = 2) -> None:
    """Under torchrun, this process is one rank; otherwise spawn ``world`` ranks here."""
    if "RANK" in os.environ:
        worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), 0, setup, str(out))
        return
    import torch.multiprocessing as mp

    mp.spawn(worker, args=(world, free_port(), setup, str(out)), nprocs=world, join=True)


def parse(argv: list[str] | None = None) -> tuple[Setup, Path, int]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parallel", choices=["ddp", "fsdp"], default="ddp")
    parser.add_argument("--compile", choices=["whole", "blocks"], default="whole")
    parser.add_argument("--model", choices=["gpt2", "llama-1b"], default="gpt2")
    parser.add_argument("--full", action="store_true", help="real sizes instead of hidden 32, 2 layers")
    parser.add_argument("--attention", default="eager")
    parser.add_argument("--inner", default="aot_eager", choices=["inductor", "aot_eager"])
    parser.add_argument("--mode", default=None)
    parser.add_argument("--bucket-mb", type=float, default=None)
    parser.add_argument("--optimize-ddp", default="True", choices=["True", "False", "python_reducer"],
                        help="torch._dynamo.config.optimize_ddp: split at buckets (True), one graph (False), "
                        "or compiled autograd's reducer")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--autocast", action="store_true")
    parser.add_argument("--options", default='{"force": true, "strict": true}', help="memopt options, JSON")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="torch.compile, memopt, memopt+wta")
    parser.add_argument("--world", type=int, default=2, help="processes to spawn without torchrun")
    parser.add_argument("--out", type=Path, default=Path("distributed_out"))
    args = parser.parse_args(argv)
    setup = Setup(
        parallel=args.parallel, compile=args.compile, model=args.model, full=args.full, attention=args.attention,
        inner=args.inner, mode=args.mode, bucket_mb=args.bucket_mb,
        optimize_ddp={"True": True, "False": False}.get(args.optimize_ddp, args.optimize_ddp),
        batch=args.batch, seq=args.seq, autocast=args.autocast, options=json.loads(args.options),
        variants=tuple(args.variants.split(",")),
    )
    return setup, args.out, args.world


if __name__ == "__main__":
    setup, out, world = parse()
    launch(setup, out, world)
