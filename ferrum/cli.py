"""`ferrum` command line: serve, pull, bench."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from ferrum.backends.selection import BackendSelectionError
from ferrum.bench.cli import add_bench_parser, run_bench
from ferrum.config import ConfigError, load_config
from ferrum.models.config import ModelConfigError
from ferrum.models.loader import WeightsError
from ferrum.server.launch import StartupError, pull_model, serve
from ferrum.weights.errors import WeightError
from ferrum.weights.uri import ModelLocationError

USER_ERRORS = (
    ConfigError,
    BackendSelectionError,
    StartupError,
    ModelConfigError,
    WeightsError,
    WeightError,
    ModelLocationError,
)
MODEL_HELP = (
    "model location: a local folder, hf://org/name[@revision], s3://bucket/prefix or https://host/folder/"
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
    p.add_argument("--max-model-len", dest="max_model_len", type=int)
    p.add_argument("--max-num-seqs", dest="max_num_seqs", type=int)
    p.add_argument("--max-num-batched-tokens", dest="max_num_batched_tokens", type=int)
    p.add_argument("--kv-cache-memory-gb", dest="kv_cache_memory_gb", type=float)
    p.add_argument("--gpu-memory-utilization", dest="gpu_memory_utilization", type=float,
                   help="share of GPU memory for weights, activations and KV cache (default 0.9)")
    p.add_argument("--enforce-eager", dest="enforce_eager", action="store_const", const=True,
                   help="GPU: no CUDA graphs for decode")
    p.add_argument("--num-scheduler-steps", dest="num_scheduler_steps", type=int,
                   help="GPU: greedy decode iterations per host round trip while no request waits for a slot (default 16)")
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_const", const=False,
                   help="do not reuse the KV of prompt prefixes shared with earlier requests")
    p.add_argument("--engine-process", dest="engine_process", choices=("auto", "on", "off"),
                   help="run the engine in a process of its own (auto: on cuda and mps, not on cpu)")
    p.add_argument("--log-level", dest="log_level", help="debug | info | warning | error")


def _pull_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pull", help="fetch a model into the cache ahead of serving; prints its local folder")
    p.add_argument("model", nargs="?", help=MODEL_HELP + " (default: the config file's model)")
    p.add_argument("--config", help="YAML config file: its model and weights sections")
    p.add_argument("--cache-dir", dest="cache_dir", help="where remote models are cached (weights.cache_dir)")
    p.add_argument("--log-level", dest="log_level", help="debug | info | warning | error")


def _logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ferrum", description="Ferrum LLM inference server")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    _pull_parser(sub)
    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)

    if args.command == "bench":
        try:
            sys.exit(run_bench(args))
        except USER_ERRORS as exc:
            print(f"ferrum: error: {exc}", file=sys.stderr)
            sys.exit(2)
        except KeyboardInterrupt:
            sys.exit(130)
    overrides = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
    try:
        config = load_config(args.config, overrides)
        _logging(config.log_level)
        if args.command == "serve":
            asyncio.run(serve(config))
        elif args.command == "pull":
            print(asyncio.run(pull_model(config)), flush=True)
    except USER_ERRORS as exc:
        print(f"ferrum: error: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
