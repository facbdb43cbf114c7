"""Shapes and dtypes of the recurrent-state layers' per-sequence states (vLLM's
`mamba_utils`): the one home the layers size their state buffers from, and what vLLM's model
files return from `get_mamba_state_shape_from_config` / `..._dtype_from_config`.

minivllm keeps conv states sequence-major, [K - 1, dim] per slot (vLLM's "SD" layout), and an
SSM state as [heads, head_dim, state_size] (Mamba-2) or [channels, state_size] (Mamba-1).
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeAlias

import torch
from torch import nn

from minivllm.distributed.utils import divide
from minivllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE


def _state_dtype(cache_dtype: str, model_dtype: torch.dtype | str) -> torch.dtype:
    """"auto" follows the model's dtype; otherwise the named one."""
    if cache_dtype == "auto":
        if isinstance(model_dtype, str):
            return STR_DTYPE_TO_TORCH_DTYPE[model_dtype]
        return model_dtype
    return STR_DTYPE_TO_TORCH_DTYPE[cache_dtype]


class MambaStateDtypeCalculator:
    @classmethod
    def mamba1_state_dtype(cls, model_dtype: torch.dtype | str, mamba_cache_dtype: str,
                           mamba_ssm_cache_dtype: str) -> tuple[torch.dtype, torch.dtype]:
        return cls._conv_and_ssm(model_dtype, mamba_cache_dtype, mamba_ssm_cache_dtype)

    @classmethod
    def mamba2_state_dtype(cls, model_dtype: torch.dtype | str, mamba_cache_dtype: str,
                           mamba_ssm_cache_dtype: str) -> tuple[torch.dtype, torch.dtype]:
        return cls._conv_and_ssm(model_dtype, mamba_cache_dtype, mamba_ssm_cache_dtype)

    @classmethod
    def short_conv_state_dtype(cls, model_dtype: torch.dtype | str,
                               mamba_cache_dtype: str) -> tuple[torch.dtype]:
        return (_state_dtype(mamba_cache_dtype, model_dtype),)

    @classmethod
    def gated_delta_net_state_dtype(cls, model_dtype: torch.dtype | str, mamba_cache_dtype: str,
                                    mamba_ssm_cache_dtype: str = "auto"
                                    ) -> tuple[torch.dtype, torch.dtype]:
        return cls._conv_and_ssm(model_dtype, mamba_cache_dtype, mamba_ssm_cache_dtype)

    @classmethod
    def linear_attention_state_dtype(cls, model_dtype: torch.dtype | str,
                                     mamba_cache_dtype: str) -> tuple[torch.dtype]:
        """Lightning attention's one state (`--mamba-cache-dtype`; "auto": the model's)."""
        return (_state_dtype(mamba_cache_dtype, model_dtype),)

    @classmethod
    def kda_state_dtype(cls, model_dtype: torch.dtype | str, mamba_cache_dtype: str,
                        mamba_ssm_cache_dtype: str = "auto") -> tuple[torch.dtype, torch.dtype]:
        """Kimi Delta Attention: the conv state follows `--mamba-cache-dtype`; the recurrent
        state is fp32 unless float32 / bfloat16 is asked for (vLLM's rule)."""
        if mamba_ssm_cache_dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"the KDA recurrent state takes auto, float32 or bfloat16, got "
                             f"{mamba_ssm_cache_dtype!r}")
        ssm = (torch.float32 if mamba_ssm_cache_dtype == "auto"
               else STR_DTYPE_TO_TORCH_DTYPE[mamba_ssm_cache_dtype])
        return _state_dtype(mamba_cache_dtype, model_dtype), ssm

    @staticmethod
    def _conv_and_ssm(model_dtype: torch.dtype | str, mamba_cache_dtype: str,
                      mamba_ssm_cache_dtype: str) -> tuple[torch.dtype, torch.dtype]:
        conv = _state_dtype(mamba_cache_dtype, model_dtype)
        ssm = conv if mamba_ssm_cache_dtype == "auto" else \
            STR_DTYPE_TO_TORCH_DTYPE[mamba_ssm_cache_dtype]
        return conv, ssm


