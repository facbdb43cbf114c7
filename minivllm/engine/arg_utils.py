"""EngineArgs: the flat user-facing knobs, turned into a VllmConfig; their CLI flags are generated.

Each field's default is written once, here; `add_cli_args` derives the flag (name, type, default,
help, choices, short aliases) from the field and its metadata.
"""

import argparse
import dataclasses
import json
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from minivllm.config import (CacheConfig, CompilationConfig, DeviceConfig, LoadConfig, LoRAConfig,
                             ModelConfig, ParallelConfig, SchedulerConfig,
                             StructuredOutputsConfig, VllmConfig)
from minivllm.config.cache import CACHE_DTYPES, MAMBA_CACHE_DTYPES
from minivllm.config.compilation import CompilationMode
from minivllm.config.load import LOAD_FORMATS
from minivllm.config.model import CONVERT_TYPES, RUNNER_TYPES
from minivllm.config.parallel import EXECUTOR_BACKENDS
from minivllm.config.scheduler import SCHEDULING_POLICIES
from minivllm.config.speculative import DRAFT_CHECKPOINT_METHODS, SpeculativeConfig, check_eagle_head
from minivllm.config.utils import check_config_keys
from minivllm.engine.model_defaults import (apply_class_pooling_default, check_pooling_model,
                                            prefix_caching, step_limits)
from minivllm.model_executor.layers.quantization import (QUANTIZATION_METHODS,
                                                         get_quantization_config)
from minivllm.model_executor.model_loader.weight_utils import get_quant_config
from minivllm.plugins import load_general_plugins
from minivllm.reasoning import ReasoningParserManager
from minivllm.transformers_utils.config import get_config
from minivllm.transformers_utils.tokenizer import TOKENIZER_MODES

_DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
_DEVICE_CHOICES = ("cpu", "cuda", "auto")


