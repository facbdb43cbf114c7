"""`MambaBase` (vLLM's `mamba/abstract.py`): the base of recurrent-state layers that keep their
states where vLLM's files look for them, `self.kv_cache`, and read their own per-step metadata
from the forward context's `attn_metadata[prefix]` (vLLM's model files that drive the state
ops themselves, such as bailing_moe_v3.py's KDA layer).

Such a layer registers itself in `static_forward_context` under its prefix, as vLLM's do. The
model runner then (`worker/model_runner.py`) gives it one zeroed tensor per state,
[max_num_seqs, *shape] (a row per state slot, shapes and dtypes from the layer's
`get_state_shape` / `get_state_dtype`), and each step the metadata its backend's builder makes
from the step's state slots. minivllm's own state layers keep their states as buffers instead.
"""

import torch
from torch import nn


class MambaBase(nn.Module):
    """Mixin of a recurrent-state layer driven through `kv_cache` and its backend's metadata."""

    # The layer's states, in `get_state_shape()` order: [slots, *shape] each.
    kv_cache: tuple[torch.Tensor, ...]

    def get_state_shape(self) -> tuple[tuple[int, ...], ...]:
        raise NotImplementedError(f"{type(self).__name__} must define get_state_shape")

    def get_state_dtype(self) -> tuple[torch.dtype, ...]:
        raise NotImplementedError(f"{type(self).__name__} must define get_state_dtype")

    @property
    def mamba_type(self) -> object:
        raise NotImplementedError(f"{type(self).__name__} must name its backend (mamba_type)")

    def get_attn_backend(self) -> type:
        """The backend class its `mamba_type` (a `MambaAttentionBackendEnum`) names."""
        return self.mamba_type.get_class()

    def bind_state_slots(self, num_slots: int, device: torch.device | str = "cpu") -> None:
        """Zeroed states, one row per state slot (a sequence's slot is zeroed again by the
        layer when a sequence starts there: has_initial_state is False)."""
        self.kv_cache = tuple(torch.zeros(num_slots, *shape, dtype=dtype, device=device)
                              for shape, dtype in zip(self.get_state_shape(),
                                                      self.get_state_dtype()))


def is_mamba_layer(layer: object) -> bool:
    return isinstance(layer, MambaBase)
