"""Deliberately broken copies of the Llama model file, written into a test's tmp_path.

Each copy changes one thing (a string replacement that must match exactly once), so a test can
check that check-model fails the right section and names the right layer.
"""

from pathlib import Path

import minivllm.model_executor.models.llama as llama_module

LLAMA_SOURCE = Path(llama_module.__file__).read_text()

BREAKAGES: dict[str, tuple[str, str]] = {
    "clean": ("", ""),
    # layer 1's down_proj is told `...mlp.down`
    "wrong_prefix": ('quant_config=quant_config, reduce_results=reduce_results, disable_tp=disable_tp,\n'
                     '            prefix=f"{prefix}.down_proj")',
                     'quant_config=quant_config, reduce_results=reduce_results, disable_tp=disable_tp,\n'
                     '            prefix=f"{prefix}.down_proj" if ".1." not in prefix else f"{prefix}.down")'),
    # layer 1's attention registers under layer 0's name
    "duplicate_attention": ('attn_type=attn_type, prefix=f"{prefix}.attn", **extra)',
                            'attn_type=attn_type, prefix=f"{prefix}.attn".replace("layers.1.", "layers.0."), **extra)'),
    # gate_up_proj has two shards but the mapping lists one
    "packed_shard_count": ('"gate_up_proj": ["gate_proj", "up_proj"]}', '"gate_up_proj": ["gate_proj"]}'),
    # the checkpoint's gate_proj / up_proj are never stacked into gate_up_proj
    "missing_mapping": ('".gate_proj": (".gate_up_proj", 0), ".up_proj": (".gate_up_proj", 1)})', '})'),
    # layer 1's MLP output is 1% too large
    "mlp_numerics": ('        x, _ = self.down_proj(x)                           # [T, H], all-reduced\n',
                     '        x, _ = self.down_proj(x)                           # [T, H], all-reduced\n'
                     '        if self.down_proj.prefix == "model.layers.1.mlp.down_proj":\n'
                     '            x = x * 1.01\n'),
}


def write_broken_llama(folder: Path, breakage: str) -> str:
    """The copy's `--model-file` spec, `path.py:LlamaForCausalLM`."""
    old, new = BREAKAGES[breakage]
    source = LLAMA_SOURCE
    if old:
        assert source.count(old) == 1, f"the {breakage} replacement no longer matches llama.py"
        source = source.replace(old, new)
    path = folder / f"llama_{breakage}.py"
    path.write_text(source)
    return f"{path}:LlamaForCausalLM"
