"""`ferrum` command line: serve."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from ferrum.backends.selection import BackendSelectionError
from ferrum.config import ConfigError, load_config
from ferrum.models.config import ModelConfigError
from ferrum.models.loader import WeightsError
from ferrum.server.launch import StartupError, serve

USER_ERRORS = (ConfigError, BackendSelectionError, StartupError, ModelConfigError, WeightsError)


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    p.add_argument("--config", help="YAML config file (default: none; flags and defaults only)")
    p.add_argument("--model", help="path of an HF model folder")
    p.add_argument("--served-model-name", dest="served_model_name", help="model id clients use")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--backend", help="auto | cpu | cuda | cuda:N | mps")
    p.add_argument("--dtype", help="auto | float32 | bfloat16 | float16")
    p.add_argument("--max-model-len", dest="max_model_len", type=int)
    p.add_argument("--max-num-seqs", dest="max_num_seqs", type=int)
    p.add_argument("--kv-cache-memory-gb", dest="kv_cache_memory_gb", type=float)
    p.add_argument("--log-level", dest="log_level", help="debug | info | warning | error")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="ferrum", description="Ferrum LLM inference server")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    args = parser.parse_args(argv)

    if args.command == "serve":
        overrides = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
        try:
            config = load_config(args.config, overrides)
            logging.basicConfig(
                level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
            )
            asyncio.run(serve(config))
        except USER_ERRORS as exc:
            print(f"ferrum: error: {exc}", file=sys.stderr)
            sys.exit(2)
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
