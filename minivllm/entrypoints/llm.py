"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))` and `.chat(messages)`."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from minivllm.beam_search import BeamSearchOutput, run_beam_search
from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.llm_engine import LLMEngine
from minivllm.inputs import PromptType, is_token_ids
from minivllm.lora.request import LoRARequest
from minivllm.entrypoints.score_utils import (cosine_similarity, cross_encoding_ids, score_kind,
                                              score_pairs)
from minivllm.outputs import (ClassificationRequestOutput, EmbeddingRequestOutput,
                              PoolingRequestOutput, RequestOutput, ScoringOutput,
                              ScoringRequestOutput)
from minivllm.pooling_params import PoolingParams
from minivllm.sampling_params import BeamSearchParams, SamplingParams
from minivllm.transformers_utils.chat_template import (chat_template_arguments, chat_token_ids,
                                                      normalize_messages, resolve_content_format)
from minivllm.v1.metrics.reader import Metric

if TYPE_CHECKING:
    import torch

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

    def get_metrics(self) -> list[Metric]:
        """The engine's metrics now (vLLM's reader types: `Counter`, `Gauge`, `Vector` from
        `minivllm.v1.metrics.reader`), e.g. speculative decoding's acceptance counts."""
        return self.llm_engine.get_metrics()

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation-config defaults (vLLM's; what `generate`
        and `chat` use when given none)."""
        return SamplingParams(**self.vllm_config.model_config.get_diff_sampling_param())

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 priority: list[int] | None = None) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the order of the prompts.

        `lora_request`: one adapter for every prompt, or a list with one (or None) per prompt;
        `priority`: one per prompt, lower first (needs `scheduling_policy="priority"`).
        """
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = list(sampling_params) if isinstance(sampling_params, Sequence) \
            else [sampling_params] * len(prompt_list)
        if not all(isinstance(p, SamplingParams) for p in params_list):
            raise ValueError("sampling_params must be a SamplingParams or a list with one per "
                             f"prompt, got {type(sampling_params).__name__}.")
        if len(params_list) != len(prompt_list):
            raise ValueError(f"Got {len(prompt_list)} prompts but {len(params_list)} sampling params; "
                             "give one SamplingParams or one per prompt.")
        lora_list = _per_prompt_loras(lora_request, len(prompt_list))
        if priority is not None and len(priority) != len(prompt_list):
            raise ValueError(f"Got {len(prompt_list)} prompts but {len(priority)} priorities; "
                             "give one per prompt.")
        return self._run(prompt_list, params_list, lora_list, use_tqdm, priority)

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                    use_tqdm: bool = False, concurrency_limit: int | None = None
                    ) -> list[BeamSearchOutput]:
        """vLLM's beam search (`minivllm.beam_search`): per prompt the best `beam_width`
        sequences, best first (`.sequences[i].tokens` include the prompt, `.text` is all of
        them decoded, `.cum_logprob`). `concurrency_limit`: prompts searched at once (all)."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}.")
        if concurrency_limit is not None and concurrency_limit < 1:
            raise ValueError(f"concurrency_limit must be >= 1 or None, got {concurrency_limit}.")
        prompt_list = _as_prompt_list(prompts)
        ids = [self.llm_engine.tokenize_prompt(p) for p in prompt_list]
        limit = self.llm_engine.max_model_len
        for i, prompt_ids in enumerate(ids):   # the last step's requests hold n + max_tokens - 1
            if len(prompt_ids) + params.max_tokens - 1 > limit:
                raise ValueError(f"Prompt {i} has {len(prompt_ids)} tokens: with max_tokens="
                                 f"{params.max_tokens} its beams would pass max_model_len="
                                 f"{limit}.")
        loras = _per_prompt_loras(lora_request, len(ids))

        def step(tokens: list[list[int]], step_params: SamplingParams,
                 step_loras: list[Any]) -> list[RequestOutput]:
            return self._run(tokens, [step_params] * len(tokens), step_loras, use_tqdm)

        def decode(tokens: list[int]) -> str:
            return self.tokenizer.decode(tokens) if self.tokenizer is not None else ""

        chunk = concurrency_limit or max(len(ids), 1)
        return [out for i in range(0, len(ids), chunk) for out in run_beam_search(
            step, ids[i:i + chunk], params, self.llm_engine.eos_token_id, decode,
            loras[i:i + chunk])]

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             use_tqdm: bool = True,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None,
             chat_template_content_format: str = "auto") -> list[RequestOutput]:
        """Apply the tokenizer's chat template to each conversation, then generate (vLLM's
        options: `continue_final_message` continues the last assistant message, `tools` go to
        the template, `chat_template_kwargs` are extra template variables such as Qwen3's
        `enable_thinking`, `chat_template_content_format` auto / string / openai: whether
        contents reach the template as text or as lists of parts)."""
        conversations = messages if messages and isinstance(messages[0], (list, tuple)) \
            else [messages]
        prompts = [self.apply_chat_template(
            c, add_generation_prompt, chat_template, continue_final_message=continue_final_message,
            tools=tools, chat_template_kwargs=chat_template_kwargs,
            chat_template_content_format=chat_template_content_format) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm,
                             lora_request=lora_request)

    def apply_chat_template(self, conversation: list[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            chat_template: str | None = None, **options: Any) -> list[int]:
        """The conversation's prompt token ids; `options`: continue_final_message, tools,
        chat_template_kwargs (as `chat`)."""
        if chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("This tokenizer has no chat template; pass chat_template=...")
        content_format = resolve_content_format(
            options.pop("chat_template_content_format", "auto"),
            chat_template or self.tokenizer.chat_template)
        # the server's OpenAI message rules
        conversation = normalize_messages(conversation, content_format)
        kwargs = chat_template_arguments(add_generation_prompt, **options)
        try:
            return chat_token_ids(self.tokenizer, conversation, chat_template=chat_template,
                                  **kwargs)
        except Exception as exc:   # jinja2 errors, raise_exception() in templates, ...
            raise ValueError(f"The chat template failed on these messages: {exc}") from exc

    def add_lora(self, lora_request: LoRARequest) -> bool:
        return self.llm_engine.add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self.llm_engine.remove_lora(lora_id)

    def list_loras(self) -> set[int]:
        return self.llm_engine.list_loras()

    def collective_rpc(self, method: str | Callable[..., Any], timeout: float | None = None,
                       args: tuple = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        """vLLM's: runs a Worker method (by name) or `method(worker, *args, **kwargs)` on every
        rank (functions, lambdas too, travel to worker processes with cloudpickle); returns
        the results in rank order. An error on a rank is raised here; the engine goes on."""
        return self.llm_engine.collective_rpc(method, timeout, args, kwargs)

    def apply_model(self, func: Callable[[torch.nn.Module], Any]) -> list[Any]:
        """vLLM's: `func(model)` on every rank's model (its TP shard, its PP stage)."""
        return self.collective_rpc("apply_model", args=(func,))

    def start_profile(self) -> None:
        """vLLM's: the torch profiler runs on every rank until `stop_profile`, which writes
        one trace per rank into VLLM_TORCH_PROFILER_DIR (open it in Perfetto or TensorBoard)."""
        self.llm_engine.start_profile()

    def stop_profile(self) -> None:
        self.llm_engine.stop_profile()

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode (needs `enable_sleep_mode=True`): level 1 frees the KV cache,
        level 2 the weights too; requests are refused until `wake_up`. ValueError while
        requests run."""
        self.llm_engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Takes back the weights (reloaded after level 2) and / or the KV cache: `tags` from
        "weights", "kv_cache" (None: both; the weights must wake first)."""
        self.llm_engine.wake_up(tags)

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached KV block (vLLM's); False, with nothing done, while requests
        hold blocks."""
        return self.llm_engine.reset_prefix_cache()

    def embed(self, prompts: PromptType | Sequence[PromptType],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              *, use_tqdm: bool = True,
              lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
              ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (`.outputs.embedding`), in the order of the prompts; needs a
        pooling model (`runner="pooling"`, with `convert="embed"` for a causal LM)."""
        return [EmbeddingRequestOutput.from_base(o) for o in self.encode(
            prompts, PoolingParams() if pooling_params is None else pooling_params,
            use_tqdm=use_tqdm, lora_request=lora_request)]

    def classify(self, prompts: PromptType | Sequence[PromptType],
                 pooling_params: PoolingParams | None = None, *, use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[ClassificationRequestOutput]:
        """Class probabilities per prompt (`.outputs.probs`) of a sequence-classification model
        (`*ForSequenceClassification`, or a causal LM with `convert="classify"`)."""
        params = dataclasses.replace(pooling_params or PoolingParams(), task="classify")
        return [ClassificationRequestOutput.from_base(o) for o in self.encode(
            prompts, params, use_tqdm=use_tqdm, lora_request=lora_request)]

    def score(self, data_1: str | list[str], data_2: str | list[str], /, *,
              truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
              lora_request: LoRARequest | None = None) -> list[ScoringRequestOutput]:
        """Relevance of each (data_1, data_2) pair (one data_1 against each data_2, or pairwise):
        a cross-encoder's probability, or the cosine of an embedding model's vectors."""
        kind = score_kind(self.vllm_config.model_config)
        pairs = score_pairs(data_1, data_2)
        params = PoolingParams(truncate_prompt_tokens=truncate_prompt_tokens,
                               task="classify" if kind == "cross-encoder" else "embed")
        if kind == "cross-encoder":
            prompts = [{"prompt_token_ids": cross_encoding_ids(self.tokenizer, a, b)}
                       for a, b in pairs]
            return [ScoringRequestOutput(o.request_id, ScoringOutput(float(o.outputs.data[0])),
                                         o.prompt_token_ids)
                    for o in self.encode(prompts, params, use_tqdm=use_tqdm,
                                         lora_request=lora_request)]
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))   # each embedded once
        outputs = dict(zip(texts, self.encode(texts, params, use_tqdm=use_tqdm,
                                              lora_request=lora_request)))
        return [ScoringRequestOutput(outputs[b].request_id, ScoringOutput(cosine_similarity(
            outputs[a].outputs.data, outputs[b].outputs.data)), outputs[b].prompt_token_ids)
            for a, b in pairs]

    def encode(self, prompts: PromptType | Sequence[PromptType],
               pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
               *, use_tqdm: bool = True,
               lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
               ) -> list[PoolingRequestOutput]:
        """The pooler's output per prompt (`.outputs.data`: `[H]`, or `[n, H]` for ALL pooling);
        `lora_request` as in `generate`."""
        prompt_list = _as_prompt_list(prompts)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            pooling_params = [pooling_params or PoolingParams(task="encode")] * len(prompt_list)
        if len(pooling_params) != len(prompt_list):
            raise ValueError(f"Got {len(prompt_list)} prompts but {len(pooling_params)} pooling "
                             "params; give one PoolingParams or one per prompt.")
        loras = _per_prompt_loras(lora_request, len(prompt_list))
        return self._run(prompt_list, pooling_params, loras, use_tqdm)

    def _run(self, prompts: list[PromptType], params: list[Any], loras: list[LoRARequest | None],
             use_tqdm: bool, priority: list[int] | None = None) -> list[Any]:
        """Adds one request per prompt, then steps the engine until all finish. A prompt the
        engine refuses aborts those added before it (as vLLM does), then raises."""
        request_ids: list[str] = []
        try:
            for i, (prompt, request_params, lora) in enumerate(zip(prompts, params, loras)):
                request_id = str(next(self._counter))
                self.llm_engine.add_request(request_id, prompt, request_params, lora_request=lora,
                                            priority=priority[i] if priority else 0)
                request_ids.append(request_id)
        except BaseException:
            self.llm_engine.abort_request(request_ids)
            raise
        # A bar only for batches long enough to watch.
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
    if not isinstance(prompts, Iterable):
        raise ValueError(f"prompts must be a string, a list of token ids, a prompt dict, or a "
                         f"list of these; got {type(prompts).__name__}.")
    prompts = list(prompts)
    if prompts and is_token_ids(prompts):   # one token-id prompt
        return [prompts]
    return prompts
