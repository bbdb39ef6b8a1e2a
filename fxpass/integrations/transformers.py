"""Hugging Face ``Trainer`` with memopt (TRL's trainers subclass it and call the model the same way; the
tests run ``Trainer`` itself).

    from fxpass.integrations.transformers import compile_model

    model = compile_model(model)                          # in place, before building the Trainer
    trainer = Trainer(model=model, args=TrainingArguments(..., bf16=True))   # torch_compile left off
    trainer.train()

Why a function and not ``TrainingArguments(torch_compile_backend="memopt")``: Trainer hands the backend name
to accelerate, whose ``TorchDynamoPlugin`` converts it to its own ``DynamoBackend`` enum of fixed names inside
``Trainer.__init__`` and raises ``ValueError: 'MEMOPT' is not a valid DynamoBackend``; the name never reaches
``torch.compile``. That happens before any callback runs, so the only way to accept the name, or to replace
the error with a better one, is to patch accelerate's enum globally. Such a patch would only exist once this
module had been imported (the users who write the name have not imported it) and would depend on accelerate's
private validation, so this module does not patch anything.

``compile_model`` compiles the module in place (``nn.Module.compile``), so Trainer, accelerate and TRL see the
same object: its ``state_dict`` keys, ``save_pretrained`` and ``unwrap_model`` are unchanged. accelerate then
wraps ``forward`` in autocast for ``bf16=True``/``fp16=True``; the compiled call goes through that ``forward``,
so Dynamo captures the autocast region and memopt's rewrites cast as autocast did. Training mode and
``torch.no_grad()`` are guarded by Dynamo, so evaluation compiles its own graph, which returns the logits
``prediction_step`` needs. Gradient accumulation passes ``num_items_in_batch`` to the model, whose loss becomes
a sum divided by it; the CCE rule recognises that form.

``TrainingArguments(torch_compile=True)`` must stay off: accelerate would wrap the model in a second
``torch.compile`` (it only recognises ``torch.compile``'s wrapper object as compiled), which is redundant.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, TypeVar

import torch

from fxpass.backend import MemoptBackend

log = logging.getLogger(__name__)

M = TypeVar("M", bound=torch.nn.Module)

DEFAULT_LOSS_TYPE = "ForCausalLM"  # what transformers falls back to when ``loss_type`` names no known loss


def missing_loss_type(model: torch.nn.Module) -> str | None:
    """The ``loss_type`` to set on ``model``, or None to leave it.

    A model whose ``loss_type`` transformers does not recognise (``GPT2LMHeadModel``'s class name names none,
    so it is None) makes its ``loss_function`` log a ``warning_once`` and use the causal-LM loss anyway, so
    setting that name keeps the model's computation. (``import fxpass`` already has Dynamo skip the warning,
    which would otherwise split head and loss into two graphs: ``transformers_logging``.) The Trainer reads
    the name: with it, gradient accumulation's ``num_items_in_batch`` counts
    the shifted labels the loss averages over, as for Llama; without it (GPT-2), it counts one more token a
    row, and the logged loss is that much lower. A model with its own ``loss_function`` never reads
    ``loss_type``.
    """
    if not hasattr(model, "loss_type") or "_loss_function" in vars(model):
        return None
    from transformers.loss.loss_utils import LOSS_MAPPING

    return None if model.loss_type in LOSS_MAPPING else DEFAULT_LOSS_TYPE


def checkpoint_layers(model: torch.nn.Module, use_reentrant: bool | None = None) -> None:
    """Turn on HF's per-layer activation checkpointing; ``use_reentrant`` None keeps transformers' default.

    transformers renamed ``gradient_checkpointing_enable`` to ``activation_checkpointing_enable`` and warns that the
    old name goes in v6; versions before the rename have only the old one. Calling whichever the installed
    version has keeps the suite and the benchmarks free of the warning now and working after the removal."""
    kwargs = None if use_reentrant is None else {"use_reentrant": use_reentrant}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def compile_model(
    model: M, options: Mapping[str, Any] | None = None, mode: str | None = None, **compile_kwargs: Any
) -> M:
    """Compile ``model`` in place with memopt's backend, ready for ``Trainer(model=model)``; returns it.

    Args:
        model: a ``PreTrainedModel`` (or any module) before it is handed to the Trainer.
        options: memopt's options and Inductor config keys, as ``torch.compile(options=...)`` takes them.
        mode: ``torch.compile``'s mode, applied to Inductor.
        compile_kwargs: other ``nn.Module.compile`` arguments (``dynamic``, ``fullgraph``).
    """
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        raise TypeError(
            "compile_model compiles a module in place; pass the module itself (model._orig_mod), not the "
            "result of torch.compile"
        )
    taken = {"backend", "options", "mode"} & compile_kwargs.keys()
    if taken:
        raise TypeError(f"compile_model sets {', '.join(sorted(taken))} itself; pass options= and mode=")
    loss_type = missing_loss_type(model)
    if loss_type is not None:
        log.info(
            "memopt: %s.loss_type %r -> %r, which transformers would use anyway (the Trainer reads it)",
            type(model).__name__,
            model.loss_type,
            loss_type,
        )
        model.loss_type = loss_type
    model.compile(backend=MemoptBackend(mode=mode, options=options), **compile_kwargs)
    return model
