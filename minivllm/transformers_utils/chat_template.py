"""Chat templates rendered as transformers renders them, for plain-text conversations.

transformers' renderer lives behind its ~1 s package import; a cold `minivllm generate` only needs
the common case: messages of role/content strings and `add_generation_prompt`. `render_chat`
builds the same jinja2 sandbox (`trim_blocks`, `lstrip_blocks`, loop controls, the `tojson`,
`raise_exception`, `strftime_now`, `dict` and `namespace` globals) and passes the same variables;
`is_plain_chat` says which requests it serves, the tokenizer hands every other one to transformers.
"""

import json
import re
from datetime import datetime
from functools import lru_cache
from typing import Any

__all__ = ["CHAT_TEMPLATE_CONTENT_FORMATS", "chat_template_arguments", "chat_token_ids",
           "is_plain_chat", "normalize_messages", "render_chat", "resolve_content_format"]

# vLLM's --chat-template-content-format: how a message's content reaches the template: "string"
# (text parts joined), "openai" (a list of {"type": "text", "text": ...} parts), or "auto": openai
# when the template loops over a message's content, else string.
CHAT_TEMPLATE_CONTENT_FORMATS = ("auto", "string", "openai")

_PLAIN_MESSAGE_KEYS = frozenset({"role", "content", "name"})
# `{% generation %}` needs transformers' AssistantTracker extension.
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


def chat_token_ids(tokenizer: Any, conversation: list[dict[str, Any]],
                   add_special_tokens: bool = False, **kwargs: Any) -> list[int]:
    """`tokenizer.apply_chat_template(conversation, tokenize=True, **kwargs)` as a list of ids,
    whatever the tokenizer returns them in (transformers v5: a BatchEncoding).
    `add_special_tokens` (vLLM's chat option): the rendered text is tokenized with the
    tokenizer's special tokens (e.g. a BOS on top of the template's)."""
    if add_special_tokens:
        text = tokenizer.apply_chat_template(conversation, tokenize=False, **kwargs)
        return list(tokenizer.encode(text, add_special_tokens=True))
    ids = tokenizer.apply_chat_template(conversation, tokenize=True, **kwargs)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


# apply_chat_template's own arguments: chat_template_kwargs may not set them (their fields do).
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "return_dict", "return_tensors", "padding",
    "truncation", "max_length", "tokenizer_kwargs", "return_assistant_tokens_mask"})


def chat_template_arguments(add_generation_prompt: bool = True,
                            continue_final_message: bool = False,
                            tools: list[dict[str, Any]] | None = None,
                            chat_template_kwargs: dict[str, Any] | None = None,
                            documents: list[dict[str, str]] | None = None) -> dict[str, Any]:
    """The keyword arguments of one conversation's `apply_chat_template` from vLLM's chat
    options (`chat_template_kwargs`: extra template variables, e.g. Qwen3's enable_thinking).
    ValueError naming the option at fault."""
    if add_generation_prompt and continue_final_message:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true: "
                         "a continued final message gets no new turn.")
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
        raise ValueError("chat_template_kwargs must be a dict of template variables, got "
                         f"{type(chat_template_kwargs).__name__}.")
    extra = dict(chat_template_kwargs or {})
    clash = sorted(_RESERVED_TEMPLATE_KWARGS & extra.keys())
    if clash:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(clash)}: give them as "
                         "their own arguments.")
    kwargs = {**extra, "add_generation_prompt": add_generation_prompt}
    if continue_final_message:
        kwargs["continue_final_message"] = True
    if tools:
        kwargs["tools"] = tools
    if documents:   # RAG templates (e.g. Command R's) list them in the prompt
        kwargs["documents"] = documents
    return kwargs


def resolve_content_format(given: str, chat_template: Any) -> str:
    """"string" or "openai" for `given` (one of CHAT_TEMPLATE_CONTENT_FORMATS; ValueError
    otherwise), "auto" decided by the template."""
    if given not in CHAT_TEMPLATE_CONTENT_FORMATS:
        raise ValueError(f"chat_template_content_format must be one of "
                         f"{', '.join(CHAT_TEMPLATE_CONTENT_FORMATS)}, got {given!r}.")
    if given != "auto":
        return given
    return _detect_content_format(chat_template) if isinstance(chat_template, str) else "string"


