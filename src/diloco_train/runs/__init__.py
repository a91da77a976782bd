"""A run's folder and what lives in it: checkpoints, resume, divergence, ownership, run names, join."""
