"""`python -m mlx_lm_plus server ...` (like `python -m mlx_lm server ...`)."""

import sys


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "server":
        print("usage: python -m mlx_lm_plus server [mlx_lm.server flags]", file=sys.stderr)
        sys.exit(2)
    from mlx_lm_plus.server import main as server_main

    server_main(argv[1:])


if __name__ == "__main__":
    main()
