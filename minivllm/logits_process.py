"""vLLM's per-request logits processor type (`vllm.logits_process`): a function of one request's
tokens and its logits row `[V]`, returning the new row. `AdapterLogitsProcessor` runs them."""

from __future__ import annotations

from collections.abc import Callable

import torch

# (output token ids, logits [V]) -> logits, or (prompt ids, output ids, logits [V]) -> logits
LogitsProcessor = (Callable[[list[int], torch.Tensor], torch.Tensor]
                   | Callable[[list[int], list[int], torch.Tensor], torch.Tensor])
