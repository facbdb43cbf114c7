"""The weights section: checkpoint names that fill nothing, parameters nothing fills, and the
mapping rule that would fix a systematic mismatch.

Each checkpoint tensor is loaded on its own (`model.load_weights([(name, tensor)])`), so every
finding is in the checkpoint's (HF) name, whatever mappers the model's loaders apply.
"""

from collections import Counter
from dataclasses import dataclass

import torch.nn as nn

from minivllm.model_executor.layers.linear import QKVParallelLinear
from minivllm.model_executor.model_loader.default_loader import DefaultModelLoader
from minivllm.model_executor.models.auto_weights_loader import UnexpectedWeightsError

from .build import CheckTarget
from .report import Section


@dataclass(frozen=True)
class _Candidate:
    hf_name: str             # the name a checkpoint would use for it
    param: str               # the minivllm parameter it fills
    fused: str | None = None    # the fused module's last name (qkv_proj) when a shard
    shard_id: str | int | None = None


def load_and_check(section: Section, target: CheckTarget, model: nn.Module) -> None:
    """Load every checkpoint tensor into `model`, reporting unexpected and missing names."""
    model_config = target.vllm_config.model_config
    loader = DefaultModelLoader(target.vllm_config.load_config)
    unexpected: list[str] = []
    num_names = 0
    failed: set[str] = set()
    # Pass 1, one tensor at a time: which checkpoint names reach no parameter.
    for name, tensor in loader.get_all_weights(model_config, model):
        num_names += 1
        try:
            model.load_weights([(name, tensor)])
        except UnexpectedWeightsError:
            unexpected.append(name)
        except Exception as err:     # a model's own loader may raise anything: report it
            failed.add(name)
            section.error("load_error", f"loading {name!r} failed: {type(err).__name__}: "
                          f"{err}", layer=name)
    # Pass 2, the whole stream as the loader sends it: which parameters get filled (a fused
    # MoE parameter, say, counts as loaded only once every expert has arrived).
    try:
        loaded = _load_all(model, ((n, w) for n, w in loader.get_all_weights(model_config, model)
                                   if n not in failed))
    except Exception as err:     # e.g. a tied weight whose canonical name never came
        section.error("load_error", f"loading the whole checkpoint failed: "
                      f"{type(err).__name__}: {err}")
        loaded = set()
    params = [n for n, _ in model.named_parameters()]
    missing = [n for n in params if n not in loaded]
    candidates = _hf_candidates(model, params)
    _report(section, model, unexpected, missing, candidates,
            strict=getattr(model, "quant_config", None) is None)
    section.data.update(num_checkpoint_names=num_names, num_parameters=len(params),
                        unexpected=unexpected, missing=missing)
    section.summary = (f"{num_names} checkpoint names, {len(params)} parameters; "
                       f"{len(unexpected)} unexpected, {len(missing)} missing")


def _load_all(model: nn.Module, weights) -> set[str]:
    try:
        return set(model.load_weights(weights) or ())
    except UnexpectedWeightsError as err:
        return set(err.loaded)


def part_distance(a: str, b: str) -> float:
    """Edit distance on dotted parts; a substituted part costs its normalised character
    distance, so `wq` -> `q_proj` is a cheaper step than `wq` -> `down_proj`."""
    pa, pb = a.split("."), b.split(".")
    prev = [float(j) for j in range(len(pb) + 1)]
    for i, x in enumerate(pa, 1):
        row = [float(i)]
        for j, y in enumerate(pb, 1):
            sub = 0.0 if x == y else 0.5 + 0.5 * _char_distance(x, y) / max(len(x), len(y))
            row.append(min(prev[j] + 1, row[j - 1] + 1, prev[j - 1] + sub))
        prev = row
    return prev[-1]


def nearest(name: str, pool: list[str]) -> tuple[str | None, float]:
    best = min(pool, key=lambda c: (part_distance(name, c), c), default=None)
    return best, (part_distance(name, best) if best is not None else float("inf"))


