"""Parsers of `minivllm serve`'s own flags (vLLM's `entrypoints/openai/cli_args.py`); light, so
that building the CLI imports no server code."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass


@dataclass
class LoRAModulePath:
    """One `--lora-modules` adapter: its served name, PEFT folder and (optional) parent."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(value: str) -> LoRAModulePath:
    """`name=path`, or vLLM's JSON form `{"name": ..., "path": ..., "base_model_name": ...}`."""
    text = value.strip()
    if text.startswith("{"):
        try:
            fields = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"--lora-modules {value!r} is not valid JSON: {exc}")
        if not isinstance(fields, dict) or not {"name", "path"} <= set(fields) \
                or not set(fields) <= {"name", "path", "base_model_name"}:
            raise argparse.ArgumentTypeError(
                f"--lora-modules {value!r}: a JSON adapter needs 'name' and 'path' (and may give "
                "'base_model_name'), nothing else")
        return LoRAModulePath(str(fields["name"]), str(fields["path"]), fields.get("base_model_name"))
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--lora-modules {value!r}: expected name=path or a JSON "
                                         'object such as \'{"name": "a", "path": "/adapters/a"}\'')
    return LoRAModulePath(name, path)


def json_string_list(value: str) -> list[str]:
    """A CORS flag's value: a JSON list of strings, e.g. '["http://localhost:3000"]'."""
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        parsed = None
    if not isinstance(parsed, list) or not all(isinstance(v, str) for v in parsed):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings such as "
                                         f"'[\"http://localhost:3000\"]', got {value!r}")
    return parsed
