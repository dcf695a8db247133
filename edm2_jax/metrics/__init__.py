"""Evaluation metrics: Inception FID, classifier Frechet distance (FD_classifier), KID,
and improved precision/recall."""
