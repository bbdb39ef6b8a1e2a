"""Shared test setup: a clean Dynamo cache and report history per test, fixed seeds, rules that raise instead of
warning, and a check that fails the test that leaves process-wide state behind (``tests/leaks.py``)."""

from __future__ import annotations

import os
import shutil

# Without a GPU, Triton kernels run in its interpreter on CPU tensors. The variable must be set before any
# kernel module is imported (``triton.jit`` reads it when decorating).
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
import torch._dynamo

os.environ.setdefault("MEMOPT_STRICT", "1")

# Under pytest-xdist each worker takes its share of the cores: two workers of two intra-op threads each on two
# cores made the CPU-bound op tests 3-7× slower than run alone (OpenMP threads waiting on each other).
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    torch.set_num_threads(max(1, torch.get_num_threads() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

# What importing these does to process-wide state happens here, before the first test's snapshot: fxpass adds
# transformers' ``warning_once`` to Dynamo's ignored logging functions once transformers defines it; building the
# first model imports transformers' generation code, which imports scikit-learn where it is installed (the GPU
# image), and scikit-learn sets ``KMP_DUPLICATE_LIB_OK`` and ``KMP_INIT_AT_FORK`` and installs six's import hook.
import transformers.generation.utils
import transformers.utils.logging  # noqa: F401

import fxpass
from tests.leaks import no_leaked_state  # noqa: F401  (autouse)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    fxpass.clear_reports()
    torch.manual_seed(0)
    yield
    torch._dynamo.reset()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
