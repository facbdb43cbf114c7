"""`set_model_tag` (vLLM's compilation.backends): the tag holds inside the block and comes back
after it; re-entering the current tag is refused."""

import pytest

from minivllm.compilation import backends


def test_tag_is_set_inside_and_restored():
    assert backends.model_tag == "backbone"
    with backends.set_model_tag("self_decoder"):
        assert (backends.model_tag, backends.model_is_encoder) == ("self_decoder", False)
        with backends.set_model_tag("vision", is_encoder=True):
            assert backends.model_is_encoder
        assert backends.model_tag == "self_decoder"
        with pytest.raises(ValueError, match="already the current tag"):
            with backends.set_model_tag("self_decoder"):
                pass
    assert backends.model_tag == "backbone"