def _report(section: Section, model: nn.Module, unexpected: list[str], missing: list[str],
            candidates: list[_Candidate], strict: bool) -> None:
    by_hf = {c.hf_name: c for c in candidates}
    missing_set = set(missing)
    missing_hf = [c.hf_name for c in candidates if c.param in missing_set]
    rules: Counter = Counter()
    for name in unexpected:
        best, dist = nearest(name, missing_hf or list(by_hf))
        rule = _rule(name, by_hf[best], model) if best is not None and dist < 2.5 else None
        if rule is not None:
            rules[rule] += 1
        hint = ""
        if best is not None:
            cand = by_hf[best]
            hint = f"; nearest parameter: {cand.param!r}" + (
                f" (checkpoint name {best!r})" if best != cand.param else "")
        section.error("unexpected", f"checkpoint weight {name!r} maps to no parameter{hint}",
                      layer=name.rsplit(".", 1)[0], fix=rule)
    ckpt_pool = list(unexpected)
    for param in missing:
        wanted = [c.hf_name for c in candidates if c.param == param]
        best = min((nearest(w, ckpt_pool) + (w,) for w in wanted), key=lambda t: t[1],
                   default=(None, float("inf"), param))
        hint = f"; nearest checkpoint name: {best[0]!r}" if best[0] else ""
        report = section.error if strict else section.warning
        report("missing", f"parameter {param!r} (checkpoint name {', '.join(wanted)}) is filled "
               f"by no checkpoint weight{hint}", layer=param.rsplit(".", 1)[0])
    for rule, count in rules.most_common():
        if count > 1:
            section.error("systematic_mismatch", f"{count} checkpoint names differ from the "
                          f"model's names the same way; one rule fixes them all: {rule}",
                          fix=rule)
    section.data["rules"] = [{"rule": r, "count": n} for r, n in rules.most_common()]


def _rule(ckpt: str, cand: _Candidate, model: nn.Module) -> str | None:
    """The WeightsMapper rule that turns checkpoint name `ckpt` into candidate `cand`."""
    if ckpt == cand.hf_name and cand.fused is not None:
        shard = cand.hf_name.split(".")[-2]
        return (f"hf_to_vllm_mapper = WeightsMapper(orig_to_new_stacked={{\".{shard}\": "
                f"(\".{cand.fused}\", {cand.shard_id!r})}}) (a hand-written load_weights: "
                f"stacked_params_mapping entry (\".{cand.fused}\", \".{shard}\", "
                f"{cand.shard_id!r}))")
    a, b = ckpt.split("."), cand.hf_name.split(".")
    if len(a) == len(b):
        # An inner part is matched with both dots, the last one (weight, bias) with one.
        substr = ", ".join(f"\".{x}.\": \".{y}.\"" if i < len(a) - 1 else f"\".{x}\": \".{y}\""
                           for i, (x, y) in enumerate(zip(a, b)) if x != y)
        return f"hf_to_vllm_mapper = WeightsMapper(orig_to_new_substr={{{substr}}})"
    tail = 0
    while tail < min(len(a), len(b)) and a[-1 - tail] == b[-1 - tail]:
        tail += 1
    lead_a, lead_b = ".".join(a[:len(a) - tail]), ".".join(b[:len(b) - tail])
    if not any(p.isdigit() for p in (lead_a + "." + lead_b).split(".")):
        return (f"hf_to_vllm_mapper = WeightsMapper(orig_to_new_prefix="
                f"{{\"{lead_a}.\": \"{lead_b}.\"}})")
    return None


def _hf_candidates(model: nn.Module, params: list[str]) -> list[_Candidate]:
    """Each parameter under the checkpoint name(s) it expects: a fused layer's parameter under
    each shard name `packed_modules_mapping` gives it (qkv_proj -> q_proj, k_proj, v_proj)."""
    mapping = getattr(model, "packed_modules_mapping", None) or {}
    out: list[_Candidate] = []
    for param in params:
        module_path, _, leaf = param.rpartition(".")
        parent, _, fused = module_path.rpartition(".")
        if fused not in mapping:
            out.append(_Candidate(param, param))
            continue
        is_qkv = isinstance(model.get_submodule(module_path), QKVParallelLinear)
        for i, shard in enumerate(mapping[fused]):
            shard_id = "qkv"[i] if is_qkv and i < 3 else i
            hf = ".".join(p for p in (parent, shard, leaf) if p)
            out.append(_Candidate(hf, param, fused, shard_id))
    return out


def _char_distance(x: str, y: str) -> int:
    prev = list(range(len(y) + 1))
    for i, cx in enumerate(x, 1):
        row = [i]
        for j, cy in enumerate(y, 1):
            row.append(min(prev[j] + 1, row[j - 1] + 1, prev[j - 1] + (cx != cy)))
        prev = row
    return prev[-1]
