"""AutoWeightsLoader: stream checkpoint weights down the module tree (contract §5.3, §5.7)."""

import itertools
from collections.abc import Iterable, Iterator

import torch
import torch.nn as nn

from minivllm.logger import init_logger
from minivllm.model_executor.models.placeholders import PPMissingLayer, StageMissingLayer
from minivllm.model_executor.models.weights_mapper import WeightsMapper
from minivllm.model_executor.parameter import default_weight_loader

logger = init_logger(__name__)

Weights = Iterable[tuple[str, torch.Tensor]]

# Rotary caches that some checkpoints save; the model recomputes them.
REMOVE_UNUSED_ROTARY_EMBEDS_MAPPER = WeightsMapper(orig_to_new_substr={
    "rotary_pos_emb.inv_freq": None, "rotary_emb.inv_freq": None,
    "rotary_emb.cos_cached": None, "rotary_emb.sin_cached": None,
})
_EMBEDDING_CLASS_NAMES = ("VocabParallelEmbedding", "ParallelLMHead")
_MAX_LISTED = 50


class UnexpectedWeightsError(ValueError):
    """Checkpoint names with no matching module or parameter, all listed at once.

    `loaded` holds the names that did load, so a caller can still report missing parameters.
    """

    def __init__(self, model_name: str, unexpected: list[str], loaded: set[str],
                 available: dict[str, list[str]]) -> None:
        self.model_name, self.unexpected, self.loaded = model_name, unexpected, loaded
        self.available = available
        where = "; ".join(f"under {p or '<root>'!r}: {_short(names)}" for p, names in available.items())
        super().__init__(
            f"There is no module or parameter named {unexpected} in {model_name} "
            f"({len(unexpected)} unexpected checkpoint weight(s)). The available parameters are {where}")


