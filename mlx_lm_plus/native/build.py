"""Build the CPU kernels (src/) into this folder:

    python -m mlx_lm_plus.native.build          # scripts/setup runs it on Linux

It needs cmake, a C++ compiler with OpenMP and a nanobind whose internals
match mlx.core's (3.1.0 for mlx 0.32.4: the extension shares its nanobind
types; scripts/setup installs it). The module is built for the machine it
runs on (-march=native) and against the installed mlx. Beside it, a stamp
of what it was built from: the sources, mlx's and nanobind's versions, the
Python and the CPU's instruction sets. `mlx_lm_plus.native` loads it only
where the stamp is today's (a module built from older sources lacks
kernels the code calls; one built on another CPU may hold instructions
this one lacks, which would kill the server at its first request), so a
new mlx, a pull or another machine needs this run again; a build that
would give the same module is skipped (--force builds anyway). Exits 0
with a note where it can't build: the server then decodes with MLX's own
kernels.
"""

import glob
import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
STAMP = HERE / "_cpu_kernels.stamp"


# The /proc/cpuinfo flags that name instruction sets (x86's and Arm's):
# what -march=native compiles for. Not the others (a hypervisor's, a kernel's
# mitigations), which change with a kernel or a host and not the code.
INSTRUCTION_SETS = re.compile(
    r"^(sse|ssse|avx|fma|f16c|bmi|amx|popcnt|abm|movbe|vaes|vpclmul|gfni|sha|adx|aes|"
    r"pclmul|xsave|asimd|sve|fphp|i8mm|bf16|dotprod|fp$|atomics|lse)")


def cpu_features() -> str:
    """A digest of the CPU's instruction sets (see INSTRUCTION_SETS), or ""
    where unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return flags_digest(line)
    except OSError:
        pass
    return ""


def flags_digest(line: str) -> str:
    """The digest of a cpuinfo flags line's instruction sets."""
    flags = sorted(f for f in line.split(":", 1)[1].split() if INSTRUCTION_SETS.match(f))
    return hashlib.sha256(" ".join(flags).encode()).hexdigest()[:16]


def stamp() -> str:
    """What the built module depends on (see the module doc)."""
    from importlib.metadata import version

    h = hashlib.sha256()
    for path in sorted((HERE / "src").iterdir()):
        h.update(path.name.encode() + path.read_bytes())
    return (f"{h.hexdigest()} mlx={version('mlx')} nanobind={version('nanobind')} "
            f"python={sys.version_info[:2]} machine={platform.machine()} "
            f"cpu={cpu_features()}")


def up_to_date() -> bool:
    try:
        return (bool(list(HERE.glob("_cpu_kernels*.so")))
                and STAMP.read_text() == stamp())
    except Exception:  # (no metadata for a package, an unreadable stamp: build)
        return False


def build(verbose: bool = False) -> Path:
    """Configure and build; returns the module's path. Raises on failure."""
    out = subprocess.DEVNULL if not verbose else None
    with tempfile.TemporaryDirectory(prefix="mlx_lm_plus-native-") as tmp:
        subprocess.run(["cmake", "-S", str(HERE / "src"), "-B", tmp,
                        f"-DPython_EXECUTABLE={sys.executable}",
                        "-DCMAKE_BUILD_TYPE=Release"],
                       check=True, stdout=out, stderr=None if verbose else subprocess.PIPE)
        subprocess.run(["cmake", "--build", tmp, "-j", str(os.cpu_count() or 1)],
                       check=True, stdout=out, stderr=None if verbose else subprocess.PIPE)
        built = glob.glob(os.path.join(tmp, "_cpu_kernels*.so"))
        if len(built) != 1:
            raise RuntimeError(f"the build left {built}")
        for old in HERE.glob("_cpu_kernels*.so"):
            old.unlink()
        target = HERE / os.path.basename(built[0])
        shutil.copy2(built[0], target)
        STAMP.write_text(stamp())
        return target


def main(argv=None) -> int:
    argv = argv if argv is not None else sys.argv[1:]
    verbose = "-v" in argv
    if "--force" not in argv and up_to_date():
        print("the CPU kernels are built")
        return 0
    try:
        path = build(verbose)
    except (OSError, subprocess.CalledProcessError, RuntimeError) as e:
        detail = getattr(e, "stderr", None)
        detail = detail.decode(errors="replace")[-2000:] if detail else ""
        print(f"note: the CPU kernels were not built ({e}); decode on a CPU uses "
              f"MLX's own kernels.\n{detail}", file=sys.stderr)
        return 0
    print(f"built {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
