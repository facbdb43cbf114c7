"""Custom logits processors, as vLLM's `vllm.v1.sample.logits_processor`.

A user loads them with `LLM(..., logits_processors=[MyProcessor])` (classes, or
"module:Class" / "module.Class" names; `--logits-processors` on the CLI), or installs a package
that declares them under the `minivllm.logits_processors` entry-point group. Each worker builds
one instance per class (`build_logitsprocs`); requests configure them through
`SamplingParams.extra_args` (the server's `vllm_xargs`), which each class checks in
`validate_params` before the request is queued. As in vLLM, pooling models and speculative
decoding take no custom processors.
"""

from __future__ import annotations

import inspect
from abc import abstractmethod
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from minivllm.logits_process import LogitsProcessor as RequestLogitsProcessor
from minivllm.plugins import load_plugins_by_group
from minivllm.sampling_params import SamplingParams
from minivllm.utils.import_utils import resolve_obj_by_qualname
from minivllm.v1.sample.logits_processor.interface import (AddedRequest, BatchUpdate,
                                                           LogitsProcessor, MovedRequest,
                                                           MoveDirectionality, RemovedRequest)
from minivllm.v1.sample.logits_processor.state import (LogitsProcessorBatch, LogitsProcessors,
                                                       LogitsProcsStep, process_dict_updates)

if TYPE_CHECKING:
    from minivllm.config import VllmConfig

__all__ = ["AdapterLogitsProcessor", "AddedRequest", "BatchUpdate", "LOGITSPROCS_GROUP",
           "LogitsProcessor", "LogitsProcessorBatch", "LogitsProcessors", "LogitsProcsStep",
           "MoveDirectionality", "MovedRequest", "RemovedRequest", "build_logitsprocs",
           "check_logitsprocs_supported", "load_custom_logitsprocs", "process_dict_updates"]

LOGITSPROCS_GROUP = "minivllm.logits_processors"
STR_POOLING_REJECTS_LOGITSPROCS = "Pooling models do not support custom logits processors."
STR_SPEC_DEC_REJECTS_LOGITSPROCS = ("Custom logits processors are not supported when "
                                    "speculative decoding is enabled.")


class AdapterLogitsProcessor(LogitsProcessor):
    """Runs per-request functions (`minivllm.logits_process.LogitsProcessor`: (output_ids,
    logits_row) or (prompt_ids, output_ids, logits_row) -> logits_row) as a batch processor.
    Subclasses give `new_req_logits_processor(params)` and `is_argmax_invariant()`; one that
    overrides `__init__` must call this one."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        self.req_info: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {}   # batch index ->

    @abstractmethod
    def new_req_logits_processor(self, params: SamplingParams) -> RequestLogitsProcessor | None:
        """The function for a request with these params, or None (its row is left alone)."""
        raise NotImplementedError

    def _new_state(self, params: SamplingParams, prompt_ids: list[int],
                   output_ids: list[int]) -> Callable[[torch.Tensor], torch.Tensor] | None:
        func = self.new_req_logits_processor(params)
        if func is None:
            return None
        # NOTE: the output list is the request's live one, so the bound call sees new tokens.
        if len(inspect.signature(func).parameters) == 3:
            return partial(func, prompt_ids, output_ids)
        return partial(func, output_ids)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.req_info, batch_update, self._new_state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, func in self.req_info.items():
            logits[index] = func(logits[index])
        return logits


def load_custom_logitsprocs(specs: Sequence[str | type] | None) -> list[type[LogitsProcessor]]:
    """The classes of the installed entry points, then of `specs` (classes, or "module:Class" /
    "module.Class" names). ValueError naming an entry that is not a LogitsProcessor class."""
    found = [(f"entry point {name!r}", obj)
             for name, obj in load_plugins_by_group(LOGITSPROCS_GROUP).items()]
    if specs is not None and (isinstance(specs, (str, type)) or not isinstance(specs, Sequence)):
        raise ValueError("logits_processors must be a list of LogitsProcessor classes or "
                         f"'module:Class' names, got {specs!r}.")
    found += [(repr(spec), _resolve(spec)) for spec in specs or ()]
    for where, obj in found:
        if not (isinstance(obj, type) and issubclass(obj, LogitsProcessor)):
            raise ValueError(f"Logits processor {where} is not a subclass of minivllm.v1.sample."
                             "logits_processor.LogitsProcessor (wrap a per-request function "
                             "with AdapterLogitsProcessor).")
    return [obj for _, obj in found]


def _resolve(spec: Any) -> Any:
    if isinstance(spec, type):
        return spec
    if not isinstance(spec, str):
        raise ValueError(f"Logits processor {spec!r}: give a LogitsProcessor class or its "
                         "'module:Class' / 'module.Class' name.")
    try:
        return resolve_obj_by_qualname(spec)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ValueError(f"Cannot load logits processor {spec!r}: {exc}") from None


def check_logitsprocs_supported(vllm_config: VllmConfig) -> list[type[LogitsProcessor]]:
    """The configured classes; ValueError (vLLM's messages) for a pooling model or speculative
    decoding, which take none. The engine calls this before any worker starts."""
    classes = load_custom_logitsprocs(getattr(vllm_config.model_config, "logits_processors",
                                              None))
    if classes and vllm_config.model_config.runner_type == "pooling":
        raise ValueError(STR_POOLING_REJECTS_LOGITSPROCS)
    if classes and vllm_config.speculative_config is not None:
        raise ValueError(STR_SPEC_DEC_REJECTS_LOGITSPROCS)
    return classes


def build_logitsprocs(vllm_config: VllmConfig, device: torch.device,
                      is_pin_memory: bool = False) -> LogitsProcessorBatch | None:
    """One instance of every configured class, in the batch a runner feeds them; None when
    there are none (the sampler then runs as before)."""
    classes = check_logitsprocs_supported(vllm_config)
    if not classes:
        return None
    instances = []
    for cls in classes:
        try:
            instances.append(cls(vllm_config, device, is_pin_memory))
        except TypeError as exc:   # e.g. an abstract method left out
            raise ValueError(f"Cannot build logits processor {cls.__name__}: {exc}") from exc
    return LogitsProcessorBatch(LogitsProcessors(instances))
