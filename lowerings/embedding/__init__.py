"""``torch.ops.memopt.embedding``: an embedding whose 16-bit weight gradient needs no fp32 table."""

from lowerings.embedding import op  # noqa: F401  (registers torch.ops.memopt.embedding*)
