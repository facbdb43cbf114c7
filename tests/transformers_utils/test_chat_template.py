"""render_chat renders as transformers' renderer; is_plain_chat says which requests it serves."""

import jinja2
import pytest
from transformers.utils.chat_template_utils import _normalize_chat_messages, render_jinja_template

from minivllm.transformers_utils.chat_template import is_plain_chat, render_chat

# Whitespace control (trim/lstrip blocks), loop controls, namespace, dict, tojson (no HTML
# escaping, non-ASCII kept), raise_exception and extra variables.
TEMPLATE = """{{ bos_token }}{% set ns = namespace(count=0) %}
{% for m in messages %}
    {% if m['role'] == 'skip' %}{% continue %}{% endif %}
    {% set ns.count = ns.count + 1 %}
    <{{ m['role'] }}>{{ m['content'] | trim }}{% if m.name is defined %} ({{ m.name }}){% endif %}
    {{ dict(n=ns.count) | tojson }}{{ {'text': m['content']} | tojson(indent=1) }}
{% endfor %}
{% if add_generation_prompt %}<assistant>{% endif %}{% if greeting %}{{ greeting }}{% endif %}"""
MESSAGES = [{"role": "system", "content": " Be <brief> & kind. "},
            {"role": "user", "content": "héllo 東京 🚀", "name": "ann"},
            {"role": "skip", "content": "not shown"},
            {"role": "assistant", "content": "ok", "name": None}]


def _reference(messages, template, add_generation_prompt, **kwargs) -> str:
    """What apply_chat_template renders: None-valued keys dropped, then the jinja renderer."""
    rendered, _ = render_jinja_template(conversations=[_normalize_chat_messages(messages)],
                                        chat_template=template,
                                        add_generation_prompt=add_generation_prompt, **kwargs)
    return rendered[0]


@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_render_equals_transformers(add_generation_prompt):
    kwargs = {"bos_token": "<s>", "greeting": "hi"}
    ours = render_chat(MESSAGES, TEMPLATE, add_generation_prompt, **kwargs)
    assert ours == _reference(MESSAGES, TEMPLATE, add_generation_prompt, **kwargs)
    assert "<brief> & kind" in ours and "東京" in ours and "not shown" not in ours


def test_template_errors_and_sandbox_as_transformers():
    with pytest.raises(jinja2.exceptions.TemplateError, match="no system"):
        render_chat(MESSAGES, "{{ raise_exception('no system') }}", False)
    with pytest.raises(jinja2.exceptions.SecurityError):
        render_chat(MESSAGES, "{% set ns = namespace(_x=1) %}", False)
    with pytest.raises(jinja2.exceptions.SecurityError):
        render_chat(MESSAGES, "{{ messages.__class__.__mro__ }}", False)


def test_is_plain_chat():
    assert is_plain_chat([MESSAGES], TEMPLATE, {"greeting": "hi"})
    assert not is_plain_chat([MESSAGES], TEMPLATE, {"tools_json": [{"a": 1}]})      # not a scalar
    assert not is_plain_chat([[{"role": "user", "content": [{"type": "text", "text": "x"}]}]],
                             TEMPLATE, {})                                          # content blocks
    assert not is_plain_chat([[{"role": "user", "content": "x", "reasoning_content": "r"}]],
                             TEMPLATE, {})                                          # aliased fields
    assert not is_plain_chat([MESSAGES], "{% generation %}x{% endgeneration %}", {})
    assert not is_plain_chat([MESSAGES[0]], TEMPLATE, {})                           # not a list


# A template that reads contents as OpenAI lists of parts only (as some vision-era templates do).
PARTS_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}:{% for p in m['content'] %}"
                  "[{{ p['text'] }}]{% endfor %}\n{% endfor %}")


def test_content_format_detection_and_conversion():
    from minivllm.transformers_utils.chat_template import (normalize_messages,
                                                          resolve_content_format)

    both = ("{% for m in messages %}{% if m.content is string %}{{ m.content }}{% else %}"
            "{% for p in m.content | list %}{{ p.text }}{% endfor %}{% endif %}{% endfor %}")
    assert resolve_content_format("auto", PARTS_TEMPLATE) == "openai"
    assert resolve_content_format("auto", both) == "openai"   # `.content` through a filter
    assert resolve_content_format("auto", TEMPLATE) == "string"
    assert resolve_content_format("auto", "{% generation %}") == "string"   # unparseable
    assert resolve_content_format("auto", None) == "string"
    assert resolve_content_format("string", PARTS_TEMPLATE) == "string"
    with pytest.raises(ValueError, match="auto, string, openai"):
        resolve_content_format("parts", PARTS_TEMPLATE)
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                             {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": "c"}, {"role": "assistant", "content": None}]
    assert [m["content"] for m in normalize_messages(messages, "openai")] == [
        messages[0]["content"], [{"type": "text", "text": "c"}], []]
    assert [m["content"] for m in normalize_messages(messages)] == ["a\nb", "c", ""]
