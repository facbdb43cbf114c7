"""`PoolingMetadata`: vLLM's per-step description of the prompts a pooler pools.

minivllm's pooling runner (worker/pooling.py) calls a pooler with `(hidden_states, prompt_lens)`
and builds no `PoolingMetadata`; the class is here for the type hints of vLLM's model files and
for code that wants the same two facts in one object.
"""

from dataclasses import dataclass

import torch


@dataclass
class PoolingMetadata:
    prompt_lens: torch.Tensor                        # int64 [B], CPU: each prompt's tokens
    prompt_token_ids_cpu: torch.Tensor | None = None  # [B, max_len], right-padded, or None

    def get_prompt_token_ids_cpu(self) -> list[torch.Tensor]:
        """Each prompt's ids, unpadded; ValueError when they were not given."""
        if self.prompt_token_ids_cpu is None:
            raise ValueError("this PoolingMetadata was built without prompt token ids")
        return [ids[:n] for ids, n in zip(self.prompt_token_ids_cpu, self.prompt_lens.tolist())]


__all__ = ["PoolingMetadata"]
