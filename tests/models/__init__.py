"""Tests of mlx_lm_plus/models/: the served set, residency, CPU, vision models."""
