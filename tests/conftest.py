"""Shared fixtures: offline hub, a per-session cache dir, one default engine, tiny random HF models."""
from __future__ import annotations

import collections
import gc
import importlib.util
import json
import os
import pathlib
import shutil
from importlib import metadata

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # Workers share the cores, so a second OpenMP thread per worker (torch, the transformers reference) mostly waits
    # for a core while its partner spins at barriers (the measurement: benchmarks/results/throughput_cpu.md, CI).
    # Inherited by the subprocesses (notebook kernels, servers).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
# The suite spends more of its time compiling than running what it compiled. On CPU, XLA's older fusion emitters and
# LLVM's optimizations off (backend optimization level 0) make an engine's pieces compile in about a quarter of the
# time, while the default model's steps run about as fast (their products are library calls, not generated loops). Users' engines keep XLA's defaults. Inherited by the subprocesses; a flag
# already in XLA_FLAGS is kept (docs/design/test_suite.md).
from jvllm.worker.xla_flags import append_unset_flags  # noqa: E402


def _test_xla_flags() -> dict[str, str]:
    """The suite's compile flags: none where a CUDA plugin is installed (GPU kernels compile as users' do)."""
    if any(importlib.util.find_spec(f"jax_cuda{version}_plugin") for version in (12, 13)):
        return {}
    flags = {"xla_backend_optimization_level": "0"}
    if tuple(int(part) for part in metadata.version("jaxlib").split(".")[:2]) < (0, 11):
        flags["xla_cpu_use_fusion_emitters"] = "false"  # jaxlib 0.11 removed it, and XLA stops at an unknown flag
    return flags


append_unset_flags(_test_xla_flags())

import pytest  # noqa: E402


@pytest.hookimpl(trylast=True)  # after the tmp_path plugin's configure, which makes the base temp's factory
def pytest_configure(config: pytest.Config) -> None:
    """Keep the run's native kernels, converted weights and compiled executables out of the user's home cache,
    unless JVLLM_CACHE_DIR is set (CI may point it at a warm cache). Set here, before collection, whose checks of
    the native kernels build them: the whole run then builds them once, into the folder its subprocesses use too.
    Under pytest-xdist the workers share one folder (the run's base temp), so a model converted or a step compiled
    by one worker's subprocesses (servers, notebooks, the CLI) is loaded by the other's; conversions and cache
    entries are written by rename or read back with a fallback to compiling."""
    if "JVLLM_CACHE_DIR" in os.environ:
        return
    if os.environ.get("PYTEST_XDIST_WORKER"):  # xdist gives each worker the folder <run's base temp>/<worker>
        shared = pathlib.Path(config.option.basetemp).parent
    else:
        shared = config._tmp_path_factory.getbasetemp()
    from cpu_kernels.build import cache_dir

    # The kernels built for the user (named by their sources, flags and CPU: never stale) come along, so that a
    # developer's run does not build them again.
    users_kernels, run_kernels = cache_dir(), shared / "jvllm-cache" / "cpu_kernels"
    run_kernels.mkdir(parents=True, exist_ok=True)
    for library in users_kernels.glob("*.so") if users_kernels.is_dir() else ():
        if not (run_kernels / library.name).exists():
            shutil.copyfile(library, run_kernels / f".{library.name}.{os.getpid()}")
            os.replace(run_kernels / f".{library.name}.{os.getpid()}", run_kernels / library.name)
    os.environ["JVLLM_CACHE_DIR"] = str(shared / "jvllm-cache")


@pytest.fixture(scope="session", autouse=True)
def _jvllm_cache() -> pathlib.Path:
    """The run's cache folder (pytest_configure); this process compiles everything itself, its subprocesses use
    the folder's persistent compilation cache."""
    from jvllm.worker.compile_cache import disable_in_this_process

    disable_in_this_process()
    return pathlib.Path(os.environ["JVLLM_CACHE_DIR"])


@pytest.fixture(scope="module", autouse=True)
def _earlier_heap_frozen() -> None:
    """Before each test file: collect, then freeze what is alive (imports, session fixtures, earlier files' caches)
    out of the cyclic collector's reach. Every engine start in a library caller's process runs one full collection
    (jvllm.collector.settle_heap), which in a test process walks everything the run has built: ~0.75 s per engine
    a third of the way through the suite, a fifth of some files' time. Frozen, the collection walks only what the
    current file made; a file's engines stay collectable (nothing they build is frozen before the file ends)."""
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="session")
def default_engine(_jvllm_cache):
    """SmolLM2-135M-Instruct in float32 everywhere (no bf16 batched copy: its numbers are compared with
    transformers'), the default attention backend, shared by every test that only reads it."""
    from jvllm import Engine

    return Engine(dtype="float32", kv_cache_memory_bytes=256 << 20, max_num_seqs=32, max_model_len=2048,
                  precompile=False)  # shapes compile when first met; tests/jvllm/test_no_compile.py covers precompiling


