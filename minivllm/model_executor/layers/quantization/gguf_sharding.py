"""Tensor parallelism over GGUF-packed weights: a rank holds whole blocks of a row's values
(row-parallel layers, expert down projections); a size that would cut a block is refused with
the sizes that would not."""

from gguf import GGMLQuantizationType

from minivllm.model_executor.kernels.gguf_linear import GGUF_FLOAT_TYPES, gguf_block_shape


def splits_whole_blocks(size: int, block_elems: int, tp_size: int) -> bool:
    """True when `size` values split over `tp_size` ranks in whole blocks of `block_elems`."""
    return size % tp_size == 0 and (size // tp_size) % block_elems == 0


def gguf_split_columns(qtype: int, row_width: int, size: int, tp_size: int, tp_rank: int,
                       what: str, hint: str = "") -> slice:
    """This rank's part of a GGUF row of `size` values (`row_width` bytes for block types,
    elements for float types) split over `tp_size` ranks in whole blocks; a split that would cut
    a block is a ValueError naming `what` and the valid sizes (then `hint`)."""
    if tp_size == 1:
        return slice(0, row_width)
    elems, nbytes = (1, 1) if qtype in GGUF_FLOAT_TYPES else gguf_block_shape(qtype)
    if not splits_whole_blocks(size, elems, tp_size):
        valid = [t for t in range(1, size + 1) if splits_whole_blocks(size, elems, t)]
        raise ValueError(
            f"tensor_parallel_size={tp_size} would split a GGUF block ({elems} values) of "
            f"{what}, a {GGMLQuantizationType(qtype).name} weight; valid tensor_parallel_size "
            f"values for this layer: {valid}{hint}")
    width = size // tp_size // elems * nbytes
    return slice(tp_rank * width, (tp_rank + 1) * width)
