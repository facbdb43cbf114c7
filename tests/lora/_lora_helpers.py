"""Shared by the LoRA tests: random PEFT adapters on a tiny Llama, transformers + PEFT references."""

import copy
import json
import os
import shutil

import torch

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL_LINEAR = ATTENTION + ["gate_proj", "up_proj", "down_proj"]
# A regex form of target_modules (PEFT full-matches it against module names).
QV_REGEX = r".*\.(q_proj|v_proj|down_proj)"
NUM_TOKENS = 6


def write_adapter(base_path: str, folder: str, seed: int, target_modules, r: int = 8,
                  alpha: float = 16, use_rslora: bool = False) -> str:
    """A random PEFT LoRA adapter with a non-zero B (PEFT's default init makes B zero)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=target_modules,
                        use_rslora=use_rslora, init_lora_weights=False, lora_dropout=0.0)
    torch.manual_seed(seed)
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:      # small enough to stay a perturbation, big enough to show
                param.copy_(torch.randn_like(param) * 0.3 / param.shape[-1] ** 0.5)
    model.save_pretrained(folder)
    return folder


def edit_adapter(src: str, dst: str, **config_changes) -> str:
    """A copy of an adapter folder with some adapter_config.json entries replaced."""
    shutil.copytree(src, dst)
    path = os.path.join(dst, "adapter_config.json")
    with open(path) as f:
        config = json.load(f)
    config.update(config_changes)
    with open(path, "w") as f:
        json.dump(config, f)
    return dst


def hf_reference(base_path: str, adapter: str | None, prompt: list[int], merged: bool = False,
                 num_tokens: int = NUM_TOKENS) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and their logprobs from transformers (+ PEFT, unmerged or merged), fp32."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32).eval()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).eval()
        if merged:
            model = copy.deepcopy(model).merge_and_unload()
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = model.generate(ids, max_new_tokens=num_tokens, do_sample=False,
                             attention_mask=torch.ones_like(ids), pad_token_id=0)
        logits = model(out).logits[0, len(prompt) - 1:-1].float()
        logprobs = torch.log_softmax(logits, -1)
        tokens = out[0, len(prompt):]
    return tokens.tolist(), logprobs.gather(1, tokens[:, None])[:, 0]


def run(llm, prompts, lora_requests=None, num_tokens: int = NUM_TOKENS):
    """minivllm greedy tokens and their logprobs, one (tokens, tensor) per prompt."""
    from minivllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True, logprobs=0)
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora_requests)
    results = []
    for out in outputs:
        c = out.outputs[0]
        lps = torch.tensor([step[t].logprob for step, t in zip(c.logprobs, c.token_ids)])
        results.append((list(c.token_ids), lps))
    return results


def assert_adapter_matches_peft(llm, base_path: str, adapter: str, prompts: list[list[int]],
                                lora_request) -> None:
    """`llm` under `lora_request` gives transformers + PEFT's greedy tokens (logprobs within
    1e-4), and they differ from the base model's."""
    ours = run(llm, prompts, lora_request)
    plain = run(llm, prompts)
    for prompt, (tokens, logprobs), (base_tokens, _) in zip(prompts, ours, plain):
        ref_tokens, ref_logprobs = hf_reference(base_path, adapter, prompt)
        assert tokens == ref_tokens and tokens != base_tokens
        torch.testing.assert_close(logprobs, ref_logprobs, atol=1e-4, rtol=0)
