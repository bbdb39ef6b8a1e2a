"""Let Dynamo trace through transformers' ``Logger.warning_once``, whatever the order of imports.

transformers adds ``warning_once`` to ``logging.Logger`` and calls it inside forward passes. The one that
matters here: a model whose class name names no loss (``GPT2LMHeadModel``: its ``loss_type`` is None) logs
from its ``loss_function`` on every call, and Dynamo cannot trace a logger call. The graph breaks between the
head and the loss, so ``torch.compile(model, backend="memopt")`` hands the CCE rule a graph whose logits
arrive as an input, and the rewrite cannot apply. Dynamo's own remedy is its ``ignore_logging_functions``
setting: a listed function becomes a no-op while a frame is traced (eager calls still log, and the setting is
left out of Dynamo's config hash, so it changes no cache key).

``install`` adds ``warning_once`` to that set as soon as transformers defines it: at once if
``transformers.utils.logging`` is already imported, else right after that module runs (a one-shot import
hook that leaves ``sys.meta_path`` on first use). ``import fxpass`` calls it and never imports transformers.
The setting is process-wide, so plain ``torch.compile`` in the same process loses the graph break too.

torch 2.11 renamed Dynamo's ``ignore_logger_methods`` to ``ignore_logging_functions`` but left the new name out
of the keys its compile-metrics record skips (pytorch/pytorch#178455), so with any function in the set every
compile logs a ``TypeError`` traceback ("not JSON serializable"). ``_keep_metrics_serializable`` detects that
and has the record built with the set emptied for the moment it is read.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
from types import ModuleType

import torch._dynamo
import torch._dynamo.utils

LOGGING_MODULE = "transformers.utils.logging"

log = logging.getLogger(__name__)


def ignore_warning_once() -> bool:
    """Add transformers' ``Logger.warning_once`` to Dynamo's ignored logging functions; False when transformers
    has not defined it (not imported yet, or a version without it)."""
    method = getattr(logging.Logger, "warning_once", None)
    if method is None:
        return False
    torch._dynamo.config.ignore_logging_functions.add(method)  # torch 2.11 and 2.13 alike
    _keep_metrics_serializable()
    return True


def _keep_metrics_serializable() -> None:
    """Where Dynamo's metrics record cannot serialize the ignored functions (torch 2.11), build it without
    them; elsewhere do nothing."""
    utils = torch._dynamo.utils
    record = getattr(utils, "_get_dynamo_config_for_logging", None)
    if record is None or getattr(record, "_memopt_serializable", False):
        return
    try:
        record()
        return
    except TypeError:
        pass

    def without_ignored_functions() -> str | None:
        with torch._dynamo.config.patch(ignore_logging_functions=set()):
            return record()

    without_ignored_functions._memopt_serializable = True  # type: ignore[attr-defined]
    utils._get_dynamo_config_for_logging = without_ignored_functions


class _AfterLoggingImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for ``transformers.utils.logging`` it takes the regular spec and has its loader
    call ``ignore_warning_once`` once the module has run, then leaves ``sys.meta_path``."""

    def find_spec(self, fullname: str, path, target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != LOGGING_MODULE:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run_module(module)
            if not ignore_warning_once():
                log.debug("memopt: %s defines no Logger.warning_once; nothing to ignore", fullname)

        spec.loader.exec_module = exec_module  # this spec's own loader instance
        return spec


def install() -> None:
    """Ignore ``warning_once`` now if transformers is imported, else once it is."""
    if LOGGING_MODULE in sys.modules:
        ignore_warning_once()
    elif not any(isinstance(finder, _AfterLoggingImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterLoggingImport())
