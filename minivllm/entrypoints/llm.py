"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))` and `.chat(messages)`."""

import itertools
from collections.abc import Sequence
from typing import Any

from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.llm_engine import LLMEngine, PromptType
from minivllm.lora.request import LoRARequest
from minivllm.outputs import EmbeddingRequestOutput, PoolingRequestOutput, RequestOutput
from minivllm.pooling_params import PoolingParams
from minivllm.sampling_params import SamplingParams
from minivllm.transformers_utils.chat_template import chat_token_ids

_TQDM_MIN_REQUESTS = 8   # show a progress bar only for batches at least this long


class LLM:
    """An engine for offline batched generation (continuous batching under the hood)."""

    def __init__(self, model: str | None = None, *, tokenizer: str | None = None,
                 dtype: str = "auto", seed: int = 0, **kwargs: Any) -> None:
        self.engine_args = EngineArgs.from_kwargs(model=model, tokenizer=tokenizer, dtype=dtype,
                                                  seed=seed, **kwargs)
        self.llm_engine = LLMEngine.from_engine_args(self.engine_args)
        self.vllm_config = self.llm_engine.vllm_config
        self.tokenizer = self.llm_engine.tokenizer
        self._counter = itertools.count()

    @property
    def executor(self) -> Any:
        return self.llm_engine.executor

    def get_tokenizer(self):
        return self.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the order of the prompts.

        `lora_request`: one adapter for every prompt, or a list with one (or None) per prompt.
        """
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = list(sampling_params) if isinstance(sampling_params, Sequence) \
            else [sampling_params] * len(prompt_list)
        if len(params_list) != len(prompt_list):
            raise ValueError(f"Got {len(prompt_list)} prompts but {len(params_list)} sampling params; "
                             "give one SamplingParams or one per prompt.")
        lora_list = _per_prompt_loras(lora_request, len(prompt_list))
        ids = []
        for prompt, params, lora in zip(prompt_list, params_list, lora_list):
            request_id = str(next(self._counter))
            self.llm_engine.add_request(request_id, prompt, params, lora_request=lora)
            ids.append(request_id)
        # A bar only for batches long enough to watch.
        return self.llm_engine.run_until_finished(
            ids, use_tqdm=use_tqdm and len(ids) >= _TQDM_MIN_REQUESTS)

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | None = None, *, use_tqdm: bool = True,
             add_generation_prompt: bool = True, chat_template: str | None = None
             ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to each conversation, then generate."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [self.apply_chat_template(c, add_generation_prompt, chat_template)
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def apply_chat_template(self, conversation: list[dict[str, str]],
                            add_generation_prompt: bool = True,
                            chat_template: str | None = None) -> list[int]:
        if chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("This tokenizer has no chat template; pass chat_template=...")
        return chat_token_ids(self.tokenizer, conversation, chat_template=chat_template,
                              add_generation_prompt=add_generation_prompt)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        return self.llm_engine.add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self.llm_engine.remove_lora(lora_id)

    def list_loras(self) -> set[int]:
        return self.llm_engine.list_loras()

    def embed(self, prompts: PromptType | Sequence[PromptType],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              *, use_tqdm: bool = True,
              lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
              ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (`.outputs.embedding`), in the order of the prompts; needs a
        pooling model (`runner="pooling"`, with `convert="embed"` for a causal LM)."""
        return [EmbeddingRequestOutput.from_base(o) for o in self.encode(
            prompts, pooling_params, use_tqdm=use_tqdm, lora_request=lora_request)]

    def encode(self, prompts: PromptType | Sequence[PromptType],
               pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
               *, use_tqdm: bool = True,
               lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
               ) -> list[PoolingRequestOutput]:
        """The pooler's output per prompt (`.outputs.data`: `[H]`, or `[n, H]` for ALL pooling);
        `lora_request` as in `generate`."""
        prompt_list = _as_prompt_list(prompts)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            pooling_params = [pooling_params or PoolingParams()] * len(prompt_list)
        if len(pooling_params) != len(prompt_list):
            raise ValueError(f"Got {len(prompt_list)} prompts but {len(pooling_params)} pooling "
                             "params; give one PoolingParams or one per prompt.")
        loras = _per_prompt_loras(lora_request, len(prompt_list))
        request_ids = [str(next(self._counter)) for _ in prompt_list]
        for request_id, prompt, params, lora in zip(request_ids, prompt_list, pooling_params, loras):
            self.llm_engine.add_request(request_id, prompt, params, lora_request=lora)
        return self.llm_engine.run_until_finished(
            request_ids, use_tqdm=use_tqdm and len(request_ids) >= _TQDM_MIN_REQUESTS)

    def shutdown(self) -> None:
        engine = getattr(self, "llm_engine", None)   # None when __init__ failed
        if engine is not None:
            engine.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass


def _per_prompt_loras(lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
                      num_prompts: int) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    loras = list(lora_request)
    if len(loras) != num_prompts:
        raise ValueError(f"Got {num_prompts} prompts but {len(loras)} lora requests; give one "
                         "LoRARequest (or None) or one per prompt.")
    return loras


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) for p in prompts):   # one token-id prompt
        return [prompts]
    return prompts
