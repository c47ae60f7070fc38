"""Tests of mlx_lm_plus/http/: the event loop's side (routes, bodies, connections, streams, metrics)."""
