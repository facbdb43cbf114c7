"""LoRA adapters: requests, PEFT checkpoints, the layers that wrap the TP linears, the slot table."""
