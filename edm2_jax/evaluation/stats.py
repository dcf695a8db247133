"""Feature-space statistics shared by every metric: Frechet distance, KID, precision/recall.

Pure numpy / scipy on host float64 arrays; the feature extractor (Inception-v3, a small
classifier, ...) is someone else's business. All functions take features as `[N, D]`
arrays (any real dtype; converted to float64).

- `FeatureStats`: streaming mean and unbiased (N - 1) covariance, merged batch by batch
  (or set by set: processes, resumed runs) with Chan et al.'s pairwise update, so a
  50k-image set never has to sit in memory.
- `frechet_distance`: Frechet distance between Gaussians fitted to two feature sets
  (Heusel et al. 2017, "GANs trained by a two time-scale update rule", Eq. 6; FID when the
  features are Inception-v3 pool_3).
- `kid`: Kernel Inception Distance (Binkowski et al. 2018, "Demystifying MMD GANs",
  Sec. 4), the unbiased MMD^2 with the cubic polynomial kernel averaged over random
  subsets, as in the StyleGAN2-ADA / StyleGAN3 / EDM metric code.
- `precision_recall`: improved precision and recall (Kynkaanniemi et al. 2019, "Improved
  Precision and Recall Metric for Assessing Generative Models", Eqs. 1-3).

    stats = FeatureStats()
    for batch in batches:
        stats.append(extract(batch))          # [n, D]
    mu, sigma = stats.mean_cov()
    fd = frechet_distance(mu, sigma, mu_ref, sigma_ref)
"""
from __future__ import annotations

import warnings

import numpy as np
import scipy.linalg


def _as_features(x, what: str) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2:
        raise ValueError(f"{what} must be a 2-D feature array [N, D], got shape {x.shape}; "
                         f"flatten per-image features with x.reshape(len(x), -1)")
    if not np.all(np.isfinite(x)):
        raise ValueError(f"{what} contains NaN or Inf features; check the images fed to the "
                         f"feature extractor")
    return x


class FeatureStats:
    """Streaming mean and covariance of feature vectors, in float64.

    `append(x)` with `x [n, D]` merges the batch into the running statistics with the
    pairwise update of Chan, Golub & LeVeque (1979): for sets A, B with means `m_a, m_b` and
    scatter matrices `M_a, M_b` (sums of outer products of centred vectors),
    `M = M_a + M_b + (m_b - m_a)(m_b - m_a)^T n_a n_b / (n_a + n_b)`. This avoids the
    cancellation of `E[xx^T] - mu mu^T` when features have a large mean.

    Attributes: `num_items` (int), `dim` (D, None before the first append).
    `mean()` -> float64 `[D]`; `cov()` -> float64 `[D, D]` with the N - 1 denominator
    (equal to `np.cov(all_x, rowvar=False)`); `mean_cov()` -> both. `merge(other)` adds
    another set's statistics (sums over processes, resumed runs); `state()` /
    `from_state()` convert to and from plain arrays.
    Raises ValueError on a feature dimension that changes between calls, on non-finite
    features, and from `mean()` / `cov()` with fewer than 1 / 2 items.
    """

    def __init__(self, dim: int | None = None):
        self.dim = dim
        self.num_items = 0
        self._mean = None if dim is None else np.zeros(dim)
        self._scatter = None if dim is None else np.zeros((dim, dim))

    def append(self, x) -> "FeatureStats":
        x = _as_features(x, "FeatureStats.append(x)")
        n_b, d = x.shape
        if self.dim is None:
            self.dim, self._mean, self._scatter = d, np.zeros(d), np.zeros((d, d))
        if d != self.dim:
            raise ValueError(f"FeatureStats holds {self.dim}-dimensional features; got a batch "
                             f"of dimension {d}. Use one FeatureStats per feature extractor.")
        if n_b == 0:
            return self
        mean_b = x.mean(axis=0)
        xc = x - mean_b
        return self._merge(n_b, mean_b, xc.T @ xc)

    def _merge(self, n_b: int, mean_b: np.ndarray, scatter_b: np.ndarray) -> "FeatureStats":
        n_a = self.num_items
        n = n_a + n_b
        delta = mean_b - self._mean
        self._mean = self._mean + delta * (n_b / n)
        self._scatter = self._scatter + scatter_b + np.outer(delta, delta) * (n_a * n_b / n)
        self.num_items = n
        return self

    def merge(self, other: "FeatureStats") -> "FeatureStats":
        """Add the features of `other` (statistics of another set, e.g. another process's
        or an earlier run's share) with the same pairwise update as `append`; the result
        equals the statistics of both sets appended here, up to float64 rounding.
        Raises ValueError when the feature dimensions differ."""
        if other.num_items == 0:
            return self
        if self.dim is None:
            self.dim, self._mean, self._scatter = other.dim, np.zeros(other.dim), np.zeros(
                (other.dim, other.dim))
        if other.dim != self.dim:
            raise ValueError(f"FeatureStats.merge: dimensions differ ({self.dim} vs "
                             f"{other.dim}); merge statistics of one feature extractor")
        return self._merge(other.num_items, other._mean, other._scatter)

    def state(self) -> dict[str, np.ndarray]:
        """The statistics as arrays (`num_items` int64 [], `mean` float64 [D], `scatter`
        float64 [D, D]; empty D before the first append), for `from_state` (e.g. through
        `np.savez`)."""
        d = self.dim or 0
        return {"num_items": np.asarray(self.num_items, np.int64),
                "mean": np.zeros(d) if self._mean is None else self._mean,
                "scatter": np.zeros((d, d)) if self._scatter is None else self._scatter}

    @classmethod
    def from_state(cls, state) -> "FeatureStats":
        """The `FeatureStats` whose `state()` is `state` (a mapping of those three arrays).
        Raises ValueError on inconsistent shapes."""
        n, mean, scatter = (int(state["num_items"]), np.asarray(state["mean"], np.float64),
                            np.asarray(state["scatter"], np.float64))
        if mean.ndim != 1 or scatter.shape != (mean.size, mean.size) or n < 0:
            raise ValueError(f"FeatureStats state: mean {mean.shape} and scatter "
                             f"{scatter.shape} for {n} items do not fit together")
        out = cls(mean.size or None)
        if n:
            out.num_items, out._mean, out._scatter = n, mean.copy(), scatter.copy()
        return out

    def mean(self) -> np.ndarray:
        if self.num_items < 1:
            raise ValueError("FeatureStats.mean(): no features appended yet")
        return self._mean.copy()

    def cov(self) -> np.ndarray:
        if self.num_items < 2:
            raise ValueError(f"FeatureStats.cov() needs at least 2 items for the N - 1 "
                             f"covariance, have {self.num_items}")
        return self._scatter / (self.num_items - 1)

    def mean_cov(self) -> tuple[np.ndarray, np.ndarray]:
        return self.mean(), self.cov()

    @classmethod
    def from_features(cls, x) -> "FeatureStats":
        """Statistics of one in-memory feature array `[N, D]`."""
        return cls().append(x)


