"""The numerics section (--hf): one prompt through minivllm and transformers (fp32, same
weights), every module's output compared by name, the first one that leaves the tolerance named
in both trees; then greedy tokens and logprobs compared as vLLM's `check_logprobs_close`.

minivllm names map to transformers names directly, except fused layers, which map through
`packed_modules_mapping` (`qkv_proj` <-> concat of `q_proj, k_proj, v_proj` outputs).
"""

import re
from collections.abc import Callable

import torch
import torch.nn as nn

from .build import CheckTarget, registered_as, small_cache
from .report import Section

NUM_LOGPROBS = 5
_DECODER_LAYER = re.compile(r"(^|\.)layers\.\d+$")


def numerics_section(section: Section, target: CheckTarget, *, prompt: str | None = None,
                     max_tokens: int = 8, rtol: float = 1e-3, logprob_atol: float = 1e-3) -> None:
    model_config = target.vllm_config.model_config
    if target.checkpoint_dir is None and not model_config.is_gguf:
        section.skip("needs a checkpoint with weights (a HF folder or a GGUF file)")
        return
    from minivllm import LLM, SamplingParams

    hf_model = _load_hf_model(model_config.model, model_config.is_gguf)
    # A GGUF file runs dequantised in fp32 (quantization "none"), as transformers reads it.
    extra = {"quantization": "none"} if model_config.is_gguf else {}
    with registered_as(target.architecture, target.model_class):
        llm = LLM(model_config.model, dtype="float32", enforce_eager=True,
                  seed=model_config.seed, **small_cache(target), **extra)
    try:
        ids = _prompt_ids(llm.get_tokenizer(), prompt, hf_model.config.vocab_size)
        mv_model = llm.llm_engine.executor.worker.model_runner.model
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                logprobs=NUM_LOGPROBS)
        mv_outputs, outs = capture_outputs(mv_model, lambda: llm.generate([ids], params,
                                                                          use_tqdm=False))
        hf_outputs, _ = capture_outputs(hf_model, lambda: hf_model(torch.tensor([ids])))
    finally:
        llm.shutdown()
    packed = getattr(target.model_class, "packed_modules_mapping", None) or {}
    # A fused activation (SiluAndMul: silu(gate) * up) is not transformers' act_fn (silu(gate)).
    skip = {n for n, m in mv_model.named_modules() if type(m).__name__.endswith("AndMul")}
    rows = compare_layers(mv_outputs, hf_outputs, packed, rtol, skip)
    _report_layers(section, rows, rtol)
    completion = outs[0].outputs[0]
    _compare_greedy(section, hf_model, ids, list(completion.token_ids), completion.logprobs,
                    logprob_atol)


def _load_hf_model(path: str, gguf: bool) -> nn.Module:
    """transformers' model on the same weights, fp32 (a GGUF file dequantised on load)."""
    import os

    from transformers import AutoModelForCausalLM

    if gguf:
        folder, name = os.path.split(os.path.abspath(path))
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


def capture_outputs(model: nn.Module, run: Callable[[], object]
                    ) -> tuple[dict[str, object], object]:
    """Every submodule's output of its FIRST call (the prompt's forward), in completion order."""
    outputs: dict[str, object] = {}

    def hook_for(name: str):
        def hook(module: nn.Module, args: object, output: object) -> None:
            if name not in outputs:
                outputs[name] = _detach(output)
        return hook

    handles = [m.register_forward_hook(hook_for(n)) for n, m in model.named_modules() if n]
    try:
        result = run()
    finally:
        for h in handles:
            h.remove()
    return outputs, result


def compare_layers(mv: dict[str, object], hf: dict[str, object],
                   packed: dict[str, list[str]], rtol: float,
                   skip: set[str] = frozenset()) -> list[dict]:
    """One row per minivllm module with a transformers counterpart, in minivllm's order."""
    rows = []
    for name, out in mv.items():
        hf_names = _hf_names(name, hf, packed)
        if hf_names is None or name in skip:
            continue
        a = _as_rows(_mv_tensor(name, out))
        parts = [_as_rows(_first_tensor(hf[n]), batch_dim=True) for n in hf_names]
        if a is None or any(p is None for p in parts):
            continue
        b = torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]
        if a.shape != b.shape:
            continue
        max_abs = (a - b).abs().max().item()
        rel = max_abs / max(b.abs().max().item(), 1e-12)
        rows.append({"module": name, "hf_modules": hf_names, "max_abs_error": max_abs,
                     "max_rel_error": rel, "ok": rel <= rtol})
    return rows


