"""The metrics library: FID (Inception-v3), FD_DINOv2 (DINOv2 ViT-L/14), and the
classifier-feature FD, KID and precision/recall of small data sets, of image folders, data
set splits or a network's samples, with reference statistics in the release's format.

    metrics.py             metric names, `Metrics` (references prepared once), `evaluate`
    images.py              the images measured: folders, network samples, data splits
    fid.py, stats.py       feature statistics, Frechet distance, KID, precision/recall
    ref_cache.py           reference statistics of a data set, computed once and cached
    inception.py, dinov2.py  the feature networks
    classifier.py, classifier_metrics.py  the project classifier and its `cls` metrics
    stream.py              a network's metrics in one streamed, resumable pass
    commands.py            the bodies of `--mode=eval` and `--mode=ref`
"""
