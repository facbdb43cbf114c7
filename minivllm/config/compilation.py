"""CompilationConfig: torch.compile mode, custom-op switches and the static forward context."""

import enum
from dataclasses import dataclass, field
from typing import Any


class CompilationMode(enum.IntEnum):
    NONE = 0
    STOCK_TORCH_COMPILE = 1
    DYNAMO_TRACE_ONCE = 2
    VLLM_COMPILE = 3


class CUDAGraphMode(enum.IntEnum):
    """Which steps replay a captured graph (vLLM's names; minivllm has CPU graphs of whole
    decode-only steps, `compilation/cpu_graph.py`, and no piecewise graphs)."""
    NONE = 0
    FULL_DECODE_ONLY = 3


@dataclass
class CompilationConfig:
    mode: CompilationMode = CompilationMode.NONE
    backend: str = "inductor"
    custom_ops: list[str] = field(default_factory=list)   # "all"/"none" plus "+name"/"-name"
    # prefix -> Attention layer; filled by layers at construction (NOTE: names must be unique)
    static_forward_context: dict[str, Any] = field(default_factory=dict, repr=False)
    enabled_custom_ops: set[str] = field(default_factory=set, repr=False)
    # vLLM's ops that split a piecewise-compiled graph (model files append theirs). minivllm
    # compiles one whole graph with opaque ops instead, so the list is only recorded.
    splitting_ops: list[str] | None = None
    # Steps with at most this many tokens run the model eagerly even when it is compiled. 0: all
    # compiled (one-token steps get their own graph: dynamo specialises a size of 1). Since the
    # compiled forward checks only its arguments' guards, it pays at batch-1 decode too (bf16
    # SmolLM2, 2 cores: 60.8-65.7 compiled vs 43.5-45.5 eager tok/s, same session).
    eager_max_tokens: int = 0
    disabled_custom_ops: set[str] = field(default_factory=set, repr=False)
    # Decode-only steps of up to max_cudagraph_capture_size sequences replay a CPU graph of
    # their native kernel calls (captured on a size's first step) when the model runs eagerly on
    # one CPU rank and every op of its step is a native kernel; NONE runs every step eagerly.
    cudagraph_mode: CUDAGraphMode = CUDAGraphMode.FULL_DECODE_ONLY
    max_cudagraph_capture_size: int = 64

    def __post_init__(self) -> None:
        self.mode = CompilationMode(int(self.mode))
        if isinstance(self.cudagraph_mode, str):
            names = [m.name for m in CUDAGraphMode]
            if self.cudagraph_mode.upper() not in names:
                raise ValueError(f"cudagraph_mode must be one of {names}; "
                                 f"got {self.cudagraph_mode!r}")
            self.cudagraph_mode = CUDAGraphMode[self.cudagraph_mode.upper()]
        self.cudagraph_mode = CUDAGraphMode(int(self.cudagraph_mode))
        if self.max_cudagraph_capture_size < 0:
            raise ValueError(f"max_cudagraph_capture_size must be >= 0, "
                             f"got {self.max_cudagraph_capture_size}")
        for op in self.custom_ops:
            if op not in ("all", "none") and op[:1] not in "+-":
                raise ValueError(f"custom_ops entries must be 'all', 'none', '+name' or '-name'; got {op!r}")

    def set_default_custom_ops(self, device: str = "cpu") -> None:
        """vLLM's default: 'none' when inductor compiles the model, else 'all'.

        NOTE: on CPU it is always 'all': minivllm's CPU forwards are single torch ops (e.g.
        `torch.rms_norm`) that inductor decomposes and fuses as well as the native maths, and the
        steps that stay eager (`eager_max_tokens`) need them fast.
        """
        if any(op in ("all", "none") for op in self.custom_ops):
            return
        compiles = self.mode != CompilationMode.NONE and self.backend == "inductor"
        self.custom_ops.append("none" if compiles and device != "cpu" else "all")

    def custom_op_log_check(self) -> None:
        """Warn-free placeholder kept for contract parity (vLLM logs unused +/- entries)."""
