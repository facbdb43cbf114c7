"""What `minivllm serve`'s deployment flags set up around the app, as vLLM's do: TLS
(`--ssl-keyfile`, `--ssl-certfile`, `--ssl-ca-certs`, `--ssl-cert-reqs`), `--root-path` behind a
proxy, extra ASGI `--middleware`, request logging (`--enable-log-requests`, `--max-log-len`)
and the periodic stats line (on unless `--disable-log-stats`)."""

from __future__ import annotations

import argparse
import inspect
import logging
import os
from typing import Any

from minivllm import envs
from minivllm.engine.async_llm import AsyncLLM
from minivllm.entrypoints.logger import RequestLogger
from minivllm.entrypoints.openai.server_options import load_chat_template, resolve_api_keys
from minivllm.utils.import_utils import resolve_obj_by_qualname
from minivllm.v1.metrics.loggers import LoggingStatLogger


def check_serve_args(args: argparse.Namespace, engine_args: Any) -> str | None:
    """Flag combinations that cannot work, found before the model loads; returns the chat
    template (`--chat-template` read)."""
    if args.lora_modules and not engine_args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora (and --max-lora-rank at least the "
                         "adapters' rank)")
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        raise ValueError("TLS needs both --ssl-keyfile and --ssl-certfile")
    if args.root_path and not args.root_path.startswith("/"):
        raise ValueError(f"--root-path must start with '/', got {args.root_path!r}")
    if args.max_log_len is not None and args.max_log_len < 0:
        raise ValueError(f"--max-log-len must be >= 0, got {args.max_log_len}")
    for path in args.middleware:
        _middleware(path)                # an unknown import path fails here
    resolve_api_keys(args.api_key, envs.VLLM_API_KEY)
    return load_chat_template(args.chat_template)


def uvicorn_config(app: Any, args: argparse.Namespace) -> Any:
    import uvicorn

    return uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                          access_log=not args.disable_uvicorn_access_log,
                          timeout_graceful_shutdown=5, root_path=args.root_path,
                          ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
                          ssl_ca_certs=args.ssl_ca_certs, ssl_cert_reqs=args.ssl_cert_reqs)


def server_log_level() -> None:
    """`serve` logs at INFO, as vLLM's server does (the stats line, request logs), unless
    MINIVLLM_LOGGING_LEVEL says otherwise; offline runs stay at WARNING."""
    if "MINIVLLM_LOGGING_LEVEL" not in os.environ:
        logging.getLogger("minivllm").setLevel(logging.INFO)


def configure_logging_and_middleware(app: Any, async_llm: AsyncLLM,
                                     args: argparse.Namespace) -> None:
    """The request logger and stats line on `async_llm`; each `--middleware` on the app (a
    class: `app.add_middleware(cls)`; a function: an HTTP middleware, as vLLM adds them)."""
    if args.enable_log_requests:
        async_llm.request_logger = RequestLogger(max_log_len=args.max_log_len)
    if not args.disable_log_stats:
        async_llm.stat_loggers.append(LoggingStatLogger(lambda: _gauges(async_llm),
                                                        envs.VLLM_LOG_STATS_INTERVAL))
    for path in args.middleware:
        middleware = _middleware(path)
        if inspect.isclass(middleware):
            app.add_middleware(middleware)
        else:
            app.middleware("http")(middleware)


def _gauges(async_llm: AsyncLLM) -> Any:
    stats = async_llm.stats
    return type(stats)(num_running=stats.num_running, num_waiting=async_llm.num_queued,
                       kv_cache_usage=stats.kv_cache_usage)


def _middleware(path: str) -> Any:
    try:
        obj = resolve_obj_by_qualname(path)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ValueError(f"--middleware {path!r} cannot be imported: {exc}") from exc
    if not callable(obj):
        raise ValueError(f"--middleware {path!r} is neither an ASGI middleware class nor a "
                         "function")
    return obj
