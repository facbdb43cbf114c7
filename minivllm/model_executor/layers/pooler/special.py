"""Poolers that wrap others: `DispatchPooler` (one per task), `IdentityPooler`, `BgeM3Pooler`,
`BOSEOSFilter`."""

from collections.abc import Mapping

import torch
import torch.nn as nn

from minivllm.config import PoolerConfig
from minivllm.model_executor.layers.pooler.abstract import Pooler
from minivllm.model_executor.layers.pooler.common import (ClassifierFn, PoolingParamsUpdate,
                                                          PromptLens)
from minivllm.model_executor.layers.pooler.seqwise import (ActivationFn, SequencePoolingFn,
                                                           SequencePoolingMethod,
                                                           pooler_for_classify, pooler_for_embed)
from minivllm.model_executor.layers.pooler.tokwise import pooler_for_token_embed


class DispatchPooler(Pooler):
    """vLLM 0.33's holder of one pooler per pooling task ("embed", "classify", "token_embed",
    ...), which its model files build. minivllm's pooling engine runs one task per model, so
    `forward` is the pooler of `task` (by default the first), and the factories build only the
    task the engine runs: `for_embedding` "token_embed" when the config pools ALL tokens, else
    "embed"; `for_seq_cls` "classify"."""

    def __init__(self, poolers_by_task: Mapping[str, nn.Module], task: str | None = None) -> None:
        nn.Module.__init__(self)
        if not poolers_by_task:
            raise ValueError("DispatchPooler needs at least one pooler")
        for name, pooler in poolers_by_task.items():
            # A combined key ("embed&token_classify") names a pooler that serves both at once.
            if isinstance(pooler, Pooler) and "&" not in name \
                    and name not in pooler.get_supported_tasks():
                raise ValueError(f"{type(pooler).__name__} does not support task {name!r}; it "
                                 f"supports {sorted(pooler.get_supported_tasks())}")
        self.poolers_by_task = nn.ModuleDict(dict(poolers_by_task))
        self.task = task or next(iter(poolers_by_task))
        if self.task not in self.poolers_by_task:
            raise ValueError(f"no pooler for task {self.task!r}; have {sorted(poolers_by_task)}")

    @classmethod
    def for_embedding(cls, pooler_config: PoolerConfig) -> "DispatchPooler":
        if pooler_config.tok_pooling_type is not None:
            return cls({"token_embed": pooler_for_token_embed(pooler_config)})
        return cls({"embed": pooler_for_embed(pooler_config)})

    @classmethod
    def for_seq_cls(cls, pooler_config: PoolerConfig, *,
                    pooling: SequencePoolingMethod | SequencePoolingFn | None = None,
                    classifier: ClassifierFn | None = None, act_fn: ActivationFn | None = None
                    ) -> "DispatchPooler":
        """Logits `[B, num_labels]` of `classifier` on each sequence's pooled state (`pooling`,
        else the config's sequence pooling type, else LAST)."""
        return cls({"classify": pooler_for_classify(pooler_config, pooling=pooling,
                                                    classifier=classifier, act_fn=act_fn)})

    def get_supported_tasks(self) -> set[str]:
        return set(self.poolers_by_task)

    def get_pooling_updates(self, task: str) -> PoolingParamsUpdate:
        return self.poolers_by_task[task].get_pooling_updates(task)

    def forward(self, hidden_states: torch.Tensor, prompt_lens: PromptLens
                ) -> torch.Tensor | list[torch.Tensor]:
        return self.poolers_by_task[self.task](hidden_states, prompt_lens)


class IdentityPooler(Pooler):
    """The hidden states as they are (`[T, H]`)."""

    def __init__(self) -> None:
        nn.Module.__init__(self)

    def get_supported_tasks(self) -> set[str]:
        return {"plugin"}

    def forward(self, hidden_states: torch.Tensor, prompt_lens: PromptLens) -> torch.Tensor:
        return hidden_states


class BOSEOSFilter(Pooler):
    """vLLM's filter of BOS / EOS rows from a token pooler's output. It reads each prompt's
    token ids, which minivllm's pooling runner does not pass: it builds (model files construct
    it for BGE-M3's token tasks) but refuses to run."""

    def __init__(self, pooler: Pooler, bos_token_id: int = -1, eos_token_id: int = -1) -> None:
        nn.Module.__init__(self)
        self.pooler = pooler
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id

    def get_supported_tasks(self) -> set[str]:
        return self.pooler.get_supported_tasks()

    def get_pooling_updates(self, task: str) -> PoolingParamsUpdate:
        return PoolingParamsUpdate(requires_token_ids=True)

    def forward(self, hidden_states: torch.Tensor, prompt_lens: PromptLens) -> list[torch.Tensor]:
        raise NotImplementedError("BOSEOSFilter needs the prompts' token ids, which minivllm's "
                                  "pooling runner does not pass; supported token tasks are "
                                  "unfiltered AllPool poolers")


class BgeM3Pooler(Pooler):
    """BGE-M3's combined task: each sequence's embedding and its per-token scores, flattened and
    concatenated into one vector (`[H + n_i * C]`)."""

    def __init__(self, token_classify_pooler: Pooler, embed_pooler: Pooler) -> None:
        nn.Module.__init__(self)
        self.token_classify_pooler = token_classify_pooler
        self.embed_pooler = embed_pooler

    def get_supported_tasks(self) -> set[str]:
        return {"embed&token_classify"}

    def get_pooling_updates(self, task: str) -> PoolingParamsUpdate:
        return (self.embed_pooler.get_pooling_updates("embed")
                | self.token_classify_pooler.get_pooling_updates("token_classify"))

    def forward(self, hidden_states: torch.Tensor, prompt_lens: PromptLens) -> list[torch.Tensor]:
        embeds = self.embed_pooler(hidden_states, prompt_lens)                  # [B, H]
        token_scores = self.token_classify_pooler(hidden_states, prompt_lens)   # B x [n_i, C]
        return [torch.cat([e.reshape(-1), t.reshape(-1)]) for e, t in zip(embeds, token_scores)]


__all__ = ["BOSEOSFilter", "BgeM3Pooler", "DispatchPooler", "IdentityPooler"]
