"""Evaluation metrics: Inception FID, FD_DINOv2 (DINOv2 ViT-L/14), classifier Frechet
distance (FD_classifier), KID, and improved precision/recall."""