class AutoWeightsLoader:
    """Loads `(name, tensor)` pairs into `module` by walking its tree by the dotted names.

    Children with their own `load_weights` (inner models, fused linear layers) get their part of
    the stream; placeholders drop theirs; everything else goes through the parameter's
    `weight_loader`. Unknown names are collected and raised together at the end.
    """

    def __init__(self, module: nn.Module, *, ignore_unexpected_prefixes: list[str] | None = None,
                 ignore_unexpected_suffixes: list[str] | None = None) -> None:
        self.module = module
        self.ignore_unexpected_prefixes = list(ignore_unexpected_prefixes or [])
        self.ignore_unexpected_suffixes = list(ignore_unexpected_suffixes or [])
        # alias qualified name -> canonical qualified name (tied embeddings, §5.7)
        self.aliased_params = _find_tied_aliases(module)

    def load_weights(self, weights: Weights, *, mapper: WeightsMapper | None = None) -> set[str]:
        """Load the stream; return the qualified names that were loaded."""
        suffixes = [*self.ignore_unexpected_suffixes, ".bias"]
        mappers = [m for m in (mapper,) if m is not None]
        quant_config = _find_quant_config(self.module)
        if quant_config is not None:
            mappers += _quant_mappers(quant_config)
            suffixes += list(getattr(quant_config, "_ignore_unexpected_suffixes", None) or [])
        mappers.append(REMOVE_UNUSED_ROTARY_EMBEDS_MAPPER)
        self._suffixes = tuple(suffixes)
        self._unexpected: list[str] = []
        self._available: dict[str, list[str]] = {}
        self._alias_check = True
        self._warned_casts: set[tuple[torch.dtype, torch.dtype]] = set()
        skipped_aliases: dict[str, str] = {}

        stream: Iterable[tuple[str, torch.Tensor]] = weights
        for m in mappers:
            stream = m.apply(stream)
        stream = self._drop_aliases(stream, skipped_aliases)
        loaded = set(self._load_module("", self.module, stream))
        if self._unexpected:
            raise UnexpectedWeightsError(type(self.module).__name__, self._unexpected, loaded,
                                         self._available)
        if self._alias_check:
            self._check_aliases(skipped_aliases, loaded)
        return loaded

    # ---- descent -------------------------------------------------------------------------------

    def _load_module(self, base_prefix: str, module: nn.Module, weights: Weights) -> Iterator[str]:
        if isinstance(module, (PPMissingLayer, StageMissingLayer)):
            for _ in weights:   # another stage (or no stage) owns these: drop silently
                pass
            return
        if module is not self.module and callable(getattr(module, "load_weights", None)):
            yield from self._delegate(base_prefix, module, weights)
            return
        children = dict(module.named_children())
        params = dict(module.named_parameters(recurse=False))
        buffers = {name: buf for name, buf in module.named_buffers(recurse=False)
                   if name not in module._non_persistent_buffers_set}
        for child_prefix, group in itertools.groupby(weights, key=lambda item: item[0].split(".", 1)[0]):
            qualified = _join(base_prefix, child_prefix)
            if child_prefix in children:
                stripped = ((name.split(".", 1)[1] if "." in name else "", w) for name, w in group)
                yield from self._load_module(qualified, children[child_prefix], stripped)
            elif child_prefix in params or child_prefix in buffers:
                target = params.get(child_prefix, buffers.get(child_prefix))
                yield from self._load_tensor(base_prefix, child_prefix, target, group)
            else:
                for name, _ in group:
                    self._record_unexpected(base_prefix, _join(base_prefix, name), module)

    def _delegate(self, base_prefix: str, module: nn.Module, weights: Weights) -> Iterator[str]:
        """Hand this part of the stream to the child's own `load_weights`."""
        try:
            names = module.load_weights(weights)
        except UnexpectedWeightsError as err:
            # Keep going so that the top-level error lists every unexpected name.
            self._unexpected += [_join(base_prefix, n) for n in err.unexpected]
            for prefix, avail in err.available.items():
                self._available.setdefault(_join(base_prefix, prefix), avail)
            names = err.loaded
        if names is None:
            logger.warning("%s.load_weights returned None; the tied-weight check is disabled.",
                           type(module).__name__)
            self._alias_check = False
            return
        yield from (_join(base_prefix, n) for n in names)

    def _load_tensor(self, base_prefix: str, name: str, target: torch.Tensor,
                     group: Weights) -> Iterator[str]:
        qualified = _join(base_prefix, name)
        for weight_name, weight in group:
            if weight_name != name:
                if not self._can_skip(_join(base_prefix, weight_name)):
                    self._record_unexpected(base_prefix, _join(base_prefix, weight_name), None,
                                            note=f"nested weight aimed at the single tensor {qualified!r}")
                continue
            if weight.dtype != target.dtype:
                self._note_cast(qualified, weight.dtype, target.dtype, weight.dim())
            loader = getattr(target, "weight_loader", default_weight_loader)
            with torch.no_grad():
                loader(target, weight)
            yield qualified

    # ---- bookkeeping ---------------------------------------------------------------------------

    def _note_cast(self, qualified: str, src: torch.dtype, dst: torch.dtype,
                   ndim: int = 2) -> None:
        # Exact widenings (fp16 -> fp32) are routine, and so are vectors (norm weights, biases)
        # kept in fp32 beside half-precision matrices (GGUF files always store norms so); a
        # narrowing cast of a matrix is worth one warning.
        try:
            widening = torch.promote_types(src, dst) == dst
        except RuntimeError:      # fp8 and other dtypes without promotion rules
            widening = False
        if widening or ndim < 2 or (src, dst) in self._warned_casts:
            logger.debug("Loading %s: casting %s to %s", qualified, src, dst)
            return
        self._warned_casts.add((src, dst))
        logger.warning("Casting checkpoint weights from %s to %s (first: %s)", src, dst, qualified)

    def _can_skip(self, qualified: str) -> bool:
        return (qualified.startswith(tuple(self.ignore_unexpected_prefixes))
                or qualified.endswith(self._suffixes))

    def _record_unexpected(self, base_prefix: str, qualified: str, module: nn.Module | None,
                           note: str = "") -> None:
        if self._can_skip(qualified):
            logger.debug("Ignoring unexpected checkpoint weight %s", qualified)
            return
        self._unexpected.append(f"{qualified} ({note})" if note else qualified)
        if module is not None and base_prefix not in self._available:
            self._available[base_prefix] = [n for n, _ in module.named_parameters()]

    def _drop_aliases(self, stream: Weights, skipped: dict[str, str]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in stream:
            if name in self.aliased_params:
                skipped[name] = self.aliased_params[name]
                continue
            yield name, tensor

    def _check_aliases(self, skipped: dict[str, str], loaded: set[str]) -> None:
        for alias, canonical in skipped.items():
            if canonical not in loaded:
                raise ValueError(
                    f"'{alias}' was skipped because it is tied to '{canonical}' in "
                    f"{type(self.module).__name__}, but '{canonical}' was not found in the "
                    "checkpoint, so the tied weight is uninitialized.")


def _join(prefix: str, name: str) -> str:
    if not prefix:
        return name
    return f"{prefix}.{name}" if name else prefix


def _short(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:_MAX_LISTED])
    more = f", ... ({len(names) - _MAX_LISTED} more)" if len(names) > _MAX_LISTED else ""
    return f"[{shown}{more}]"


def _find_tied_aliases(module: nn.Module) -> dict[str, str]:
    """Embedding parameters reachable under two names: the first name met is canonical."""
    first_name: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        if not any(cls.__name__ in _EMBEDDING_CLASS_NAMES for cls in type(mod).__mro__):
            continue
        for param_name, param in mod.named_parameters(recurse=False):
            qualified = _join(mod_name, param_name)
            canonical = first_name.setdefault(id(param), qualified)
            if canonical != qualified:
                aliases[qualified] = canonical
    return aliases


def _find_quant_config(module: nn.Module):
    for candidate in (module, *module.children()):
        quant_config = getattr(candidate, "quant_config", None)
        if quant_config is not None:
            return quant_config
    return None


def _quant_mappers(quant_config) -> list[WeightsMapper]:
    mappers = []
    for getter in ("get_cache_scale_mapper", "get_checkpoint_weight_mapper"):
        fn = getattr(quant_config, getter, None)
        found = fn() if callable(fn) else None
        if found is not None:
            mappers.append(found)
    return mappers
