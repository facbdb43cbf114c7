"""Attention types shared by layers and backends."""

import enum


class AttentionType(str, enum.Enum):
    """Which attention a layer performs; a `str` enum as in vLLM."""

    DECODER = "decoder"
    ENCODER = "encoder"
    ENCODER_ONLY = "encoder_only"
    ENCODER_DECODER = "encoder_decoder"
