"""The served set: what this server serves, loaded or not. Every --model
(the first is the default and pinned), the folders of --models-dir, and the
entries of a --models-config file (aliases, pinning, a TTL, sampling
defaults); with no model named, the embedded demo model."""

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

# The sampling defaults a --models-config entry may set: its key -> the CLI
# flag (argparse dest) it stands in for.
MODEL_DEFAULTS = {"temperature": "temp", "top_p": "top_p", "top_k": "top_k",
                  "min_p": "min_p", "max_tokens": "max_tokens"}


def resolve_default_model(cli_args) -> None:
    """Fill in --model with the demo model when nothing names a model."""
    if (cli_args.model is None and not cli_args.models_dir
            and not cli_args.models_config):
        from mlx_lm_plus.models.demo import demo_model_path

        cli_args.model = str(demo_model_path())
        cli_args.models = [cli_args.model]
        logging.info(f"No --model given: serving the demo model at {cli_args.model}")


@dataclass
class ServedModel:
    """A model this server serves, loaded or not."""

    name: str  # its id in /v1/models
    path: str
    adapter: Optional[str] = None
    draft: Optional[str] = None
    aliases: Tuple[str, ...] = ()  # other names requests may use
    pinned: bool = False  # never unloaded for room or by TTL
    ttl: Optional[float] = None  # idle seconds before unloading (None: --model-ttl)
    defaults: Dict[str, Any] = field(default_factory=dict)  # flag dest -> value
    # "sequential": images (and text) through mlx-vlm's own generation, one
    # request at a time, for a family mlx-lm would serve as text only.
    vision: Optional[str] = None
    # "embed", "rerank" or "generate": what it serves, where its folder
    # doesn't say (embedders.folder_task). None: what the folder says.
    task: Optional[str] = None

    @property
    def key(self):
        return (self.path, self.adapter, self.draft)


def _entry(raw, where: str) -> ServedModel:
    """A --models-config entry, checked (a bad config stops the server at
    startup, not at the first request)."""
    if not isinstance(raw, dict) or not isinstance(raw.get("path"), str):
        raise ValueError(f"{where}: an entry needs a `path` string")
    known = {"name", "path", "adapter_path", "draft_model", "aliases", "pinned", "ttl",
             "defaults", "vision", "task"}
    if unknown := set(raw) - known:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)} (known: {sorted(known)})")
    aliases = raw.get("aliases", [])
    if not (isinstance(aliases, list) and all(isinstance(a, str) for a in aliases)):
        raise ValueError(f"{where}: `aliases` must be a list of strings")
    ttl = raw.get("ttl")
    if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, (int, float))
                            or ttl < 0):
        raise ValueError(f"{where}: `ttl` must be a number of seconds, at least 0")
    for k, kind in (("name", str), ("adapter_path", str), ("draft_model", str),
                    ("pinned", bool)):
        if raw.get(k) is not None and not isinstance(raw[k], kind):
            raise ValueError(f"{where}: `{k}` must be a {kind.__name__}")
    if raw.get("vision") not in (None, "sequential"):
        raise ValueError(f'{where}: `vision` may be "sequential" (images through '
                         "mlx-vlm's own generation, one request at a time)")
    if raw.get("task") not in (None, "generate", "embed", "rerank"):
        raise ValueError(f'{where}: `task` may be "generate", "embed" (/v1/embeddings) '
                         'or "rerank" (/v1/rerank)')
    if raw.get("task") in ("embed", "rerank") and (
            raw.get("adapter_path") or raw.get("draft_model") or raw.get("vision")):
        raise ValueError(f"{where}: an embedding or reranking model takes no adapter, "
                         "draft model or vision setting")
    if raw.get("vision") and (raw.get("adapter_path") or raw.get("draft_model")):
        raise ValueError(f"{where}: `vision` is not available with an adapter or a draft "
                         "model (those load through mlx-lm, as text)")
    defaults = raw.get("defaults", {})
    if not isinstance(defaults, dict) or set(defaults) - set(MODEL_DEFAULTS):
        raise ValueError(f"{where}: `defaults` may set {sorted(MODEL_DEFAULTS)}")
    for k, v in defaults.items():
        # The checks a request's own value gets (validation.py), so a bad
        # default fails here, not every request that leaves it out.
        ok = (not isinstance(v, bool)
              and isinstance(v, int if k in ("top_k", "max_tokens") else (int, float))
              and not (isinstance(v, float) and not math.isfinite(v)))
        low, high = {"max_tokens": (1, None), "top_k": (0, None), "temperature": (0, 1000),
                     "top_p": (0, 1), "min_p": (0, 1)}[k]
        if not ok or v < low or (high is not None and v > high):
            raise ValueError(f"{where}: defaults.{k} must be a number in "
                             f"[{low}, {high if high is not None else 'inf'}]"
                             + (", an integer" if k in ("top_k", "max_tokens") else ""))
    path = resolved_path(raw["path"])
    return ServedModel(
        name=raw.get("name") or Path(path).name or path, path=path,
        adapter=raw.get("adapter_path"), draft=raw.get("draft_model"),
        aliases=tuple(aliases), pinned=bool(raw.get("pinned", False)),
        ttl=None if ttl is None else float(ttl),
        defaults={MODEL_DEFAULTS[k]: v for k, v in defaults.items()},
        vision=raw.get("vision"), task=raw.get("task"))


