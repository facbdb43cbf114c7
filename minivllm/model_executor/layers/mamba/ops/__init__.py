"""Vectorised CPU / PyTorch kernels of the recurrent-state layers (`layers/mamba/`)."""
