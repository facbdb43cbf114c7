"""The checkpoint's own tokenizer: HF tokenizer files, or the one embedded in a GGUF file."""

import os
from typing import TYPE_CHECKING

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from minivllm.logger import init_logger
from minivllm.transformers_utils.config import is_gguf
from minivllm.transformers_utils.fast_tokenizer import FastTokenizer
from minivllm.transformers_utils.gguf_file import GGUFFile, open_gguf

if TYPE_CHECKING:     # transformers costs ~1 s to import; GGUF BPE vocabularies skip it
    from transformers import PreTrainedTokenizerBase

logger = init_logger(__name__)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# llama.cpp's tokenizer.ggml.token_type values (llama_token_type) that become added tokens.
_CONTROL, _USER_DEFINED = 3, 4
# tokenizer.ggml.pre values that split text with GPT-2's own byte-level regex (transformers
# gives every value it has no regex for that split too); others take transformers' converter.
_GPT2_SPLIT_PRES = (None, "default", "gpt-2", "gpt2", "smollm")
# Archs whose GGUF tokenizer transformers converts but whose config it cannot read (AutoTokenizer
# reads the config first and refuses the file): their tokenizer class, called directly.
_GGUF_TOKENIZER_CLASSES = {"gemma": "GemmaTokenizer"}


# vLLM's --tokenizer-mode values minivllm runs ("hf" is vLLM's name for "auto").
TOKENIZER_MODES = ("auto", "hf", "slow")


def get_tokenizer(path: str, trust_remote_code: bool = False, tokenizer_mode: str = "auto"
                  ) -> "PreTrainedTokenizerBase | FastTokenizer | None":
    """Load the tokenizer; a folder without tokenizer files gives None (token-id prompts only).
    `tokenizer_mode` "slow" asks transformers for the Python tokenizer; `trust_remote_code`
    lets it run the folder's own tokenizer code."""
    if tokenizer_mode not in TOKENIZER_MODES:
        raise ValueError(f"Unknown tokenizer_mode {tokenizer_mode!r}; minivllm runs "
                         f"{', '.join(TOKENIZER_MODES)} (mistral and custom modes need "
                         "packages it does not use)")
    if is_gguf(path):
        return _gguf_tokenizer(os.path.abspath(path))
    if os.path.isdir(path) and not any(os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        logger.warning("No tokenizer files in %s: only token-id prompts will work.", path)
        return None
    # Imported here for start-up time: the auto tables cost ~0.3 s and GGUF runs skip them.
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code,
                                         use_fast=tokenizer_mode != "slow")


def _gguf_tokenizer(path: str) -> "PreTrainedTokenizerBase | FastTokenizer":
    gguf_file = open_gguf(path)
    meta = gguf_file.metadata
    if (meta.get("tokenizer.ggml.model") == "gpt2" and "tokenizer.ggml.merges" in meta
            and meta.get("tokenizer.ggml.pre") in _GPT2_SPLIT_PRES):
        return build_gguf_bpe_tokenizer(gguf_file)
    # Sentencepiece, unigram and regex-split BPE vocabularies: transformers' GGUF converter.
    import transformers

    folder, name = os.path.dirname(path), os.path.basename(path)
    tokenizer_class = _GGUF_TOKENIZER_CLASSES.get(gguf_file.architecture)
    if tokenizer_class is not None:
        return getattr(transformers, tokenizer_class).from_pretrained(folder, gguf_file=name)
    return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)


def build_gguf_bpe_tokenizer(gguf_file: GGUFFile) -> FastTokenizer:
    """The byte-level BPE tokenizer (`tokenizer.ggml.model == "gpt2"`) a GGUF file describes,
    built straight from its vocabulary, merges and token types; it encodes, decodes and renders
    the chat template as `AutoTokenizer.from_pretrained(folder, gguf_file=...)` does."""
    meta = gguf_file.metadata
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    token_types = meta.get("tokenizer.ggml.token_type")
    token_types = token_types.tolist() if token_types is not None else [0] * len(tokens)
    backend = Tokenizer(models.BPE(
        vocab=_byte_level_vocab(tokens), merges=[tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]],
        dropout=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    # A control token spelled outside the byte alphabet is a llama.cpp mislabel (adding it would
    # grow the vocabulary past the embedding), so only spellable ones become special tokens.
    control = [AddedToken(t, normalized=False, special=True)
               for t, kind in zip(tokens, token_types) if kind == _CONTROL and _BYTE_CHARS.issuperset(t)]
    if control:
        backend.add_special_tokens(control)
    if _USER_DEFINED in token_types:
        vocab = backend.get_vocab()
        backend.add_tokens([AddedToken(t, normalized=False, special=False)
                            for t, kind in zip(tokens, token_types) if kind == _USER_DEFINED and t in vocab])
    # NOTE: the control tokens stay off the wrapper's extra_special_tokens list, as with
    # AutoTokenizer: they are special in the backend (skipped by decode(skip_special_tokens)).
    return FastTokenizer(backend, chat_template=meta.get("tokenizer.chat_template"),
                         name_or_path=os.path.dirname(gguf_file.path), **_special_tokens(meta, tokens))


def _special_tokens(meta: dict, tokens: list[str]) -> dict:
    """bos/eos/unk/pad strings (None when the file names none) and the add-BOS/EOS flags."""
    out = {}
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        token_id = meta.get(f"tokenizer.ggml.{key}")
        out[name] = tokens[token_id] if token_id is not None else None
    for flag in ("add_bos_token", "add_eos_token"):
        if f"tokenizer.ggml.{flag}" in meta:
            out[flag] = bool(meta[f"tokenizer.ggml.{flag}"])
    return out


def gpt2_byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table: printable Latin-1 bytes stand for themselves,
    the 68 others (controls, space, NBSP, soft hyphen) take code points 256, 257, ... in order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)}
    table, num_moved = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + num_moved)
            num_moved += 1
    return table


_BYTE_TO_CHAR = gpt2_byte_alphabet()
_BYTE_CHARS = frozenset(_BYTE_TO_CHAR.values())


def _byte_level_vocab(tokens: list[str]) -> dict[str, int]:
    """token -> id; a token the file spells with characters outside the byte alphabet (raw text)
    is respelled from its UTF-8 bytes, as the byte-level pre-tokenizer will present it."""
    if _BYTE_CHARS.issuperset("".join(tokens)):     # the usual case, checked in one pass
        return dict(zip(tokens, range(len(tokens))))
    vocab = {}
    for index, token in enumerate(tokens):
        if not _BYTE_CHARS.issuperset(token):
            token = "".join(_BYTE_TO_CHAR[b] for b in token.encode("utf-8"))
        vocab[token] = index
    return vocab
