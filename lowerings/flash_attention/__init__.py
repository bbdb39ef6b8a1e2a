"""Flash attention: softmax(q kᵀ·scale + bias) v in O(T) memory, with causal masks, GQA and dropout."""

from lowerings.flash_attention import op as _op  # noqa: F401  (registers torch.ops.memopt.flash_attention*)