@lru_cache(maxsize=32)
def _detect_content_format(chat_template: str) -> str:
    """"openai" when some `{% for ... in <message>['content'] %}` (or `.content`, through
    filters too) iterates a message's content parts; vLLM's detection reads the Jinja AST
    the same way."""
    from jinja2 import Environment, nodes

    try:
        ast = Environment(extensions=["jinja2.ext.loopcontrols"]).parse(chat_template)
    except Exception:   # noqa: BLE001 - e.g. transformers' {% generation %} tag
        return "string"
    for loop in ast.find_all(nodes.For):
        node = loop.iter
        while isinstance(node, nodes.Filter):
            node = node.node
        if (isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const)
                and node.arg.value == "content") or \
                (isinstance(node, nodes.Getattr) and node.attr == "content"):
            return "openai"
    return "string"


def normalize_messages(messages: Any, content_format: str = "string") -> list[dict[str, Any]]:
    """OpenAI-style messages as templates read them: each a dict with a string `role`, its
    `content` a string (text parts joined by newlines; None -> ""), tool-call arguments given as
    JSON text parsed into mappings; with the "openai" content format, content is a list of
    text parts. ValueError naming the first bad message."""
    if not isinstance(messages, (list, tuple)):
        raise ValueError("messages must be a list of message dicts, got "
                         f"{type(messages).__name__}.")
    normalized = [_normalize_message(i, m) for i, m in enumerate(messages)]
    if content_format == "openai":   # the parts as sent (checked above); a string is one part
        for original, message in zip(messages, normalized):
            parts = original.get("content")
            message["content"] = parts if isinstance(parts, list) else \
                ([{"type": "text", "text": message["content"]}] if message["content"] else [])
    return normalized


def _normalize_message(index: int, message: Any) -> dict[str, Any]:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ValueError(f"messages[{index}] needs a string `role`: give a dict with `role` and "
                         "`content`.")
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or \
                    not isinstance(part.get("text"), str):
                raise ValueError(f"messages[{index}]: only text content parts are supported.")
            texts.append(part["text"])
        content = "\n".join(texts)
    elif content is not None and not isinstance(content, str):
        raise ValueError(f"messages[{index}].content must be a string or a list of text parts.")
    normalized = {**message, "content": content or ""}
    if isinstance(message.get("reasoning"), str) and "reasoning_content" not in message:
        # vLLM's `reasoning` field, sent back; templates (Qwen3's) read `reasoning_content`.
        normalized["reasoning_content"] = message["reasoning"]
    if isinstance(message.get("tool_calls"), list):
        # Templates read the arguments as a mapping; OpenAI sends them as JSON text.
        normalized["tool_calls"] = [_template_tool_call(c) for c in message["tool_calls"]]
    return normalized


def _template_tool_call(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except json.JSONDecodeError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}


def is_plain_chat(conversations: list, chat_template: str, template_kwargs: dict[str, Any]) -> bool:
    """Messages are dicts of role/content/name strings, the extra template variables plain
    scalars, and the template needs no transformers-only extension."""
    if _GENERATION_TAG.search(chat_template):
        return False
    if not all(isinstance(v, (str, int, float, bool, type(None))) for v in template_kwargs.values()):
        return False
    for messages in conversations:
        if not isinstance(messages, (list, tuple)):
            return False
        for message in messages:
            if not (isinstance(message, dict) and _PLAIN_MESSAGE_KEYS.issuperset(message)
                    and all(isinstance(v, (str, type(None))) for v in message.values())):
                return False
    return True


def render_chat(messages: list[dict[str, str]], chat_template: str, add_generation_prompt: bool,
                **template_kwargs: Any) -> str:
    """One conversation rendered; keys whose value is None are dropped, as transformers does."""
    messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
    return _compile(chat_template).render(messages=messages, tools=None, documents=None,
                                          add_generation_prompt=add_generation_prompt,
                                          **template_kwargs)


@lru_cache(maxsize=8)
def _compile(chat_template: str):
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _namespace_class()
    return env.from_string(chat_template)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja's own tojson escapes HTML characters; chat templates want the text as is.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


class _TemplateDict:
    """`dict(...)` in a template without handing the template the `dict` type itself."""

    def __call__(self, *args, **kwargs) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs) -> dict:
        return dict.fromkeys(*args, **kwargs)


@lru_cache(maxsize=1)
def _namespace_class() -> type:
    from jinja2.exceptions import SecurityError
    from jinja2.utils import Namespace

    def check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError("Chat templates cannot store underscore-prefixed attributes on a "
                                f"namespace, but got {name!r}.")

    class TemplateNamespace(Namespace):
        """jinja's namespace, refusing underscore names (no route to CPython internals)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            attrs = dict(*args, **kwargs)
            for name in attrs:
                check(name)
            super().__init__(attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            check(name)
            super().__setitem__(name, value)

    return TemplateNamespace
