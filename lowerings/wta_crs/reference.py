"""Winner-Take-All Column-Row Sampling (Liu et al., NeurIPS 2023, "Winner-Take-All Column Row Sampling for
Memory Efficient Adaptation of Language Model"), in PyTorch: the sample, and the running gradient-norm estimate.

For a linear layer y = x Wᵀ the weight gradient is a sum over tokens, ∂W = Σ_i g_i x_iᵀ. WTA-CRS keeps k of the
N rows of x: the "winners" C (largest sampling probability p_i) enter with weight 1, and k − |C| rows drawn
with replacement from the remaining probability mass enter with weight (1 − P_C) / ((k − |C|) p_j), so that

    ∂W ≈ Σ_{c∈C} g_c x_cᵀ + 1/(k−|C|) Σ_t (1 − P_C)/p_{j_t} · g_{j_t} x_{j_t}ᵀ

is unbiased for any p with full support on the rows that matter and any C chosen before the draw. The weights
are folded into the saved rows. |C| minimises (1 − P_c)/(k − c), the paper's adaptive rule. The two biased
paths of the reference code (the unscaled first epoch, and unweighted draws without replacement when C is
empty) are not reproduced: every draw is weighted, every step.

p_i ∝ ‖x_i‖ · ĝ_i, where ĝ_i is a running (exponential moving average) estimate of the output-gradient norm of
the token's position, kept per layer group instead of the paper's per-example cache. ĝ only steers the
variance; a stale or missing estimate never biases the gradient (positions without history use the mean).

Everything has a fixed shape (k rows whatever the data), so the sample stays traceable and CUDA-graph safe.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction

import torch

# Positions (index along the sequence) with their own gradient-norm estimate; later ones share the last slot.
MAX_POSITIONS = 4096
# Weight of the past in the running gradient-norm estimate.
EMA_DECAY = 0.9
# ĝ is floored at this fraction of its mean: a row must never get p = 0 while its gradient may be non-zero.
GRAD_FLOOR = 1e-3


def sample_size(rows, budget: float):
    """k = ceil(budget · N), at least 1 and at most N; integer arithmetic so that a SymInt N gets no guard."""
    ratio = Fraction(budget).limit_denominator(1_000_000)
    k = (rows * ratio.numerator + ratio.denominator - 1) // ratio.denominator
    return torch.sym_max(1, torch.sym_min(rows, k))


@dataclasses.dataclass
class GradNormEstimate:
    """Running per-position estimate of output-gradient row norms for one group of linears."""

    values: torch.Tensor  # [MAX_POSITIONS] fp32, 0 where no gradient was seen yet

    @classmethod
    def empty(cls, device: torch.device) -> GradNormEstimate:
        return cls(torch.zeros(MAX_POSITIONS, dtype=torch.float32, device=device))

    def lookup(self, positions: torch.Tensor) -> torch.Tensor:
        """ĝ for each row; positions never seen (and the whole first step) get the mean of the seen ones, or 1."""
        seen = self.values > 0
        mean = torch.where(seen.any(), self.values.sum() / seen.sum().clamp_min(1), 1.0)
        estimate = self.values[positions]
        estimate = torch.where(estimate > 0, estimate, mean)
        return estimate.clamp_min(GRAD_FLOOR * mean)

    def updated(self, grad_norms: torch.Tensor, period) -> torch.Tensor:
        """The values after folding in this step's per-row gradient norms (rows of [..., period] tokens).

        Every position holds the same number of rows, so the average of the positions that share the last slot
        is the average of their rows; reductions and a gather, no scatter."""
        period = torch.sym_max(period, 1)
        per_position = grad_norms.float().reshape(-1, period).mean(0)  # [period]
        last = MAX_POSITIONS - 1
        in_tail = torch.arange(period, device=grad_norms.device) >= last
        tail = torch.where(in_tail, per_position, 0.0).sum() / in_tail.sum().clamp_min(1)
        slots = torch.arange(MAX_POSITIONS, device=grad_norms.device)
        current = torch.where(slots < last, per_position[slots.clamp_max(period - 1)], tail)
        observed = slots < period
        blended = torch.where(self.values > 0, EMA_DECAY * self.values + (1 - EMA_DECAY) * current, current)
        return torch.where(observed, blended, self.values)


def positions_of(rows: int, period: int, device: torch.device) -> torch.Tensor:
    """Position of each flattened row along its sequence (row i of [B, L] tokens is at i mod L)."""
    return (torch.arange(rows, device=device) % torch.sym_max(period, 1)).clamp_max(MAX_POSITIONS - 1)


def sampling_scores(row_norms: torch.Tensor, grad_estimate: torch.Tensor) -> torch.Tensor:
    """‖x_i‖ · ĝ_i in fp32: the sampling probabilities before normalization."""
    return row_norms.float() * grad_estimate


def normalize(scores: torch.Tensor) -> torch.Tensor:
    """p_i = score_i / Σ scores (all zero rows: uniform)."""
    total = scores.sum()
    uniform = torch.full_like(scores, 1.0 / scores.numel())
    return torch.where(total > 0, scores / total.clamp_min(torch.finfo(torch.float32).tiny), uniform)


def draw(
    probabilities: torch.Tensor, uniforms: torch.Tensor, winners: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices [k] and weights [k] of one WTA-CRS sample (plain CRS when ``winners`` is False), k = len(uniforms).

    Slots before |C| hold the winners (weight 1); the others hold draws with replacement from the residual
    distribution, weighted (1 − P_C) / ((k − |C|) · p_j); slot j draws with ``uniforms[j]`` ∈ [0, 1).
    ``kernels.draw`` computes the same on CUDA without the sort (its winners come in row order).
    """
    k = uniforms.numel()
    n = probabilities.numel()
    top_p, top_index = torch.topk(probabilities, k)
    mass_before = torch.cat([top_p.new_zeros(1), torch.cumsum(top_p, 0)[:-1]])  # P_c for c = 0..k-1
    slots = torch.arange(k, device=probabilities.device)
    if winners:
        score = (1.0 - mass_before).clamp_min(0) / (k - slots)
        n_winners = torch.argmin(score)  # the adaptive |C| (ties: the smallest c)
    else:
        n_winners = torch.zeros((), dtype=torch.long, device=probabilities.device)
    is_winner_slot = slots < n_winners
    winner_mask = torch.zeros(n, dtype=torch.bool, device=probabilities.device)
    winner_mask[top_index] = is_winner_slot
    residual = torch.where(winner_mask, 0.0, probabilities)
    residual_mass = residual.sum()
    cumulative = torch.cumsum(residual, 0)
    u = uniforms * residual_mass
    drawn = torch.searchsorted(cumulative, u, right=True).clamp_max(n - 1)
    p_drawn = probabilities[drawn]
    draws = (k - n_winners).clamp_min(1)
    draw_weight = torch.where(p_drawn > 0, residual_mass / (draws * p_drawn).clamp_min(1e-30), 0.0)
    index = torch.where(is_winner_slot, top_index, drawn)
    weight = torch.where(is_winner_slot, 1.0, draw_weight)
    return index, weight


def gather_rows(x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x[index] · weight, in x's dtype (computed in at least fp32): the rows saved for the weight gradient."""
    compute = torch.promote_types(x.dtype, torch.float32)
    return (x[index].to(compute) * weight.to(compute)[:, None]).to(x.dtype)


def row_norms(x: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(x.float(), dim=1)
