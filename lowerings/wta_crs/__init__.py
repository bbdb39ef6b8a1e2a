"""WTA-CRS linear: exact outputs and input gradients, weight gradients from a sample of activation rows."""

from lowerings.wta_crs.op import sampled_linears  # registers torch.ops.memopt.wta_crs_linears
from lowerings.wta_crs.state import reset as reset_estimates

__all__ = ["reset_estimates", "sampled_linears"]
