"""The parallel section: valid TP sizes, the PP layer split, and (with -tp/-pp) a real
multi-process dry run that builds and loads every rank and runs one step."""

import contextlib
import os
from collections.abc import Callable

from torch import nn

from minivllm.config.vllm import valid_tp_sizes
from minivllm.distributed.utils import get_pp_indices
from minivllm.model_executor.kernels.gguf_linear import gguf_block_shape
from minivllm.model_executor.layers.fused_moe import RoutedExperts
from minivllm.model_executor.layers.linear import RowParallelLinear
from minivllm.model_executor.layers.quantization.gguf import GGUFLinearMethod
from minivllm.model_executor.layers.quantization.gguf_moe import GGUFMoEMethod
from minivllm.model_executor.layers.quantization.gguf_sharding import splits_whole_blocks
from minivllm.model_executor.layers.vocab_parallel_embedding import pad_vocab_size
from minivllm.model_executor.models import interfaces as itf

from .build import CheckTarget, model_file_plugin, registered_as, small_cache
from .report import Section

_SHOWN_PP_SIZES = (2, 4)


def parallel_section(section: Section, target: CheckTarget, tp: int = 1, pp: int = 1,
                     dry_run: bool = True, model: nn.Module | None = None) -> None:
    """`model`: the built (and loaded) model, whose layers may limit TP further."""
    mc = target.vllm_config.model_config
    heads, kv_heads = mc.get_num_attention_heads(), mc.get_total_num_kv_heads()
    valid = valid_tp_sizes(mc)
    inter = getattr(mc.hf_text_config, "intermediate_size", None)
    if isinstance(inter, int):     # MergedColumnParallelLinear splits it evenly too
        valid = [t for t in valid if inter % t == 0]
    limits = layer_tp_limits(model)
    valid = [t for t in valid if all(accepts(t) for accepts in limits.values())]
    section.data["layer_limits"] = list(limits)
    padded = pad_vocab_size(mc.get_vocab_size())
    section.data["valid_tp_sizes"] = valid
    section.data["tp_shapes"] = {t: {"heads_per_rank": heads // t,
                                     "kv_heads_per_rank": max(1, kv_heads // t),
                                     "kv_heads_replicated": kv_heads < t,
                                     "vocab_rows_per_rank": padded // t} for t in valid}
    num_layers = mc.get_num_layers()
    supports_pp = itf.supports_pp(target.model_class)
    section.data["supports_pp"] = supports_pp
    section.data["pp_layer_partition"] = {}
    sizes = sorted({s for s in (*_SHOWN_PP_SIZES, pp) if 1 < s <= num_layers})
    for size in sizes:
        try:
            section.data["pp_layer_partition"][size] = [list(get_pp_indices(num_layers, r, size))
                                                        for r in range(size)]
        except ValueError as err:          # a VLLM_PP_LAYER_PARTITION for another size
            if size == pp:
                section.error("pp_partition", str(err))
    section.data["VLLM_PP_LAYER_PARTITION"] = os.environ.get("VLLM_PP_LAYER_PARTITION")
    if tp not in valid:
        refusing = [what for what, accepts in limits.items() if not accepts(tp)]
        by = f"; refused by {', '.join(refusing)}" if refusing else ""
        section.error("tp_size", f"tensor_parallel_size {tp} does not split this model "
                      f"({heads} heads, {kv_heads} KV heads, padded vocab {padded}, "
                      f"intermediate {inter}{by}); valid sizes: {valid}")
    if pp > 1 and not supports_pp:
        section.error("pp_support", f"{target.model_class.__name__} does not support pipeline "
                      "parallelism (SupportsPP and forward(intermediate_tensors=...))")
    if pp > num_layers:
        section.error("pp_size", f"pipeline_parallel_size {pp} is larger than the number of "
                      f"layers ({num_layers})")
    section.summary = f"valid TP sizes {valid}; " + ("PP supported" if supports_pp
                                                     else "no PP")
    section.text_rows.extend(
        f"TP {t}: {s['heads_per_rank']} heads, {s['kv_heads_per_rank']} KV heads"
        + (" (replicated)" if s["kv_heads_replicated"] else "")
        + f", {s['vocab_rows_per_rank']} vocab rows per rank"
        for t, s in section.data["tp_shapes"].items())
    if limits:
        section.text_rows.append("layers limiting TP: " + "; ".join(limits))
    section.text_rows.extend(
        f"PP {size}: layers " + ", ".join(f"[{a}, {b})" for a, b in split)
        for size, split in section.data["pp_layer_partition"].items())
    if dry_run and tp * pp > 1 and not section.errors():
        _dry_run(section, target, tp, pp)


def layer_tp_limits(model: nn.Module | None) -> dict[str, Callable[[int], bool]]:
    """{layer and its constraint: accepts(tp)} for layers whose own shapes limit TP beyond the
    config's sizes: a MoE layer's intermediate size (each expert is split; not under expert
    parallelism) and, for GGUF weights, whole blocks per rank of the input that a row-parallel
    layer or a MoE down projection splits. One entry per distinct constraint (its first layer)."""
    limits: dict[tuple, tuple[str, Callable[[int], bool]]] = {}
    for name, module in model.named_modules() if model is not None else ():
        method = getattr(module, "quant_method", None)
        if isinstance(module, RoutedExperts) and not module.use_ep:
            size, what = module.intermediate_size, "MoE intermediate"
            qtype = getattr(module, "w2_qweight_type", None) if isinstance(
                method, GGUFMoEMethod) else None
        elif isinstance(module, RowParallelLinear) and isinstance(method, GGUFLinearMethod):
            size, what, qtype = module.input_size, "input", module.qweight_type
        else:
            continue
        elems = gguf_block_shape(qtype)[0] if qtype is not None else 1
        blocks = f", {elems}-value GGUF blocks" if elems > 1 else ""
        limits.setdefault((what, size, elems), (
            f"{name} ({what} {size}{blocks})",
            lambda t, n=size, e=elems: splits_whole_blocks(n, e, t)))
    return dict(limits.values())


def _dry_run(section: Section, target: CheckTarget, tp: int, pp: int) -> None:
    """Start tp x pp worker processes, build and load every rank, run one greedy step."""
    from minivllm import LLM, SamplingParams

    load_format = target.vllm_config.load_config.load_format
    model = target.vllm_config.model_config.model if not target.config_only else None
    if model is None:
        section.error("dry_run_config_only", "the dry run needs a model folder or GGUF file")
        return
    # Worker ranks resolve the architecture in their own processes: a --model-file class
    # reaches them through a temporary general plugin (the driver registers it directly).
    from_file = ".py:" in target.class_ref
    in_ranks = model_file_plugin(target.class_ref, target.architecture) if from_file \
        else contextlib.nullcontext()
    in_driver = registered_as(target.architecture, target.model_class) if from_file \
        else contextlib.nullcontext()
    try:
        with in_ranks, in_driver:
            llm = LLM(model, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                      dtype="float32", load_format=load_format,
                      seed=target.vllm_config.model_config.seed, **small_cache(target))
    except Exception as err:
        section.error("dry_run", f"building the {tp} x {pp} ranks failed: "
                      f"{type(err).__name__}: {err}")
        return
    try:
        out = llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=1,
                                                          ignore_eos=True), use_tqdm=False)
        section.data["dry_run"] = {"tensor_parallel_size": tp, "pipeline_parallel_size": pp,
                                   "ranks": tp * pp, "token": out[0].outputs[0].token_ids[0]}
        section.info("dry_run", f"{tp * pp} ranks (TP {tp} x PP {pp}) built, loaded and ran "
                     "one step")
    except Exception as err:
        section.error("dry_run", f"the first step on {tp} x {pp} ranks failed: "
                      f"{type(err).__name__}: {err}")
    finally:
        llm.shutdown()
