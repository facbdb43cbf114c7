"""What check-model checks: the config, the model class (registry or a file) and the built model."""

import contextlib
import importlib.util
import json
import os
import sys
import tempfile
import types
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch.nn as nn

from minivllm.config import LoadConfig, ModelConfig, ParallelConfig, VllmConfig
from minivllm.distributed import ensure_model_parallel_initialized
from minivllm.model_executor.model_loader.utils import initialize_model
from minivllm.model_executor.model_loader.weight_utils import get_quant_config
from minivllm.model_executor.models.registry import ModelRegistry
from minivllm.plugins import load_general_plugins
from minivllm.transformers_utils.config import is_gguf, patch_rope_parameters

from .vllm_file import imports_vllm, port_vllm_source

# Out-of-tree files load inside the models package, so a copy of an in-tree model file (whose
# imports are relative: `from .utils import ...`) loads unchanged.
_FILE_MODULE_PACKAGE = "minivllm.model_executor.models"


@dataclass
class CheckTarget:
    """The model under check: where it came from, its config, its class."""

    model: str                       # MODEL as given (folder, .gguf or config.json)
    vllm_config: VllmConfig
    model_class: type[nn.Module]
    architecture: str
    class_ref: str                   # "module:Class"
    checkpoint_dir: str | None       # a HF folder with weights (numerics needs one)
    config_only: bool = False        # MODEL was a bare config.json: dummy weights
    notes: list[str] = field(default_factory=list)


def make_target(model: str, *, model_file: str | None = None, arch: str | None = None,
                load_format: str = "auto", quantization: str | None = None,
                dtype: str = "auto", seed: int = 0) -> CheckTarget:
    """Resolve MODEL and the class to check; the config is built for one process (TP = PP = 1)."""
    load_general_plugins()
    model = os.path.expanduser(model)
    config_only = os.path.isfile(model) and os.path.basename(model).endswith(".json")
    if config_only:
        model_config = ModelConfig(model=os.path.dirname(os.path.abspath(model)),
                                   hf_config=_config_from_json(model), dtype=dtype, seed=seed,
                                   quantization=quantization)
        load_format = "dummy"
    elif os.path.isdir(model) or is_gguf(model):
        model_config = ModelConfig(model=model, dtype=dtype, seed=seed, quantization=quantization)
    else:
        raise ValueError(f"MODEL {model!r} must be a HF checkpoint folder, a .gguf file or a "
                         "config.json file")
    load_config = LoadConfig(load_format=load_format)
    vllm_config = VllmConfig(model_config=model_config, load_config=load_config,
                             parallel_config=ParallelConfig())
    vllm_config.quant_config = get_quant_config(model_config, load_config, "cpu")
    model_class, architecture, class_ref = _resolve_class(model_config, model_file, arch)
    checkpoint_dir = model if os.path.isdir(model) and load_format != "dummy" else None
    return CheckTarget(model, vllm_config, model_class, architecture, class_ref, checkpoint_dir,
                       config_only)


def load_model_file(spec: str) -> type[nn.Module]:
    """`path/to/file.py:ClassName` -> the class (the file is imported once per path). A file
    written for vLLM (`from vllm... import`) is ported as it loads (`vllm_file.py`)."""
    path, sep, class_name = spec.rpartition(":")
    if not sep or not path.endswith(".py") or not class_name:
        raise ValueError(f"--model-file expects path/to/file.py:ClassName, got {spec!r}")
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(path):
        raise ValueError(f"--model-file: no such file {path!r}")
    module = _import_model_file(path)
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        names = sorted(n for n, v in vars(module).items()
                       if isinstance(v, type) and issubclass(v, nn.Module))
        raise ValueError(f"{path} has no nn.Module class {class_name!r}; its classes: {names}")
    return cls


def _import_model_file(path: str) -> types.ModuleType:
    """The module of the file at `path`, inside minivllm's models package."""
    stem = os.path.splitext(os.path.basename(path))[0]
    module_name = f"{_FILE_MODULE_PACKAGE}._checked_{stem}_{zlib.crc32(path.encode()):08x}"
    module = sys.modules.get(module_name)
    if module is not None:
        return module
    file_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(file_spec)
    sys.modules[module_name] = module
    try:
        with open(path) as f:
            source = f.read()
        if imports_vllm(source):
            source = port_vllm_source(source, lambda name: _sibling(path, name))
        exec(compile(source, path, "exec"), module.__dict__)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


def _sibling(path: str, name: str) -> str | None:
    """The module name of `<name>.py` beside `path`, imported (None when there is none)."""
    sibling = os.path.join(os.path.dirname(path), f"{name}.py")
    return _import_model_file(sibling).__name__ if os.path.isfile(sibling) else None


