"""Model layers: TP linear/embedding layers, norms, activations, RoPE, logits, quantization hooks."""
