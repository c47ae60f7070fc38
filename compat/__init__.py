"""Black-box compatibility suite: mlx_lm_plus.server against mlx_lm.server."""
