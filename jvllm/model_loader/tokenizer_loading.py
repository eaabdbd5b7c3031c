"""A model's tokenizer: the tokenizer class itself where AutoTokenizer would pick it anyway (the tokenizer jvllm
rebuilt from a GGUF file; a Llama checkpoint naming the generic fast tokenizer, a Qwen2 one naming Qwen2's),
AutoTokenizer otherwise.

AutoTokenizer's module imports PyTorch wherever PyTorch is installed (transformers' configuration code checks for it
and imports it): ~2-3.5 s and ~250 MB on the 2-core CPU, 13-18 s on a GPU machine whose image holds PyTorch, although
jvllm never uses it. The tokenizer classes themselves do not import it."""
from __future__ import annotations

import importlib
import json
import logging
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger("jvllm")

GENERIC = ("transformers", "PreTrainedTokenizerFast")  # the generic fast tokenizer (TokenizersBackend in 5.x)
QWEN2 = ("transformers.models.qwen2.tokenization_qwen2", "Qwen2Tokenizer")
# (model type, the tokenizer class a checkpoint's tokenizer config names) -> (module, name) of the class AutoTokenizer
# loads it with, which is that class: Llama 3's generic fast tokenizer, Qwen2's own. transformers overrides the
# named class by the model type for others (a qwen2 or phi3 checkpoint naming the generic one among them); those,
# and anything not listed, go through AutoTokenizer. tests/models/test_tokenizer_loading.py checks each pair
# against AutoTokenizer.
DIRECT_CLASSES = {("llama", "TokenizersBackend"): GENERIC, ("llama", "PreTrainedTokenizerFast"): GENERIC,
                  ("qwen2", "Qwen2Tokenizer"): QWEN2, ("qwen2", "Qwen2TokenizerFast"): QWEN2}


def processor_chat_template(folder: Path) -> str | None:
    """The chat template a vision-language checkpoint keeps beside its processor (chat_template.json, as the llava-hf
    and Qwen-VL repositories do) rather than in its tokenizer config; None when there is none."""
    path = folder / "chat_template.json"
    if not path.is_file():
        return None
    template = json.loads(path.read_text()).get("chat_template")
    return template if isinstance(template, str) else None


def direct_class(folder: Path) -> Any | None:
    """The tokenizer class AutoTokenizer would load `folder`'s tokenizer with, imported without AutoTokenizer's
    module, where DIRECT_CLASSES lists the folder's model type and named class (with a tokenizer.json and no
    tokenizer code of the checkpoint's own); None otherwise."""
    try:
        tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
        model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return None
    where = DIRECT_CLASSES.get((model_type, tokenizer_config.get("tokenizer_class")))
    if where is None or "auto_map" in tokenizer_config or not (folder / "tokenizer.json").is_file():
        return None
    return _import_class(where)


def _import_class(where: tuple[str, str]) -> Any | None:
    """The class `name` of `module` (None where this transformers has no such module or class)."""
    module, name = where
    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:  # a transformers without that module: AutoTokenizer knows where the class is
        return None


def load_tokenizer(source: str, folder: Path, rebuilt: bool) -> Any:
    """The tokenizer of `source` (a folder or name), with the chat template of `folder`'s processor where it has none.
    `rebuilt`: `source` is the folder jvllm wrote for a GGUF file's tokenizer, whose fast tokenizer is loaded back
    as that class (AutoTokenizer could pick another class by the config's model type, and imports PyTorch)."""
    started = time.perf_counter()
    cls = _import_class(GENERIC) if rebuilt else direct_class(Path(source))
    if cls is not None:
        tokenizer = cls.from_pretrained(source)
    else:
        from transformers import AutoTokenizer

        logger.info("transformers imported in %.1fs; reading the tokenizer", time.perf_counter() - started)
        tokenizer = AutoTokenizer.from_pretrained(source)
    if tokenizer.chat_template is None:
        tokenizer.chat_template = processor_chat_template(folder)
    logger.info("tokenizer ready in %.1fs", time.perf_counter() - started)
    return tokenizer
