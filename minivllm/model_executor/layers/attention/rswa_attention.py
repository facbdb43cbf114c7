"""`RSWAAttention`: vLLM's reference-sliding-window layer, refused unless the window is off."""

from typing import Any

from minivllm.model_executor.layers.attention.attention import Attention


class RSWAAttention(Attention):
    """Attention whose cache manager would evict blocks between a fixed prefix and a trailing
    window (`rswa_window > 0`); minivllm has no such manager, so only window 0 (plain
    attention) is accepted."""

    def __init__(self, *args: Any, rswa_window: int, **kwargs: Any) -> None:
        if rswa_window > 0:
            raise NotImplementedError(f"reference sliding-window attention (rswa_window="
                                      f"{rswa_window}) is not supported; use rswa_window=0")
        super().__init__(*args, **kwargs)
        self._rswa_window = rswa_window
