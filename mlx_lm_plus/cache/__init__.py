"""The prompt cache: a token-level radix tree of layer caches under a byte
budget (store.py) and its disk tier (disk.py). A library: it imports nothing
of the package but logs."""
