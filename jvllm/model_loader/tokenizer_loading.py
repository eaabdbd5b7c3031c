"""A model's tokenizer: the fast tokenizer class itself where AutoTokenizer would pick it anyway (the tokenizer jvllm
rebuilt from a GGUF file, a Llama checkpoint naming the generic fast tokenizer), AutoTokenizer otherwise.

AutoTokenizer's module imports PyTorch wherever PyTorch is installed (transformers' configuration code checks for it
and imports it): ~2-3.5 s and ~250 MB on the 2-core CPU, 13-18 s on a GPU machine whose image holds PyTorch, although
jvllm never uses it. The tokenizer classes themselves do not import it."""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger("jvllm")

GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")  # the generic fast tokenizer's names
# Model types for which AutoTokenizer gives a checkpoint the generic fast tokenizer it names (as Llama 3's do);
# transformers overrides the named class for some others by the model type (qwen2 and phi3 among them).
GENERIC_MODEL_TYPES = frozenset({"llama"})


def processor_chat_template(folder: Path) -> str | None:
    """The chat template a vision-language checkpoint keeps beside its processor (chat_template.json, as the llava-hf
    and Qwen-VL repositories do) rather than in its tokenizer config; None when there is none."""
    path = folder / "chat_template.json"
    if not path.is_file():
        return None
    template = json.loads(path.read_text()).get("chat_template")
    return template if isinstance(template, str) else None


def names_the_generic_tokenizer(folder: Path) -> bool:
    """Whether AutoTokenizer would load `folder`'s tokenizer as the generic fast tokenizer its config names: a model
    type of GENERIC_MODEL_TYPES, a tokenizer.json and no tokenizer code of the checkpoint's own."""
    try:
        tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
        model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return False
    return (tokenizer_config.get("tokenizer_class") in GENERIC_CLASSES and "auto_map" not in tokenizer_config
            and model_type in GENERIC_MODEL_TYPES and (folder / "tokenizer.json").is_file())


def load_tokenizer(source: str, folder: Path, rebuilt: bool) -> Any:
    """The tokenizer of `source` (a folder or name), with the chat template of `folder`'s processor where it has none.
    `rebuilt`: `source` is the folder jvllm wrote for a GGUF file's tokenizer, whose fast tokenizer is loaded back
    as that class (AutoTokenizer could pick another class by the config's model type, and imports PyTorch)."""
    started = time.perf_counter()
    if rebuilt or names_the_generic_tokenizer(Path(source)):
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast.from_pretrained(source)
    else:
        from transformers import AutoTokenizer

        logger.info("transformers imported in %.1fs; reading the tokenizer", time.perf_counter() - started)
        tokenizer = AutoTokenizer.from_pretrained(source)
    if tokenizer.chat_template is None:
        tokenizer.chat_template = processor_chat_template(folder)
    logger.info("tokenizer ready in %.1fs", time.perf_counter() - started)
    return tokenizer
