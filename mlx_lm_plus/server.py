"""Command line entry point: `mlx_lm_plus.server --model X ...`, with the
same flags as `mlx_lm.server` 0.32.2 (config/flags.py)."""

import logging

from mlx_lm_plus.models.cpu import preload_fast_blas

preload_fast_blas()  # before anything loads MLX (cpu.py)

from mlx_lm_plus.config import parse_args  # noqa: E402


def main(argv=None):
    args = parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper(), None),
        format="%(asctime)s - %(levelname)s - %(message)s",
    )
    from mlx_lm_plus.app import run

    run(args)


if __name__ == "__main__":
    main()
