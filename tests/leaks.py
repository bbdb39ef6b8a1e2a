"""Process-wide state a test must leave as it found it, and the autouse check that fails the test that does not.

Why: one test's leftover is every later test's input. ``monkeypatch.setattr`` on a torch config module once
deleted Dynamo's ``ignore_logging_functions`` on undo (pytest 9.2 restores an attribute that is not in the
module's ``__dict__`` by deleting it, and torch's config modules keep their entries elsewhere), and 270 later
tests failed far from the cause. The check names the test that leaked instead.

What is compared before and after each test:
- every torch config module loaded (``torch._dynamo.config``, ``torch._inductor.config``, ...), entry by entry;
- ``sys.meta_path`` (import hooks), and the levels, handlers and ``propagate`` flags of the loggers that existed
  before the test (pytest's own capture handlers aside; torch's own loggers, which torch sets up lazily as its
  modules load, are checked through what ``torch._logging.set_logs`` enabled instead);
- ``os.environ``;
- torch's global switches: grad mode, default dtype, deterministic algorithms, float32 matmul precision, thread
  count, TF32 and autocast;
- whether a ``torch.distributed`` process group is still initialized.

Dynamo's caches are not compared: the suite resets them around every test (``_fresh_dynamo`` in conftest).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils._config_module import ConfigModule

Snapshot = dict[str, Any]

# Variables their owners set as they go: pytest for each phase of each test, Inductor on its first compile (its
# cache directory, and a pointer it hands its subprocesses).
_OWNED_ENVIRON = (
    "PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR", "_TORCHINDUCTOR_", "TRITON_CACHE_DIR", "TRITON_PTXAS_PATH",
)


def _config_modules() -> dict[str, ConfigModule]:
    return {name: module for name, module in list(sys.modules.items()) if isinstance(module, ConfigModule)}


def _loggers() -> dict[str, tuple]:
    """Each logger's level, propagate flag and handlers, by name; pytest's capture handlers are left out (it
    swaps them per test phase)."""
    loggers = {"": logging.getLogger()}
    loggers.update(
        (name, logger) for name, logger in list(logging.root.manager.loggerDict.items())
        if isinstance(logger, logging.Logger)
    )
    state = {}
    for name, logger in loggers.items():
        if name == "torch" or name.startswith("torch."):
            continue  # torch sets its loggers up lazily, as modules load (``_torch_logging`` checks its settings)
        handlers = tuple(id(h) for h in logger.handlers if not type(h).__module__.startswith("_pytest"))
        state[name] = (logger.level, logger.propagate, logger.disabled, handlers)
    return state


def _torch_logging() -> tuple:
    """What ``torch._logging.set_logs`` / ``TORCH_LOGS`` enabled: logger levels and artifacts."""
    from torch._logging._internal import log_state

    return (sorted(log_state.log_qname_to_level.items()), sorted(log_state.artifact_names))


def _torch_switches() -> dict[str, Any]:
    switches = {
        "grad_enabled": torch.is_grad_enabled(),
        "default_dtype": torch.get_default_dtype(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "num_threads": torch.get_num_threads(),
        "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
        "autocast_cpu": torch.is_autocast_enabled("cpu"),
        "logging (torch._logging.set_logs)": _torch_logging(),
    }
    if torch.cuda.is_available():
        switches["cuda.matmul.allow_tf32"] = torch.backends.cuda.matmul.allow_tf32
        switches["autocast_cuda"] = torch.is_autocast_enabled("cuda")
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    switches["distributed_process_group"] = distributed
    return switches


def snapshot() -> Snapshot:
    """The process-wide state the check compares, copied (config entries deep-copied by torch)."""
    return {
        "config": {name: module.get_config_copy() for name, module in _config_modules().items()},
        "meta_path": [id(finder) for finder in sys.meta_path],
        "meta_path_names": [type(finder).__qualname__ for finder in sys.meta_path],
        "loggers": _loggers(),
        "environ": {key: value for key, value in os.environ.items() if not key.startswith(_OWNED_ENVIRON)},
        "torch": _torch_switches(),
    }


def _changed(before: dict, after: dict, keys=None) -> list[str]:
    keys = before.keys() & after.keys() if keys is None else keys
    return sorted(str(key) for key in keys if before.get(key) != after.get(key))


def diff(before: Snapshot, after: Snapshot) -> list[str]:
    """What changed between two snapshots, one line each; empty when nothing did. Config modules first loaded
    during the test are new, not changed, and are not reported; nor are loggers first created during it (libraries
    create theirs, with handlers, as their modules load: transformers' ``ContinuousBatchingLogger``)."""
    lines = []
    for module in before["config"].keys() & after["config"].keys():
        for key in _changed(before["config"][module], after["config"][module]):
            lines.append(
                f"{module}.{key}: {before['config'][module].get(key)!r} -> {after['config'][module].get(key)!r}"
            )
    if before["meta_path"] != after["meta_path"]:
        lines.append(f"sys.meta_path: {before['meta_path_names']} -> {after['meta_path_names']}")
    for name in _changed(before["loggers"], after["loggers"]):
        lines.append(f"logger {name or 'root'!r} (level, propagate, disabled, handlers) changed")
    environ = _changed(before["environ"], after["environ"], before["environ"].keys() | after["environ"].keys())
    lines.extend(f"os.environ[{key!r}]: {before['environ'].get(key)!r} -> {after['environ'].get(key)!r}"
                 for key in environ)
    lines.extend(f"torch {key}: {before['torch'][key]!r} -> {after['torch'][key]!r}"
                 for key in _changed(before["torch"], after["torch"]))
    return sorted(lines)


@pytest.fixture(autouse=True)
def no_leaked_state(request) -> Iterator[None]:
    """Fail the test that leaves process-wide state changed (restore it first, so later tests are unaffected
    only where restoring is possible: config entries are put back)."""
    before = snapshot()
    yield
    leaked = diff(before, snapshot())
    if leaked:
        _restore_config(before)
        pytest.fail(f"{request.node.nodeid} left global state changed:\n  " + "\n  ".join(leaked), pytrace=False)


def _restore_config(before: Snapshot) -> None:
    """Put changed config entries back, so one leak fails one test, not every test after it."""
    modules = _config_modules()
    for name, entries in before["config"].items():
        module = modules.get(name)
        if module is None:
            continue
        now = module.get_config_copy()
        for key, value in entries.items():
            if now.get(key) != value:
                setattr(module, key, value)


@contextlib.contextmanager
def loggers_restored(*names: str) -> Iterator[None]:
    """Put the named loggers' levels and handlers back afterwards: for code under test that sets up logging the
    way a script does (the demo's ``main``)."""
    loggers = [logging.getLogger(name) for name in names]
    saved = [(logger.level, list(logger.handlers)) for logger in loggers]
    try:
        yield
    finally:
        for logger, (level, handlers) in zip(loggers, saved, strict=True):
            logger.setLevel(level)
            logger.handlers[:] = handlers
