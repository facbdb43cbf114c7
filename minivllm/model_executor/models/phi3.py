"""Phi-3 / Phi-3.5 / Phi-4-mini: Llama with q/k/v and gate/up already fused in the checkpoint.

The fused `qkv_proj` / `gate_up_proj` tensors carry no shard id, so the fused linears take them
whole (their "shard id None" path). LongRoPE (`rope_type: longrope`) and partial rotary come
from `get_rope` through Llama's attention.
"""

from .llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    # Fused on disk: each packed module is its own (only) checkpoint name.
    packed_modules_mapping = {"qkv_proj": ["qkv_proj"], "gate_up_proj": ["gate_up_proj"]}
