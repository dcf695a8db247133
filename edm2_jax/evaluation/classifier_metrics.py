"""Classifier-feature metrics for small data sets where Inception-v3 is a poor judge.

Generated images are measured in the penultimate feature space of the project's
classifier of the data set (`classifier.get_classifier`):

- `fd_cls`: Frechet distance of the classifier features (the FID formula, Heusel et al.
  2017 Eq. 6, but *not* FID: the features are not Inception's, so numbers are comparable
  only between runs that use the same cached classifier);
- `kid_cls`: KID (Binkowski et al. 2018) on the same features;
- `precision_cls`, `recall_cls`: improved precision/recall (Kynkaanniemi et al. 2019), k = 3.

    from edm2_jax.evaluation import classifier, classifier_metrics
    clf, acc = classifier.get_classifier(train, test)
    m = classifier_metrics.evaluate_features_metrics(gen_uint8, train, clf)
    # {'fd_cls': ..., 'kid_cls': ..., 'precision_cls': ..., 'recall_cls': ..., ...}
"""
from __future__ import annotations

import numpy as np

from edm2_jax.evaluation import stats
from edm2_jax.evaluation.classifier import Classifier, source_arrays


def evaluate_features_metrics(gen_uint8, ref, classifier: Classifier, *,
                              kid_subsets: int = 100, kid_subset_size: int = 1000,
                              pr_k: int = 3, pr_num_ref: int | None = None,
                              seed: int = 0) -> dict:
    """FD, KID and precision/recall of generated images against reference images, all in
    the classifier's feature space (never call `fd_cls` FID: the features are not
    Inception-v3's).

    Args:
      gen_uint8: uint8 `[N_g, H, W, C]` generated images.
      ref: uint8 `[N_r, H, W, C]` reference images, a data `Source` (all its images), or
        float `[N_r, feature_dim]` reference features from `classifier.features` (to
        extract them once when evaluating many checkpoints).
      classifier: from `get_classifier`.
      kid_subsets, kid_subset_size: KID subsets (100 of min(1000, N_g, N_r) as StyleGAN).
      pr_k: neighbourhood size of precision/recall.
      pr_num_ref: reference images used for precision/recall, drawn at random with `seed`;
        None = min(N_r, N_g): equal set sizes, as Kynkaanniemi et al. (the k-NN radii
        depend on the set size). FD and KID always use every reference image.
    Returns: dict with float `fd_cls`, `kid_cls`, `precision_cls`, `recall_cls` and int
      `num_gen`, `num_ref`.
    Raises ValueError for images of the wrong dtype / shape, or fewer than `pr_k + 1`
    images in a set.
    """
    gen_feats = classifier.features(classifier.check_images(gen_uint8, "gen_uint8"))
    if isinstance(ref, np.ndarray) and np.issubdtype(ref.dtype, np.floating):
        if ref.ndim != 2 or ref.shape[1] != classifier.feature_dim:
            raise ValueError(f"reference features must be [N, {classifier.feature_dim}] from "
                             f"classifier.features(images), got shape {ref.shape}")
        ref_feats = ref
    else:
        ref_images = ref if isinstance(ref, np.ndarray) else source_arrays(ref)[0]
        ref_feats = classifier.features(classifier.check_images(ref_images, "reference images"))
    return features_metrics(gen_feats, ref_feats, kid_subsets=kid_subsets,
                            kid_subset_size=kid_subset_size, pr_k=pr_k, pr_num_ref=pr_num_ref,
                            seed=seed)


def features_metrics(gen_feats, ref_feats, *, kid_subsets: int = 100,
                     kid_subset_size: int = 1000, pr_k: int = 3,
                     pr_num_ref: int | None = None, seed: int = 0) -> dict:
    """`evaluate_features_metrics` of features already extracted: float `[N_g, D]`
    generated and `[N_r, D]` reference features of one classifier (`Classifier.features`,
    e.g. accumulated batch by batch while generating). KID's random subsets index the
    generated features in the order given. Returns and raises as
    `evaluate_features_metrics`."""
    gen_feats, ref_feats = np.asarray(gen_feats), np.asarray(ref_feats)
    if len(gen_feats) < pr_k + 1 or len(ref_feats) < pr_k + 1:
        raise ValueError(f"need at least {pr_k + 1} generated and reference images, got "
                         f"{len(gen_feats)} and {len(ref_feats)}")
    mu_g, sigma_g = stats.FeatureStats.from_features(gen_feats).mean_cov()
    mu_r, sigma_r = stats.FeatureStats.from_features(ref_feats).mean_cov()
    n_pr = min(len(ref_feats), len(gen_feats)) if pr_num_ref is None else int(pr_num_ref)
    pr_idx = np.random.default_rng(seed).choice(len(ref_feats), min(n_pr, len(ref_feats)),
                                                replace=False)
    precision, recall = stats.precision_recall(ref_feats[pr_idx], gen_feats, k=pr_k)
    return {
        "fd_cls": stats.frechet_distance(mu_g, sigma_g, mu_r, sigma_r),
        "kid_cls": stats.kid(gen_feats, ref_feats, kid_subsets, kid_subset_size, seed),
        "precision_cls": precision,
        "recall_cls": recall,
        "num_gen": len(gen_feats),
        "num_ref": len(ref_feats),
    }
