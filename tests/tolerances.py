"""Tolerances for comparing two float32 evaluations of the same math done in a different
order: another device split, micro-batching, jit against eager, another reduction order
chosen by XLA, another CPU.

Derivation. Every float32 addition rounds with a relative error of at most u = eps / 2
(eps = 2^-23 ~ 1.19e-7, `EPS32`). A sum of n terms t_i computed in any order (serial,
pairwise, blocked per device and then all-reduced) is off by at most (n - 1) u sum|t_i|,
and, when the roundings behave as independent zero-mean errors (Higham & Mary, "A new
approach to probabilistic rounding error analysis", SIAM J. Sci. Comput. 2019), by at
most lam sqrt(n) u sum|t_i| except with probability 2 exp(-lam^2 / 2). Two evaluations
in different orders differ by at most the sum of their two errors, i.e.

    |a - b| <= lam sqrt(n) eps sum|t_i|.

We take lam = 1 and replace sum|t_i| by the scale S of the compared tensor, its largest
magnitude max|b| (a sum without systematic cancellation). Both choices are less
pessimistic than the theorem but pull against each other: the partial sums that actually
get rounded are typically far below sum|t_i|, which the theorem charges to every
rounding. The margin this leaves is measured, not assumed: each test's docstring gives
its measured error next to the bound (>= 10x below it). This gives

    |a - b| <= reorder_tol(n) * S,    reorder_tol(n) = eps * sqrt(n),

with n the length of the longest float32 reduction that feeds the quantity (for a
training step: batch x pixels x channels, the sum that gives a scalar gain's gradient).

The scale is never the element itself: a single element (an Adam moment of a scalar gain,
a gradient that nearly cancels) can be much smaller than the terms it sums, and its
relative error is then amplified without bound. Tensors are scaled by their own max|b|;
scalar leaves (size 1, e.g. the gains and their Adam moments) by the magnitude of the
whole tree they belong to (the gradient's magnitude for Adam's moments).

A real bug (a missing or wrong all-reduce, shards in the wrong order, a dropped
micro-batch) changes its tensors by O(1) of their scale, orders of magnitude above these
bounds; the tests that use them show it with negative controls.
"""
from __future__ import annotations

import math

import jax
import numpy as np

EPS32 = float(np.finfo(np.float32).eps)  # 2^-23: float32 spacing at 1


def reorder_tol(n_terms: int, k: float = 1.0) -> float:
    """Relative bound `k * eps32 * sqrt(n_terms)` (see the module docstring) on the
    difference of two float32 evaluations of a reduction of `n_terms` terms in different
    orders, as a fraction of the compared tensor's scale."""
    return k * EPS32 * math.sqrt(n_terms)


def scaled_err(a, b, scale: float | None = None) -> float:
    """`max|a - b| / scale`, by default `scale = max|b|` (the tensor's magnitude)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if scale is None:
        scale = np.abs(b).max(initial=0.0)
    return float(np.abs(a - b).max(initial=0.0) / max(scale, 1e-30))


def tree_magnitude(tree) -> float:
    """Largest |x| over every floating-point leaf of `tree`."""
    return max((float(np.abs(np.asarray(x, np.float64)).max(initial=0.0))
                for x in jax.tree.leaves(tree) if np.issubdtype(np.asarray(x).dtype, np.floating)),
               default=0.0)


def tree_err(a, b, scalar_scale: float | None = None) -> tuple[float, str]:
    """`(worst, where)`: the largest `scaled_err` over the leaves of two trees of the same
    structure. Each tensor is scaled by its own max|b|; a scalar leaf (size 1) by
    `max(|b|, scalar_scale)`, where `scalar_scale` defaults to `tree_magnitude(b)`.
    Integer leaves (step counters, Adam's count) must be equal."""
    assert jax.tree.structure(a) == jax.tree.structure(b)
    if scalar_scale is None:
        scalar_scale = tree_magnitude(b)
    worst, where = 0.0, ""
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
        y = np.asarray(y)
        if not np.issubdtype(y.dtype, np.floating):
            err = 0.0 if np.array_equal(x, y) else math.inf
        elif y.size == 1:
            err = scaled_err(x, y, max(float(np.abs(y).max()), scalar_scale))
        else:
            err = scaled_err(x, y)
        if err >= worst:
            worst, where = err, jax.tree_util.keystr(path)
    return worst, where


def weighted_sum_tol(weights, scale: float) -> float:
    """Absolute bound on a float32 accumulation `sum_i w_i x_i` (weights rounded to
    float32, terms added one by one) against its exact value, for |x_i| <= `scale`.
    Each of the n terms brings three roundings (w_i to float32, the product, the
    addition), each at most u = eps/2 of sum_i |w_i| |x_i| <= sum_i |w_i| scale; by the
    argument of the module docstring: `eps32 sqrt(3 n) sum_i |w_i| scale`. The weights'
    absolute sum, not their sum, is what counts: post-hoc EMA coefficients sum to 1 but
    alternate in sign."""
    w = np.abs(np.asarray(weights, np.float64))
    return reorder_tol(3 * w.size) * float(w.sum()) * scale


def forward_terms(params) -> int:
    """Terms that a network output's float32 rounding accumulates over, for the
    tolerance of a forward pass computed in another order (another jit, batch, CPU):
    each weight tensor adds two sequential reductions over at most the largest fan-in
    (forced weight normalisation, then the matmul / convolution), so
    `2 x (number of weight tensors) x (largest fan-in)`. Pixel norms and attention
    reduce over fewer terms than that."""
    fan_ins = [math.prod(np.shape(w)[:-1]) for w in jax.tree.leaves(params) if np.ndim(w) >= 2]
    return 2 * len(fan_ins) * max(fan_ins)
