"""Worker extensions (vLLM's worker_extension_cls) the collective_rpc tests load by name."""

import torch


class ParamStats:
    """Methods every worker gains: they read the rank's own shard."""

    def num_params(self) -> int:
        return sum(p.numel() for p in self.get_model().parameters())

    def scaled_rank(self, factor: int, *, offset: int = 0) -> int:
        return self.rank * factor + offset

    def param_checksum(self) -> float:
        with torch.no_grad():
            return float(sum(p.double().sum() for p in self.get_model().parameters()))


class Clashing:
    def execute_model(self, scheduler_output):   # would replace the Worker's own
        return None
