"""The package's rooms and who may import whom: the layering the code keeps
(docs/development.md, Layout). An import against it fails here, naming the
module and the line.

    http/       the event loop's side   -> protocols, engine (facade), planning, models, cache
    protocols/  wire shapes, no I/O     -> planning
    engine/     the generation thread   -> planning, cache, models
    planning/   per-request CPU work    -> models
    models/     loading models          -> cache, native
    cache/      a library               -> nothing of ours
    native/     our CPU kernels         -> nothing of ours

Every room may use the package's leaf modules (errors, logs, upstream,
codec); only app.py (the wiring) imports http/, and config/ (the flags,
read by server.py and app.py) looks only at models/ (the served set). Inside engine/, no module
imports the facade (engine/engine.py) back.
"""

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "mlx_lm_plus"
LEAVES = {"errors", "logs", "upstream", "codec"}
ALLOWED = {
    "http": {"protocols", "engine", "planning", "models", "cache"},
    "protocols": {"planning"},
    "engine": {"planning", "cache", "models", "patches"},
    "planning": {"models"},
    "models": {"cache", "native"},
    "cache": set(),
    "native": set(),
    "patches": set(),
    "errors": set(), "logs": set(), "upstream": set(), "codec": set(),
    # The wiring, the configuration and the command line.
    "app": {"http", "protocols", "engine", "planning", "models", "cache", "config", "native"},
    "config": {"models"},
    "server": {"app", "config", "models"},
    "__main__": {"server"},
}


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def imports():
    """(importing module, imported module, file:line) of every import of
    the package from inside it."""
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        package = ".".join(parts[:-1])
        for node in ast.walk(ast.parse(path.read_text())):
            where = f"{path.relative_to(PACKAGE.parent)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("mlx_lm_plus"):
                        yield module, alias.name, where
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    target = f"{base}.{node.module}" if node.module else base
                else:
                    target = node.module or ""
                if not target.startswith("mlx_lm_plus"):
                    continue
                for alias in node.names:
                    # (from a.b import c: c may be a module of a.b, or a name in it)
                    sub = PACKAGE.parent.joinpath(*f"{target}.{alias.name}".split("."))
                    if sub.with_suffix(".py").is_file() or (sub / "__init__.py").is_file():
                        yield module, f"{target}.{alias.name}", where
                    elif target != "mlx_lm_plus":
                        yield module, target, where


def test_every_module_belongs_to_a_known_room():
    rooms = {room(m) for m, _, _ in imports()} | {room(t) for _, t, _ in imports()}
    assert rooms - {""} <= set(ALLOWED), rooms - set(ALLOWED)


def test_imports_follow_the_layering():
    wrong = []
    for module, target, where in imports():
        src, dst = room(module), room(target)
        if not dst or src == dst or dst in LEAVES:
            continue
        if dst not in ALLOWED.get(src, set()):
            wrong.append(f"{where}: {module} imports {target} ({src}/ -> {dst}/)")
    assert not wrong, "\n".join(wrong)


def test_http_uses_the_engine_through_its_facade():
    """The HTTP side reaches the engine through Engine (engine/engine.py)
    and the channel type it answers on, nothing else of it."""
    facade = {"mlx_lm_plus.engine.engine", "mlx_lm_plus.engine.channel"}
    wrong = [f"{where}: {m} imports {t}" for m, t, where in imports()
             if room(m) == "http" and room(t) == "engine" and t not in facade]
    assert not wrong, "\n".join(wrong)


def test_http_is_imported_by_the_wiring_only():
    wrong = [f"{where}: {m} imports {t}" for m, t, where in imports()
             if room(t) == "http" and room(m) not in ("http", "app")]
    assert not wrong, "\n".join(wrong)


def test_no_engine_module_imports_the_facade():
    wrong = [f"{where}: {m} imports {t}" for m, t, where in imports()
             if room(m) == "engine" and m != "mlx_lm_plus.engine.engine"
             and t == "mlx_lm_plus.engine.engine"]
    assert not wrong, "\n".join(wrong)


def test_the_rules_catch_a_wrong_import(tmp_path, monkeypatch):
    """The checker itself: a cache module importing the engine is caught,
    and an engine module importing the facade, however it is written."""
    fake = tmp_path / "mlx_lm_plus"
    for room_ in ("cache", "engine"):
        (fake / room_).mkdir(parents=True)
        (fake / room_ / "__init__.py").write_text("")
    (fake / "engine" / "engine.py").write_text("")
    (fake / "cache" / "store.py").write_text("from mlx_lm_plus.engine.engine import Engine\n")
    for i, line in enumerate(["from mlx_lm_plus.engine import engine",
                              "from . import engine", "import mlx_lm_plus.engine.engine"]):
        (fake / "engine" / f"part{i}.py").write_text(line + "\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    found = {(m, t) for m, t, _ in imports()}
    assert ("mlx_lm_plus.cache.store", "mlx_lm_plus.engine.engine") in found
    for i in range(3):
        assert (f"mlx_lm_plus.engine.part{i}", "mlx_lm_plus.engine.engine") in found, i
    with pytest.raises(AssertionError, match="cache/ -> engine/"):
        test_imports_follow_the_layering()
    with pytest.raises(AssertionError) as caught:
        test_no_engine_module_imports_the_facade()
    assert all(f"part{i}" in str(caught.value) for i in range(3)), str(caught.value)