# Relative tolerance of the covariance checks: a covariance accumulated in float32 and
# rounded to float64 is symmetric and PSD to about 1e-7 of its scale; 1e-5 leaves room.
COV_RTOL = 1e-5


def check_covariance(sigma: np.ndarray, where: str) -> None:
    """Raise ValueError naming `where` unless `sigma` `[D, D]` is a covariance: symmetric
    and positive semi-definite within `COV_RTOL` of its largest eigenvalue magnitude."""
    sigma = np.asarray(sigma, np.float64)
    scale = float(np.max(np.abs(sigma), initial=0.0))
    if np.max(np.abs(sigma - sigma.T), initial=0.0) > COV_RTOL * max(scale, 1e-300):
        raise ValueError(f"{where}: sigma is not symmetric, so not a covariance; re-download "
                         f"or recompute the reference statistics")
    eig = np.linalg.eigvalsh((sigma + sigma.T) / 2)
    if eig.size and eig[0] < -COV_RTOL * max(float(np.max(np.abs(eig))), 1e-300):
        raise ValueError(f"{where}: sigma is not positive semi-definite (smallest eigenvalue "
                         f"{eig[0]:.4g}), so not a covariance; re-download or recompute the "
                         f"reference statistics")


def frechet_distance(mu1, sigma1, mu2, sigma2) -> float:
    """Frechet (2-Wasserstein) distance between N(mu1, sigma1) and N(mu2, sigma2):
    `|mu1 - mu2|^2 + tr(sigma1 + sigma2 - 2 (sigma1 sigma2)^(1/2))` (Heusel et al. 2017,
    Eq. 6; Dowson & Landau 1982).

    Args: means `[D]`, covariances `[D, D]` (symmetric PSD), any float dtype.
    Returns: Python float, squared feature units. The matrix square root is
    `scipy.linalg.sqrtm` and only its real part is used (rounding gives tiny imaginary
    parts); if it is not finite (singular product) both covariances get `1e-6 I` added,
    as in the reference FID code.
    Raises ValueError on mismatched shapes or non-finite inputs, and for a distance below
    zero beyond rounding (then 0 within rounding is returned as 0).
    """
    mu1, mu2 = np.asarray(mu1, np.float64), np.asarray(mu2, np.float64)
    sigma1, sigma2 = np.asarray(sigma1, np.float64), np.asarray(sigma2, np.float64)
    d = mu1.shape[0] if mu1.ndim == 1 else -1
    if mu1.ndim != 1 or mu2.shape != (d,) or sigma1.shape != (d, d) or sigma2.shape != (d, d):
        raise ValueError(f"frechet_distance needs mu [D] and sigma [D, D] for both sets; got "
                         f"{mu1.shape}, {sigma1.shape}, {mu2.shape}, {sigma2.shape}")
    if not all(np.all(np.isfinite(a)) for a in (mu1, mu2, sigma1, sigma2)):
        raise ValueError("frechet_distance: statistics contain NaN or Inf")
    with warnings.catch_warnings():  # singular products (rank-deficient features) are fine
        warnings.simplefilter("ignore", scipy.linalg.LinAlgWarning)
        covmean = scipy.linalg.sqrtm(sigma1 @ sigma2)
        if not np.all(np.isfinite(covmean)):
            offset = np.eye(d) * 1e-6
            covmean = scipy.linalg.sqrtm((sigma1 + offset) @ (sigma2 + offset))
    diff = mu1 - mu2
    fd = diff @ diff + np.trace(sigma1) + np.trace(sigma2) - 2 * np.trace(np.real(covmean))
    # The distance is >= 0; a negative one beyond rounding means inputs that are no
    # covariances, never a result.
    scale = diff @ diff + abs(np.trace(sigma1)) + abs(np.trace(sigma2))
    if fd < -COV_RTOL * max(scale, 1e-300):
        raise ValueError(f"frechet_distance is {fd:.4g} < 0: the statistics are not "
                         f"covariances (symmetric, positive semi-definite)")
    return float(max(fd, 0.0))


