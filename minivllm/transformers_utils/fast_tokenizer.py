"""`PreTrainedTokenizerFast`'s interface over a `tokenizers.Tokenizer`, without importing transformers.

Why: transformers' package import (~1 s: it scans its ~1,700 model files) is a third of a cold
`minivllm generate`. `FastTokenizer` answers what the engine, the server and a typical user call
(encode/decode, token <-> id, the special tokens, plain chat templates) from the backend itself;
any other attribute, and chat requests with tools, documents or other extras, are served by a
transformers `PreTrainedTokenizerFast` built on first use around the same backend.
"""

from typing import Any

from tokenizers import AddedToken, Tokenizer, processors

from minivllm.transformers_utils.chat_template import is_plain_chat, render_chat

__all__ = ["FastTokenizer"]

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
_VERY_LARGE_INTEGER = int(1e30)      # transformers' model_max_length when nothing sets one
# apply_chat_template arguments that only transformers' implementation handles.
_HF_ONLY_CHAT_ARGS = ("tools", "documents", "continue_final_message", "sanitize_control_tokens",
                      "padding", "truncation", "max_length", "return_tensors",
                      "return_assistant_tokens_mask", "tokenizer_kwargs")


class FastTokenizer:
    """A byte-level/BPE tokenizer as `PreTrainedTokenizerFast(tokenizer_object=backend, ...)`
    would present it: the special tokens are added to the backend and its post-processor set
    as transformers does, so both encode, decode and render templates alike."""

    def __init__(self, backend: Tokenizer, *, name_or_path: str = "", chat_template: str | None = None,
                 add_bos_token: bool = False, add_eos_token: bool = False,
                 **special_tokens: str | None) -> None:
        unknown = set(special_tokens) - set(_SPECIAL_NAMES)
        if unknown:
            raise ValueError(f"Unknown special tokens {sorted(unknown)}; valid: {', '.join(_SPECIAL_NAMES)}")
        self._tokenizer = backend
        self._hf_tokenizer: Any = None
        self.name_or_path = name_or_path
        self.chat_template = chat_template
        self.add_bos_token, self.add_eos_token = add_bos_token, add_eos_token
        self.model_max_length = _VERY_LARGE_INTEGER
        self.padding_side = self.truncation_side = "right"
        self.clean_up_tokenization_spaces = False
        self._special = {name: special_tokens.get(name) for name in _SPECIAL_NAMES}
        self._init_kwargs = dict(name_or_path=name_or_path, chat_template=chat_template,
                                 add_bos_token=add_bos_token, add_eos_token=add_eos_token,
                                 **self._special)
        self._add_special_tokens_to_backend()
        self._set_post_processor()
        self._special_ids = sorted({self._tokenizer.token_to_id(t) for t in self.all_special_tokens})

    # --- special tokens -----------------------------------------------------------------------
    @property
    def backend_tokenizer(self) -> Tokenizer:
        return self._tokenizer

    bos_token = property(lambda self: self._special["bos_token"])
    eos_token = property(lambda self: self._special["eos_token"])
    unk_token = property(lambda self: self._special["unk_token"])
    pad_token = property(lambda self: self._special["pad_token"])
    bos_token_id = property(lambda self: self._token_id(self.bos_token))
    eos_token_id = property(lambda self: self._token_id(self.eos_token))
    unk_token_id = property(lambda self: self._token_id(self.unk_token))
    pad_token_id = property(lambda self: self._token_id(self.pad_token))

    @property
    def special_tokens_map(self) -> dict[str, str]:
        return {name: token for name, token in self._special.items() if token is not None}

    @property
    def all_special_tokens(self) -> list[str]:
        return list(dict.fromkeys(self.special_tokens_map.values()))

    @property
    def all_special_ids(self) -> list[int]:
        return [self._tokenizer.token_to_id(t) for t in self.all_special_tokens]

    @property
    def extra_special_tokens(self) -> list[str]:
        return []

    @property
    def added_tokens_decoder(self) -> dict[int, AddedToken]:
        return dict(sorted(self._tokenizer.get_added_tokens_decoder().items()))

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self._tokenizer.get_vocab(with_added_tokens=True)

    # --- encode / decode ----------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True, **kwargs: Any) -> list[int]:
        if kwargs or not isinstance(text, str):
            return self._hf().encode(text, add_special_tokens=add_special_tokens, **kwargs)
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text: str | list[str], add_special_tokens: bool = True, **kwargs: Any) -> Any:
        """`{"input_ids", "attention_mask"}` of one text or a batch (anything more: transformers)."""
        if kwargs or not (isinstance(text, str) or _is_str_list(text)):
            return self._hf()(text, add_special_tokens=add_special_tokens, **kwargs)
        if isinstance(text, str):
            ids = self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
            return Encoding(input_ids=ids, attention_mask=[1] * len(ids))
        batch = [e.ids for e in self._tokenizer.encode_batch(list(text), add_special_tokens=add_special_tokens)]
        return Encoding(input_ids=batch, attention_mask=[[1] * len(ids) for ids in batch])

    def decode(self, token_ids: int | list[int], skip_special_tokens: bool = False, **kwargs: Any) -> str:
        if kwargs:
            return self._hf().decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs)
        return self._tokenizer.decode(_id_list(token_ids), skip_special_tokens=skip_special_tokens)

    def batch_decode(self, sequences: list[list[int]], skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(seq, skip_special_tokens) for seq in sequences]

    def convert_ids_to_tokens(self, ids: int | list[int], skip_special_tokens: bool = False
                              ) -> str | None | list[str | None]:
        if isinstance(ids, int):
            return self._tokenizer.id_to_token(ids)
        skip = set(self._special_ids) if skip_special_tokens else ()
        return [self._tokenizer.id_to_token(i) for i in _id_list(ids) if i not in skip]

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            return self._token_id(tokens)
        return [self._token_id(t) for t in tokens]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        decoder = self._tokenizer.decoder
        return decoder.decode(tokens) if decoder is not None else " ".join(tokens)

    # --- chat ---------------------------------------------------------------------------------
    def apply_chat_template(self, conversation: list, chat_template: str | None = None,
                            add_generation_prompt: bool = False, tokenize: bool = True,
                            return_dict: bool = True, **kwargs: Any) -> Any:
        """As transformers': the rendered text, or its ids (in a dict unless return_dict=False)."""
        template = chat_template if chat_template is not None else self.chat_template
        batched = (isinstance(conversation, (list, tuple)) and bool(conversation)
                   and isinstance(conversation[0], (list, tuple)))
        conversations = conversation if batched else [conversation]
        template_kwargs = {k: v for k, v in kwargs.items() if k not in _HF_ONLY_CHAT_ARGS}
        if (template is None or not conversation or len(template_kwargs) < len(kwargs)
                or not is_plain_chat(conversations, template, template_kwargs)):
            return self._hf().apply_chat_template(
                conversation, chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                tokenize=tokenize, return_dict=return_dict, **kwargs)
        variables = {**self.special_tokens_map, **template_kwargs}
        texts = [render_chat(list(c), template, add_generation_prompt, **variables) for c in conversations]
        text = texts if batched else texts[0]
        if not tokenize:
            return text
        out = self(text, add_special_tokens=False)
        return out if return_dict else out["input_ids"]

    # --- transformers for everything else -----------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        # Only names this class does not define arrive here; dunders and private names never
        # build the transformers tokenizer (copy, pickle and hasattr probes look those up).
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._hf(), name)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_hf_tokenizer": None}    # rebuilt around the copy's backend

    def __repr__(self) -> str:
        return (f"FastTokenizer(name_or_path={self.name_or_path!r}, vocab_size={self.vocab_size}, "
                f"special_tokens={self.special_tokens_map})")

    def _hf(self) -> Any:
        """transformers' `PreTrainedTokenizerFast` sharing this backend (imports transformers)."""
        if self._hf_tokenizer is None:
            from transformers import PreTrainedTokenizerFast

            class _Adopting(PreTrainedTokenizerFast):
                # Adopt the backend as is: `tokenizer_object=` would deep-copy it (~0.4 s).
                def __init__(self, backend: Tokenizer, **kwargs: Any) -> None:
                    self._tokenizer = backend
                    super().__init__(**kwargs)

            self._hf_tokenizer = _Adopting(self._tokenizer, **self._init_kwargs)
        return self._hf_tokenizer

    def _token_id(self, token: str | None) -> int | None:
        return None if token is None else self._tokenizer.token_to_id(token)

    def _add_special_tokens_to_backend(self) -> None:
        # What transformers' __init__ does: a named special token the backend does not list
        # among its added tokens is added as a special one.
        added = {str(t) for t in self._tokenizer.get_added_tokens_decoder().values()}
        missing = [t for t in dict.fromkeys(self._special.values()) if t is not None and t not in added]
        if missing:
            self._tokenizer.add_special_tokens([AddedToken(t, special=True) for t in missing])

    def _set_post_processor(self) -> None:
        # transformers' update_post_processor: BOS/EOS around each sequence when the flags ask.
        bos = self.bos_token if self.add_bos_token and self.bos_token is not None else None
        eos = self.eos_token if self.add_eos_token and self.eos_token is not None else None
        single = f"{bos + ':0 ' if bos else ''}$A:0{' ' + eos + ':0' if eos else ''}"
        pair = f"{single}{' ' + bos + ':1' if bos else ''} $B:1{' ' + eos + ':1' if eos else ''}"
        specials = [(t, self._tokenizer.token_to_id(t)) for t in (bos, eos) if t]
        self._tokenizer.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=specials)


def _id_list(token_ids: Any) -> list[int]:
    """Plain ints from an int, a list, or an array/tensor of ids (tokenizers takes only ints)."""
    if hasattr(token_ids, "tolist"):
        token_ids = token_ids.tolist()
    return [token_ids] if isinstance(token_ids, int) else [int(i) for i in token_ids]


def _is_str_list(texts: Any) -> bool:
    return isinstance(texts, (list, tuple)) and all(isinstance(t, str) for t in texts)


class Encoding(dict):
    """transformers' BatchEncoding for what the fast path returns: a dict with attribute access."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None