def _parse_json_object(value: str) -> dict[str, Any]:
    try:
        return _json_object("", json.loads(value))
    except (json.JSONDecodeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {value!r}") from None


def _json_object(name: str, value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object (a dict), got {value!r}.")
    return value


def _parse_compilation_config(value: str) -> int | dict[str, Any]:
    """`-O` / `--compilation-config`: a mode (0-3) or a JSON object of CompilationConfig fields."""
    if value.strip().isdigit():
        return int(value)
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        parsed = None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(
            f"expected a compilation mode ({', '.join(str(int(m)) for m in CompilationMode)}) "
            f"or a JSON object such as '{{\"mode\": 3}}', got {value!r}")
    return parsed


def _arg(default: Any, help: str, **flag: Any) -> Any:
    """A field whose metadata carries its flag's help and extras (aliases, choices, type)."""
    return field(default=default, metadata={"help": help, **flag})


@dataclass
class EngineArgs:
    model: str | None = _arg(None, "HF checkpoint folder or .gguf file "
                             "(default: the embedded SmolLM2-135M-Instruct)")
    tokenizer: str | None = _arg(None, "tokenizer folder (default: the model's)")
    dtype: str = _arg("auto", "activation (and unquantized weight) dtype; auto: the "
                      "checkpoint's half precision, bfloat16 for packed GGUF where the CPU has "
                      "native bf16, else float32", choices=_DTYPE_CHOICES)
    max_model_len: int | None = _arg(None, "longest sequence, prompt plus output "
                                     "(default: the model's max_position_embeddings)")
    seed: int = _arg(0, "random seed: random weights, the CLI's per-request sampling seed")
    max_logprobs: int = _arg(20, "most logprobs (or prompt logprobs) a request may ask; -1: "
                             "the vocabulary size")
    block_size: int = _arg(16, "tokens per KV-cache block")
    kv_cache_dtype: str = _arg("auto", "KV-cache dtype; auto: the model dtype; fp8 (= fp8_e4m3), "
                               "fp8_e5m2: a byte per value, unit scales", choices=CACHE_DTYPES)
    mamba_cache_dtype: str = _arg("auto", "recurrent layers' conv-state dtype (Mamba, short "
                                  "conv); auto: the model dtype", choices=MAMBA_CACHE_DTYPES)
    mamba_ssm_cache_dtype: str = _arg("auto", "Mamba SSM-state dtype; auto: "
                                      "--mamba-cache-dtype's", choices=MAMBA_CACHE_DTYPES)
    enable_prefix_caching: bool = _arg(True, "reuse the KV blocks of shared prompt prefixes")
    num_gpu_blocks_override: int | None = _arg(None, "fix the number of KV blocks "
                                               "(default: from --kv-cache-memory-bytes)")
    kv_cache_memory_bytes: int | None = _arg(None, "KV-cache budget per rank in bytes "
                                             "(default: VLLM_CPU_KVCACHE_SPACE GiB on CPU "
                                             "if set, else 1 GiB)")
    tensor_parallel_size: int = _arg(1, "tensor-parallel ranks", aliases=("-tp",))
    pipeline_parallel_size: int = _arg(1, "pipeline stages", aliases=("-pp",))
    enable_expert_parallel: bool = _arg(False, "MoE layers: split the experts over the tensor-"
                                        "parallel ranks instead of each expert's intermediate "
                                        "dimension")
    worker_extension_cls: str = _arg("", "a class ('module:Class') whose methods every worker "
                                     "gains, for collective_rpc")
    nnodes: int = _arg(1, "nodes of a multi-node run (or torchrun's environment)")
    node_rank: int = _arg(0, "this node's rank; nodes 1..nnodes-1 only host worker ranks")
    master_addr: str = _arg("127.0.0.1", "address where the ranks of all nodes meet")
    master_port: int | None = _arg(None, "port where the ranks meet (default: a free port on "
                                   "one node, 29501 on several)")
    max_num_seqs: int = _arg(128, "at most this many running requests")
    max_num_batched_tokens: int = _arg(2048, "token budget of a step, shared by decodes and "
                                       "prefill chunks")
    max_num_queued_requests: int = _arg(1024, "server: waiting sequences before HTTP 429")
    scheduling_policy: str = _arg("fcfs", "fcfs: arrival order; priority: requests' `priority` "
                                  "(lower first), then arrival", choices=SCHEDULING_POLICIES)
    # NOTE: the scheduler has one token budget and no prefill phase, so prefills are always
    # chunked; the field exists for vLLM's name and rejects False.
    enable_chunked_prefill: bool = _arg(True, "always on in minivllm (False is an error)")
    long_prefill_token_threshold: int = _arg(0, "schedule at most this many prompt tokens of a "
                                             "request per step (0: no cap)")
    enforce_eager: bool = _arg(True, "run the model eagerly; --no-enforce-eager (or --compile) "
                               "torch.compiles it (mode 3) unless --compilation-config sets a mode")
    compilation_config: dict[str, Any] | int | CompilationConfig | None = _arg(
        None, "compilation mode 0-3 or a JSON CompilationConfig, e.g. '{\"mode\": 3}'; "
        "overrides --enforce-eager", aliases=("-O",), type=_parse_compilation_config)
    load_format: str = _arg("auto", "how to read the weights", choices=LOAD_FORMATS)
    quantization: str | None = _arg(None, "weight quantization; default: the checkpoint's own "
                                    "(config.json, GGUF tensor types); fp8/int8/int4 quantize an "
                                    "unquantized checkpoint online; none: dequantise a GGUF file",
                                    aliases=("-q",), choices=[*QUANTIZATION_METHODS, "none"])
    device: str = _arg("cpu", "where the model runs; auto: cuda when available",
                       choices=_DEVICE_CHOICES)
    runner: str = _arg("auto", "generate text, or pool hidden states into embeddings; auto: "
                       "pooling for *Model architectures (LlamaModel), else generate",
                       choices=RUNNER_TYPES)
    convert: str = _arg("auto", "adapt the checkpoint for the pooling runner (embed: a causal "
                        "LM becomes an embedding model)", choices=CONVERT_TYPES)
    pooler_config: str | dict[str, Any] | None = _arg(
        None, "pooling models: JSON such as '{\"pooling_type\": \"MEAN\", \"normalize\": false}' "
        "(default: the checkpoint's sentence-transformers files, else LAST, normalised)", type=str)
    generation_config: str = _arg("auto", "requests' default sampling settings: auto (the "
                                  "checkpoint's generation_config.json), vllm (vLLM's defaults) "
                                  "or a folder holding a generation_config.json")
    override_generation_config: dict[str, Any] | None = _arg(
        None, "JSON laid over the generation config, e.g. '{\"temperature\": 0.5}'",
        type=_parse_json_object)
    enable_lora: bool = _arg(False, "serve LoRA adapters (requests name theirs by LoRARequest)")
    max_loras: int = _arg(1, "LoRA: most distinct adapters in one step (the slot table)")
    max_lora_rank: int = _arg(16, "LoRA: largest adapter rank accepted")
    max_cpu_loras: int | None = _arg(None, "LoRA: adapters kept loaded behind the slots, least "
                                     "recently used evicted first (default: max_loras)")
    reasoning_parser: str | None = _arg(None, "a reasoning model's parser: the server splits "
                                        "its reasoning from its content, and structured outputs "
                                        "apply once the reasoning ends",
                                        choices=sorted(ReasoningParserManager.reasoning_parsers))
    enable_prompt_embeds: bool = _arg(False, "accept prompts given as input embeddings "
                                      "(prompt_embeds) instead of token ids")
    trust_remote_code: bool = _arg(False, "let transformers run the checkpoint folder's own "
                                   "config and tokenizer code")
    tokenizer_mode: str = _arg("auto", "auto / hf: the fast tokenizer where there is one; "
                               "slow: the Python one", choices=TOKENIZER_MODES)
    skip_tokenizer_init: bool = _arg(False, "load no tokenizer: prompts as token ids, outputs "
                                     "without text")
    hf_overrides: dict[str, Any] | None = _arg(
        None, "JSON laid over the checkpoint's HF config, e.g. '{\"max_position_embeddings\": "
        "4096}' (LLM(hf_overrides=...) also takes a function config -> config)",
        type=_parse_json_object)
    gpu_memory_utilization: float = _arg(
        0.9, "CUDA: the share of the GPU's memory this engine may fill, the KV cache taking "
        "what the weights leave (when --kv-cache-memory-bytes is not set); CPU: unused, as in "
        "vLLM's CPU backend (VLLM_CPU_KVCACHE_SPACE or --kv-cache-memory-bytes size the cache)")
    distributed_executor_backend: str | None = _arg(
        None, "mp: a process per rank (the default with several); uni: this process (one rank)",
        choices=EXECUTOR_BACKENDS)
    enable_sleep_mode: bool = _arg(False, "allow LLM.sleep() / wake_up() (the server's /sleep "
                                   "and /wake_up in dev mode): free the KV cache, or the "
                                   "weights too, while idle")
    logits_processors: list[str | type] | None = _arg(
        None, "custom logits processors: LogitsProcessor classes as 'module:Class' names",
        type=str, nargs="+")
    speculative_config: dict[str, Any] | SpeculativeConfig | None = _arg(
        None, "speculative decoding as JSON, e.g. '{\"method\": \"ngram\", "
        "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}'", type=_parse_json_object)

    def create_engine_config(self) -> VllmConfig:
        """Validate every part once and assemble the VllmConfig."""
        load_general_plugins()     # a plugin may register the architecture asked for
        structured_outputs_config = StructuredOutputsConfig(
            reasoning_parser=self.reasoning_parser or "")
        if self.quantization not in (None, "none", *QUANTIZATION_METHODS):
            get_quantization_config(self.quantization)   # raises, listing the known names
        model_config = ModelConfig(model=self.model, tokenizer=self.tokenizer, dtype=self.dtype,
                                   max_model_len=self.max_model_len, seed=self.seed,
                                   max_logprobs=self.max_logprobs,
                                   quantization=self.quantization, runner=self.runner,
                                   convert=self.convert, pooler_config=self.pooler_config,
                                   generation_config=self.generation_config,
                                   logits_processors=self.logits_processors,
                                   enable_prompt_embeds=self.enable_prompt_embeds,
                                   enable_sleep_mode=self.enable_sleep_mode,
                                   trust_remote_code=self.trust_remote_code,
                                   tokenizer_mode=self.tokenizer_mode,
                                   skip_tokenizer_init=self.skip_tokenizer_init,
                                   hf_overrides=self.hf_overrides,
                                   override_generation_config=_json_object(
                                       "override_generation_config",
                                       self.override_generation_config))
        check_pooling_model(model_config)
        apply_class_pooling_default(model_config, self.pooler_config)
        budget, max_num_seqs = step_limits(model_config, self.max_num_batched_tokens,
                                            self.max_num_seqs)
        load_config = LoadConfig(load_format=self.load_format)
        device_config = DeviceConfig(self.device)
        return VllmConfig(
            model_config=model_config,
            cache_config=CacheConfig(block_size=self.block_size, cache_dtype=self.kv_cache_dtype,
                                     enable_prefix_caching=prefix_caching(
                                         self.enable_prefix_caching, model_config),
                                     num_gpu_blocks_override=self.num_gpu_blocks_override,
                                     kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                                     mamba_cache_dtype=self.mamba_cache_dtype,
                                     mamba_ssm_cache_dtype=self.mamba_ssm_cache_dtype,
                                     gpu_memory_utilization=self.gpu_memory_utilization),
            parallel_config=ParallelConfig(tensor_parallel_size=self.tensor_parallel_size,
                                           pipeline_parallel_size=self.pipeline_parallel_size,
                                           enable_expert_parallel=self.enable_expert_parallel,
                                           nnodes=self.nnodes, node_rank=self.node_rank,
                                           master_addr=self.master_addr,
                                           master_port=self.master_port,
                                           worker_extension_cls=self.worker_extension_cls,
                                           distributed_executor_backend=(
                                               self.distributed_executor_backend)),
            scheduler_config=SchedulerConfig(
                max_num_batched_tokens=max(budget, 1),
                max_num_seqs=max_num_seqs,
                max_num_queued_requests=self.max_num_queued_requests,
                policy=self.scheduling_policy,
                enable_chunked_prefill=self.enable_chunked_prefill,
                long_prefill_token_threshold=self.long_prefill_token_threshold),
            device_config=device_config,
            load_config=load_config,
            compilation_config=self._compilation_config(),
            quant_config=get_quant_config(model_config, load_config, device_config.device),
            lora_config=self._lora_config(),
            speculative_config=self._speculative_config(model_config, load_config,
                                                        device_config.device),
            structured_outputs_config=structured_outputs_config)

    def _speculative_config(self, model_config: ModelConfig, load_config: LoadConfig,
                            device: str) -> SpeculativeConfig | None:
        spec = self.speculative_config
        if spec is None or isinstance(spec, SpeculativeConfig):
            return spec
        spec = SpeculativeConfig.from_dict(spec)
        if model_config.runner_type == "pooling":
            raise ValueError("speculative_config applies to text generation; this engine runs "
                             "the pooling runner (embeddings, classification), which samples "
                             "no tokens")
        if spec.method in DRAFT_CHECKPOINT_METHODS:
            spec.draft_model_config = self._draft_model_config(spec, model_config)
            spec.draft_quant_config = get_quant_config(
                spec.draft_model_config, load_config, device)
        return spec

    def _draft_model_config(self, spec: SpeculativeConfig, target: ModelConfig) -> ModelConfig:
        """The draft's ModelConfig: its checkpoint at the target's dtype and length, the target's
        tokenizer and vocabulary. A draft model runs on one rank; an EAGLE head also with
        tensor parallelism (its layers sharded like the target's), not over pipeline stages."""
        one_rank = self.tensor_parallel_size * self.pipeline_parallel_size == 1
        if not one_rank and not (spec.use_eagle and self.pipeline_parallel_size == 1):
            where = "without pipeline stages" if spec.use_eagle else "on one rank"
            raise ValueError(f"speculative_config method {spec.method!r} runs {where}; got "
                             f"tensor_parallel_size={self.tensor_parallel_size}, "
                             f"pipeline_parallel_size={self.pipeline_parallel_size} (the ngram "
                             "method runs with any)")
        hf_config = None
        if spec.use_eagle:     # a head trained at a shorter length still drafts at any position
            hf_config = get_config(os.path.expanduser(spec.model))
            hf_config.max_position_embeddings = max(
                getattr(hf_config, "max_position_embeddings", 0) or 0, target.max_model_len)
        draft = ModelConfig(model=spec.model, tokenizer=target.tokenizer, dtype=target.dtype,
                            max_model_len=target.max_model_len, seed=self.seed,
                            quantization=spec.quantization, hf_config=hf_config)
        if spec.use_eagle:
            check_eagle_head(draft, target, spec.method)
        elif draft.get_vocab_size() != target.get_vocab_size():
            raise ValueError(f"The draft model's vocabulary ({draft.get_vocab_size()} tokens) "
                             f"differs from the target's ({target.get_vocab_size()}); a draft "
                             "model must share the target's tokenizer")
        return draft

    def _lora_config(self) -> LoRAConfig | None:
        if not self.enable_lora:
            return None
        return LoRAConfig(max_lora_rank=self.max_lora_rank, max_loras=self.max_loras,
                          max_cpu_loras=self.max_cpu_loras)

    def _compilation_config(self) -> CompilationConfig:
        """An explicit compilation_config wins; otherwise enforce_eager picks mode 0 or 3."""
        cc = self.compilation_config
        if isinstance(cc, CompilationConfig):
            return cc
        if cc is None or cc == {}:
            mode = CompilationMode.NONE if self.enforce_eager else CompilationMode.VLLM_COMPILE
            return CompilationConfig(mode=mode)
        if isinstance(cc, dict):
            check_config_keys(CompilationConfig, cc, "compilation_config")
            _check_mode(cc.get("mode", CompilationMode.NONE))
            return CompilationConfig(**cc)
        return CompilationConfig(mode=_check_mode(cc))

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Engine flags shared by `generate`, `chat`, `serve` and `bench`: one per field."""
        group = parser.add_argument_group("engine")
        hints = typing.get_type_hints(EngineArgs)
        for f in dataclasses.fields(EngineArgs):
            meta = dict(f.metadata)
            flags = [*meta.pop("aliases", ()), "--" + f.name.replace("_", "-")]
            kwargs: dict[str, Any] = {"dest": f.name, "default": f.default, "help": meta.pop("help")}
            if hints[f.name] is bool:
                kwargs["action"] = argparse.BooleanOptionalAction   # --x and --no-x
            else:
                kwargs["type"] = meta.pop("type", None) or _scalar_type(hints[f.name])
            action = group.add_argument(*flags, **kwargs, **meta)
            # NOTE: some Pythons' BooleanOptionalAction already appends the default itself.
            if f.default is not None and "%(default)" not in action.help:
                action.help += " (default: %(default)s)"
        group.add_argument("--compile", dest="enforce_eager", action="store_false",
                           help="the same as --no-enforce-eager: torch.compile the model (inductor)")
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineArgs":
        """`EngineArgs(**kwargs)`, but an unknown name is a ValueError listing the valid ones."""
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(kwargs) - set(names))
        if unknown:
            raise ValueError(f"Unknown engine argument(s) {', '.join(unknown)}; valid ones: "
                             f"{', '.join(names)}")
        return cls(**kwargs)


def apply_torchrun_env(engine_args: EngineArgs) -> EngineArgs:
    """Fill --nnodes/--node-rank/--master-addr/--master-port from torchrun's environment.

    torchrun (one process per node: `--nproc-per-node 1`) sets GROUP_RANK, GROUP_WORLD_SIZE,
    MASTER_ADDR and MASTER_PORT. Its own agent store already listens on MASTER_PORT, so the
    workers meet on MASTER_PORT + 1. Explicit --nnodes > 1 wins over the environment.
    """
    env = ParallelConfig.from_torchrun_env()
    if "nnodes" not in env and "GROUP_WORLD_SIZE" in os.environ:
        env["nnodes"] = int(os.environ["GROUP_WORLD_SIZE"])
    if engine_args.nnodes != 1 or env.get("nnodes", 1) == 1:
        return engine_args
    if "master_port" in env and "TORCHELASTIC_RUN_ID" in os.environ:
        env["master_port"] += 1
    return dataclasses.replace(engine_args, **env)


def _check_mode(mode: Any) -> int:
    valid = [int(m) for m in CompilationMode]
    if isinstance(mode, bool) or not isinstance(mode, int) or mode not in valid:
        raise ValueError(f"Unknown compilation mode {mode!r}; choose one of "
                         + ", ".join(f"{int(m)} ({m.name})" for m in CompilationMode))
    return mode


def _scalar_type(hint: Any) -> type:
    """`int | None` -> int: the type argparse converts the flag's text with."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


@dataclass
class AsyncEngineArgs(EngineArgs):
    """vLLM's name for the engine arguments `AsyncLLM.from_engine_args` takes (the same
    fields here: the server's own flags live in `minivllm serve`'s parser)."""