@pytest.fixture(scope="session")
def smollm_tokenizer_dir(default_engine, tmp_path_factory) -> pathlib.Path:
    """The default model's tokenizer saved as an HF folder, reused by the tiny random models."""
    folder = tmp_path_factory.mktemp("smollm-tokenizer")
    default_engine.get_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_model_factory(smollm_tokenizer_dir, tmp_path_factory):
    """make(kind, **overrides) -> folder of a tiny random transformers model (safetensors + tokenizer).

    kind is 'llama', 'qwen2' or 'mistral'. The vocabulary is the SmolLM2 tokenizer's (49152)."""
    import shutil

    import torch
    import transformers

    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }
    made: dict[tuple, pathlib.Path] = {}

    def make(kind: str, **overrides) -> pathlib.Path:
        key = (kind, tuple(sorted(overrides.items(), key=lambda kv: kv[0])).__repr__())
        if key in made:
            return made[key]
        config_cls, model_cls = classes[kind]
        settings = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
        settings.update(overrides)
        torch.manual_seed(0)
        model = model_cls(config_cls(**settings)).eval()
        folder = tmp_path_factory.mktemp(f"tiny-{kind}")
        model.save_pretrained(folder)
        for item in smollm_tokenizer_dir.iterdir():
            shutil.copy(item, folder / item.name)
        made[key] = folder
        return folder

    return make


@pytest.fixture(scope="session")
def hf_smollm(_jvllm_cache):
    """transformers' own reading of the default model's GGUF, in float32 (the test oracle). That reading takes ~30 s
    on 2 cores (transformers parses the GGUF's metadata in Python), so the first process to make it stores the
    result (config and weights, as read) in the run's cache and the others load it from there."""
    import fcntl

    import safetensors.torch
    import torch
    import transformers

    from jvllm.model_loader.default_model import default_model_path

    path = pathlib.Path(default_model_path())
    stored = _jvllm_cache / "test-oracles" / f"{path.stem}-{path.stat().st_size}-transformers-float32"
    stored.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{stored}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another worker may be writing it
        if stored.is_dir():
            config = transformers.AutoConfig.from_pretrained(stored)
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            safetensors.torch.load_model(model, stored / "model.safetensors")
            return model.eval()
        model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                                  dtype=torch.float32)
        partial = stored.with_name(stored.name + ".partial")
        partial.mkdir(exist_ok=True)
        model.config.to_json_file(partial / "config.json")
        safetensors.torch.save_model(model, str(partial / "model.safetensors"))  # the tied lm_head stored once
        partial.rename(stored)
        return model.eval()


# Each test file's seconds in a main-leg run on the 2-core CI machine (ci/file_durations.py writes it). With
# `--dist loadfile` each file goes whole to the next free worker in the order given here (`--no-loadscope-reorder`
# in pyproject.toml keeps xdist from reordering by test count), so the longest go first and the last to run are
# short: neither worker is left running a long file alone at the end.
FILE_SECONDS: dict[str, float] = json.loads((pathlib.Path(__file__).parent / "file_durations.json").read_text())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = pathlib.Path(str(config.rootpath)).resolve()
    file_of = {item.nodeid: pathlib.Path(str(item.fspath)).resolve().relative_to(root).as_posix() for item in items}
    tests_in = collections.Counter(file_of.values())

    def rank(item: pytest.Item) -> tuple[float, int, str]:
        """The timed files longest first, then the others (the GPU-versions leg's) by their number of tests."""
        name = file_of[item.nodeid]
        return -FILE_SECONDS.get(name, 0.0), -tests_in[name], name

    items.sort(key=rank)  # stable: a file's tests keep their order
    for item in items:
        if _kernel_leg_file(pathlib.Path(str(item.fspath))):
            item.add_marker(pytest.mark.extended)


def _kernel_leg_file(path: pathlib.Path) -> bool:
    """The Pallas kernels' own tests, which ci/gpu_versions_leg.sh runs on jax 0.12.1 (and 0.11.2)
    (test_pallas_engine.py, the kernels inside the engine on the default model, is the exception: that leg leaves it
    out)."""
    return path.parent.name == "pallas_kernels" and path.name != "test_pallas_engine.py"