class MambaStateShapeCalculator:
    @classmethod
    def mamba1_state_shape(cls, tp_world_size: int, intermediate_size: int, state_size: int,
                           conv_kernel: int) -> tuple[tuple[int, int], tuple[int, int]]:
        channels = divide(intermediate_size, tp_world_size)
        return (conv_kernel - 1, channels), (channels, state_size)

    @classmethod
    def mamba2_state_shape(cls, tp_world_size: int, intermediate_size: int, n_groups: int,
                           num_heads: int, head_dim: int, state_size: int, conv_kernel: int,
                           num_spec: int = 0
                           ) -> tuple[tuple[int, int], tuple[int, int, int]]:
        # Groups a TP size does not divide are replicated beside their heads' shards.
        n_groups += cls.extra_groups_for_head_shards(n_groups, tp_world_size)
        conv_dim = intermediate_size + 2 * n_groups * state_size
        return ((conv_kernel - 1 + num_spec, divide(conv_dim, tp_world_size)),
                (divide(num_heads, tp_world_size), head_dim, state_size))

    @classmethod
    def short_conv_state_shape(cls, tp_world_size: int, intermediate_size: int,
                               conv_kernel: int, num_spec: int = 0) -> tuple[tuple[int, int]]:
        return ((conv_kernel - 1 + num_spec, divide(intermediate_size, tp_world_size)),)

    @classmethod
    def gated_delta_net_state_shape(cls, tp_world_size: int, num_k_heads: int,
                                    num_v_heads: int, head_k_dim: int, head_v_dim: int,
                                    conv_kernel_size: int, num_spec: int = 0
                                    ) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """Gated DeltaNet: the conv state over [q | k | v] channels, and the recurrent state
        [value heads, dv, dk] (vLLM's layout) of this rank's heads."""
        conv_dim = 2 * num_k_heads * head_k_dim + num_v_heads * head_v_dim
        return ((conv_kernel_size - 1 + num_spec, divide(conv_dim, tp_world_size)),
                (divide(num_v_heads, tp_world_size), head_v_dim, head_k_dim))

    @classmethod
    def linear_attention_state_shape(cls, num_heads: int, tp_size: int, head_dim: int
                                     ) -> tuple[tuple[int, int, int]]:
        """Lightning attention: the state [heads / tp, d (key), d (value)] of this rank."""
        return ((divide(num_heads, tp_size), head_dim, head_dim),)

    @classmethod
    def kda_state_shape(cls, tp_world_size: int, num_heads: int, head_dim: int,
                        num_k_heads: int | None = None, head_k_dim: int | None = None,
                        conv_kernel_size: int = 4, num_spec: int = 0
                        ) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """Kimi Delta Attention: the conv state over [q | k | v] channels and the recurrent
        state [heads, dv, dk] (square: vLLM sizes it by the value head) of this rank."""
        key_dim = (num_k_heads or num_heads) * (head_k_dim or head_dim)
        conv_dim = num_heads * head_dim + 2 * key_dim
        return ((conv_kernel_size - 1 + num_spec, divide(conv_dim, tp_world_size)),
                (divide(num_heads, tp_world_size), head_dim, head_dim))

    @classmethod
    def extra_groups_for_head_shards(cls, ngroups: int, tp_size: int) -> int:
        """Groups added so every TP rank holds the group(s) its heads read: none when the TP
        size divides the groups; a single group is copied to every rank."""
        if ngroups % tp_size == 0:
            return 0
        if ngroups != 1:
            raise ValueError(f"n_groups={ngroups} cannot be split over tensor parallel size "
                             f"{tp_size}: use a size that divides it (or a model with 1 group)")
        return tp_size - ngroups


def register_state_buffers(layer: nn.Module, vllm_config: object,
                           states: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
    """Gives `layer` one zeroed buffer [max_num_seqs, *shape] per state name (a row per state
    slot). Not persistent: state, not weights."""
    slots = vllm_config.scheduler_config.max_num_seqs
    for name, (shape, dtype) in states.items():
        layer.register_buffer(name, torch.zeros(slots, *shape, dtype=dtype), persistent=False)


@dataclass
class MambaCopySpec:
    """A state slice to copy (prefix caching in vLLM's "align" mode): address and length."""

    start_addr: int
    num_elements: int


# (state [slots, ...], block_ids, cur_block_idx, num_accepted_tokens) -> the slice to copy.
MambaStateCopyFunc: TypeAlias = Callable[[torch.Tensor, list[int], int, int], MambaCopySpec]


def get_conv_copy_spec(state: torch.Tensor, block_ids: list[int], cur_block_idx: int,
                       num_accepted_tokens: int) -> MambaCopySpec:
    """A conv state [slots, K - 1, dim]: the rows after the accepted tokens' offset."""
    src = state[block_ids[cur_block_idx], num_accepted_tokens - 1:]
    return MambaCopySpec(src.data_ptr(), src.numel())


def get_temporal_copy_spec(state: torch.Tensor, block_ids: list[int], cur_block_idx: int,
                           num_accepted_tokens: int) -> MambaCopySpec:
    """An SSM state: the whole slot of the last accepted token."""
    src = state[block_ids[cur_block_idx + num_accepted_tokens - 1]]
    return MambaCopySpec(src.data_ptr(), src.numel())


class MambaStateCopyFuncCalculator:
    @classmethod
    def mamba1_state_copy_func(cls) -> tuple[MambaStateCopyFunc, MambaStateCopyFunc]:
        return get_conv_copy_spec, get_temporal_copy_spec

    @classmethod
    def mamba2_state_copy_func(cls) -> tuple[MambaStateCopyFunc, MambaStateCopyFunc]:
        return get_conv_copy_spec, get_temporal_copy_spec

    @classmethod
    def short_conv_state_copy_func(cls) -> tuple[MambaStateCopyFunc]:
        return (get_conv_copy_spec,)

    @classmethod
    def gated_delta_net_state_copy_func(cls) -> tuple[MambaStateCopyFunc, MambaStateCopyFunc]:
        return get_conv_copy_spec, get_temporal_copy_spec

    @classmethod
    def linear_attention_state_copy_func(cls) -> tuple[MambaStateCopyFunc]:
        return (get_temporal_copy_spec,)

    @classmethod
    def kda_state_copy_func(cls) -> tuple[MambaStateCopyFunc, MambaStateCopyFunc]:
        return get_conv_copy_spec, get_temporal_copy_spec


def is_conv_state_dim_first() -> bool:
    """Whether conv states are [dim, K - 1] per slot (vLLM's "DS" layout): never in minivllm,
    which keeps them sequence-major ("SD")."""
    return False
