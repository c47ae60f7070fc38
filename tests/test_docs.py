"""README.md and docs/*.md stay true to the repository: every docs page is
linked from the README, every relative link and `#anchor` resolves, every
`python -m MODULE` names a module that exists, and every repository path
written in backticks exists. Fast: reads files, starts no server, imports
only the packages that `importlib.util.find_spec` has to import to find a
submodule."""

import importlib.util
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
PAGES = [README] + DOCS

# `python -m X` where X is a tool rather than a module of this project.
SKIPPED_MODULES = {"pip", "venv", "pytest"}
# Backticked text starting with one of these is read as a repository path.
PATH_PREFIXES = ("mlx_lm_plus/", "benchmarks/", "compat/", "scripts/", "tests/", "testkit/",
                 "patches/", "docs/", ".ci/")

FENCE = re.compile(r"^```.*?^```[ \t]*$", re.M | re.S)
LINK = re.compile(r"\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*([^)\s]+)(?:\s+\"[^\"]*\")?\s*\)")
PYTHON_M = re.compile(r"\bpython3?\s+-m\s+([A-Za-z_][\w.]*)")
CODE_SPAN = re.compile(r"(?<!`)`([^`\n]+(?:\n[^`\n]+)*?)`(?!`)")
PATH_CHARS = re.compile(r"^[\w./-]+$")


def rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def blank_fences(text: str) -> str:
    """Fenced code blocks replaced by blank lines (line numbers kept): their
    backticks are not code spans and their brackets are not links."""
    return FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation
    dropped (hyphens and underscores kept), spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set:
    found, counts = set(), {}
    for match in re.finditer(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$",
                             blank_fences(path.read_text()), re.M):
        base = slug(match.group(1))
        n = counts.get(base, 0)
        counts[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(path: Path):
    """(line, target) for every Markdown link outside fenced code."""
    text = blank_fences(path.read_text())
    for match in LINK.finditer(text):
        yield line_of(text, match.start()), match.group(1)


def test_there_are_docs_pages():
    assert DOCS, "no docs/*.md found"


def test_every_docs_page_is_linked_from_the_readme():
    linked = set()
    for _, target in links(README):
        if "://" in target or target.startswith(("#", "mailto:")):
            continue
        linked.add((README.parent / target.split("#")[0]).resolve())
    missing = [rel(page) for page in DOCS if page.resolve() not in linked]
    assert not missing, "docs pages not linked from README.md: " + ", ".join(missing)


def test_relative_links_resolve():
    bad = []
    for page in PAGES:
        for line, target in links(page):
            if "://" in target or target.startswith("mailto:"):
                continue
            file_part, _, anchor = target.partition("#")
            dest = (page.parent / file_part).resolve() if file_part else page
            where = f"{rel(page)}:{line}: ({target})"
            if not dest.exists():
                bad.append(f"{where} -> {file_part} does not exist")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{where} -> no heading with anchor #{anchor} in {rel(dest)}")
    assert not bad, "broken links:\n" + "\n".join(bad)


def module_problem(name: str):
    """None when `python -m name` would find its module from the repository
    root; otherwise why not."""
    added = str(REPO) not in sys.path[:1]
    if added:
        sys.path.insert(0, str(REPO))
    try:
        spec = importlib.util.find_spec(name)
        if spec is None:
            return "no such module"
        if spec.submodule_search_locations is not None:  # a package: runs __main__
            if importlib.util.find_spec(name + ".__main__") is None:
                return "a package without __main__"
        return None
    except Exception as e:  # a parent package missing or failing to import
        return f"{type(e).__name__}: {e}"
    finally:
        if added:
            sys.path.remove(str(REPO))


def python_m_commands():
    for page in PAGES:
        text = page.read_text()
        for match in PYTHON_M.finditer(text):
            name = match.group(1).rstrip(".")
            if name.split(".")[0] in SKIPPED_MODULES:
                continue
            command = text[match.start():].split("\n", 1)[0].split("`", 1)[0]
            yield page, line_of(text, match.start()), name, command


def test_python_m_commands_name_existing_modules():
    commands = list(python_m_commands())
    assert commands, "no `python -m` command found (the pattern is broken?)"
    bad = []
    for page, line, name, command in commands:
        problem = module_problem(name)
        if problem:
            bad.append(f"{rel(page)}:{line}: python -m {name}: {problem}  (in: {command.strip()})")
    assert not bad, "`python -m` commands naming no module:\n" + "\n".join(bad)


def repository_paths():
    """(page, line, path) for every backticked repository path: text that
    starts with one of PATH_PREFIXES, its first word when the span is a
    command line (`tests/planning/test_lanes.py -s`), with a `:line` suffix dropped;
    spans with wildcards or placeholders are skipped."""
    for page in PAGES:
        text = blank_fences(page.read_text())
        for match in CODE_SPAN.finditer(text):
            words = match.group(1).split()
            if not words or not words[0].startswith(PATH_PREFIXES):
                continue
            path = re.sub(r":\d+(?:-\d+)?$", "", words[0].rstrip(",;"))
            if not PATH_CHARS.match(path):  # *, ?, <...>, {a,b}: not one path
                continue
            yield page, line_of(text, match.start()), path


def test_backticked_repository_paths_exist():
    paths = list(repository_paths())
    assert paths, "no repository path found (the pattern is broken?)"
    bad = [f"{rel(page)}:{line}: {path}" for page, line, path in paths
           if not (REPO / path).exists()]
    assert not bad, "paths that do not exist:\n" + "\n".join(bad)


@pytest.mark.parametrize("heading, expected", [
    ("The hot path", "the-hot-path"),
    ("What is guarded, and how", "what-is-guarded-and-how"),
    ("Across hosts (mx.distributed)", "across-hosts-mxdistributed"),
    ("Agent APIs: Anthropic Messages and OpenAI Responses",
     "agent-apis-anthropic-messages-and-openai-responses"),
    ("`--kv-bits` inside the batch", "--kv-bits-inside-the-batch"),
])
def test_slug(heading, expected):
    assert slug(heading) == expected
