"""Tests of mlx_lm_plus/engine/: the generation thread."""
