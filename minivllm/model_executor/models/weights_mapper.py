"""WeightsMapper: rename checkpoint weights (and tag fused-layer shards) before they are loaded."""

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from minivllm.logger import init_logger

logger = init_logger(__name__)

ShardId = str | int | None
# A stacked target: `(new_substring, shard_id)`; a list of ids yields the tensor once per id.
StackedTarget = tuple[str, ShardId | list[ShardId]]


@dataclass
class WeightsMapper:
    """Maps checkpoint names to module names in six fixed stages (contract §5.4):

    renaming -> regex -> substr -> stacked -> prefix -> suffix.
    A None target drops the weight (except in the stacked stage, which never drops).
    """

    # Objects with `rename_source_key(key) -> new_key | (new_key, matched_pattern)`
    # (Transformers' `WeightRenaming`).
    orig_to_new_renaming: list[Any] = field(default_factory=list)
    orig_to_new_regex: dict[re.Pattern | str, str | None] = field(default_factory=dict)
    orig_to_new_substr: dict[str, str | None] = field(default_factory=dict)
    orig_to_new_stacked: dict[str, StackedTarget] = field(default_factory=dict)
    orig_to_new_prefix: dict[str, str | None] = field(default_factory=dict)
    orig_to_new_suffix: dict[str, str | None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.orig_to_new_regex = {re.compile(k) if isinstance(k, str) else k: v
                                  for k, v in self.orig_to_new_regex.items()}

    def __or__(self, other: "WeightsMapper") -> "WeightsMapper":
        """Merge every field; `other` wins on key clashes."""
        return WeightsMapper(
            orig_to_new_renaming=[*self.orig_to_new_renaming, *other.orig_to_new_renaming],
            orig_to_new_regex={**self.orig_to_new_regex, **other.orig_to_new_regex},
            orig_to_new_substr={**self.orig_to_new_substr, **other.orig_to_new_substr},
            orig_to_new_stacked={**self.orig_to_new_stacked, **other.orig_to_new_stacked},
            orig_to_new_prefix={**self.orig_to_new_prefix, **other.orig_to_new_prefix},
            orig_to_new_suffix={**self.orig_to_new_suffix, **other.orig_to_new_suffix},
        )

    def _map_name_with_shard(self, key: str) -> tuple[str, ShardId | list[ShardId]] | None:
        """`(new_name, shard_id)`, or None when a rule drops the weight."""
        for renaming in self.orig_to_new_renaming:
            renamed = renaming.rename_source_key(key)
            key = renamed[0] if isinstance(renamed, tuple) else renamed
        if key.endswith(".kv_scale"):
            logger.warning("'%s': the '.kv_scale' checkpoint format is deprecated; use "
                           "'.k_scale' and '.v_scale'.", key)
        for pattern, new in self.orig_to_new_regex.items():
            if pattern.search(key):
                if new is None:
                    return None
                key = pattern.sub(new, key)
        for substr, new in self.orig_to_new_substr.items():
            if substr in key:
                if new is None:
                    return None
                key = key.replace(substr, new, 1)
        shard_id: ShardId | list[ShardId] = None
        for substr, (new, sid) in self.orig_to_new_stacked.items():
            # NOTE: the leading dot in ".up_proj" keeps it from matching inside ".gate_up_proj".
            if substr in key:
                key, shard_id = key.replace(substr, new, 1), sid
        for prefix, new in self.orig_to_new_prefix.items():
            if key.startswith(prefix):
                if new is None:
                    return None
                key = new + key[len(prefix):]
        for suffix, new in self.orig_to_new_suffix.items():
            if key.endswith(suffix):
                if new is None:
                    return None
                key = new.join(key.rsplit(suffix, 1))
        return key, shard_id

    def _map_name(self, key: str) -> str | None:
        mapped = self._map_name_with_shard(key)
        return None if mapped is None else mapped[0]

    map_name = _map_name

    def apply(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Map every name; a stacked match writes `tensor.shard_id` (one copy per id for a list)."""
        for name, tensor in weights:
            mapped = self._map_name_with_shard(name)
            if mapped is None:
                continue
            new_name, shard_id = mapped
            if isinstance(shard_id, list):
                for i, sid in enumerate(shard_id):
                    # Later copies are aliases of the same data, so each can carry its own id.
                    copy = tensor if i == 0 else tensor.detach()
                    copy.shard_id = sid
                    yield new_name, copy
                continue
            if shard_id is not None:
                tensor.shard_id = shard_id
            yield new_name, tensor

    def apply_list(self, values: list[str]) -> list[str]:
        return [out for out in map(self._map_name, values) if out is not None]

    def apply_dict(self, values: dict[str, Any]) -> dict[str, Any]:
        return {out: value for name, value in values.items()
                if (out := self._map_name(name)) is not None}

    def get_rename_mapper(self) -> "WeightsMapper":
        """A copy without stacked rules and without dropping rules (what quant configs receive)."""
        return WeightsMapper(
            orig_to_new_renaming=list(self.orig_to_new_renaming),
            orig_to_new_regex={k: v for k, v in self.orig_to_new_regex.items() if v is not None},
            orig_to_new_substr={k: v for k, v in self.orig_to_new_substr.items() if v is not None},
            orig_to_new_prefix={k: v for k, v in self.orig_to_new_prefix.items() if v is not None},
            orig_to_new_suffix={k: v for k, v in self.orig_to_new_suffix.items() if v is not None},
        )
