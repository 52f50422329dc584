"""GGUF checkpoints: `--model x.gguf` (or a folder holding one .gguf) is converted once into an
ordinary Hugging Face checkpoint folder in the cache, cache_root()/gguf/<sha256 of the file>,
which later starts load as it is. Everything downstream (model_info, the worker's loader, the
frontend's AutoTokenizer) reads that folder and knows nothing of GGUF.

With `--quantization gguf` the conversion keeps the matrices our kernels multiply (Q8_0,
Q4_0, Q4_1) as the file's own blocks, uint8 tensors [rows, row_bytes], and names their formats
in quantization.json; that copy lives in cache_root()/gguf-blocks/<sha256>."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtime.checkpoints.cache import cache_root, discard, write_atomically

if TYPE_CHECKING:
    from runtime.checkpoints.gguf_file import GGUFFile

logger = logging.getLogger("runtime")

# Bump when what the conversion writes changes: copies made before are then converted again.
CONVERTER_VERSION = 1
MARKER = "gguf_source.json"  # written with the rest, read to tell a current copy
BLOCKS_FILE = "quantization.json"  # the formats of the tensors a copy keeps as blocks


def gguf_source(model: str | Path) -> Path | None:
    """The .gguf file `model` names: itself, or the one in a folder without a config.json;
    None for anything else (a Hugging Face folder)."""
    path = Path(model).expanduser()
    if path.is_file():
        return path if path.suffix.lower() == ".gguf" else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    found = sorted(path.glob("*.gguf"))
    if len(found) > 1:
        names = ", ".join(f.name for f in found)
        raise ValueError(f"{path} holds {len(found)} .gguf files ({names}): name one of them")
    return found[0] if found else None


def resolve_checkpoint(
    model: str, cache: Path | None = None, quantization: str | None = None
) -> str:
    """The checkpoint folder to serve for `model`: itself, or the converted copy of its GGUF
    file (converted first if this cache has none): with `quantization` "gguf", the copy that
    keeps the file's blocks."""
    source = gguf_source(model)
    if source is None:
        check_folder(Path(model).expanduser(), quantization)
        return model
    keep = quantization == "gguf"
    return str(converted_checkpoint(source, cache_root() if cache is None else cache, keep))


def check_folder(folder: Path, quantization: str | None) -> None:
    """A ValueError saying what to do where a checkpoint folder and `--quantization` do not
    go together: blocks kept for `gguf` only, and `gguf` only with them."""
    blocks = (folder / BLOCKS_FILE).is_file()
    if quantization == "gguf" and not blocks:
        raise ValueError(
            f"--quantization gguf keeps a GGUF file's own blocks, and {folder} is no GGUF "
            "file: give --model the .gguf file, or use --quantization int8 for a safetensors "
            "checkpoint"
        )
    if quantization != "gguf" and blocks:
        raise ValueError(
            f"{folder} holds GGUF blocks (a .gguf file converted for --quantization gguf): "
            "serve it with --quantization gguf, or serve the .gguf file itself"
        )


def converted_checkpoint(source: Path, cache: Path, keep_blocks: bool = False) -> Path:
    digest = file_sha256(source)
    target = cache / ("gguf-blocks" if keep_blocks else "gguf") / digest
    if is_current(target):
        logger.info("%s: using its converted copy %s", source.name, target)
        return target
    from runtime.checkpoints.gguf_config import hf_config
    from runtime.checkpoints.gguf_file import GGUFFile
    from runtime.checkpoints.gguf_tokenizer import check_tokenizer
    from runtime.checkpoints.gguf_weights import check_names

    started = time.monotonic()
    file = GGUFFile(source)
    file.check()  # everything we refuse, refused before writing anything
    check_tokenizer(file)
    check_names(file)
    config = hf_config(file)
    if is_current(target):  # another start converted it meanwhile
        return target
    discard(target)  # a copy by an older converter, if any
    write_atomically(target, partial(convert, file, config, digest, keep_blocks))
    took = time.monotonic() - started
    logger.info("%s: converted into %s in %.1f s", source.name, target, took)
    return target


def convert(
    file: GGUFFile, config: dict[str, Any], digest: str, keep_blocks: bool, out: Path
) -> None:
    from runtime.checkpoints.gguf_config import generation_config
    from runtime.checkpoints.gguf_tokenizer import build_tokenizer, tokenizer_config
    from runtime.checkpoints.gguf_weights import write_weights

    write_json(out / "config.json", config)
    write_json(out / "generation_config.json", generation_config(file))
    (out / "tokenizer.json").write_text(build_tokenizer(file).to_str())
    write_json(out / "tokenizer_config.json", tokenizer_config(file))
    write_weights(file, config, out, keep_blocks)
    source = {"converter": CONVERTER_VERSION, "sha256": digest, "file": str(file.path)}
    write_json(out / MARKER, source | {"quantization": file.quantization()})


def is_current(target: Path) -> bool:
    try:
        return json.loads((target / MARKER).read_text())["converter"] == CONVERTER_VERSION
    except (OSError, ValueError, KeyError):
        return False


def file_sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_json(path: Path, data: object) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
