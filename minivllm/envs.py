"""vLLM's `envs` module: environment variables by name, parsed at each access (`envs.X`).

Two tables. `environment_variables`: the variables minivllm reads through this module, with
their defaults (other modules still read their own `MINIVLLM_*` / timeout variables directly).
`_FIXED`: vLLM switches that vLLM's files read but for which minivllm has one behaviour only
(the feature is absent); they always give that value, and a set variable that asks otherwise
is reported once instead of being silently believed.
"""

import os
from collections.abc import Callable
from typing import Any

from minivllm.logger import init_logger

logger = init_logger(__name__)


def _flag(name: str, default: bool) -> Callable[[], bool]:
    return lambda: os.environ.get(name, "1" if default else "0").strip().lower() in ("1", "true")


def _str(name: str, default: str | None = None) -> Callable[[], str | None]:
    return lambda: os.environ.get(name, default)


def _gib(name: str) -> float:
    """A non-negative number of GiB (unset: 0); ValueError naming the variable otherwise."""
    text = os.environ.get(name, "0").strip() or "0"
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"{name} must be a non-negative number of GiB, got {text!r}.")
    return value


def _seconds(name: str, default: float) -> float:
    """A positive number of seconds (unset: `default`); ValueError naming the variable."""
    text = os.environ.get(name, "").strip()
    try:
        value = float(text) if text else default
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise ValueError(f"{name} must be a positive number of seconds, got {text!r}.")
    return value


def _choice(name: str, choices: tuple[str, ...]) -> str:
    """One of `choices` (unset: the first); ValueError naming them otherwise."""
    value = os.environ.get(name, choices[0]).strip().lower() or choices[0]
    if value not in choices:
        raise ValueError(f"{name} must be {', '.join(choices[:-1])} or {choices[-1]}, got "
                         f"{value!r}.")
    return value


environment_variables: dict[str, Callable[[], Any]] = {
    # "a,b,...": layers per pipeline stage (distributed/utils.py get_pp_indices)
    "VLLM_PP_LAYER_PARTITION": _str("VLLM_PP_LAYER_PARTITION"),
    # the server's /v1/load_lora_adapter and /v1/unload_lora_adapter routes
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING": _flag("VLLM_ALLOW_RUNTIME_LORA_UPDATING", False),
    # vLLM's: the server adds its development routes (/reset_prefix_cache, /collective_rpc,
    # /server_info); never on a server others can reach
    "VLLM_SERVER_DEV_MODE": _flag("VLLM_SERVER_DEV_MODE", False),
    # vLLM's torch profiler: traces of LLM.start_profile() .. stop_profile() (and the server's
    # /start_profile, /stop_profile) go to this folder, one per rank
    "VLLM_TORCH_PROFILER_DIR": _str("VLLM_TORCH_PROFILER_DIR"),
    "VLLM_TORCH_PROFILER_RECORD_SHAPES": _flag("VLLM_TORCH_PROFILER_RECORD_SHAPES", False),
    "VLLM_TORCH_PROFILER_WITH_STACK": _flag("VLLM_TORCH_PROFILER_WITH_STACK", True),
    # the server's API key when --api-key is not given
    "VLLM_API_KEY": _str("VLLM_API_KEY"),
    # KV-cache GiB per rank on CPU when --kv-cache-memory-bytes is not given; 0: the default
    "VLLM_CPU_KVCACHE_SPACE": lambda: _gib("VLLM_CPU_KVCACHE_SPACE"),
    # /v1/responses keeps responses (store=true) for GET, previous_response_id and background
    "VLLM_ENABLE_RESPONSES_API_STORE": _flag("VLLM_ENABLE_RESPONSES_API_STORE", False),
    # seconds between the server's "Avg prompt throughput ..." log lines (--disable-log-stats)
    "VLLM_LOG_STATS_INTERVAL": lambda: _seconds("VLLM_LOG_STATS_INTERVAL", 10.0),
    # GGUF weights in the x8 layout: auto / 1 (wherever its kernels are built), 0 (never)
    "MINIVLLM_GGUF_X8": lambda: _choice("MINIVLLM_GGUF_X8", ("auto", "0", "1")),
}

# name -> (the only value minivllm has, why)
_FIXED: dict[str, tuple[Any, str]] = {
    "VLLM_USE_AOT_COMPILE": (False, "no ahead-of-time compile cache"),
    "VLLM_USE_BYTECODE_HOOK": (False, "torch.compile runs without vLLM's bytecode hook"),
    "VLLM_BATCH_INVARIANT": (False, "no batch-invariant kernels"),
    "VLLM_ROCM_USE_AITER": (False, "no ROCm / AITER kernels"),
    "VLLM_USE_DEEP_GEMM": (False, "no DeepGEMM kernels"),
    "VLLM_DCP_Q_REPLICATE": (False, "no decode context parallelism"),
    # Token threshold of Cohere2-MoE's attention / MoE dual stream: 0 turns it off.
    "VLLM_COHERE2_ATTN_MOE_DUAL_STREAM_TOKEN_THRESHOLD": (
        0, "no attention / MoE dual stream (the MoE runs inline, on one stream)"),
}
_reported: set[str] = set()


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return environment_variables[name]()
    if name in _FIXED:
        value, why = _FIXED[name]
        if name in os.environ and name not in _reported and \
                _flag(name, False)() != value:
            _reported.add(name)
            logger.warning("%s=%s is ignored: minivllm has %s.", name, os.environ[name], why)
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r} (known: "
                         f"{', '.join(sorted([*environment_variables, *_FIXED]))})")


def __dir__() -> list[str]:
    return sorted([*environment_variables, *_FIXED])


def is_set(name: str) -> bool:
    """Whether the variable is set in the environment (vLLM's `envs.is_set`)."""
    if name not in environment_variables and name not in _FIXED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return name in os.environ
