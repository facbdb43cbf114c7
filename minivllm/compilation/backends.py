"""vLLM's `compilation.backends` names that model files use: `set_model_tag`.

vLLM compiles each tagged part of a model (Gemma 4's YOCO "self_decoder" / "cross_decoder")
as its own graph and keys its compile cache by the tag. minivllm's `support_torch_compile`
keeps no on-disk cache per part, so the tag is only recorded (`model_tag`, `model_is_encoder`)
while the tagged modules are built.
"""

from collections.abc import Iterator
from contextlib import contextmanager

model_tag: str = "backbone"
model_is_encoder: bool = False


@contextmanager
def set_model_tag(tag: str, is_encoder: bool = False) -> Iterator[None]:
    """Within the block, `model_tag` is `tag` (nesting the same tag twice is an error, as in
    vLLM: two parts would share one name)."""
    global model_tag, model_is_encoder
    if tag == model_tag:
        raise ValueError(f"Model tag {tag!r} is already the current tag")
    old = model_tag, model_is_encoder
    model_tag, model_is_encoder = tag, is_encoder
    try:
        yield
    finally:
        model_tag, model_is_encoder = old
