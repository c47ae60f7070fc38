"""Whole servers: end to end, distributed and multi-host, soak, fuzz, load, compat, real agents, benchmark smoke runs, the demo model, the dashboard in a browser."""