class DuplicateRecorder(dict):
    """A `static_forward_context` that lets a second layer register under a taken name (so
    the rest of the model still builds and every other check runs) and remembers it."""

    def __init__(self) -> None:
        super().__init__()
        self.duplicates: list[str] = []

    def __contains__(self, name: object) -> bool:
        if dict.__contains__(self, name):
            self.duplicates.append(str(name))
        return False

    def __setitem__(self, name: str, layer: object) -> None:
        if not dict.__contains__(self, name):
            dict.__setitem__(self, name, layer)


def build_model(target: CheckTarget) -> tuple[nn.Module, DuplicateRecorder]:
    """The model with no weights loaded, built the way the loader builds it (one rank)."""
    ensure_model_parallel_initialized(1, 1)
    context = DuplicateRecorder()
    target.vllm_config.compilation_config.static_forward_context = context
    model = initialize_model(target.vllm_config, model_class=target.model_class)
    return model, context


@contextlib.contextmanager
def registered_as(arch: str, model_class: type[nn.Module]) -> Iterator[None]:
    """`arch` resolves to `model_class` inside (an engine built here uses it); restored after."""
    previous = ModelRegistry.models.get(arch)
    ModelRegistry.register_model(arch, model_class)
    try:
        yield
    finally:
        if previous is None:
            ModelRegistry.models.pop(arch, None)
        else:
            ModelRegistry.models[arch] = previous


_PLUGIN_MODULE = "minivllm_check_model_file"
_PLUGIN_SOURCE = """
def register():
    # check-model's temporary general plugin: every worker rank loads the --model-file class.
    from minivllm import ModelRegistry
    from minivllm.entrypoints.check_model.build import load_model_file

    ModelRegistry.register_model({arch!r}, load_model_file({spec!r}))
"""


@contextlib.contextmanager
def model_file_plugin(spec: str, arch: str) -> Iterator[None]:
    """Worker processes started inside see a general plugin that registers `arch` as the
    `--model-file` class: a temporary distribution on PYTHONPATH, as an installed plugin."""
    with tempfile.TemporaryDirectory(prefix="check_model_plugin_") as folder:
        with open(os.path.join(folder, f"{_PLUGIN_MODULE}.py"), "w") as f:
            f.write(_PLUGIN_SOURCE.format(arch=arch, spec=os.path.abspath(spec.rpartition(":")[0])
                                          + ":" + spec.rpartition(":")[2]))
        info = os.path.join(folder, f"{_PLUGIN_MODULE}-0.dist-info")
        os.mkdir(info)
        with open(os.path.join(info, "METADATA"), "w") as f:
            f.write(f"Metadata-Version: 2.1\nName: {_PLUGIN_MODULE}\nVersion: 0\n")
        with open(os.path.join(info, "entry_points.txt"), "w") as f:
            f.write(f"[minivllm.general_plugins]\n{_PLUGIN_MODULE} = {_PLUGIN_MODULE}:register\n")
        saved = {k: os.environ.get(k) for k in ("PYTHONPATH", "VLLM_PLUGINS")}
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (folder, saved["PYTHONPATH"]) if p)
        if saved["VLLM_PLUGINS"] is not None:     # a selection must include this plugin
            os.environ["VLLM_PLUGINS"] = f"{saved['VLLM_PLUGINS']},{_PLUGIN_MODULE}"
        try:
            yield
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


def small_cache(target: CheckTarget, max_model_len: int = 256) -> dict[str, int]:
    """Engine arguments for a check's short run: a short context and a KV cache just for it."""
    length = min(target.vllm_config.model_config.max_model_len, max_model_len)
    block_size = 16
    return {"max_model_len": length, "block_size": block_size,
            "num_gpu_blocks_override": -(-length // block_size) + 1}


def _resolve_class(model_config: ModelConfig, model_file: str | None,
                   arch: str | None) -> tuple[type[nn.Module], str, str]:
    archs = model_config.architectures
    if model_file is not None:
        if arch is not None:
            raise ValueError("pass either --model-file or --arch, not both")
        cls = load_model_file(model_file)
        return cls, (archs[0] if archs else cls.__name__), model_file
    cls, found = ModelRegistry.resolve_model_cls([arch] if arch else archs, model_config)
    return cls, found, f"{cls.__module__}:{cls.__qualname__}"


def _config_from_json(path: str):
    """A transformers config from a config.json alone (its `model_type` picks the class)."""
    from transformers import AutoConfig

    with open(path) as f:
        fields = json.load(f)
    model_type = fields.pop("model_type", None)
    if model_type is None:
        raise ValueError(f"{path} has no model_type; it is not a transformers config.json")
    config = AutoConfig.for_model(model_type, **fields)
    patch_rope_parameters(config)
    return config
