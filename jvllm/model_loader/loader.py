"""Resolves a model reference (None, short name, HF folder, .gguf) and builds the Flax model with its weights."""
from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jvllm.model_loader.float_weights import cast_float_matrices, load_float_weights, takes_matrix_dtype
from jvllm.model_loader.read_progress import weight_bar
from jvllm.model_loader.tokenizer_loading import load_tokenizer
from jvllm.model_loader.vision import complete_config, is_vision_language, load_vision, split_tensors
from models.config import EncoderConfig, ModelConfig
from models.layers import is_float_matrix
from models.registry import config_from_hf, model_class_for

logger = logging.getLogger("jvllm")

_DTYPES = {"float32": jnp.float32, "float": jnp.float32, "bfloat16": jnp.bfloat16,
           "float16": jnp.float16, "half": jnp.float16}


@dataclasses.dataclass
class LoadedModel:
    """A ready model: its config, NNX graphdef/state split once, tokenizer and served name."""

    config: ModelConfig | EncoderConfig
    graphdef: Any
    state: Any
    tokenizer: Any
    served_name: str
    dtype: Any
    folder: Path | None = None  # the HF folder it came from (a GGUF's converted folder)
    mesh: Any = None  # the tensor-parallel jax.sharding.Mesh the weights are sharded over (None: one device)
    vision: Any = None  # a vision-language model's vision side (jvllm.model_loader.vision.VisionModel)

    @property
    def tensor_parallel_size(self) -> int:
        return 1 if self.mesh is None else self.mesh.shape["tp"]

    @property
    def is_encoder(self) -> bool:
        """A bidirectional encoder: embeds, never generates, needs no KV pool."""
        return self.config.is_encoder

    @property
    def is_cross_encoder(self) -> bool:
        """A sequence-pair classifier: scores pairs, neither embeds nor generates."""
        return bool(getattr(self.config, "is_cross_encoder", False))

    @property
    def arrays(self) -> list[jax.Array]:
        """Every weight array it holds (GGUF blocks as stored), the vision side's included."""
        leaves = jax.tree.leaves(self.state) + (jax.tree.leaves(self.vision.state) if self.vision else [])
        return [a for a in leaves if isinstance(a, jax.Array)]

    @property
    def weight_bytes(self) -> int:
        return sum(int(a.nbytes) for a in self.arrays)

    def drop_float_matrices(self) -> None:
        """Keep only the shapes of the language model's float matrices (an engine whose steps all read a copy of
        them in another dtype): their memory is freed once nothing else holds them."""
        self.state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype) if is_float_matrix(a) else a,
                                  self.state)

    @property
    def keeps_blocks(self) -> bool:
        """Whether some weights are GGUF blocks (uint8) rather than floats."""
        return any(a.dtype == jnp.uint8 for a in jax.tree.leaves(self.state))

    @property
    def has_bf16_matrices(self) -> bool:
        """Whether the float matrices were loaded in bfloat16 beside a float32 model (`matrix_dtype_at_load`)."""
        return self.dtype == jnp.float32 and any(is_float_matrix(a) and a.dtype == jnp.bfloat16
                                                 for a in jax.tree.leaves(self.state))


def resolve_dtype(dtype: str | Any) -> Any:
    """'auto' is float32 on CPU (bf16 single-row matmuls are slow there) and bfloat16 on accelerators."""
    if not isinstance(dtype, str):
        return jnp.dtype(dtype)
    if dtype == "auto":
        return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def cache_root() -> Path:
    return Path(os.environ.get("JVLLM_CACHE_DIR", Path.home() / ".cache" / "jvllm"))


