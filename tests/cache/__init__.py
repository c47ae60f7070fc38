"""Tests of mlx_lm_plus/cache/: the prompt cache, its disk tier, and its exactness in the engine."""
