"""`ferrum` command line: serve, pull, chat, run, bench."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from ferrum.bench.cli import add_bench_parser, run_bench


def user_errors() -> tuple[type[Exception], ...]:
    """The exceptions that are the user's to fix: printed as one line, exit code 2. Imported here, not at
    the top: `ferrum serve` starts its engine process before these modules (torch among them) load."""
    from ferrum.backends.selection import BackendSelectionError
    from ferrum.config.loader import ConfigError
    from ferrum.models.errors import ModelConfigError
    from ferrum.models.loader import WeightsError
    from ferrum.server.launch import StartupError
    from ferrum.weights.errors import WeightError
    from ferrum.weights.locations.uri import ModelLocationError

    return (ConfigError, BackendSelectionError, StartupError, ModelConfigError, WeightsError, WeightError,
            ModelLocationError)


MODEL_HELP = (
    "model location: a local folder, hf://org/name[@revision], s3://bucket/prefix or https://host/folder/"
)
QUANTIZATION_HELP = (
    "quantize the linear layers' weights as they load: int8 | int4 | fp8 | none (also FERRUM_QUANTIZATION; "
    "group_size, symmetric and skip from the config file's quantization section); or the format a published "
    "checkpoint must be in: gptq | awq | fp8 | compressed-tensors | gguf (detected without the flag)"
)
KV_CACHE_DTYPE_HELP = (
    "what the KV cache holds: auto (the serving dtype) | bfloat16 | float16 | float32 | int8 (per-head int8 with "
    "a float32 scale: about half the bytes of bfloat16; read by the CPU kernels' attention only) | fp8 (e4m3 with a "
    "scale per layer, from the checkpoint or measured at start-up: half the bytes; GPUs with fp8, compute "
    "capability 8.9+)"
)


SPECULATIVE_HELP = (
    'speculative decoding, as JSON: {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
    '"prompt_lookup_min": 2} (optional: "disable_by_batch_size": N, "adaptive": false); default: off'
)


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    p.add_argument("--config", help="YAML config file (default: none; flags and defaults only)")
    p.add_argument("--model", help=MODEL_HELP)
    p.add_argument("--cache-dir", dest="cache_dir", help="where remote models are cached (weights.cache_dir)")
    p.add_argument("--served-model-name", dest="served_model_name", help="model id clients use")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--backend", help="auto | cpu | cuda | cuda:N | mps")
    p.add_argument("--dtype", help="auto | float32 | bfloat16 | float16")
    p.add_argument("--quantization", "-q", dest="quantization", metavar="METHOD", help=QUANTIZATION_HELP)
    p.add_argument("--max-model-len", dest="max_model_len", type=int)
    p.add_argument("--max-num-seqs", dest="max_num_seqs", type=int)
    p.add_argument("--max-num-batched-tokens", dest="max_num_batched_tokens", type=int)
    p.add_argument("--kv-cache-memory-gb", dest="kv_cache_memory_gb", type=float)
    p.add_argument("--kv-cache-dtype", dest="kv_cache_dtype", help=KV_CACHE_DTYPE_HELP)
    p.add_argument("--threads", dest="threads", type=int,
                   help="CPU: compute threads (default: the cores the process may use, cgroup quota included)")
    p.add_argument("--gpu-memory-utilization", dest="gpu_memory_utilization", type=float,
                   help="share of GPU memory for weights, activations and KV cache (default 0.9)")
    p.add_argument("--enforce-eager", dest="enforce_eager", action="store_const", const=True,
                   help="GPU: no CUDA graphs for decode")
    p.add_argument("--num-scheduler-steps", dest="num_scheduler_steps", type=int,
                   help="GPU: greedy decode iterations per host round trip while no request waits for a slot "
                        "(default 16)")
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_const", const=False,
                   help="do not reuse the KV of prompt prefixes shared with earlier requests")
    p.add_argument("--speculative-config", dest="speculative_config", metavar="JSON", help=SPECULATIVE_HELP)
    p.add_argument("--tensor-parallel-size", "-tp", dest="tensor_parallel_size", type=int,
                   help="split the model across N devices (one process each; default 1)")
    p.add_argument("--engine-process", dest="engine_process", choices=("auto", "on", "off"),
                   help="run the engine in a process of its own (auto: on, on every backend)")
    p.add_argument("--log-level", dest="log_level", help="debug | info | warning | error")
    p.add_argument("--log-format", dest="log_format", choices=("text", "json"), help="log lines as text or JSON")
    p.add_argument("--log-prompts", dest="log_prompts", action="store_const", const=True,
                   help="put prompts in the per-request log line (off by default)")
    p.add_argument("--no-log-requests", dest="log_requests", action="store_const", const=False,
                   help="no log line per finished request")
    api = p.add_argument_group("access")
    api.add_argument("--api-key", dest="api_keys", action="append", metavar="KEY",
                     help="accept `Authorization: Bearer KEY` (repeat for several; also FERRUM_API_KEY)")
    api.add_argument("--api-key-file", dest="api_key_file", metavar="FILE", help="more keys, one per line")
    api.add_argument("--metrics-require-key", dest="metrics_require_key", action="store_const", const=True,
                     help="/metrics needs a key too (it is open by default)")
    api.add_argument("--cors-origin", dest="cors_origins", action="append", metavar="ORIGIN",
                     help="allow cross-site requests from ORIGIN (repeat; * for any; default: CORS off)")
    api.add_argument("--root-path", dest="root_path", help="the path prefix a proxy serves Ferrum under")
    api.add_argument("--no-ui", dest="ui", action="store_const", const=False, help="no chat page at /")
    api.add_argument("--ssl-keyfile", dest="ssl_keyfile", help="serve HTTPS with this key (and --ssl-certfile)")
    api.add_argument("--ssl-certfile", dest="ssl_certfile", help="serve HTTPS with this certificate")
    chat = p.add_argument_group("chat output")
    chat.add_argument("--tool-call-parser", dest="tool_call_parser",
                      choices=("auto", "hermes", "llama3_json", "mistral"),
                      help="the format of the model's tool calls (default auto: told by its chat template)")
    chat.add_argument("--reasoning-parser", dest="reasoning_parser", choices=("qwen3", "deepseek_r1"),
                      help="return a reasoning model's <think> part as reasoning_content (default: none)")
    limits = p.add_argument_group("admission and limits")
    limits.add_argument("--max-waiting-requests", dest="max_waiting_requests", type=int,
                        help="requests that may wait beyond the running batch (default 4 x max_num_seqs)")
    limits.add_argument("--max-waiting-tokens", dest="max_waiting_tokens", type=int,
                        help="prompt tokens that may wait (default: no limit)")
    limits.add_argument("--overload-status", dest="overload_status", type=int, choices=(429, 503),
                        help="the status of a request refused for load (default 429)")
    limits.add_argument("--retry-after", dest="retry_after_s", type=int, metavar="SECONDS",
                        help="Retry-After sent with an overload refusal (default 1)")
    limits.add_argument("--max-body-mb", dest="max_body_mb", type=float, help="largest request body (default 4)")
    limits.add_argument("--max-tokens-limit", dest="max_tokens", type=int,
                        help="largest max_tokens a request may ask (default: the context length)")
    limits.add_argument("--max-n", dest="max_n", type=int, help="largest n a request may ask (default 16)")
    limits.add_argument("--request-timeout", dest="request_timeout_s", type=float, metavar="SECONDS",
                        help="deadline of a request that sends no `timeout` of its own (default: none)")
    limits.add_argument("--shutdown-timeout", dest="shutdown_timeout_s", type=float, metavar="SECONDS",
                        help="on SIGTERM/SIGINT, how long in-flight requests may finish (default 30)")
    limits.add_argument("--failed-start-linger", dest="failed_start_linger_s", type=float, metavar="SECONDS",
                        help="after a failed start, how long /ready says why before exiting (default 3)")


def _pull_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pull", help="fetch a model into the cache ahead of serving; prints its local folder")
    p.add_argument("model", nargs="?", help=MODEL_HELP + " (default: the config file's model)")
    p.add_argument("--config", help="YAML config file: its model and weights sections")
    p.add_argument("--cache-dir", dest="cache_dir", help="where remote models are cached (weights.cache_dir)")
    p.add_argument("--log-level", dest="log_level", help="debug | info | warning | error")


def _chat_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="chat in the terminal with a running OpenAI-compatible server")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default http://127.0.0.1:8000)")
    p.add_argument("--model", help="model id (default: the server's first)")
    p.add_argument("--api-key", help="sent as Authorization: Bearer (default: $OPENAI_API_KEY)")
    p.add_argument("--temperature", type=float)
    p.add_argument("--max-tokens", type=int)


def _run_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="serve a model in the background of this process and chat with it")
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument("--config", help="YAML config file")
    p.add_argument("--backend", help="auto | cpu | cuda | cuda:N | mps")
    p.add_argument("--dtype", help="auto | float32 | bfloat16 | float16")
    p.add_argument("--quantization", "-q", dest="quantization", metavar="METHOD", help=QUANTIZATION_HELP)
    p.add_argument("--max-model-len", dest="max_model_len", type=int)
    p.add_argument("--kv-cache-dtype", dest="kv_cache_dtype", help=KV_CACHE_DTYPE_HELP)
    p.add_argument("--port", type=int, help="port of the background server (default: a free one)")
    p.add_argument("--temperature", type=float)
    p.add_argument("--log-level", dest="log_level", help="the server's log level (default warning)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ferrum", description="Ferrum LLM inference server")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    _pull_parser(sub)
    _chat_parser(sub)
    _run_parser(sub)
    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.command != "serve" or args.engine_process == "off":
        return _run(args)
    from ferrum.engine.warm_start import discard, prestart

    prestart()  # the engine process imports its modules while this one imports the server's
    try:
        _run(args)
    finally:
        discard()  # if the server stopped before a launch took it, it exits now


def _run(args: argparse.Namespace) -> None:
    errors = user_errors()
    from ferrum.server.logs import setup_logging

    if args.command == "bench":
        try:
            sys.exit(run_bench(args))
        except errors as exc:
            print(f"ferrum: error: {exc}", file=sys.stderr)
            sys.exit(2)
        except KeyboardInterrupt:
            sys.exit(130)
    if args.command == "chat":
        from ferrum.chat_client import ChatClient, repl

        client = ChatClient(args.url, args.api_key or os.environ.get("OPENAI_API_KEY"), args.model,
                            args.temperature, args.max_tokens)
        sys.exit(repl(client))
    if args.command == "run":
        from ferrum.chat_client import run_config, run_model

        try:
            config = run_config(args.model, args.config, {k: getattr(args, k) for k in (
                "backend", "dtype", "quantization", "max_model_len", "kv_cache_dtype", "port", "log_level")})
            setup_logging(config.server.logging)
            sys.exit(run_model(config, args.temperature))
        except errors as exc:
            print(f"ferrum: error: {exc}", file=sys.stderr)
            sys.exit(2)
    from ferrum.config.loader import load_config
    from ferrum.server.launch import pull_model

    overrides = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
    try:
        config = load_config(args.config, overrides)
        setup_logging(config.server.logging)
        if args.command == "serve":
            from ferrum.server.serve import EngineStopped, serve

            try:
                asyncio.run(serve(config))
            except EngineStopped as exc:
                print(f"ferrum: error: {exc}", file=sys.stderr)
                sys.exit(1)
        elif args.command == "pull":
            print(asyncio.run(pull_model(config)), flush=True)
    except errors as exc:
        print(f"ferrum: error: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
