"""IntermediateTensors: what one pipeline stage hands to the next."""

from dataclasses import dataclass

import torch


@dataclass(init=False)
class IntermediateTensors:
    """A dict of named tensors, each `[num_tokens, ...]`, passed between PP stages."""

    tensors: dict[str, torch.Tensor]

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def __getitem__(self, key: str | slice):
        if isinstance(key, str):
            return self.tensors[key]
        if isinstance(key, slice):
            return self.__class__({k: v[key] for k, v in self.tensors.items()})
        raise TypeError(f"IntermediateTensors index must be str or slice, got {type(key)}")

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        self.tensors[key] = value

    def items(self):
        return self.tensors.items()

    def __len__(self) -> int:
        return len(self.tensors)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, self.__class__):
            return False
        if self.tensors.keys() != other.tensors.keys():
            return False
        return all(torch.equal(self.tensors[k], other.tensors[k]) for k in self.tensors)

    def __repr__(self) -> str:
        return f"IntermediateTensors(tensors={self.tensors})"

    @staticmethod
    def empty_like(it: "IntermediateTensors") -> "IntermediateTensors":
        return IntermediateTensors({k: torch.empty_like(v) for k, v in it.tensors.items()})
