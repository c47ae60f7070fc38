"""The generation thread: admission, model residency, batches on mlx-lm's
BatchGenerator, the sequential path, the watchdog and the distributed
hand-off. Imports planning/, cache/ and models/; never http/ or protocols/
wire shapes."""
