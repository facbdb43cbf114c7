"""Modules that stand in for layers a rank does not hold (pipeline stages) or a model drops."""

from typing import Any

import torch.nn as nn


class PPMissingLayer(nn.Identity):
    """Stands in for a module that another pipeline stage owns; passes its input through."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # Return the first positional argument, else the first keyword value.
        if args:
            return args[0]
        return next(iter(kwargs.values())) if kwargs else None


class StageMissingLayer(nn.Module):
    """Placeholder for a whole stage (e.g. the LM head of a pooling model) that must never run.

    The replaced module is kept as a plain attribute, not a submodule, so its parameters do not
    show up in `named_parameters()` and the loader never asks for them.
    """

    def __init__(self, stage_name: str, module: nn.Module | None = None) -> None:
        super().__init__()
        self.stage_name = stage_name
        self.__dict__["module"] = module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        owner = type(self.__dict__["module"]).__name__ if self.__dict__["module"] is not None else "module"
        raise RuntimeError(f"The {self.stage_name!r} stage ({owner}) is not available in this model; "
                           "it was replaced by a StageMissingLayer.")

    def extra_repr(self) -> str:
        return f"stage_name={self.stage_name!r}"