def _report_layers(section: Section, rows: list[dict], rtol: float) -> None:
    section.data["layers"] = rows
    section.data["rtol"] = rtol
    section.text_rows.append(f"{'module':44} {'transformers':44} {'max abs':>9} {'max rel':>9}")
    for r in rows:
        section.text_rows.append(f"{r['module']:44} {_short_names(r['hf_modules']):44} "
                                 f"{r['max_abs_error']:9.2e} {r['max_rel_error']:9.2e}"
                                 + ("" if r["ok"] else "  <-"))
    # The divergence is the run of out-of-tolerance rows that lasts to the end: an error
    # propagates down the residual stream. A row out of tolerance with matching rows after it
    # is a module that computes something else under the same name (Gemma's embedding scales
    # inside transformers' module, outside minivllm's): a warning, not the divergence.
    last_ok = max((i for i, r in enumerate(rows) if r["ok"]), default=-1)
    first = rows[last_ok + 1] if last_ok + 1 < len(rows) else None
    for r in rows[:last_ok + 1]:
        if not r["ok"]:
            section.warning("local_mismatch", f"output differs from transformers' "
                            f"{', '.join(r['hf_modules'])} (rel {r['max_rel_error']:.3g}) but "
                            "later modules match: the two modules compute different parts of "
                            "the same step", layer=r["module"])
    section.data["first_divergence"] = first and {"module": first["module"],
                                                  "hf_modules": first["hf_modules"]}
    if first is not None:
        section.error("divergence", f"outputs leave the tolerance (rel {rtol:g}) here: minivllm "
                      f"{first['module']} vs transformers {', '.join(first['hf_modules'])} "
                      f"(max abs {first['max_abs_error']:.3g}, rel {first['max_rel_error']:.3g});"
                      " every later module is off too", layer=first["module"])
    section.summary = f"{len(rows)} modules compared" + (
        f", first divergence at {first['module']}" if first else ", no divergence")


def _compare_greedy(section: Section, hf_model: nn.Module, ids: list[int], mv_tokens: list[int],
                    mv_logprobs: list[dict], atol: float) -> None:
    """vLLM's check_logprobs_close: equal tokens until the first difference, which passes only
    as a near-tie (each side's token in the other's top logprobs); then comparison stops."""
    seq = list(ids)
    max_diff = 0.0
    with torch.no_grad():
        for step, mv_tok in enumerate(mv_tokens):
            logprobs = torch.log_softmax(hf_model(torch.tensor([seq])).logits[0, -1].double(), -1)
            hf_tok = int(logprobs.argmax())
            hf_top = set(logprobs.topk(NUM_LOGPROBS).indices.tolist())
            if mv_tok != hf_tok:
                mv_top = set(mv_logprobs[step])
                if mv_tok in hf_top and hf_tok in mv_top:
                    section.info("near_tie", f"step {step}: minivllm chose {mv_tok}, "
                                 f"transformers {hf_tok}; each is in the other's top "
                                 f"{NUM_LOGPROBS} (logprobs {logprobs[mv_tok]:.4f} vs "
                                 f"{logprobs[hf_tok]:.4f})")
                else:
                    section.error("tokens", f"greedy tokens differ at step {step}: minivllm "
                                  f"{mv_tok}, transformers {hf_tok}, and neither is in the "
                                  f"other's top {NUM_LOGPROBS}")
                break
            max_diff = max(max_diff, abs(mv_logprobs[step][mv_tok].logprob - float(logprobs[hf_tok])))
            seq.append(hf_tok)
    section.data.update(tokens=mv_tokens, max_logprob_diff=max_diff)
    if max_diff > atol:
        section.error("logprobs", f"chosen-token logprobs differ by up to {max_diff:.3g} "
                      f"(tolerance {atol:g})")


def _short_names(names: list[str]) -> str:
    """`a.q_proj, a.k_proj` -> `a.q_proj+k_proj` (one column of the text table)."""
    head = names[0].rpartition(".")[0]
    return names[0] + "".join("+" + n.rpartition(".")[2] for n in names[1:]) if all(
        n.rpartition(".")[0] == head for n in names) else ",".join(names)


def _hf_names(name: str, hf: dict[str, object], packed: dict[str, list[str]]) -> list[str] | None:
    head, _, last = name.rpartition(".")
    if name in hf:
        return [name]
    shards = [f"{head}.{s}" if head else s for s in packed.get(last, [])]
    return shards if shards and all(s in hf for s in shards) else None


def _mv_tensor(name: str, out: object) -> torch.Tensor | None:
    # A minivllm decoder layer returns (branch output, residual): transformers' layer output is
    # their sum. Elsewhere a tuple's first item is the output (linear layers: (out, bias)).
    if isinstance(out, tuple) and _DECODER_LAYER.search(name) and len(out) == 2 and \
            all(isinstance(t, torch.Tensor) for t in out) and out[0].shape == out[1].shape:
        return out[0] + out[1]
    return _first_tensor(out)


def _first_tensor(out: object) -> torch.Tensor | None:
    while isinstance(out, (tuple, list)) and out:
        out = out[0]
    return out if isinstance(out, torch.Tensor) and out.is_floating_point() else None


def _as_rows(t: torch.Tensor | None, batch_dim: bool = False) -> torch.Tensor | None:
    """[T, features] in fp64 ([1, T, ...] from transformers loses its batch dim)."""
    if t is None:
        return None
    if batch_dim:
        if t.dim() < 2 or t.shape[0] != 1:
            return None
        t = t[0]
    return t.reshape(t.shape[0], -1).double() if t.dim() >= 1 else None


def _detach(out: object) -> object:
    if isinstance(out, torch.Tensor):
        return out.detach().clone()
    if isinstance(out, (tuple, list)):
        return tuple(_detach(o) for o in out)
    return None


def _prompt_ids(tokenizer: object, prompt: str | None, vocab_size: int) -> list[int]:
    if tokenizer is not None:
        return list(tokenizer.encode(prompt or "The capital of France is"))
    if prompt is not None:
        raise ValueError("--prompt needs a tokenizer in the checkpoint folder")
    gen = torch.Generator().manual_seed(0)     # no tokenizer: a fixed random prompt
    return torch.randint(3, vocab_size, (12,), generator=gen).tolist()
