"""EngineArgs: the flat user-facing knobs, turned into a VllmConfig."""

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any

from minivllm.config import (CacheConfig, CompilationConfig, DeviceConfig, LoadConfig, ModelConfig,
                             ParallelConfig, SchedulerConfig, VllmConfig)


@dataclass
class EngineArgs:
    model: str | None = None                 # HF folder or .gguf; None = embedded SmolLM2
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    block_size: int = 16
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_num_queued_requests: int = 1024
    enforce_eager: bool = True
    compilation_config: dict[str, Any] | int | None = None
    load_format: str = "auto"
    device: str = "cpu"

    def create_engine_config(self) -> VllmConfig:
        """Validate every part once and assemble the VllmConfig."""
        model_config = ModelConfig(model=self.model, tokenizer=self.tokenizer, dtype=self.dtype,
                                   max_model_len=self.max_model_len, seed=self.seed,
                                   enforce_eager=self.enforce_eager)
        return VllmConfig(
            model_config=model_config,
            cache_config=CacheConfig(block_size=self.block_size, cache_dtype=self.kv_cache_dtype,
                                     enable_prefix_caching=self.enable_prefix_caching,
                                     num_gpu_blocks_override=self.num_gpu_blocks_override,
                                     kv_cache_memory_bytes=self.kv_cache_memory_bytes),
            parallel_config=ParallelConfig(tensor_parallel_size=self.tensor_parallel_size,
                                           pipeline_parallel_size=self.pipeline_parallel_size,
                                           nnodes=self.nnodes, node_rank=self.node_rank,
                                           master_addr=self.master_addr,
                                           master_port=self.master_port),
            scheduler_config=SchedulerConfig(
                max_num_batched_tokens=max(self.max_num_batched_tokens, 1),
                max_num_seqs=self.max_num_seqs,
                max_num_queued_requests=self.max_num_queued_requests),
            device_config=DeviceConfig(self.device),
            load_config=LoadConfig(load_format=self.load_format),
            compilation_config=self._compilation_config())

    def _compilation_config(self) -> CompilationConfig:
        cc = self.compilation_config
        if isinstance(cc, CompilationConfig):
            return cc
        if isinstance(cc, int):
            return CompilationConfig(mode=cc)
        if cc:
            return CompilationConfig(**cc)
        return CompilationConfig(mode=0 if self.enforce_eager else 3)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Engine flags shared by `generate`, `chat`, `serve` and `bench`."""
        g = parser.add_argument_group("engine")
        g.add_argument("--model", default=None, help="HF checkpoint folder or .gguf file "
                       "(default: the embedded SmolLM2-135M-Instruct)")
        g.add_argument("--tokenizer", default=None)
        g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
        g.add_argument("--max-model-len", type=int, default=None)
        g.add_argument("--seed", type=int, default=0)
        g.add_argument("--block-size", type=int, default=16)
        g.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching",
                       action="store_false", default=True)
        g.add_argument("--num-gpu-blocks-override", type=int, default=None)
        g.add_argument("--kv-cache-memory-bytes", type=int, default=None)
        g.add_argument("-tp", "--tensor-parallel-size", type=int, default=1)
        g.add_argument("-pp", "--pipeline-parallel-size", type=int, default=1)
        g.add_argument("--nnodes", type=int, default=1)
        g.add_argument("--node-rank", type=int, default=0)
        g.add_argument("--master-addr", default="127.0.0.1")
        g.add_argument("--master-port", type=int, default=None)
        g.add_argument("--max-num-seqs", type=int, default=128)
        g.add_argument("--max-num-batched-tokens", type=int, default=2048)
        g.add_argument("--max-num-queued-requests", type=int, default=1024)
        g.add_argument("--enforce-eager", action="store_true", default=True)
        g.add_argument("--compile", dest="enforce_eager", action="store_false",
                       help="torch.compile the model (inductor)")
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})
