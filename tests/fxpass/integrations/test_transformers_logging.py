"""``fxpass.integrations.transformers_logging``: transformers' ``Logger.warning_once`` is skipped by Dynamo
whichever of fxpass and transformers is imported first, and the import hook leaves ``sys.meta_path`` after use.

Each order runs in a fresh interpreter: in this one both modules are imported already.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

CHECK = """
    import logging, sys, torch
    from fxpass.integrations.transformers_logging import _AfterLoggingImport
    hooks = [f for f in sys.meta_path if isinstance(f, _AfterLoggingImport)]
    assert not hooks, hooks  # used once, then gone
    assert logging.Logger.warning_once in torch._dynamo.config.ignore_logging_functions

    logger = logging.getLogger("transformers.check")

    @torch.compile(backend="eager", fullgraph=True)  # a logger call Dynamo cannot trace would raise here
    def step(x):
        logger.warning_once("traced through")
        return x + 1

    assert torch.equal(step(torch.zeros(2)), torch.ones(2))
    assert isinstance(torch._dynamo.utils._get_dynamo_config_for_logging(), str)  # the metrics record serializes
    print("ok")
"""


@pytest.mark.parametrize(
    "imports", ["import fxpass\nimport transformers", pytest.param("import transformers\nimport fxpass", marks=pytest.mark.slow)],
    ids=["fxpass_first", "transformers_first"],
)
def test_warning_once_is_skipped_in_either_import_order(imports):
    code = textwrap.dedent(imports + "\n") + textwrap.dedent(CHECK)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


def test_no_hook_waits_once_transformers_is_imported():
    import transformers  # noqa: F401

    from fxpass.integrations import transformers_logging

    transformers_logging.install()
    assert not any(isinstance(f, transformers_logging._AfterLoggingImport) for f in sys.meta_path)
    assert transformers_logging.ignore_warning_once()


def test_metrics_record_built_without_the_ignored_functions_where_it_cannot_serialize(monkeypatch):
    """torch 2.11's record serializes the set (pytorch/pytorch#178455): imitated here, the shim empties the set
    while the record is built, and leaves it whole afterwards."""
    import json

    import torch

    from fxpass.integrations import transformers_logging

    def record_like_torch_2_11():
        return json.dumps(sorted(torch._dynamo.config.ignore_logging_functions))

    monkeypatch.setattr(torch._dynamo.utils, "_get_dynamo_config_for_logging", record_like_torch_2_11)
    with torch._dynamo.config.patch(ignore_logging_functions={print}):
        transformers_logging._keep_metrics_serializable()
        shim = torch._dynamo.utils._get_dynamo_config_for_logging
        assert shim is not record_like_torch_2_11
        assert shim() == "[]"
        assert torch._dynamo.config.ignore_logging_functions == {print}
        transformers_logging._keep_metrics_serializable()  # installed once
        assert torch._dynamo.utils._get_dynamo_config_for_logging is shim