def _cubic_kernel(x: np.ndarray, y: np.ndarray, d: int) -> np.ndarray:
    k = x @ y.T / d + 1
    return k * k * k  # several times faster than k ** 3 in numpy


def kid(feats_a, feats_b, num_subsets: int = 100, subset_size: int = 1000,
        seed: int = 0) -> float:
    """Kernel Inception Distance (Binkowski et al. 2018, Sec. 4): the unbiased estimate of
    MMD^2 between the two feature distributions with the kernel `k(x, y) = (x.y / D + 1)^3`,
    averaged over `num_subsets` random subsets.

    Each subset draws `m = min(N_a, N_b, subset_size)` rows of each set without
    replacement and evaluates
    `sum_{i != j} k(a_i, a_j) / (m (m-1)) + sum_{i != j} k(b_i, b_j) / (m (m-1))
     - 2 sum_{i, j} k(a_i, b_j) / m^2`,
    as the StyleGAN2-ADA / StyleGAN3 metric code does (`max_subset_size` = 1000, 100 subsets
    there). The estimate is unbiased, so it can be slightly negative for equal distributions.

    Args: `feats_a [N_a, D]`, `feats_b [N_b, D]`; `seed` seeds numpy's default_rng.
    Returns: Python float (the papers often report KID x 10^3).
    Raises ValueError on mismatched D, fewer than 2 rows in a set, or bad counts.
    """
    a = _as_features(feats_a, "kid(feats_a)")
    b = _as_features(feats_b, "kid(feats_b)")
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"kid: feature dimensions differ ({a.shape[1]} vs {b.shape[1]})")
    if num_subsets < 1 or subset_size < 2:
        raise ValueError(f"kid needs num_subsets >= 1 and subset_size >= 2, got "
                         f"{num_subsets}, {subset_size}")
    m = min(len(a), len(b), subset_size)
    if m < 2:
        raise ValueError(f"kid needs at least 2 feature vectors per set, got {len(a)} and {len(b)}")
    d = a.shape[1]
    rng = np.random.default_rng(seed)
    total = 0.0
    for _ in range(num_subsets):
        x = a[rng.choice(len(a), m, replace=False)]
        y = b[rng.choice(len(b), m, replace=False)]
        kxx, kyy, kxy = _cubic_kernel(x, x, d), _cubic_kernel(y, y, d), _cubic_kernel(x, y, d)
        within = (kxx.sum() - np.trace(kxx) + kyy.sum() - np.trace(kyy)) / (m * (m - 1))
        total += within - 2 * kxy.sum() / (m * m)
    return float(total / num_subsets)


