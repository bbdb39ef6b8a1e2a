"""memopt's operators (``torch.ops.memopt.*``): library definitions, Triton kernels, PyTorch references."""

from lowerings import cce, embedding, flash_attention, wta_crs  # noqa: F401  (registers torch.ops.memopt.*)