def resolved_path(path: str) -> str:
    """A local folder's path in one spelling (so "./x", "x/" and its
    absolute path are one model, loaded once); a repo id as it is."""
    try:
        return str(Path(path).resolve()) if Path(path).is_dir() else path
    except OSError:
        return path


def read_models_config(path) -> List[ServedModel]:
    """A --models-config file: JSON, or YAML when it ends in .yaml/.yml:
    `{"models": [{"path": ..., "name": ..., "aliases": [...], "pinned": true,
    "ttl": 600, "adapter_path": ..., "draft_model": ..., "defaults":
    {"temperature": 0.7, "max_tokens": 512}}]}`."""
    text = Path(path).read_text()
    if str(path).endswith((".yaml", ".yml")):
        import yaml

        data = yaml.safe_load(text)
    else:
        data = json.loads(text)
    if not isinstance(data, dict) or not isinstance(data.get("models"), list):
        raise ValueError(f"{path}: expected an object with a `models` list")
    return [_entry(raw, f"{path}: models[{i}]") for i, raw in enumerate(data["models"])]


def served_set(cli_args) -> List[ServedModel]:
    """What this server serves: every --model (the first with --adapter-path
    and --draft-model, pinned), then --models-config's entries, then the
    model folders in --models-dir (named by their folder)."""
    served = []
    for i, model in enumerate(cli_args.models or
                              ([cli_args.model] if cli_args.model else [])):
        aliases = set()
        if Path(model).exists():
            aliases.add(str(Path(model).resolve()))
        first = i == 0
        served.append(ServedModel(
            name=str(Path(model).resolve()) if Path(model).exists() else model,
            path=resolved_path(model), adapter=cli_args.adapter_path if first else None,
            draft=cli_args.draft_model if first else None,
            aliases=tuple(sorted(aliases | {model})), pinned=first))
    if cli_args.models_config:
        served += read_models_config(cli_args.models_config)
    if cli_args.models_dir:
        for folder in sorted(Path(cli_args.models_dir).iterdir()):
            if (folder / "config.json").is_file():
                served.append(ServedModel(name=folder.name, path=resolved_path(folder),
                                          aliases=(str(folder.resolve()),)))
    for entry in served:
        others = {e.task for e in served if e.key == entry.key}
        if len(others) > 1:
            raise ValueError(f"the served entries of {entry.path} ask for different tasks "
                             f"({sorted(map(str, others))}): one folder is loaded once, for "
                             "one task (a copy of the folder may serve another)")
    names = [e.name for e in served]
    if len(set(names)) < len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"two served models are named {twice[0]!r} (--model, "
                         "--models-config names, --models-dir folders): give one another name")
    return served


