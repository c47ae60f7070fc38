"""Tests of mlx_lm_plus/planning/: prompts, constraints, reasoning budgets, lanes."""
