"""Random EAGLE / EAGLE-3 heads for a tiny Llama target, and what they should draft, computed
independently: the target's features from transformers, the head's layers from transformers'
Llama modules (attention, MLP, norms, rotary) over the whole sequence, each draft position
recomputed from scratch (no paged cache, no incremental state)."""

import json
import os

import torch
from safetensors.torch import save_file


def write_eagle_target(folder: str) -> str:
    """A 4-layer tiny Llama (with the test tokenizer) whose layers add little to the token's
    own embedding (o_proj and down_proj scaled by 0.02, a final norm of ones): a head that
    passes the next token's embedding through then guesses it well."""
    from safetensors.torch import load_file

    from tests.entrypoints.openai._helpers import write_tiny_checkpoint

    write_tiny_checkpoint(folder, num_hidden_layers=4)
    weights = load_file(os.path.join(folder, "model.safetensors"))
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = weights[name] * 0.02
    weights["model.norm.weight"] = torch.ones_like(weights["model.norm.weight"])
    save_file(weights, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    return folder


def write_aligned_head(folder: str, target: str) -> str:
    """An EAGLE head that passes the next token's embedding through (fc = [I, 0] plus noise
    of 0.003, its layer's outputs scaled by 0.01): on `write_eagle_target`'s model about a
    quarter of its drafts are accepted, at every draft position."""
    from safetensors.torch import load_file

    write_eagle_head(folder, target, seed=1)
    weights = load_file(os.path.join(folder, "model.safetensors"))
    h = weights["fc.weight"].shape[0]
    weights["fc.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], 1) \
        + 0.003 * torch.randn(h, 2 * h)
    for name in ("layers.0.self_attn.o_proj.weight", "layers.0.mlp.down_proj.weight"):
        weights[name] = weights[name] * 0.01
    save_file(weights, os.path.join(folder, "model.safetensors"))
    return folder


def _rand_like_norm(n: int) -> torch.Tensor:
    return 1.0 + 0.2 * torch.randn(n)


def head_config(target: str, **extra) -> dict:
    """A one-layer Llama config of the target's width and vocabulary."""
    with open(os.path.join(target, "config.json")) as f:
        t = json.load(f)
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "vocab_size", "rms_norm_eps", "max_position_embeddings", "bos_token_id",
            "eos_token_id", "pad_token_id")
    return {**{k: t[k] for k in keys}, "model_type": "llama", "num_hidden_layers": 1,
            "hidden_act": "silu", "tie_word_embeddings": False, **extra}


def _layer_weights(cfg: dict, qkv_in: int, prefix: str) -> dict[str, torch.Tensor]:
    h, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d, inter = h // heads, cfg["intermediate_size"]
    std = 0.15
    w = {"self_attn.q_proj.weight": torch.randn(heads * d, qkv_in) * std,
         "self_attn.k_proj.weight": torch.randn(kv * d, qkv_in) * std,
         "self_attn.v_proj.weight": torch.randn(kv * d, qkv_in) * std,
         "self_attn.o_proj.weight": torch.randn(h, heads * d) * std,
         "mlp.gate_proj.weight": torch.randn(inter, h) * std,
         "mlp.up_proj.weight": torch.randn(inter, h) * std,
         "mlp.down_proj.weight": torch.randn(h, inter) * std,
         "post_attention_layernorm.weight": _rand_like_norm(h)}
    return {f"{prefix}.{k}": v for k, v in w.items()}


def write_eagle_head(folder: str, target: str, seed: int = 0, with_embed: bool = False) -> str:
    """An EAGLE-1 head (as yuhuili's checkpoints: `fc`, `layers.0.*` without an input norm,
    no LM head; the embedding only if asked)."""
    torch.manual_seed(seed)
    cfg = head_config(target, architectures=["LlamaForCausalLM"])
    h = cfg["hidden_size"]
    weights = _layer_weights(cfg, h, "layers.0")
    weights["fc.weight"] = torch.randn(h, 2 * h) * 0.15
    if with_embed:
        weights["embed_tokens.weight"] = torch.randn(cfg["vocab_size"], h) * 0.5
    return _save(folder, cfg, weights)


def write_eagle3_head(folder: str, target: str, aux_layers: tuple[int, ...] = (1, 2, 3),
                      draft_vocab: int | None = None, seed: int = 0) -> str:
    """An EAGLE-3 head as the EAGLE-3 checkpoints: `midlayer.*` (q/k/v over 2H, a
    hidden_norm), `fc` over the aux layers, `norm`, its own `lm_head` over `draft_vocab` ids
    with `d2t` (and the unused `t2d`), no embedding."""
    torch.manual_seed(seed)
    cfg = head_config(target, architectures=["LlamaForCausalLMEagle3"],
                      eagle_config={"eagle_aux_hidden_state_layer_ids": list(aux_layers)})
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    draft_vocab = draft_vocab or vocab
    cfg["draft_vocab_size"] = draft_vocab
    weights = _layer_weights(cfg, 2 * h, "midlayer")
    weights.update({"midlayer.input_layernorm.weight": _rand_like_norm(h),
                    "midlayer.hidden_norm.weight": _rand_like_norm(h),
                    "fc.weight": torch.randn(h, len(aux_layers) * h) * 0.15,
                    "norm.weight": _rand_like_norm(h),
                    "lm_head.weight": torch.randn(draft_vocab, h) * 0.5})
    if draft_vocab != vocab:
        ids = torch.sort(torch.randperm(vocab)[:draft_vocab]).values
        weights["d2t"] = ids - torch.arange(draft_vocab)
        weights["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, ids, True)
    return _save(folder, cfg, weights)


def _save(folder: str, cfg: dict, weights: dict[str, torch.Tensor]) -> str:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    save_file({k: v.contiguous() for k, v in weights.items()},
              os.path.join(folder, "model.safetensors"))
    return folder


class ReferenceDrafter:
    """Drafts of a head for a known token sequence, from transformers' modules."""

    def __init__(self, target: str, head: str) -> None:
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM, LlamaConfig

        self.target = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
        with open(os.path.join(head, "config.json")) as f:
            self.cfg = json.load(f)
        self.w = load_file(os.path.join(head, "model.safetensors"))
        self.eagle3 = "midlayer.hidden_norm.weight" in self.w
        config = LlamaConfig(**{k: v for k, v in self.cfg.items() if k != "architectures"})
        config._attn_implementation = "eager"
        self.config = config
        self.modules = self._build(config)

    def _build(self, config) -> dict:
        from transformers.models.llama.modeling_llama import (LlamaAttention, LlamaMLP,
                                                              LlamaRMSNorm, LlamaRotaryEmbedding)

        h = config.hidden_size
        prefix = "midlayer." if self.eagle3 else "layers.0."
        attn = LlamaAttention(config, layer_idx=0)
        qkv_in = 2 * h if self.eagle3 else h
        for name in ("q_proj", "k_proj", "v_proj"):
            weight = self.w[f"{prefix}self_attn.{name}.weight"]
            setattr(attn, name, torch.nn.Linear(qkv_in, weight.shape[0], bias=False))
            getattr(attn, name).weight.data.copy_(weight)
        attn.o_proj.weight.data.copy_(self.w[f"{prefix}self_attn.o_proj.weight"])
        mlp = LlamaMLP(config)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(mlp, name).weight.data.copy_(self.w[f"{prefix}mlp.{name}.weight"])
        norms = {}
        for key in ("post_attention_layernorm", "input_layernorm", "hidden_norm"):
            if f"{prefix}{key}.weight" in self.w:
                norms[key] = LlamaRMSNorm(h, eps=config.rms_norm_eps)
                norms[key].weight.data.copy_(self.w[f"{prefix}{key}.weight"])
        if "norm.weight" in self.w:
            norms["norm"] = LlamaRMSNorm(h, eps=config.rms_norm_eps)
            norms["norm"].weight.data.copy_(self.w["norm.weight"])
        return {"attn": attn, "mlp": mlp, "rotary": LlamaRotaryEmbedding(config), **norms}

    @torch.no_grad()
    def target_features(self, tokens: list[int]) -> torch.Tensor:
        """[N, F]: the target's last hidden state (EAGLE) or its aux layers' inputs side by
        side (EAGLE-3) at each position of `tokens`."""
        out = self.target.model(input_ids=torch.tensor([tokens]), output_hidden_states=True)
        if not self.eagle3:
            return out.last_hidden_state[0]
        layers = self.cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        return torch.cat([out.hidden_states[i][0] for i in layers], dim=-1)

    @torch.no_grad()
    def _head(self, tokens: list[int], feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The head over a whole sequence: rows (tokens[j], feats[j]) at positions j ->
        (features scored by the LM head, features fed to the next position), [S, H] each."""
        m, n = self.modules, len(tokens)
        embed = self.w.get("embed_tokens.weight", self.target.model.embed_tokens.weight)
        emb = embed[torch.tensor(tokens)][None]                               # [1, S, H]
        feats = feats[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        pos = m["rotary"](emb, torch.arange(n)[None])
        if self.eagle3:
            residual = feats
            x = torch.cat([m["input_layernorm"](emb), m["hidden_norm"](feats)], dim=-1)
        else:
            x = torch.cat([emb, feats], dim=-1) @ self.w["fc.weight"].T
            residual = x
        residual = residual + m["attn"](x, pos, mask)[0]
        pre = residual + m["mlp"](m["post_attention_layernorm"](residual))
        if self.eagle3:
            return m["norm"](pre)[0], pre[0]
        return pre[0], pre[0]

    def _logits(self, feats: torch.Tensor) -> int:
        if not self.eagle3:
            return int(self.target.lm_head(feats).argmax())
        best = int((feats @ self.w["lm_head.weight"].T).argmax())
        return best + int(self.w["d2t"][best]) if "d2t" in self.w else best

    @torch.no_grad()
    def drafts(self, tokens: list[int], k: int) -> list[int]:
        """k drafts after `tokens` (all known): row j reads token j + 1 and the target's
        features at j; each draft then joins the sequence with the head's own features."""
        feats = self.target_features(tokens[:-1])
        if self.eagle3:
            feats = feats @ self.w["fc.weight"].T
        seq, out = list(tokens[1:]), []
        for _ in range(k):
            scored, fed = self._head(seq, feats)
            out.append(self._logits(scored[-1]))
            seq.append(out[-1])
            feats = torch.cat([feats, fed[-1:]], dim=0)
        return out
