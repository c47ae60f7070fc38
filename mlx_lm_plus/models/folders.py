"""What a model's folder says before it is loaded: the size of its weights
(what loading it will take), how its image requests would be served, its
context length, whether mlx-lm has its family, and whether this host can
load it the way mx.distributed asks. Read from its files (config.json, the
weights' names and sizes), never by loading it: the residency decisions,
/v1/models and the ranks' agreement before a load are made from these.
"""

import json
import math
import zlib
from pathlib import Path
from typing import Optional

from mlx_lm_plus.models.embedders import local_folder
from mlx_lm_plus.models.vision import is_vision_model, splits_across_ranks
from mlx_lm_plus.models.vlm_generation import is_mlx_vlm_model


def weights_bytes_on_disk(path) -> int:
    """The size of a model's weight files (what loading it will take, about):
    a local folder, or a Hugging Face repo already in the local cache; 0
    when neither (a download: known once loaded)."""
    folder = local_folder(path)
    try:
        return sum(f.stat().st_size for f in folder.glob("*.safetensors")) if folder else 0
    except OSError:
        return 0


def image_path(model_path, sequential: bool = False) -> Optional[str]:
    """How a folder's image requests are served: "batched" (vision.py's
    families), "sequential" (through mlx-vlm's own generation: a family
    mlx-lm can't load at all, or one the config asks that of), or None
    (text only: no vision config, or mlx-lm's text model of the family)."""
    if sequential and is_mlx_vlm_model(model_path):
        return "sequential"
    if is_vision_model(model_path):
        return "batched"
    if is_mlx_vlm_model(model_path) and not _mlx_lm_has(model_path):
        return "sequential"
    return None


def served_image_path(key, sequential: bool, distributed: bool) -> Optional[str]:
    """`image_path` of a (path, adapter, draft) key: None (text) with an
    adapter; with a draft model "batched" where the family batches (its
    draft proposes in the batch, engine/drafting.py), else None; under
    mx.distributed "batched" for a family whose language model splits
    across the ranks, None for the others (and with a draft)."""
    if key is None or key[1] is not None:
        return None
    if distributed:
        return "batched" if key[2] is None and splits_across_ranks(key[0]) else None
    path = image_path(key[0], sequential)
    return path if key[2] is None or path == "batched" else None


def loadable_fingerprint(model_path, pipeline: bool = False) -> int:
    """What the ranks of mx.distributed agree on before any loads a model:
    raises where this host can't (no config.json, no weights in a local
    folder, a family mlx-lm lacks or can't split the way asked: sharded
    tensor-parallel, or pipelined, which also needs the weights' index),
    else the CRC of its config.json (the same model on every host). Its
    small files are fetched first where it is a Hugging Face repo, as
    mlx-lm's sharded_load does."""
    from mlx_lm_plus.upstream import download, get_classes

    folder = Path(download(str(model_path), allow_patterns=["*.json", "*.jinja", "*.txt"]))
    raw = (folder / "config.json").read_bytes()
    config = json.loads(raw)
    if Path(model_path).is_dir() and not any(folder.glob("model*.safetensors")):
        raise FileNotFoundError(f"no weights (model*.safetensors) in {folder}")
    if pipeline and not (folder / "model.safetensors.index.json").exists():
        raise FileNotFoundError(f"no model.safetensors.index.json in {folder} (mlx-lm's "
                                "pipelined load reads it)")
    if not config.get("model_file"):  # (remote code: only its own load can tell)
        model_class, args_class = get_classes(config)
        # Built, not loaded (its arrays are never evaluated): what mlx-lm's
        # sharded_load asks of it.
        model = model_class(args_class.from_dict(config))
        if pipeline and not hasattr(getattr(model, "model", None), "pipeline"):
            raise ValueError(f"{config.get('model_type')} models can't be pipelined")
        if not pipeline and not hasattr(model, "shard"):
            raise ValueError(f"{config.get('model_type')} models can't be split "
                             "tensor-parallel (--pipeline may)")
    return zlib.crc32(raw)


def _mlx_lm_has(model_path) -> bool:
    """Whether mlx-lm has a model for the folder's family."""
    import importlib.util

    from mlx_lm.utils import MODEL_REMAPPING

    try:
        model_type = json.loads((Path(model_path) / "config.json").read_text())["model_type"]
        name = MODEL_REMAPPING.get(model_type, model_type)
        return importlib.util.find_spec(f"mlx_lm.models.{name}") is not None
    except Exception:  # (unreadable: mlx-lm's load says why)
        return True


def context_length(config: Optional[dict]) -> Optional[int]:
    """How many tokens a model takes, as its config.json says: the largest
    position (max_position_embeddings, or its text model's), times its rope
    scaling factor when it has one (a bound, not exact: Llama 3.1's already
    counts its factor). None: the config does not say (mlx-lm's model
    arguments are not read: their defaults stand in for fields a config
    lacks, 2056 for Mamba 2, whose context has no such bound)."""
    for c in (config, (config or {}).get("text_config")):
        n = c.get("max_position_embeddings") if isinstance(c, dict) else None
        if isinstance(n, int) and n > 0:
            scaling = c.get("rope_scaling")
            factor = scaling.get("factor") if isinstance(scaling, dict) else None
            ok = isinstance(factor, (int, float)) and math.isfinite(factor)
            return int(n * max(1.0, factor if ok else 1.0))
    return None
