"""Which kernel computes a layer's math on CPU, and the `minivllm::` ops compiled graphs call.

- `op_library.py`: `register_op`, the `torch.library` fragment that defines `torch.ops.minivllm.*`;
- `cpu_linear.py`: the routing of bf16 linears (AMX GEMM / GEMV / oneDNN's packed copy) and the
  `cpu_linear` / `cpu_linear_silu_mul` ops;
- `activation.py`: SiluAndMul's math (the native kernel for bf16, else torch) and its op.

The native kernels themselves are `minivllm/csrc/*.cpp`, bound in `minivllm/_custom_ops.py`.
Layers call these functions; nothing here imports a layer.
"""
