"""The prompt cache: a token-level radix tree of layer caches under a byte
budget (store.py) and its disk tier (disk.py; its file format and model
identity in disk_format.py, its index in memory in disk_index.py, its writer
thread in disk_writer.py), which share the token trie (radix.py) and the
layer helpers (layers.py). A library: it imports nothing of the package but
logs."""
