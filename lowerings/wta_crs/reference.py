"""Winner-Take-All Column-Row Sampling (Liu et al., NeurIPS 2023, "Winner-Take-All Column Row Sampling for
Memory Efficient Adaptation of Language Model"), in PyTorch: the sample, and the running gradient-norm estimate.

For a linear layer y = x Wᵀ the weight gradient is a sum over tokens, ∂W = Σ_i g_i x_iᵀ. WTA-CRS keeps k of the
N rows of x: the "winners" C (largest sampling probability p_i) enter with weight 1, and k − |C| rows drawn
with replacement from the remaining probability mass enter with weight (1 − P_C) / ((k − |C|) p_j), so that

    ∂W ≈ Σ_{c∈C} g_c x_cᵀ + 1/(k−|C|) Σ_t (1 − P_C)/p_{j_t} · g_{j_t} x_{j_t}ᵀ

is unbiased for any p with full support on the rows that matter and any C chosen before the draw. The weights
are folded into the saved rows. |C| minimises (1 − P_c)/(k − c), the paper's adaptive rule, found here as a
probability threshold without sorting (``winner_mask``). The two biased
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
# Fixed-point rounds that find the winner set (``winner_mask``); each round is one reduction over the rows.
# Softmax-normal probabilities over 16384 rows (spreads 0.1–8, budgets 0.01–0.5) converged within 11.
WINNER_ROUNDS = 12


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

    def update(self, positions: torch.Tensor, grad_norms: torch.Tensor) -> None:
        """Fold this step's per-row gradient norms into the per-position averages (in place)."""
        total = torch.zeros_like(self.values).index_add_(0, positions, grad_norms.float())
        count = torch.zeros_like(self.values).index_add_(0, positions, torch.ones_like(grad_norms, dtype=torch.float32))
        observed = count > 0
        current = total / count.clamp_min(1)
        blended = torch.where(self.values > 0, EMA_DECAY * self.values + (1 - EMA_DECAY) * current, current)
        self.values.copy_(torch.where(observed, blended, self.values))


def positions_of(rows: int, period: int, device: torch.device) -> torch.Tensor:
    """Position of each flattened row along its sequence (row i of [B, L] tokens is at i mod L)."""
    return (torch.arange(rows, device=device) % torch.sym_max(period, 1)).clamp_max(MAX_POSITIONS - 1)


def sampling_probabilities(row_norms: torch.Tensor, grad_estimate: torch.Tensor) -> torch.Tensor:
    """p_i ∝ ‖x_i‖ · ĝ_i, normalized (all zero rows: uniform)."""
    weights = row_norms.float() * grad_estimate
    total = weights.sum()
    uniform = torch.full_like(weights, 1.0 / weights.numel())
    return torch.where(total > 0, weights / total.clamp_min(torch.finfo(torch.float32).tiny), uniform)


def winner_mask(probabilities: torch.Tensor, k: int, rounds: int = WINNER_ROUNDS) -> torch.Tensor:
    """The rows taken deterministically: the paper's adaptive |C| = argmin_c (1 − P_c)/(k − c), without a sort.

    Adding the next-largest row to C lowers the score f(c) = (1 − P_c)/(k − c) exactly when its probability
    exceeds f(c), and once one row fails every later row does; so the optimal C is {i : p_i > τ} at the fixed
    point τ = f(|{p > τ}|). Iterating from τ = f(0) = 1/k only ever adds rows that lower f, so the sets grow
    to the optimum, usually within a few rounds. Each round is one reduction over the rows, where the top-k
    this replaces took ~0.13 ms a call on the H200 (16384 rows). Unconverged after ``rounds``, C is a smaller set of
    winners: any C fixed before the draw keeps the estimate unbiased, at a little more variance."""
    threshold = probabilities.new_ones(()) / k  # a tensor op: a symbolic k stays symbolic, without a guard
    for _ in range(rounds):
        above = probabilities > threshold
        mass = torch.where(above, probabilities, 0.0).sum()
        threshold = (1.0 - mass).clamp_min(0) / (k - above.sum()).clamp_min(1)
    mask = probabilities > threshold
    return mask & (mask.sum() < k)  # fewer than k by the mass bound; rounding must not leave no slot to draw


def draw(probabilities: torch.Tensor, k: int, winners: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices [k] and weights [k] of one WTA-CRS sample (plain CRS when ``winners`` is False).

    Slots before |C| hold the winners (weight 1, in row order); the others hold draws with replacement from
    the residual distribution, weighted (1 − P_C) / ((k − |C|) · p_j).
    """
    n = probabilities.numel()
    if winners:
        is_winner = winner_mask(probabilities, k)
    else:
        is_winner = torch.zeros(n, dtype=torch.bool, device=probabilities.device)
    n_winners = is_winner.sum()
    slots = torch.arange(k, device=probabilities.device)
    is_winner_slot = slots < n_winners
    # Slot j < |C| holds the (j+1)-th winner: the first row where the running count of winners reaches j + 1.
    winner_index = torch.searchsorted(torch.cumsum(is_winner, 0), slots + 1).clamp_max(n - 1)
    residual = torch.where(is_winner, 0.0, probabilities)
    residual_mass = residual.sum()
    cumulative = torch.cumsum(residual, 0)
    u = torch.rand(k, device=probabilities.device) * residual_mass
    drawn = torch.searchsorted(cumulative, u, right=True).clamp_max(n - 1)
    p_drawn = probabilities[drawn]
    draws = (k - n_winners).clamp_min(1)
    draw_weight = torch.where(p_drawn > 0, residual_mass / (draws * p_drawn).clamp_min(1e-30), 0.0)
    index = torch.where(is_winner_slot, winner_index, drawn)
    weight = torch.where(is_winner_slot, 1.0, draw_weight)
    return index, weight


def gather_rows(x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x[index] · weight, in x's dtype (computed in at least fp32): the rows saved for the weight gradient."""
    compute = torch.promote_types(x.dtype, torch.float32)
    return (x[index].to(compute) * weight.to(compute)[:, None]).to(x.dtype)


def row_norms(x: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(x.float(), dim=1)