def _sq_norms(x: np.ndarray) -> np.ndarray:
    return np.einsum("nd,nd->n", x, x)


def _block_sq_dists(x, x_sq, y, y_sq) -> np.ndarray:
    # |x - y|^2 = |x|^2 + |y|^2 - 2 x.y; clipped because rounding can make it slightly < 0.
    return np.maximum(x_sq[:, None] + y_sq[None, :] - 2 * (x @ y.T), 0.0)


def knn_radii_sq(feats, k: int = 3, batch_size: int = 4096) -> np.ndarray:
    """Squared distance from each row of `feats [N, D]` to its k-th nearest other row
    (the radius of its hypersphere in Kynkaanniemi et al. 2019, Sec. 3; the row itself, at
    distance 0, is not counted). Computed in `batch_size x batch_size` blocks of float64
    distances. Returns float64 `[N]`. Raises ValueError unless `1 <= k < N`."""
    x = _as_features(feats, "knn_radii_sq(feats)")
    n = len(x)
    if not 1 <= k < n:
        raise ValueError(f"k-NN radii need 1 <= k < number of features; got k={k}, N={n}")
    x_sq = _sq_norms(x)
    radii = np.empty(n)
    for r0 in range(0, n, batch_size):
        rows = slice(r0, min(r0 + batch_size, n))
        best = []  # the k + 1 smallest squared distances of every column block
        for c0 in range(0, n, batch_size):
            cols = slice(c0, min(c0 + batch_size, n))
            d2 = _block_sq_dists(x[rows], x_sq[rows], x[cols], x_sq[cols])
            if r0 == c0:  # exact zero for the point itself (rounding could leave ~1e-12)
                np.fill_diagonal(d2, 0.0)
            if d2.shape[1] > k + 1:
                d2 = np.partition(d2, k, axis=1)[:, :k + 1]
            best.append(d2)
        best = np.concatenate(best, axis=1)
        radii[rows] = np.partition(best, k, axis=1)[:, k]  # (k+1)-th smallest incl. self
    return radii


def _fraction_inside(manifold, radii_sq, probes, batch_size: int) -> float:
    """Fraction of `probes` inside the union of balls around `manifold` with radii^2
    `radii_sq` (Kynkaanniemi et al. 2019, Eq. 1: f(phi, Phi))."""
    m_sq, p_sq = _sq_norms(manifold), _sq_norms(probes)
    inside = np.zeros(len(probes), dtype=bool)
    for r0 in range(0, len(probes), batch_size):
        rows = slice(r0, min(r0 + batch_size, len(probes)))
        hit = np.zeros(rows.stop - rows.start, dtype=bool)
        for c0 in range(0, len(manifold), batch_size):
            cols = slice(c0, min(c0 + batch_size, len(manifold)))
            d2 = _block_sq_dists(probes[rows], p_sq[rows], manifold[cols], m_sq[cols])
            hit |= np.any(d2 <= radii_sq[None, cols], axis=1)
        inside[rows] = hit
    return float(inside.mean())


def precision_recall(real_feats, gen_feats, k: int = 3,
                     batch_size: int = 4096) -> tuple[float, float]:
    """Improved precision and recall (Kynkaanniemi et al. 2019, Eqs. 1-3).

    The real manifold is the union of balls around every real feature with radius the
    distance to its k-th nearest real neighbour; precision is the fraction of generated
    features inside it. Recall swaps the roles: the fraction of real features inside the
    generated manifold. Euclidean distances, ties count as inside (`<=`), k = 3 as in the
    paper and the StyleGAN metric code (`pr50k3`).

    Set sizes matter: the radii shrink as a set grows, so compare sets of equal size (as
    the paper does) to keep precision and recall comparable.

    Args: `real_feats [N_r, D]`, `gen_feats [N_g, D]`; `batch_size` bounds the distance
      blocks (`batch_size^2` float64 values at a time).
    Returns: `(precision, recall)`, Python floats in [0, 1].
    Raises ValueError on mismatched D, or unless `1 <= k < N` for both sets.
    """
    real = _as_features(real_feats, "precision_recall(real_feats)")
    gen = _as_features(gen_feats, "precision_recall(gen_feats)")
    if real.shape[1] != gen.shape[1]:
        raise ValueError(f"precision_recall: feature dimensions differ "
                         f"({real.shape[1]} vs {gen.shape[1]})")
    precision = _fraction_inside(real, knn_radii_sq(real, k, batch_size), gen, batch_size)
    recall = _fraction_inside(gen, knn_radii_sq(gen, k, batch_size), real, batch_size)
    return precision, recall
