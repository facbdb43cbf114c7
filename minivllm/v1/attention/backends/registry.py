"""`AttentionBackendEnum` (vLLM's backend registry): the backend names model files refer to.
minivllm has one attention backend, the CPU paged one (`CPU_ATTN`, vLLM's name for its CPU
backend); every other member names a GPU backend it does not have, and `get_class()` on it
raises naming the one available. `MambaAttentionBackendEnum` names the recurrent-state layers'
backends (a layer's `mamba_type`): `GDN_ATTN`."""

from enum import Enum

from minivllm.utils.import_utils import resolve_obj_by_qualname


class AttentionBackendEnum(Enum):
    """Backend names; the value is the class path vLLM imports (minivllm's for `CPU_ATTN`)."""

    CPU_ATTN = ("minivllm.model_executor.layers.attention.backends.cpu_attn."
                "TorchAttentionBackend")
    FLASH_ATTN = "vllm.v1.attention.backends.flash_attn.FlashAttentionBackend"
    FLASH_ATTN_DIFFKV = "vllm.v1.attention.backends.flash_attn_diffkv.FlashAttentionDiffKVBackend"
    TRITON_ATTN = "vllm.v1.attention.backends.triton_attn.TritonAttentionBackend"
    TRITON_ATTN_DIFFKV = ("vllm.v1.attention.backends.triton_attn_diffkv."
                          "TritonAttentionDiffKVBackend")
    FLASHINFER = "vllm.v1.attention.backends.flashinfer.FlashInferBackend"
    FLASHMLA = "vllm.v1.attention.backends.mla.flashmla.FlashMLABackend"

    def get_path(self) -> str:
        return self.value

    def get_class(self) -> type:
        """The backend class; only `CPU_ATTN` exists in minivllm. (Its layers take a V head
        size different from K's directly: `Attention(head_size_v=...)`, no DiffKV backend.)"""
        if self is not AttentionBackendEnum.CPU_ATTN:
            raise NotImplementedError(f"attention backend {self.name} is not available in "
                                      f"minivllm; the one backend is CPU_ATTN")
        # A lazy table, resolved by path (as vLLM's registry): no import of the layers here.
        return resolve_obj_by_qualname(self.value)


class MambaAttentionBackendEnum(Enum):
    """The recurrent-state layers' backends vLLM's files name (a layer's `mamba_type`); the
    value is minivllm's class path. Only the ones minivllm has are listed."""

    GDN_ATTN = "minivllm.v1.attention.backends.gdn_attn.GDNAttentionBackend"

    def get_path(self) -> str:
        return self.value

    def get_class(self) -> type:
        return resolve_obj_by_qualname(self.value)