def resolve_model_path(model: str | None) -> tuple[str, str]:
    """-> (path of an HF folder or .gguf file, served model name)."""
    from jvllm.model_loader.default_model import DEFAULT_MODEL_NAME, default_model_path
    from jvllm.model_loader.embedded_models import embedded_model_names, embedded_model_path, find_embedded_model

    if model is None or model == DEFAULT_MODEL_NAME:
        return default_model_path(), DEFAULT_MODEL_NAME
    embedded = find_embedded_model(model) if not Path(model).expanduser().exists() else None
    if embedded is not None:
        return embedded_model_path(embedded), embedded.name
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return str(path), path.stem
    if path.is_dir() and (path / "config.json").is_file():
        return str(path), path.name
    raise ValueError(
        f"model {model!r} not found: give a local Hugging Face folder containing config.json, a .gguf file, "
        f"or a known name ({', '.join([DEFAULT_MODEL_NAME, *embedded_model_names()])}); "
        "nothing is downloaded from a model hub"
    )


def _converted_folder(gguf_path: str) -> Path:
    """An HF-style folder holding a GGUF's dequantized weights, keyed by the file's identity."""
    stat = os.stat(gguf_path)
    key = hashlib.sha256(f"{os.path.abspath(gguf_path)}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_root() / "converted" / f"{Path(gguf_path).stem}-{key}"


def _gguf_as_hf_folder(gguf_path: str, tokenizer_required: bool = True, weights: bool = True) -> Path:
    """Convert a GGUF once into a cached folder: config and tokenizer, and with `weights` the dequantized weights as
    safetensors; later starts reuse it. With `tokenizer_required=False` (an explicit tokenizer folder is given) a
    tokenizer kind the GGUF reader cannot rebuild is skipped instead of raising."""
    folder = _converted_folder(gguf_path)
    if not (folder / "config.json").is_file():
        _convert_gguf_metadata(gguf_path, folder, tokenizer_required)
    if weights and not (folder / "model.safetensors").is_file():
        _convert_gguf_weights(gguf_path, folder)
    if tokenizer_required and not (folder / "tokenizer_config.json").is_file():
        from jvllm.model_loader.gguf import gguf_tokenizer

        # converted earlier without one: this raises the error naming the tokenizer kind
        gguf_tokenizer(gguf_path).save_pretrained(folder)
    return folder


def transformers_folder(model: str | None = None) -> str:
    """A folder transformers' `from_pretrained` loads with the same weights as jvllm: a Hugging Face folder as is;
    for a GGUF file (the default model) the converted folder in jvllm's cache, its weights dequantized to float32
    on first use (the engine itself serves GGUF weights from their blocks and writes no such copy)."""
    path, _ = resolve_model_path(model)
    return str(_gguf_as_hf_folder(path)) if path.endswith(".gguf") else path


def _convert_gguf_metadata(gguf_path: str, folder: Path, tokenizer_required: bool) -> None:
    from jvllm.model_loader.gguf import gguf_tokenizer, open_gguf, read_gguf_config
    from jvllm.model_loader.gguf_index import INDEX_FILE, write_index

    header = open_gguf(gguf_path)
    config = read_gguf_config(header)  # an unsupported architecture fails here, before any work
    try:
        tokenizer = gguf_tokenizer(header)
    except ValueError as error:
        if tokenizer_required:
            raise
        logger.info("not converting the GGUF tokenizer (%s); using the tokenizer given", error)
        tokenizer = None
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    write_index(header, gguf_path, tmp / INDEX_FILE)  # loading the blocks then parses nothing
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    if folder.exists():  # another process finished the same conversion first
        shutil.rmtree(tmp)
    else:
        os.replace(tmp, folder)


def _convert_gguf_weights(gguf_path: str, folder: Path) -> None:
    from safetensors.numpy import save_file

    from jvllm.model_loader.gguf import load_gguf_tensors

    logger.info("dequantizing %s into %s (first float start only)", gguf_path, folder)
    partial = folder / f"model.safetensors.tmp{os.getpid()}"
    save_file({k: np.ascontiguousarray(v) for k, v in load_gguf_tensors(gguf_path).items()}, str(partial))
    os.replace(partial, folder / "model.safetensors")  # atomic: a concurrent converter writes the same file


def keeps_gguf_blocks(quantization: str | None, dtype: Any, tensor_parallel_size: int, load_format: str) -> bool:
    """Whether a GGUF model keeps its quantized blocks: always with quantization="gguf"; by default (None) when its
    dtype is "auto", on one device, on CPU with the native kernels (llama.cpp's way); otherwise it is dequantized to
    its float dtype (`dtype="float32"` gives transformers' float32 numbers)."""
    if quantization not in (None, "gguf"):
        raise ValueError(f"unknown quantization {quantization!r} for a GGUF model; choose gguf (keep its blocks) or "
                         "leave it unset")
    if quantization == "gguf":
        if tensor_parallel_size != 1:
            raise ValueError("quantization='gguf' runs on one device; use tensor_parallel_size=1, or leave "
                             "quantization unset to dequantize the weights")
        return load_format != "dummy"
    if dtype != "auto" or tensor_parallel_size != 1 or load_format == "dummy" or jax.default_backend() != "cpu":
        return False
    from models.quantized import native_kernel_available

    return native_kernel_available()


def check_quantization(quantization: str | None, is_gguf: bool, name: str, tensor_parallel_size: int) -> None:
    """ValueError unless `quantization` suits the model: gguf for GGUF files, int8 (or fp8 off CPU) for float
    checkpoints."""
    from jvllm.model_loader.quantize_weights import QUANTIZATIONS, storage_format

    if quantization is None or (is_gguf and quantization == "gguf"):
        return
    if quantization == "gguf":
        raise ValueError(f"quantization='gguf' needs a GGUF model; {name} is a float checkpoint (quantization='int8' "
                         "quantizes it at load)")
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; choose gguf (a GGUF model's own blocks) or "
                         f"{', '.join(QUANTIZATIONS)} (a float checkpoint quantized at load)")
    if is_gguf:
        raise ValueError(f"quantization={quantization!r} quantizes a float checkpoint; {name} is a GGUF file, which "
                         "keeps its own blocks (quantization='gguf' or unset)")
    if tensor_parallel_size != 1:
        raise ValueError(f"quantization={quantization!r} runs on one device; use tensor_parallel_size=1")
    storage_format(quantization)  # refuses fp8 on CPU before any weight is read


def read_safetensors(folder: Path) -> dict[str, np.ndarray]:
    from safetensors import safe_open

    files = sorted(glob.glob(str(folder / "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in {folder}")
    tensors: dict[str, np.ndarray] = {}
    with weight_bar(sum(os.path.getsize(file) for file in files)) as bar:
        for file in files:
            with safe_open(file, framework="flax") as f:
                for name in f.keys():
                    tensors[name] = np.asarray(f.get_tensor(name))
                    bar.update(tensors[name].nbytes)
    return tensors


def abstract_module(model_cls: Any, config: Any, dtype: Any) -> Any:
    """The module with every parameter a jax.ShapeDtypeStruct, for loading weights into. `rngs=None` makes the
    random initializers return shapes only: SmolLM2 in 0.13 s instead of 1.0-1.2 s of tracing them."""
    return nnx.eval_shape(lambda: model_cls(config, dtype, None))


def load_model(model: str | None = None, *, dtype: str | Any = "auto", load_format: str = "auto",
               tokenizer: str | None = None, served_model_name: str | None = None, seed: int = 0,
               tensor_parallel_size: int = 1, mm_processor_kwargs: dict[str, Any] | None = None,
               quantization: str | None = None, matrix_dtype: Any = None) -> LoadedModel:
    """Load config, tokenizer and weights (or random weights with load_format='dummy'). With
    tensor_parallel_size > 1 the weights are placed shard by shard on a mesh (jvllm.parallel.sharding) and
    the returned config holds the KV heads the model really has (repeated when tp exceeds them).
    `mm_processor_kwargs`: a vision-language model's image-processor settings (jvllm.model_loader.vision).
    `quantization`: a GGUF model keeps its quantized blocks as `keeps_gguf_blocks` says; a float checkpoint with
    "int8" or "fp8" has its projections and embeddings quantized at load, in the format of the backend
    (jvllm.model_loader.quantize_weights). `matrix_dtype`: a float decoder's weight matrices in this dtype rather
    than `dtype` (an engine whose steps read them only in that dtype; float_weights.takes_matrix_dtype)."""
    if load_format not in ("auto", "safetensors", "gguf", "dummy"):
        raise ValueError(f"unknown load_format {load_format!r}; choose auto, safetensors, gguf or dummy")
    path, name = resolve_model_path(model)
    is_gguf = path.endswith(".gguf")
    logger.info("loading %s from %s", name, path)
    check_quantization(quantization, is_gguf, name, tensor_parallel_size)
    blocks = is_gguf and keeps_gguf_blocks(quantization, dtype, tensor_parallel_size, load_format)
    folder = _gguf_as_hf_folder(path, tokenizer_required=tokenizer is None, weights=not blocks) if is_gguf \
        else Path(path)
    hf_config = json.loads((folder / "config.json").read_text())
    multimodal = is_vision_language(hf_config)
    if multimodal:
        hf_config = complete_config(folder)
    config = config_from_hf(hf_config)
    model_cls = model_class_for(config.architecture)
    jdtype = resolve_dtype(dtype)
    tok = load_tokenizer(tokenizer or str(folder), folder, rebuilt=is_gguf and tokenizer is None)
    if tensor_parallel_size != 1:
        vision_tensors, text_names = None, None
        if multimodal and load_format != "dummy":
            vision_tensors, text_names = _vision_language_tensors(folder, hf_config)
        loaded = _load_sharded(config, model_cls, jdtype, folder, load_format, seed, tensor_parallel_size,
                               LoadedModel(config, None, None, tok, served_model_name or name, jdtype, folder),
                               text_names)
        if not multimodal:
            return loaded
        with jax.default_device(jax.local_devices(backend="cpu")[0]):  # the encoder runner replicates it on the mesh
            vision = load_vision(folder, hf_config, tok, jdtype, vision_tensors, seed, mm_processor_kwargs)
        return dataclasses.replace(loaded, vision=vision)
    if blocks:
        return _load_gguf_blocks(path, config, model_cls, jdtype, LoadedModel(
            config, None, None, tok, served_model_name or name, jdtype, folder))
    if not takes_matrix_dtype(config, matrix_dtype, blocks=blocks, quantization=quantization,
                              tensor_parallel_size=tensor_parallel_size):
        matrix_dtype = None
    vision_tensors = None
    if load_format == "dummy":
        module = model_cls(config, jdtype, nnx.Rngs(seed))
        if matrix_dtype is not None:
            cast_float_matrices(module, matrix_dtype)
    elif multimodal:
        vision_tensors, tensors = split_tensors(hf_config, read_safetensors(folder))
        module = abstract_module(model_cls, config, jdtype)
        module.load_hf_weights(tensors, jdtype, matrix_dtype)
    elif config.is_encoder:  # BERT-sized encoders read whole
        module = abstract_module(model_cls, config, jdtype)
        module.load_hf_weights(read_safetensors(folder), jdtype)
    else:
        module = abstract_module(model_cls, config, jdtype)
        load_float_weights(module, folder, jdtype, matrix_dtype)
    if quantization is not None:
        from jvllm.model_loader.quantize_weights import quantize_module

        logger.info("quantized %d tensors to %s at load", quantize_module(module, quantization), quantization)
    _fuse_projections(module)
    graphdef, state = nnx.split(module)
    vision = load_vision(folder, hf_config, tok, jdtype, vision_tensors, seed,
                         mm_processor_kwargs) if multimodal else None
    return LoadedModel(config, graphdef, state, tok, served_model_name or name, jdtype, folder, vision=vision)


def _fuse_projections(module: Any) -> None:
    """Each layer's q, k and v as one projection, and its MLP's gate and up, where they hold the same kind of
    weights (models.llama.fuse_projections; under tensor parallelism within each device's columns)."""
    from models.llama import fuse_projections

    attention, mlps = fuse_projections(module)
    if attention or mlps:
        logger.info("q, k and v as one projection in %d layers; gate and up in %d", attention, mlps)


def _load_gguf_blocks(path: str, config: Any, model_cls: Any, jdtype: Any, partial: LoadedModel) -> LoadedModel:
    from jvllm.model_loader.gguf_blocks import load_gguf_weights, read_gguf_weights
    from jvllm.model_loader.gguf_index import INDEX_FILE, indexed_gguf

    if not hasattr(model_cls, "set_quantized_embedding"):
        raise ValueError(f"{config.architecture} does not run on GGUF blocks; leave quantization unset")
    module = abstract_module(model_cls, config, jdtype)
    started = time.perf_counter()
    header = indexed_gguf(path, _converted_folder(path) / INDEX_FILE)
    logger.info("read the GGUF header (%d tensors) in %.2fs", len(header.tensors), time.perf_counter() - started)
    weights = read_gguf_weights(header)
    kept = load_gguf_weights(module, weights, jdtype)
    logger.info("kept %d tensors in their GGUF blocks (%.1f MB)", kept, weights.block_bytes / 1e6)
    _fuse_projections(module)
    graphdef, state = nnx.split(module)
    return dataclasses.replace(partial, graphdef=graphdef, state=state)


def _vision_language_tensors(folder: Path, hf_config: dict[str, Any]) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """A vision-language checkpoint under tensor parallelism: (the vision side's tensors, read whole, by canonical
    name; the language model's canonical names -> stored names, which the sharded loader reads slice by slice)."""
    from safetensors import safe_open

    files = sorted(glob.glob(str(folder / "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in {folder}")
    file_of: dict[str, str] = {}
    for file in files:
        with safe_open(file, framework="np") as f:
            file_of.update({name: file for name in f.keys()})
    vision_names, text_names = split_tensors(hf_config, {name: name for name in file_of})
    vision: dict[str, np.ndarray] = {}
    for file in files:
        wanted = {canonical: name for canonical, name in vision_names.items() if file_of[name] == file}
        if wanted:
            with safe_open(file, framework="flax") as f:
                vision.update({canonical: np.asarray(f.get_tensor(name)) for canonical, name in wanted.items()})
    return vision, text_names


def _load_sharded(config: Any, model_cls: Any, jdtype: Any, folder: Path, load_format: str, seed: int, tp: int,
                  partial: LoadedModel, names: dict[str, str] | None = None) -> LoadedModel:
    """Build the module abstractly and give each parameter its sharded array, read slice by slice. `names`: the
    tensors' stored names by the names the model reads (a vision-language checkpoint's language model)."""
    import contextlib

    from jvllm.parallel.mesh import make_mesh
    from jvllm.parallel.sharding import (RenamedSource, SafetensorsSource, TensorParallelPlan, hf_tensors,
                                         load_sharded)
    from models.hf_names import ArraySource

    if config.is_encoder:
        raise ValueError(f"tensor_parallel_size={tp}: encoder (embedding) models run on one device; "
                         "use tensor_parallel_size=1")
    plan = TensorParallelPlan.for_model(config, tp)
    mesh = make_mesh(tp)
    sharded_config = plan.model_config(config)
    module = abstract_module(model_cls, sharded_config, jdtype)
    with contextlib.ExitStack() as stack:
        if load_format == "dummy":  # the same random weights as tp=1, drawn on the host CPU
            with jax.default_device(jax.local_devices(backend="cpu")[0]):
                source = ArraySource(dict(hf_tensors(model_cls(config, jdtype, nnx.Rngs(seed)))))
        else:
            source = SafetensorsSource(folder, stack)
            source = source if names is None else RenamedSource(source, names)
        load_sharded(module, source, plan, mesh, jdtype)
    _fuse_projections(module)
    graphdef, state = nnx.split(module)
    return dataclasses.replace(partial, config=sharded_config, graphdef=graphdef, state=state, mesh=mesh)
