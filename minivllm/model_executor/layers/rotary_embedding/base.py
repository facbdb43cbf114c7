"""RotaryEmbedding: the plain RoPE module every variant derives from (contract section 7.3)."""

import torch

from minivllm.model_executor.custom_op import CustomOp
from minivllm.model_executor.kernels.rotary_embedding import rotary_embedding_bf16


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     is_neox_style: bool) -> torch.Tensor:
    """Rotate feature pairs of `x [T, heads, rotary_dim]` by `cos`/`sin [T, rotary_dim / 2]`.

    NeoX pairs feature i with i + rotary_dim/2 (halves); GPT-J pairs 2i with 2i+1 (even/odd).
    """
    cos = cos.unsqueeze(-2)  # [T, 1, rotary_dim / 2], broadcast over heads
    sin = sin.unsqueeze(-2)
    if is_neox_style:
        x1, x2 = torch.chunk(x, 2, dim=-1)
    else:
        x1, x2 = x[..., ::2], x[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if is_neox_style:
        return torch.cat((o1, o2), dim=-1)
    return torch.stack((o1, o2), dim=-1).flatten(-2)


@CustomOp.register("rotary_embedding")
class RotaryEmbedding(CustomOp):
    """Rotary position embedding with a precomputed `cos_sin_cache [max_position, rotary_dim]`.

    Each cache row holds `cos(pos * inv_freq)` then `sin(pos * inv_freq)` (rotary_dim/2 each);
    only the first `rotary_dim` features of every head are rotated.
    """

    def __init__(self, head_size: int, rotary_dim: int, max_position_embeddings: int,
                 base: float, is_neox_style: bool, dtype: torch.dtype,
                 init_cache: bool = True) -> None:
        super().__init__()
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.max_position_embeddings = max_position_embeddings
        self.base = base
        self.is_neox_style = is_neox_style
        self.dtype = dtype
        self._step_cos_sin: tuple | None = None
        if init_cache:
            cache = self._compute_cos_sin_cache().to(dtype)
            # Non-persistent: rebuilt from the config, never read from a checkpoint.
            self.register_buffer("cos_sin_cache", cache, persistent=False)

    def _compute_inv_freq(self, base: float) -> torch.Tensor:
        """`base^(-2i / rotary_dim)` for i < rotary_dim / 2, in fp32."""
        exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.float) / self.rotary_dim
        return 1.0 / (base ** exponents)

    def _compute_cos_sin_cache(self) -> torch.Tensor:
        inv_freq = self._compute_inv_freq(self.base)
        return self._cos_sin_from(inv_freq, self.max_position_embeddings)

    @staticmethod
    def _cos_sin_from(inv_freq: torch.Tensor, num_positions: int,
                      mscale: float = 1.0) -> torch.Tensor:
        t = torch.arange(num_positions, dtype=torch.float, device=inv_freq.device)
        freqs = t[:, None] * inv_freq[None, :]  # [num_positions, rotary_dim / 2]
        cos, sin = freqs.cos(), freqs.sin()
        if mscale != 1.0:
            cos, sin = cos * mscale, sin * mscale
        return torch.cat((cos, sin), dim=-1)  # [num_positions, rotary_dim]

    def _match_cos_sin_cache(self, query: torch.Tensor) -> torch.Tensor:
        """The cache on the query's device and dtype, converted once and kept (not while compiling)."""
        cache = self.cos_sin_cache
        if cache.device == query.device and cache.dtype == query.dtype:
            return cache
        cache = cache.to(query.device, dtype=query.dtype)
        if not torch.compiler.is_compiling():
            self.cos_sin_cache = cache
        return cache

    def forward_native(self, positions: torch.Tensor, query: torch.Tensor,
                       key: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """positions `[T]`, query `[T, nH * d]`, key `[T, nKV * d]` -> rotated (query, key)."""
        positions = positions.flatten()
        cos, sin = self._cos_sin_for(positions, query)          # [T, rotary_dim / 2] each
        num_tokens = positions.shape[0]
        if (key is not None and not torch.compiler.is_compiling()
                and self._can_rotate_together(query, key)):
            # q and k are adjacent column slices of one qkv output: rotate both in one pass.
            both = query.as_strided((num_tokens, query.shape[-1] + key.shape[-1]), query.stride())
            if self.is_neox_style:                              # rotary_dim == head_size here
                both = self._rotate_neox_full(both, positions, num_tokens)
            else:
                both = self._rotate(both, cos, sin, num_tokens)
            return both[:, :query.shape[-1]], both[:, query.shape[-1]:]
        query = self._rotate(query, cos, sin, num_tokens)
        if key is not None:
            key = self._rotate(key, cos, sin, num_tokens)
        return query, key

    def forward_cpu(self, positions: torch.Tensor, query: torch.Tensor,
                    key: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """bf16 q/k rotated in place by one native call (bit-identical to `forward_native`;
        a CPU graph can record it); anything else takes `forward_native`."""
        if (query.dtype == torch.bfloat16 and not torch.compiler.is_compiling()
                and self._rotates_plainly(positions)
                and rotary_embedding_bf16(positions.flatten(), query, key,
                                          self._match_cos_sin_cache(query), self.head_size,
                                          self.rotary_dim, self.is_neox_style)):
            return query, key
        return self.forward_native(positions, query, key)

    def _rotates_plainly(self, positions: torch.Tensor) -> bool:
        """Whether these positions rotate exactly as this class's plain cos/sin table says (so
        the native bf16 kernel may do it); a subclass with its own `forward_native` says no."""
        return type(self).forward_native is RotaryEmbedding.forward_native

    def _cos_sin_for(self, positions: torch.Tensor, query: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        # NOTE: get_rope shares one module across all layers, and the runner passes the same
        # positions tensor to every layer of a step: select cos/sin once per step, not per layer.
        if torch.compiler.is_compiling():                       # the compiler fuses the gather
            return self._match_cos_sin_cache(query).index_select(0, positions).chunk(2, dim=-1)
        cached = self._step_cos_sin
        if cached is not None and cached[0] is positions and cached[1].dtype == query.dtype:
            return cached[1], cached[2]
        cos_sin = self._match_cos_sin_cache(query).index_select(0, positions)  # [T, rotary_dim]
        cos, sin = cos_sin.chunk(2, dim=-1)
        self._step_cos_sin = (positions, cos, sin)
        return cos, sin

    def _rotate_neox_full(self, x: torch.Tensor, positions: torch.Tensor,
                          num_tokens: int) -> torch.Tensor:
        """NeoX rotation of whole heads as `x * cos + roll(x, d/2) * sin_signed` (4 ops).

        `roll` gives [x2, x1]; with sin_signed = [-sin, sin] the two halves are
        x1*cos - x2*sin and x2*cos + x1*sin, each product rounded as transformers' own
        `q * cos + rotate_half(q) * sin` rounds it. x [T, heads*d] -> [T, heads*d].
        """
        cached = self._step_cos_sin
        if len(cached) < 5:                                     # full-width pair, once per step
            cos, sin = cached[1], cached[2]
            full = (torch.cat((cos, cos), dim=-1).unsqueeze(1),
                    torch.cat((-sin, sin), dim=-1).unsqueeze(1))   # [T, 1, d] each
            cached = self._step_cos_sin = cached[:3] + full
        cos_full, sin_signed = cached[3], cached[4]
        x = x.view(num_tokens, -1, self.head_size)              # [T, heads, d]
        rotated = x * cos_full + x.roll(self.head_size // 2, dims=-1) * sin_signed
        return rotated.view(num_tokens, -1)

    def _can_rotate_together(self, query: torch.Tensor, key: torch.Tensor) -> bool:
        return (self.rotary_dim == self.head_size and query.dim() == 2 and key.dim() == 2
                and query.stride() == key.stride() and query.stride(-1) == 1
                and key.data_ptr() == query.data_ptr() + query.shape[-1] * query.element_size()
                and query.dtype == key.dtype)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                num_tokens: int) -> torch.Tensor:
        shape = x.shape
        x = x.view(num_tokens, -1, self.head_size)  # [T, heads, head_size]
        rotated = apply_rotary_emb(x[..., :self.rotary_dim], cos, sin, self.is_neox_style)
        if self.rotary_dim < self.head_size:
            rotated = torch.cat((rotated, x[..., self.rotary_dim:]), dim=-1)
        return rotated.reshape(shape)

    def extra_repr(self) -> str:
        return (f"head_size={self.head_size}, rotary_dim={self.rotary_dim}, "
                f"max_position_embeddings={self.max_position_embeddings}, base={self.base}, "
                f"is_neox_style={self.is_neox_style}")
