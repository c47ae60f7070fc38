"""mlx_lm_plus: a drop-in replacement for mlx_lm.server (mlx-lm 0.32.2)."""

__version__ = "0.1.0"
