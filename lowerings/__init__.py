"""memopt's operators (``torch.ops.memopt.*``): library definitions, Triton kernels, PyTorch references."""

from lowerings import cce, flash_attention, wta_crs  # noqa: F401  (registers torch.ops.memopt.*)
