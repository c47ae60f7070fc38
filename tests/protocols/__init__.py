"""Tests of mlx_lm_plus/protocols/: wire shapes, validation, assembly, replay."""
