"""`minivllm serve`: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse

from minivllm.engine.arg_utils import EngineArgs
from minivllm.entrypoints.openai.cli_args import json_string_list, parse_lora_module
from minivllm.entrypoints.openai.tool_parsers import TOOL_PARSER_NAMES


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "serve", help="serve the model over an OpenAI-compatible HTTP API",
        description="Start an OpenAI-compatible server (/v1/completions, /v1/chat/completions, "
                    "/v1/responses (stored responses with VLLM_ENABLE_RESPONSES_API_STORE=1), "
                    "/v1/embeddings for pooling models (--runner pooling), "
                    "/v1/models, /tokenize, /detokenize, /health, /metrics, /version).")
    parser.add_argument("model_tag", nargs="?", default=None,
                        help="the model, as a positional alternative to --model")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                        help="the name(s) clients use in `model`; responses name the first "
                             "(default: the checkpoint's name)")
    parser.add_argument("--health-stall-timeout", type=float, default=60.0,
                        help="/health answers 503 when the engine made no progress for this many "
                             "seconds with requests in flight")
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])
    parser.add_argument("--disable-uvicorn-access-log", action="store_true",
                        help="no access-log line per HTTP request")
    parser.add_argument("--api-key", nargs="+", default=None, metavar="KEY",
                        help="requests under /v1 must send 'Authorization: Bearer KEY' (one of "
                             "these keys; default: VLLM_API_KEY, else no key)")
    for flag, what in (("--allowed-origins", "origins"), ("--allowed-methods", "methods"),
                       ("--allowed-headers", "headers")):
        parser.add_argument(flag, type=json_string_list, default=["*"],
                            help=f"CORS: the {what} a browser may call from, as a JSON list "
                                 '(default ["*"])')
    parser.add_argument("--allow-credentials", action="store_true",
                        help="CORS: allow credentials (cookies, auth headers) on cross-origin "
                             "calls")
    parser.add_argument("--enable-prompt-tokens-details", action="store_true",
                        help="usage.prompt_tokens_details.cached_tokens: the prompt tokens the "
                             "prefix cache served")
    parser.add_argument("--return-tokens-as-token-ids", action="store_true",
                        help='logprobs name tokens "token_id:<id>" (requests may choose with '
                             "return_tokens_as_token_ids)")
    parser.add_argument("--enable-request-id-headers", action="store_true",
                        help="responses carry an X-Request-Id header (the request's own, else "
                             "a new id)")
    parser.add_argument("--chat-template", default=None,
                        help="a Jinja chat template file (or the template itself) in place of "
                             "the tokenizer's")
    parser.add_argument("--chat-template-content-format", default="auto",
                        choices=["auto", "string", "openai"],
                        help="message contents reach the template as text (string) or as "
                             "lists of parts (openai); auto: openai when the template loops "
                             "over a message's content")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='let the model decide to call tools (tool_choice "auto"); needs '
                             "--tool-call-parser")
    parser.add_argument("--tool-call-parser", default=None, choices=TOOL_PARSER_NAMES,
                        help="how tool calls are read from the model's text")
    parser.add_argument("--lora-modules", nargs="+", type=parse_lora_module, default=None,
                        metavar="NAME=PATH",
                        help="LoRA adapters to serve (needs --enable-lora): name=path, or JSON "
                             '\'{"name": ..., "path": ..., "base_model_name": ...}\'; requests '
                             "pick one by its name in `model`")
    _add_deployment_args(parser)
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(func=cmd_serve)
    return parser


def _add_deployment_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's flags for where and how the server runs (server_launch.py)."""
    parser.add_argument("--response-role", default="assistant",
                        help="the role of chat replies after a generation prompt")
    parser.add_argument("--root-path", default="",
                        help="the path prefix a proxy serves this server under")
    parser.add_argument("--middleware", action="append", default=[], metavar="IMPORT.PATH",
                        help="an ASGI middleware class (app.add_middleware) or an HTTP "
                             "middleware function, by import path; repeatable")
    parser.add_argument("--ssl-keyfile", default=None, help="TLS: the private key file")
    parser.add_argument("--ssl-certfile", default=None, help="TLS: the certificate file")
    parser.add_argument("--ssl-ca-certs", default=None,
                        help="TLS: CA certificates to check client certificates against")
    parser.add_argument("--ssl-cert-reqs", type=int, default=0,
                        help="TLS: whether client certificates are required (Python's "
                             "ssl.CERT_NONE 0, CERT_OPTIONAL 1, CERT_REQUIRED 2)")
    parser.add_argument("--enable-log-requests", action="store_true",
                        help="log each request's prompt and sampling parameters")
    parser.add_argument("--disable-log-requests", action="store_false",
                        dest="enable_log_requests", help="vLLM's older spelling: no request log")
    parser.add_argument("--max-log-len", type=int, default=None,
                        help="logged prompts are cut to this many characters (or token ids)")
    parser.add_argument("--disable-log-stats", action="store_true",
                        help="no periodic throughput / queue / KV-usage log line "
                             "(VLLM_LOG_STATS_INTERVAL seconds apart)")


def cmd_serve(args: argparse.Namespace) -> int:
    from minivllm.entrypoints.openai.api_server import run_server

    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(f"Two models given: {args.model_tag!r} and --model {args.model!r}; "
                             "give one.")
        args.model = args.model_tag
    return run_server(args)
