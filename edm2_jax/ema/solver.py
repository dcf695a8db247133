"""The post-hoc EMA solver (paper App. C.3, Algorithm 3; docs/recipe.md §5): pure
float64 NumPy, no I/O.

A power-function EMA with exponent `gamma` at time `t` (images seen) averages the
training weights with the profile `p_{t,gamma}(tau) = (gamma+1) tau^gamma / t^(gamma+1)`
on `0 <= tau <= t` (App. C.1; its width `sigma_rel`, Eq. 123). Any other profile is
approximated, in the least-squares sense over `tau`, by a linear combination of the
snapshots' profiles; the same combination of the snapshots' weights is the reconstructed
EMA:

    A[i, j] = <p_i, p_j>,  B[i, k] = <p_i, p_out_k>,  A X = B,
    X[:, k] /= sum(X[:, k]),  theta_out_k = sum_i X[i, k] theta_i        (Algorithm 3)

Owns: the profiles' inner products (`profile_inner_products`), the solve
(`solve_weights`) and its error measure (`profile_error`). The `sigma_rel <-> gamma`
conversion (Eq. 123, 126) and the EMA betas are `ema.py`'s, shared with the EMAs tracked
during training.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from edm2_jax.ema import power as ema_lib


def profile_inner_products(t_a: Any, gamma_a: Any, t_b: Any, gamma_b: Any) -> np.ndarray:
    """Inner products `<p_a, p_b> = int_0^inf p_a(tau) p_b(tau) dtau` of power-function
    EMA profiles `p_{t,gamma}(tau) = (gamma+1) tau^gamma / t^(gamma+1)`, `tau <= t`
    (Algorithm 3, `p_dot_p`; Eq. 123):

        (g_a+1)(g_b+1) (t_a/t_b)^e / ((g_a+g_b+1) max(t_a, t_b)),
        e = g_b if t_a < t_b else -g_a.

    Args: times `t_a`, `t_b` (> 0, any common unit, e.g. nimg) and exponents `gamma_a`,
      `gamma_b` (> -1/2); broadcastable arrays.
    Returns: float64 array of the broadcast shape (units 1 / time).
    """
    t_a, g_a, t_b, g_b = np.broadcast_arrays(*(np.asarray(x, np.float64)
                                               for x in (t_a, gamma_a, t_b, gamma_b)))
    e = np.where(t_a < t_b, g_b, -g_a)
    return (g_a + 1) * (g_b + 1) * (t_a / t_b) ** e / ((g_a + g_b + 1) * np.maximum(t_a, t_b))


def gammas(sigma_rel: Any, what: str) -> np.ndarray:
    """`ema.sigma_rel_to_gamma(sigma_rel)`, its ValueError prefixed with `what`."""
    try:
        return ema_lib.sigma_rel_to_gamma(sigma_rel)
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None


def _describe_input(nimg: float, sigma_rel: float) -> str:
    return f"(kimg {nimg / 1000:g}, sigma_rel {sigma_rel:g})"


def _ill_conditioned(A: np.ndarray, cond: float, t: np.ndarray, s: np.ndarray,
                     t_out: float, max_cond: float) -> ValueError:
    d = np.sqrt(np.diag(A))
    cos = A / d[:, None] / d[None, :]  # cosine similarity of the input profiles
    np.fill_diagonal(cos, -np.inf)
    i, j = np.unravel_index(np.argmax(cos), cos.shape)
    return ValueError(
        f"post-hoc EMA at kimg {t_out / 1000:g}: the {len(t)} input profiles are nearly "
        f"linearly dependent (condition number {cond:.3g} > max_cond {max_cond:.3g}); the "
        f"closest pair {_describe_input(t[i], s[i])} and {_describe_input(t[j], s[j])} has "
        f"cosine similarity {cos[i, j]:.12f}. Pass each snapshot once, use EMAs whose "
        f"sigma_rels differ clearly (e.g. 0.05 and 0.10), drop snapshots that nearly "
        f"coincide in time, or raise max_cond.")


def _flat_pair(nimg: Any, sigma_rel: Any) -> tuple[np.ndarray, np.ndarray]:
    """`nimg`, `sigma_rel` broadcast together, flattened, float64."""
    return tuple(np.ravel(x) for x in np.broadcast_arrays(np.asarray(nimg, np.float64),
                                                          np.asarray(sigma_rel, np.float64)))


def solve_weights(in_nimg: Any, in_sigma_rel: Any, out_nimg: Any, out_sigma_rel: Any, *,
                  max_cond: float = 1e12) -> np.ndarray:
    """Coefficients of the snapshots for each wanted EMA (Algorithm 3), float64.

    For each output `k` only inputs with `in_nimg <= out_nimg[k]` take part: solve
    `A X = B` in the least-squares sense with `A[i, j] = <p_i, p_j>` and
    `B[i, k] = <p_i, p_out_k>` (`profile_inner_products`), then scale each column to sum 1
    so that a constant weight is reproduced exactly. Inputs after the output time get 0.

    Args:
      in_nimg, in_sigma_rel: `[num_in]` (broadcast together) time (images seen, > 0) and
        relative width of each snapshot.
      out_nimg, out_sigma_rel: `[num_out]` (broadcast together) the wanted EMAs.
      max_cond: largest accepted condition number of `A`.
    Returns: `X` float64 `[num_in, num_out]`, columns summing to 1.
    Raises ValueError, naming the fix, for: no inputs; a `sigma_rel` outside
    `(0, ema.SIGMA_REL_MAX ~ 0.300]`; a time <= 0; an output time before every snapshot;
    the same snapshot passed twice or profiles so alike that `cond(A) > max_cond`.
    """
    t_in, s_in = _flat_pair(in_nimg, in_sigma_rel)
    t_out, s_out = _flat_pair(out_nimg, out_sigma_rel)
    if t_in.size == 0:
        raise ValueError("post-hoc EMA needs at least one snapshot, got none; train with "
                         "snapshots enabled (config.snapshot_kimg) and pass their times and "
                         "sigma_rels")
    for name, t in (("in_nimg", t_in), ("out_nimg", t_out)):
        if not np.all(np.isfinite(t) & (t > 0)):
            raise ValueError(f"{name} must be finite and > 0 (images seen), got {t}")
    g_in = gammas(s_in, "snapshot sigma_rel")
    g_out = gammas(s_out, "wanted sigma_rel")

    key = np.stack([t_in, g_in], 1)
    uniq, counts = np.unique(key, axis=0, return_counts=True)
    if np.any(counts > 1):
        t, g = uniq[np.argmax(counts > 1)]
        raise ValueError(f"snapshot {_describe_input(t, float(ema_lib.gamma_to_sigma_rel(g)))} "
                         f"is passed {counts.max()} times; the system is singular. Pass each "
                         f"snapshot once.")

    X = np.zeros((t_in.size, t_out.size), np.float64)
    for t in np.unique(t_out):
        use = t_in <= t
        cols = t_out == t
        if not np.any(use):
            raise ValueError(f"no snapshot at or before the wanted time kimg {t / 1000:g}; "
                             f"the first is at kimg {t_in.min() / 1000:g}. Ask for a time at "
                             f"or after it (at_kimg >= {t_in.min() / 1000:g}).")
        ti, gi = t_in[use], g_in[use]
        A = profile_inner_products(ti[:, None], gi[:, None], ti[None, :], gi[None, :])
        cond = np.linalg.cond(A)
        if not cond <= max_cond:
            raise _ill_conditioned(A, cond, ti, s_in[use], t, max_cond)
        B = profile_inner_products(ti[:, None], gi[:, None], t_out[cols][None, :],
                                   g_out[cols][None, :])
        x = np.linalg.lstsq(A, B, rcond=None)[0]
        X[np.ix_(use, cols)] = x / np.sum(x, axis=0, keepdims=True)
    return X


def profile_error(in_nimg: Any, in_sigma_rel: Any, out_nimg: Any, out_sigma_rel: Any,
                  X: np.ndarray) -> np.ndarray:
    """Relative L2 distance `||sum_i X[i,k] p_i - p_out_k|| / ||p_out_k||` between the
    reconstructed and the wanted profile of each output (float64 `[num_out]`): 0 when a
    snapshot has exactly the wanted profile. In the paper's setting (0.05 and 0.10 every
    8Mi, 16 times) 0.0035 for sigma_rel 0.075, 0.023 for 0.20, 0.12 for the sharp 0.02;
    0.69 for 0.10 from a single 0.05 snapshot. Large values mean the snapshots cannot
    express the wanted EMA (too few, one sigma_rel only, or none near the wanted time)."""
    t_in, s_in = _flat_pair(in_nimg, in_sigma_rel)
    t_out, s_out = _flat_pair(out_nimg, out_sigma_rel)
    g_in, g_out = ema_lib.sigma_rel_to_gamma(s_in), ema_lib.sigma_rel_to_gamma(s_out)
    A = profile_inner_products(t_in[:, None], g_in[:, None], t_in[None, :], g_in[None, :])
    B = profile_inner_products(t_in[:, None], g_in[:, None], t_out[None, :], g_out[None, :])
    c = profile_inner_products(t_out, g_out, t_out, g_out)
    sq = np.einsum("ik,ij,jk->k", X, A, X) - 2 * np.einsum("ik,ik->k", X, B) + c
    return np.sqrt(np.maximum(sq, 0) / c)
