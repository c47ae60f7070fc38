"""upstream.py, the one door to mlx-lm's private names: each is checked on
import, and one that is gone fails the start with a message naming it."""

import subprocess
import sys

import pytest

from mlx_lm_plus import upstream


def test_the_names_are_upstreams_own():
    import mlx_lm.server
    import mlx_lm.utils

    assert upstream.make_sampler is mlx_lm.server._make_sampler
    assert upstream.image_parts is mlx_lm.server._image_parts
    assert upstream.download is mlx_lm.utils._download


@pytest.mark.parametrize("remove", ["mlx_lm.server._make_sampler",
                                    "mlx_lm.generate.BatchGenerator._prompt_batch"])
def test_a_name_upstream_no_longer_has_fails_the_import_naming_it(remove):
    module, _, name = remove.rpartition(".")
    if name == "_prompt_batch":  # (instance state: found in the class's source)
        setup = ("import inspect, sys, mlx_lm.generate; g = sys.modules['mlx_lm.generate']; "
                 "src = inspect.getsource; "
                 "inspect.getsource = lambda o: src(o).replace('self._prompt_batch', 'x') "
                 "if o is g.BatchGenerator else src(o)")
    else:
        setup = f"import {module} as m; del m.{name}"
    code = f"{setup}\nimport mlx_lm_plus.upstream"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode != 0
    assert "UpstreamChanged" in run.stderr and name in run.stderr, run.stderr[-2000:]
    assert "install mlx-lm==0.32.2" in run.stderr


def test_no_module_but_upstream_and_patches_imports_a_private_mlx_name():
    """Every private name of mlx-lm or mlx-vlm comes through upstream.py
    (patches/ replace upstream functions and are guarded on their own)."""
    import ast
    from pathlib import Path

    package = Path(upstream.__file__).parent
    wrong = []
    for path in package.rglob("*.py"):
        if path.name == "upstream.py" or "patches" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                    and node.module.split(".")[0] in ("mlx_lm", "mlx_vlm")):
                wrong += [f"{path.relative_to(package)}:{node.lineno}: {node.module}.{a.name}"
                          for a in node.names if a.name.startswith("_")]
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                    and not node.attr.startswith("__")
                    and isinstance(node.value, ast.Name) and node.value.id == "upstream"):
                wrong.append(f"{path.relative_to(package)}:{node.lineno}: upstream.{node.attr}")
    assert not wrong, "\n".join(wrong)
