"""Per-block compilation, the torchtitan / FSDP2 habit, and a head + loss compiled as one graph.

    from fxpass.integrations.blocks import compile_blocks, HeadLoss

    compile_blocks(model)                           # each transformer block its own memopt graph, in place
    step = HeadLoss(model, backend=MemoptBackend())  # trunk as it is, lm_head + loss in one compiled graph
    loss = step(input_ids, labels)

Why the head needs its own graph: a block compiled alone holds attention and the MLP, so memopt's attention and
WTA-CRS rewrites apply inside it, but the cross-entropy is computed outside any block. Left eager (torchtitan's
default) it keeps the N×V logits. Cut cross-entropy can only replace ``linear → cross_entropy`` when both are in
one graph; ``HeadLoss`` puts the classifier and the model's own loss function there, and nothing else.

What differs from a whole-model graph: a block receives the attention mask as an input, so a causal mask that
the model built outside the block cannot be proved causal and is passed to the flash op as an additive bias
(exact; the T×T mask, built once for all layers, stays alive). The record's ``causal`` parameter says which.
Models that pass ``is_causal`` to SDPA instead (HF's ``sdpa`` implementation without padding) keep SDPA, which
memopt leaves alone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from fxpass.backend import MemoptBackend

log = logging.getLogger(__name__)

BlockSpec = str | type[nn.Module] | Sequence[type[nn.Module]] | None


def _by_path(model: nn.Module, path: str) -> list[tuple[str, nn.Module]]:
    container = model.get_submodule(path)
    if not isinstance(container, nn.ModuleList | nn.Sequential | nn.ModuleDict):
        return [(path, container)]
    return [(f"{path}.{name}", child) for name, child in container.named_children()]


def _by_types(model: nn.Module, types: tuple[type[nn.Module], ...]) -> list[tuple[str, nn.Module]]:
    """The outermost submodules of one of ``types`` (a block nested in a block is compiled with its parent)."""
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if isinstance(module, types) and not any(name.startswith(f"{outer}.") for outer, _ in found):
            found.append((name, module))
    return found


def _hf_block_types(model: nn.Module) -> tuple[type[nn.Module], ...]:
    """transformers lists a model's repeated layer classes in ``_no_split_modules`` (FSDP's wrap policy uses it)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return tuple({type(m) for m in model.modules() if type(m).__name__ in names})


def find_blocks(model: nn.Module, blocks: BlockSpec = None) -> list[tuple[str, nn.Module]]:
    """The transformer blocks of ``model`` as (qualified name, module).

    Args:
        blocks: an attribute path to a ``ModuleList`` (``"transformer.h"``, ``"model.layers"``), a block class
            or classes, or None for a transformers model's ``_no_split_modules`` classes.
    """
    if isinstance(blocks, str):
        found = _by_path(model, blocks)
    else:
        types = _hf_block_types(model) if blocks is None else (blocks,) if isinstance(blocks, type) else tuple(blocks)
        if not types:
            raise ValueError(
                f"{type(model).__name__} names no block classes (_no_split_modules); pass blocks= as an attribute "
                "path such as 'model.layers' or as the block class"
            )
        found = _by_types(model, types)
    if not found:
        raise ValueError(f"no blocks matching {blocks!r} in {type(model).__name__}")
    return found


def compile_blocks(
    model: nn.Module,
    blocks: BlockSpec = None,
    *,
    backend: Callable | str | None = None,
    options: dict[str, Any] | None = None,
    mode: str | None = None,
    **compile_kwargs: Any,
) -> list[str]:
    """Compile each block of ``model`` in place (``nn.Module.compile``) with memopt; returns the blocks' names.

    In place, so ``fully_shard``, DDP, ``state_dict`` and checkpoint wrappers see the same modules, before or
    after this call. One backend serves every block; identical blocks share Dynamo's cache entry.

    Args:
        backend: a backend to use instead of ``MemoptBackend(mode, options)`` (``"inductor"`` for a baseline;
            ``mode`` then goes to ``torch.compile``).
        compile_kwargs: other ``nn.Module.compile`` arguments (``fullgraph``, ``dynamic``).
    """
    if backend is None:
        backend = MemoptBackend(mode=mode, options=options)
    elif options:
        raise TypeError("pass options= through the backend when giving one")
    elif mode is not None:
        compile_kwargs["mode"] = mode
    named = find_blocks(model, blocks)
    allow_a_graph_per_block(len(named))
    for _, block in named:
        block.compile(backend=backend, **compile_kwargs)
    log.info("memopt: compiled %d blocks of %s one by one", len(named), type(model).__name__)
    return [name for name, _ in named]


def allow_a_graph_per_block(blocks: int) -> None:
    """Raise Dynamo's recompile limit so that each of ``blocks`` blocks may compile a graph of its own.

    Blocks compiled one by one (or split by FSDP2's hooks) are frames of one code object. Where each guards on
    something of its own (HF's KV cache on: its own cache layer), Dynamo compiles a graph per block and, past
    its limit of 8, runs the rest eagerly, unrewritten (GPT-2's last four blocks on the H200). Without the
    cache the blocks share one graph and the limit is never reached."""
    wanted = blocks + 8
    if torch._dynamo.config.recompile_limit < wanted:
        log.info("memopt: Dynamo's recompile limit raised to %d for %d blocks", wanted, blocks)
        torch._dynamo.config.recompile_limit = wanted


class HeadLoss(nn.Module):
    """A causal LM whose classifier and loss run as one compiled graph, so cut cross-entropy applies.

    ``forward(input_ids, labels, attention_mask=None, **loss_kwargs)`` returns the loss. The trunk
    (``model.base_model``: embeddings, blocks, final norm) runs as it is: eager, or with blocks compiled by
    ``compile_blocks``. The hidden states are then handed to one compiled function holding
    ``model.get_output_embeddings()`` and ``model.loss_function``, the model's own loss (shifted labels, -100,
    ``num_items_in_batch``), so the result equals ``model(input_ids, labels=labels).loss``.

    A module rather than a function so that DDP and ``fully_shard`` can wrap it as the root: their forward
    hooks then run around the whole step (gradient sync; the root's all-gather of embeddings and classifier).
    The wrapped model is ``self.model``, so state-dict keys gain a ``model.`` prefix.
    """

    def __init__(self, model: nn.Module, backend: Callable | str | None = None, **compile_kwargs: Any) -> None:
        super().__init__()
        self.model = model
        self.loss_of_hidden = torch.compile(
            self._head_loss, backend=backend if backend is not None else MemoptBackend(), **compile_kwargs
        )

    def _head_loss(self, hidden: torch.Tensor, labels: torch.Tensor, **loss_kwargs: Any) -> torch.Tensor:
        logits = self.model.get_output_embeddings()(hidden)
        return self.model.loss_function(
            logits=logits, labels=labels, vocab_size=self.model.config.vocab_size, **loss_kwargs
        )

    def forward(
        self, input_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor | None = None,
        **loss_kwargs: Any,
    ) -> torch.Tensor:
        hidden = self.model.base_model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.loss_of_hidden(hidden, labels, **loss_kwargs)
