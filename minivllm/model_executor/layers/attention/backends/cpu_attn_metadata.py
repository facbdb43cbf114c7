"""Per-step metadata of the CPU attention backend: built once, shared by all layers.

The model runner fills one `CommonAttentionMetadata` per step, and
`TorchAttentionMetadataBuilder.build` turns it into `TorchAttentionMetadata`: the batch split into
padded *groups* (decode rows bucketed by length, one group per prefill, short chunks padded
together) with every gather index and mask precomputed, so that each layer only runs
`index_select` + `scaled_dot_product_attention` per group.
"""

from dataclasses import dataclass, field

import torch

# Decode rows are bucketed by length so short sequences are not padded to the longest one.
# Cost model: one more bucket (gather + SDPA call) costs about as much as attending this many
# extra padded key rows (~50 us on a 2-core CPU at nKV=3, d=64) ...
_BUCKET_OVERHEAD_KEYS = 512
# ... and a bucket holds at most this many key rows, so its gathered K/V (~6 MB at nKV=3, d=64,
# bf16) is still in cache when SDPA reads it (measured ~15% faster than one big gather at B=64).
_MAX_BUCKET_KEYS = 8192
_MAX_DECODE_BUCKETS = 8
# Prefills with more query rows than this get an SDPA call of their own (see `_prefill_groups`).
_MAX_PADDED_PREFILL = 16


@dataclass
class CommonAttentionMetadata:
    """What the model runner knows about one step (all CPU tensors, sequences in batch order).

    Sequence i owns query rows `query_start_loc[i]:query_start_loc[i+1]`; they are the last
    `query_len` of its `seq_lens[i]` tokens (earlier ones are already in the KV cache).
    """

    query_start_loc: torch.Tensor   # int32 [B+1], cumulative query lengths
    seq_lens: torch.Tensor          # int32 [B], tokens in the KV cache after this step
    block_table: torch.Tensor       # int32 [B, max_blocks_per_seq], block ids (padding entries 0)
    slot_mapping: torch.Tensor      # int64 [T], cache slot (block_id * block_size + offset)
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    causal: bool = True

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.shape[0]


