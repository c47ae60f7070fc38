"""Benchmarks: mlx_lm_plus side by side with upstream mlx_lm.server."""
