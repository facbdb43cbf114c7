"""`PrefillPrefixLMAttention` on the CPU backend against a dense fp64 reference: fresh prompts
attend bidirectionally (short ones padded together, long ones alone), decodes causally, beside
each other in one step; a prefill continued from cached tokens is refused."""

import pytest
import torch

from minivllm.config import CacheConfig, ParallelConfig, VllmConfig, set_current_vllm_config
from minivllm.model_executor.layers.attention import Attention, PrefillPrefixLMAttention
from tests.model_executor.layers.attention.test_attention import (HEAD, MIXED, Batch,
                                                                  _one_thread,  # noqa: F401
                                                                  make_config, make_layer)

# Fresh prompts (7 and 3 tokens padded into one group, 20 in a group of its own) between decodes
# of several lengths.
FRESH = ([7, 1, 20, 1, 3, 1], [7, 13, 20, 30, 3, 9])


@pytest.mark.parametrize("nH,nKV", [(4, 4), (6, 2)])
def test_prompts_bidirectional_decodes_causal(nH, nKV):
    cfg = make_config()
    batch = Batch(*FRESH, nH=nH, nKV=nKV)
    layer = make_layer(cfg, PrefillPrefixLMAttention, num_heads=nH, head_size=HEAD, scale=0.3,
                       num_kv_heads=nKV)
    out = batch.run(cfg, layer)
    # causal=False: a prompt's rows see its whole prompt; a decode row sees every cached key,
    # which is also what causal attention gives it.
    torch.testing.assert_close(out.double(), batch.expected(0.3, causal=False),
                               atol=1e-5, rtol=1e-5)
    causal = batch.run(cfg, make_layer(cfg, Attention, num_heads=nH, head_size=HEAD, scale=0.3,
                                       num_kv_heads=nKV))
    decode_rows = torch.tensor([7, 28, 32])
    torch.testing.assert_close(out[decode_rows], causal[decode_rows])
    assert not torch.allclose(out[:7], causal[:7], atol=1e-3)          # the prompt rows differ
    # The step's keys and values went to the cache, for the decodes that follow.
    written = batch.kv_cache[0].view(-1, nKV * HEAD)[batch.slot_mapping]
    k_rows = torch.cat([k[s - q:] for k, q, s in zip(batch.k, batch.q_lens, batch.seq_lens)])
    torch.testing.assert_close(written, k_rows.flatten(1))


def test_decode_only_step_is_causal_attention():
    cfg = make_config()
    batch = Batch([1, 1, 1], [5, 17, 2], nH=4, nKV=2)
    layer = make_layer(cfg, PrefillPrefixLMAttention, num_heads=4, head_size=HEAD, scale=0.3,
                       num_kv_heads=2)
    torch.testing.assert_close(batch.run(cfg, layer).double(), batch.expected(0.3),
                               atol=1e-5, rtol=1e-5)


def test_prefill_continued_from_cached_tokens_is_refused():
    """MIXED holds a 5-token chunk after 9 cached tokens (a chunked prefill or prefix hit)."""
    cfg = make_config()
    batch = Batch(*MIXED, nH=4, nKV=4)
    layer = make_layer(cfg, PrefillPrefixLMAttention, num_heads=4, head_size=HEAD, scale=0.3)
    with pytest.raises(NotImplementedError, match="chunked prefill or a prefix-cache hit"):
        batch.run(cfg, layer)


def test_constructor_refusals():
    cfg = make_config()
    with pytest.raises(ValueError, match="only supports attn_type='decoder'"):
        make_layer(cfg, PrefillPrefixLMAttention, num_heads=4, head_size=HEAD, scale=0.3,
                   attn_type="encoder_only")
    # Worker processes cannot turn the engine's prefix caching off: refused up front.
    parallel = VllmConfig(model_config=cfg.model_config,
                          parallel_config=ParallelConfig(tensor_parallel_size=2))
    with pytest.raises(ValueError, match="needs enable_prefix_caching=False"):
        with set_current_vllm_config(parallel):
            PrefillPrefixLMAttention(4, HEAD, 0.3, cache_config=CacheConfig(),
                                     prefix="model.layers.0.self_attn.attn")
