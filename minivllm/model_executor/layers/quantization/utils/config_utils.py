"""Per-layer questions model files ask of a quantization config (vLLM's `config_utils`)."""

from minivllm.model_executor.layers.quantization.base_config import QuantizationConfig


def get_quark_ocp_mx_group_size(quant_config: QuantizationConfig | None,
                                layer_name: str) -> int | None:
    """The OCP MX block size of a layer quantized by AMD Quark, else None.

    minivllm has no Quark method (`QUANTIZATION_METHODS` lists those it has), so no config is
    a Quark one and every layer answers None: its tensors are split like unquantized ones."""
    return None
