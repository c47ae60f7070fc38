"""Models: finding, loading and unloading them (provider.py), vision models
through mlx-vlm, the embedded demo model, and the CPU's weight format."""
