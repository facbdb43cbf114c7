"""Sleep mode on one rank (vLLM's `LLM.sleep` / `wake_up`): between uses, an engine gives back
the memory its KV cache (level 1) and its weights too (level 2) hold, and takes them back on
`wake_up`.

vLLM, on a GPU, copies the weights to host memory at level 1; minivllm's CPU ranks already keep
them there, so level 1 frees the KV cache only (CUDA ranks move the weights to the host and
back). Level 2 drops the model: `wake_up` rebuilds it from the checkpoint (vLLM leaves the
memory to be refilled by a weight update; reloading first makes either use correct). The
cache's contents are gone after any sleep: the engine resets its prefix cache before sleeping.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import sys
from typing import Any

import torch

from minivllm.config import CompilationMode
from minivllm.logger import init_logger

logger = init_logger(__name__)
SLEEP_TAGS = ("weights", "kv_cache")


class SleepState:
    """What a rank has let go of: a subset of SLEEP_TAGS, and where level-1 weights went."""

    def __init__(self) -> None:
        self.asleep: set[str] = set()
        self.weights_device: torch.device | None = None   # CUDA weights parked on the host


def sleep(runner: Any, state: SleepState, level: int) -> None:
    """Frees the rank's KV cache; level 1 parks CUDA weights on the host, level 2 drops the
    model (and its draft head, LoRA wrappers, CPU graphs)."""
    _release_kv_cache(runner)
    state.asleep.add("kv_cache")
    if level == 2:
        _drop_model(runner)
        state.asleep.add("weights")
    elif runner.device.type != "cpu":
        runner.model.to("cpu")
        state.weights_device = runner.device
    gc.collect()
    _return_freed_heap()


def wake_up(runner: Any, state: SleepState, tags: list[str] | None) -> None:
    """Takes back what `tags` name (None: all): weights first, then the KV cache (whose layers
    a rebuilt model registers anew)."""
    tags = list(SLEEP_TAGS) if tags is None else tags
    if "weights" in tags:
        if "weights" in state.asleep:
            runner.load_model()
            state.asleep.discard("weights")
            logger.info("Woke up: the model was reloaded from its checkpoint")
        elif state.weights_device is not None:
            runner.model.to(state.weights_device)
            state.weights_device = None
    if "kv_cache" in tags and "kv_cache" in state.asleep:
        if "weights" in state.asleep:
            raise ValueError("wake_up(tags=['kv_cache']) needs the weights awake first: the "
                             "cache belongs to the model's attention layers (level 2 dropped "
                             "them); wake up 'weights' before, or both at once")
        runner.initialize_kv_cache(runner.num_blocks)
        state.asleep.discard("kv_cache")


def _release_kv_cache(runner: Any) -> None:
    """Every attention layer's cache becomes an empty tensor; graphs (which point into the
    cache) go with it. `initialize_kv_cache(num_blocks)` builds both again."""
    for layer in runner.attn_layers.values():
        cache = layer.kv_cache
        if isinstance(cache, torch.Tensor):
            layer.bind_kv_cache(torch.empty(0, dtype=cache.dtype, device=cache.device))
    runner.cpu_graphs = None
    graphs = getattr(runner.drafter, "graphs", None)
    if graphs is not None:
        runner.drafter.graphs = None


def _drop_model(runner: Any) -> None:
    """Forgets the model and everything built on it, including the layers registered in the
    static forward context (a rebuilt model registers its own under the same names)."""
    runner.model = None
    runner.drafter = None
    runner.lora_manager = None
    runner.pooling = None
    runner.static_layers.clear()
    if runner.vllm_config.compilation_config.mode != CompilationMode.NONE:
        torch._dynamo.reset()      # compiled graphs hold the old parameters


def _return_freed_heap() -> None:
    """glibc keeps freed small-block memory for reuse; `malloc_trim` hands it back, so the
    freed cache and weights leave the process's resident set (elsewhere: nothing to do)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass
