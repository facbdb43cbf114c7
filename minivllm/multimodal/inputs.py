"""Types vLLM's model files annotate multimodal inputs with (`embed_input_ids`'s
`multimodal_embeddings`): only the types, since minivllm runs no multimodal inputs."""

import torch

# Embeddings of multimodal items: a tensor, or (nested) lists / tuples of them.
NestedTensors = list["NestedTensors"] | list[torch.Tensor] | torch.Tensor | tuple[torch.Tensor, ...]