@dataclass
class AttnGroup:
    """Sequences attended with one padded SDPA call: queries [Bg, Lq], keys [Bg, Lk].

    Padded query slots repeat the sequence's last real query (same position), so no row is fully
    masked and SDPA never produces NaN; their outputs are dropped through `out_pos`.
    """

    q_index: torch.Tensor            # int64 [Bg*Lq], query row of each padded slot
    row_start: int | None            # rows are exactly [row_start, row_start + Bg*Lq): slice them
    out_rows: torch.Tensor           # int64 [n], output rows written by this group
    out_pos: torch.Tensor | None     # int64 [n], slots (in [Bg*Lq]) holding real rows; None = all
    q_pos: torch.Tensor              # int64 [Bg, Lq], absolute position of each query slot
    k_len: torch.Tensor              # int64 [Bg], valid keys per sequence
    num_seqs: int                    # Bg
    q_len: int                       # Lq
    k_len_max: int                   # Lk (keys attended per sequence)
    block_ids: torch.Tensor | None   # int64 [Bg*num_blocks] for the cache gather (None: no cache)
    kv_from_input: bool              # nothing cached before: keys are this step's rows (`q_index`)
    block_start: int | None          # one sequence on consecutive blocks: view them, no gather
    causal: bool
    needs_mask: bool                 # False: every key is visible (or is_causal covers it)
    masks: dict[tuple, torch.Tensor | None] = field(default_factory=dict)  # (window, dtype) -> mask
    gather_views: dict[tuple, tuple] = field(default_factory=dict)       # cache geometry -> views

    @property
    def use_is_causal(self) -> bool:
        """SDPA's own causal mask is right only for square, unpadded, prefix-free groups."""
        return self.causal and not self.needs_mask and self.q_len == self.k_len_max > 1

    def mask(self, window: int | None, dtype: torch.dtype,
             chunk: int | None = None) -> torch.Tensor | None:
        """`build_mask(window, chunk)` as an additive mask (0 / -inf) in `dtype`, cached per
        step; None when nothing needs masking.

        NOTE: additive and in the query dtype because SDPA would otherwise convert a bool mask
        on every call, i.e. once per layer (two extra ops over [Bg, 1, Lq, Lk] each time).
        """
        window = 0 if window is None or window >= self.k_len_max else window
        # Every key position is below k_len_max: chunks at least that long never split them.
        chunk = 0 if chunk is None or chunk >= self.k_len_max else chunk
        key = (window, dtype, chunk)
        if key not in self.masks:
            mask = None
            if window or chunk or self.needs_mask:
                allowed = self.build_mask(window, chunk)
                mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed,
                                                                           float("-inf"))
            self.masks[key] = mask
        return self.masks[key]

    def build_mask(self, window: int | None, chunk: int | None = None) -> torch.Tensor:
        """Bool [Bg, 1, Lq|1, Lk] (True = attend): key length, causality, sliding window,
        chunked-local attention (a query sees only keys of its own `chunk`-long block of
        positions: Llama 4's local layers)."""
        k_pos = torch.arange(self.k_len_max)                       # [Lk]
        q_pos = self.q_pos[:, :, None]                             # [Bg, Lq, 1]
        mask = k_pos < self.k_len[:, None, None]                   # [Bg, 1, Lk]
        if self.causal:
            mask = mask & (k_pos <= q_pos)                         # [Bg, Lq, Lk]
        if window:
            # NOTE: vLLM's window covers `window` tokens including the query itself; without
            # causality it reaches as far to the right (ModernBERT's local encoder layers).
            mask = mask & (k_pos > q_pos - window)
            if not self.causal:
                mask = mask & (k_pos < q_pos + window)
        if chunk:
            mask = mask & (k_pos // chunk == q_pos // chunk)        # [Bg, Lq, Lk]
        return mask.unsqueeze(1)                                   # [Bg, 1, Lq or 1, Lk]

    def select_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The group's padded rows [Bg*Lq, ...] of a per-token tensor: a slice when consecutive."""
        if self.row_start is not None:
            return x[self.row_start:self.row_start + self.num_seqs * self.q_len]
        return x.index_select(0, self.q_index)

    def store_output(self, o: torch.Tensor, out: torch.Tensor) -> None:
        """Write the group's result o [Bg, Lq, nH, d] to its real rows of out [T, nH, d]."""
        if self.row_start is not None:
            out[self.row_start:self.row_start + self.num_seqs * self.q_len].copy_(o.flatten(0, 1))
            return
        o = o.reshape(self.num_seqs * self.q_len, *out.shape[1:])
        if self.out_pos is not None:
            o = o.index_select(0, self.out_pos)
        out.index_copy_(0, self.out_rows, o.to(out.dtype))

    def gather_targets(self, workspace: "Workspace", kv_cache: torch.Tensor, head_size: int,
                       head_size_v: int) -> tuple:
        """Workspace rows to gather blocks into, and the K/V views SDPA reads; cached per step.

        Returns (k_rows [Bg*nb, bs*nKV*d], v_rows, k [Bg, nKV, Lk, hs], v [Bg, nKV, Lk, hs_v]).
        """
        key = (kv_cache.dtype, kv_cache.shape[2:], head_size, head_size_v)
        views = self.gather_views.get(key)
        if views is None:
            _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
            assert self.block_ids is not None
            rows = workspace.get((2, self.block_ids.numel(), block_size * num_kv_heads * head_dim),
                                 kv_cache.dtype)
            # [2, Bg*nb, bs*nKV*d] -> [2, Bg, nb*bs, nKV, d] -> the first Lk keys per sequence
            kv = rows.view(2, self.num_seqs, -1, num_kv_heads, head_dim)[:, :, :self.k_len_max]
            views = (rows[0], rows[1], kv[0, ..., :head_size].transpose(1, 2),
                     kv[1, ..., :head_size_v].transpose(1, 2))
            self.gather_views[key] = views
        return views


class Workspace:
    """A growable flat buffer per dtype for gathered K/V, reused by every layer and step.

    Allocating tens of MB per layer costs page faults that exceed the gather itself.
    """

    def __init__(self) -> None:
        self._buffers: dict[torch.dtype, torch.Tensor] = {}

    def get(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        numel = 1
        for s in shape:
            numel *= s
        buf = self._buffers.get(dtype)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype)
            self._buffers[dtype] = buf
        return buf[:numel].view(shape)


@dataclass
class DecodeBatch:
    """The step's one-token (decode) rows, as the native paged decode kernel reads them."""

    rows: torch.Tensor               # int64 [Bd], query/output row of each decoding sequence
    seq_lens: torch.Tensor           # int32 [Bd], keys per sequence (cached + this token)
    block_table: torch.Tensor        # int32 [Bd, max_blocks], contiguous


@dataclass
class TorchAttentionMetadata:
    """One step's attention plan, shared by all layers (they differ only in window and cache)."""

    num_actual_tokens: int
    block_size: int
    causal: bool
    decode: DecodeBatch | None       # decode rows (kernel path), or None when there are none
    prefill_groups: list[AttnGroup]  # decoder layers: one group per prefill / padded chunks
    query_start_loc: torch.Tensor    # int32 [B+1]
    workspace: Workspace
    _decode_groups: list[AttnGroup] | None = None
    _encoder_groups: list[AttnGroup] | None = None

    @property
    def decode_groups(self) -> list[AttnGroup]:
        """The decode rows as length buckets for gather + SDPA (built only if a layer asks)."""
        if self._decode_groups is None:
            d = self.decode
            self._decode_groups = ([] if d is None else
                                   _decode_groups(d.rows, d.seq_lens.long(), d.block_table,
                                                  self.block_size))
        return self._decode_groups

    @property
    def groups(self) -> list[AttnGroup]:
        """Every group of the SDPA path: decode buckets, then prefill groups."""
        return self.decode_groups + self.prefill_groups

    @property
    def encoder_groups(self) -> list[AttnGroup]:
        """Bidirectional attention among each sequence's own query rows (no KV cache)."""
        if self._encoder_groups is None:
            qsl = self.query_start_loc.long()
            q_lens = qsl[1:] - qsl[:-1]                             # [B]
            seqs = torch.nonzero(q_lens > 0).flatten()
            self._encoder_groups = _prefill_groups(qsl[seqs], q_lens[seqs],
                                                   torch.zeros_like(seqs), None, self.block_size,
                                                   causal=False)
        return self._encoder_groups


class TorchAttentionMetadataBuilder:
    """Builds `TorchAttentionMetadata` from the runner's `CommonAttentionMetadata` once per step."""

    def __init__(self, block_size: int, *args: object, **kwargs: object) -> None:
        self.block_size = block_size
        self.workspace = Workspace()

    def build_for_cudagraph_capture(self, common: CommonAttentionMetadata
                                    ) -> TorchAttentionMetadata:
        """A decode-only step's metadata that reads the runner's own (static) tensors in place:
        a CPU graph replays the native decode kernel on whatever they hold at replay time.

        common.seq_lens int32 [B] and block_table int32 [B, max_blocks] (contiguous) are used
        as they are; every sequence has exactly one query row (row i is sequence i)."""
        num_reqs = common.num_reqs
        if common.num_actual_tokens != num_reqs or not common.causal:
            raise ValueError("CPU graphs capture decode-only causal steps (one token per "
                             f"sequence); got {common.num_actual_tokens} tokens for "
                             f"{num_reqs} sequences")
        decode = DecodeBatch(rows=torch.arange(num_reqs), seq_lens=common.seq_lens,
                             block_table=common.block_table)
        return TorchAttentionMetadata(num_actual_tokens=num_reqs, block_size=self.block_size,
                                      causal=True, decode=decode, prefill_groups=[],
                                      query_start_loc=common.query_start_loc,
                                      workspace=self.workspace)

    def build(self, common: CommonAttentionMetadata) -> TorchAttentionMetadata:
        qsl = common.query_start_loc.long()
        q_lens = qsl[1:] - qsl[:-1]                                 # [B]
        seq_lens = common.seq_lens.long()                           # [B]
        decode = None
        if common.causal:
            dec = torch.nonzero(q_lens == 1).flatten()
            pre = torch.nonzero(q_lens > 1).flatten()
            if dec.numel():
                decode = DecodeBatch(rows=qsl[dec], seq_lens=common.seq_lens[dec].to(torch.int32),
                                     block_table=common.block_table[dec].to(torch.int32)
                                     .contiguous())
        else:
            pre = torch.nonzero(q_lens > 0).flatten()
        groups: list[AttnGroup] = []
        if pre.numel():
            ctx_lens = seq_lens[pre] - q_lens[pre]                  # tokens cached before this step
            groups = _prefill_groups(qsl[pre], q_lens[pre], ctx_lens, common.block_table[pre],
                                     self.block_size, causal=common.causal)
        return TorchAttentionMetadata(num_actual_tokens=common.num_actual_tokens,
                                      block_size=self.block_size, causal=common.causal,
                                      decode=decode, prefill_groups=groups,
                                      query_start_loc=common.query_start_loc,
                                      workspace=self.workspace)


def _decode_groups(rows: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                   block_size: int) -> list[AttnGroup]:
    """Decode rows, cut into buckets of similar length (longest first)."""
    # stable: equal lengths keep their order, so a bucket's rows may stay one slice
    sorted_lens, order = torch.sort(seq_lens, descending=True, stable=True)
    bounds = _bucket_bounds(sorted_lens, block_size)
    if len(bounds) > 2:
        seq_lens, rows, block_table = sorted_lens, rows[order], block_table[order]
    # NOTE: a loop over at most _MAX_DECODE_BUCKETS buckets, not over sequences.
    return [_decode_group(rows[a:b], seq_lens[a:b], block_table[a:b], block_size)
            for a, b in zip(bounds[:-1], bounds[1:])]


def _bucket_bounds(sorted_lens: torch.Tensor, bs: int) -> list[int]:
    """Split points of the length-sorted rows: equal-count buckets, the count chosen by cost."""
    n = sorted_lens.numel()
    padded = ((sorted_lens + bs - 1) // bs * bs).tolist()        # keys gathered per sequence
    k_min = min(-(-sum(padded) // _MAX_BUCKET_KEYS), _MAX_DECODE_BUCKETS, n)
    best, best_cost = [0, n], None
    for k in range(k_min, min(_MAX_DECODE_BUCKETS, n) + 1):
        bounds = [n * i // k for i in range(k + 1)]
        cost = sum((b - a) * padded[a] for a, b in zip(bounds[:-1], bounds[1:]))
        cost += k * _BUCKET_OVERHEAD_KEYS
        if best_cost is None or cost < best_cost:
            best, best_cost = bounds, cost
    return best


def _decode_group(rows: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                  block_size: int) -> AttnGroup:
    n = rows.numel()
    longest, shortest = int(seq_lens.max()), int(seq_lens.min())
    num_blocks = -(-longest // block_size)
    # One sequence: slice its keys to the exact length instead of masking the last block.
    k_len_max = longest if n == 1 else num_blocks * block_size
    block_ids = block_table[:, :num_blocks].reshape(-1).long()
    return AttnGroup(q_index=rows, row_start=_contiguous_start(rows), out_rows=rows,
                     out_pos=None, q_pos=(seq_lens - 1)[:, None], k_len=seq_lens,
                     num_seqs=n, q_len=1, k_len_max=k_len_max,
                     block_ids=block_ids, kv_from_input=False,
                     block_start=_single_run_start(block_ids, n),
                     causal=True, needs_mask=shortest != k_len_max)


def _single_run_start(block_ids: torch.Tensor | None, num_seqs: int) -> int | None:
    """First block of a lone sequence whose blocks are consecutive (FIFO allocation often is)."""
    return None if block_ids is None or num_seqs != 1 else _contiguous_start(block_ids)


def _contiguous_start(rows: torch.Tensor) -> int | None:
    """`rows[0]` if rows are consecutive increasing integers (then slicing replaces gathers)."""
    first = int(rows[0])
    if int(rows[-1]) - first + 1 != rows.numel():
        return None
    return first if bool((rows == torch.arange(first, first + rows.numel())).all()) else None


def _prefill_groups(starts: torch.Tensor, q_lens: torch.Tensor, ctx_lens: torch.Tensor,
                    block_table: torch.Tensor | None, block_size: int,
                    causal: bool) -> list[AttnGroup]:
    """Short chunks padded into one group; every longer prefill in a group of its own.

    NOTE: this is the one loop over sequences, and it is deliberate: CPU SDPA has no
    variable-length form, and padding prompts of different lengths to the longest one (with an
    explicit mask, so no causal block skipping) cost 5x more than one call per prompt at 64
    prompts of 16-256 tokens. Chunks of <= _MAX_PADDED_PREFILL rows are too small to pay for a
    call of their own, so they share one padded group.
    """
    short = q_lens <= _MAX_PADDED_PREFILL
    groups = []
    if bool(short.any()):
        idx = torch.nonzero(short).flatten()
        table = None if block_table is None else block_table[idx]
        groups.append(_padded_group(starts[idx], q_lens[idx], ctx_lens[idx], table, block_size,
                                    causal))
    for i in torch.nonzero(~short).flatten().tolist():
        table = None if block_table is None else block_table[i:i + 1]
        groups.append(_padded_group(starts[i:i + 1], q_lens[i:i + 1], ctx_lens[i:i + 1], table,
                                    block_size, causal))
    return groups


def _padded_group(starts: torch.Tensor, q_lens: torch.Tensor, ctx_lens: torch.Tensor,
                  block_table: torch.Tensor | None, block_size: int, causal: bool) -> AttnGroup:
    """Sequences with query rows `starts[i] + [0, q_lens[i])` after `ctx_lens[i]` cached tokens.

    `block_table=None` means there is no KV cache (encoder-only): keys are this step's rows.
    """
    n = starts.numel()
    q_len = int(q_lens.max())
    j = torch.arange(q_len)
    offs = torch.minimum(j[None, :], q_lens[:, None] - 1)           # [Bg, Lq], padding -> last row
    q_index = (starts[:, None] + offs).reshape(-1)                  # [Bg*Lq]
    seq_lens = ctx_lens + q_lens
    if bool((q_lens == q_len).all()):
        out_pos = None
    else:
        out_pos = torch.nonzero((j[None, :] < q_lens[:, None]).reshape(-1)).flatten()
    out_rows = q_index if out_pos is None else q_index[out_pos]
    longest = int(seq_lens.max())
    num_blocks = -(-longest // block_size)
    kv_from_input = bool((ctx_lens == 0).all())
    # Keys: this step's rows padded like the queries, or whole blocks gathered from the cache
    # (a single sequence is sliced to its exact length instead of masked).
    k_len_max = q_len if kv_from_input else longest if n == 1 else num_blocks * block_size
    block_ids = None if block_table is None else block_table[:, :num_blocks].reshape(-1).long()
    unpadded = bool((seq_lens == k_len_max).all())
    # Square prefix-free groups without padding can use SDPA's is_causal; the rest need a mask.
    needs_mask = not unpadded or (causal and not kv_from_input)
    return AttnGroup(q_index=q_index, row_start=_contiguous_start(q_index), out_rows=out_rows,
                     out_pos=out_pos, q_pos=ctx_lens[:, None] + offs, k_len=seq_lens,
                     num_seqs=n, q_len=q_len, k_len_max=k_len_max, block_ids=block_ids,
                     kv_from_input=kv_from_input, block_start=_single_run_start(block_ids, n),
                     causal=causal, needs_mask=needs_mask)
