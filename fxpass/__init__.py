"""memopt's compiler side: a ``torch.compile`` backend that rewrites memory-hungry subgraphs.

    model = torch.compile(model, backend="memopt")                 # via the entry point
    model = torch.compile(model, backend=fxpass.memopt_backend, options={"debug_dir": "memopt_debug"})
    print(fxpass.explain(step, batch))                             # what would be rewritten, and why
    print(fxpass.largest_batch(make_call, "40GiB")["memopt"])      # the largest batch that fits, simulated
"""

from fxpass.backend import MemoptBackend, memopt_backend, memopt_wta_backend
from fxpass.config import Config, ConfigError
from fxpass.explain import Explanation, explain
from fxpass.fit import FitResult, largest_batch, largest_size
from fxpass.integrations import transformers_logging
from fxpass.report import GraphReport, RewriteRecord, clear_reports, reports
from fxpass.rewrite import RewriteFailedWarning, rewrite_graph

transformers_logging.install()  # so that an HF model's loss warning does not split head and loss into two graphs

__all__ = [
    "Config",
    "ConfigError",
    "Explanation",
    "FitResult",
    "GraphReport",
    "MemoptBackend",
    "RewriteFailedWarning",
    "RewriteRecord",
    "clear_reports",
    "explain",
    "largest_batch",
    "largest_size",
    "memopt_backend",
    "memopt_wta_backend",
    "reports",
    "rewrite_graph",
]
