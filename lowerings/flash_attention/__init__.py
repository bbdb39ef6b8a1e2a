"""Flash attention: softmax(softcap(q kᵀ·scale) + bias) v in O(T) memory, with causal masks, sliding windows, GQA and
dropout."""

from lowerings.flash_attention import op as _op  # noqa: F401  (registers torch.ops.memopt.flash_attention*)
from lowerings.flash_attention import uniform_rows as _uniform_rows  # noqa: F401  (and its uniform rows)
