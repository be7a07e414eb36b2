"""The `ferrum bench offline` and `ferrum bench serve` command lines."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import sys
from typing import Any

from ferrum.bench.client import ENDPOINTS
from ferrum.bench.errors import BenchError
from ferrum.bench.metrics import LevelResult
from ferrum.bench.workload import LengthRange, WorkloadSpec, load_prompts

log = logging.getLogger("ferrum.bench")

ENGINE_FLAGS = ("dtype", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "kv_cache_memory_gb",
                "kv_cache_dtype", "gpu_memory_utilization", "tensor_parallel_size", "num_scheduler_steps",
                "speculative_config")


def _length_range(text: str) -> LengthRange:
    try:
        return LengthRange.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _json_mapping(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _positive_list(text: str, what: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{what} must be integers >= 1, got {text!r}")
    return values


def _levels(text: str) -> tuple[int, ...]:
    return _positive_list(text, "concurrency levels")


def _request_counts(text: str) -> tuple[int, ...]:
    return _positive_list(text, "request counts")


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected 0 or more, got {text!r}")
    return value


def _rate(text: str) -> float:
    try:
        rate = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected inf or a positive number, got {text!r}") from None
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"the request rate must be positive (or inf), got {text!r}")
    return rate


def _workload_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--num-prompts", type=int, default=256, metavar="N",
                   help="number of requests (of each concurrency level, for serve; default 256)")
    g.add_argument("--input-len", type=_length_range, default=LengthRange(100, 1024), metavar="N|LOW:HIGH",
                   help="length in tokens of each prompt's own random part (after the shared prefix), drawn "
                        "uniformly from LOW..HIGH inclusive (default 100:1024)")
    g.add_argument("--prefix-len", type=_non_negative, default=0, metavar="N",
                   help="a random prefix of N token ids shared by every request, the same at every level "
                        "(default 0: none)")
    g.add_argument("--output-len", type=_length_range, default=LengthRange(100, 1024), metavar="N|LOW:HIGH",
                   help="max_tokens of each request, drawn like --input-len (default 100:1024)")
    g.add_argument("--seed", type=int, default=0, metavar="N", help="seed of the workload (default 0)")
    g.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let requests stop at EOS (default: ignore EOS, so each generates its output length)")
    p.add_argument("--output-json", metavar="FILE", help="write the results as JSON to FILE")
    p.add_argument("--log-level", default="warning", metavar="LEVEL",
                   help="debug | info | warning | error (default warning)")


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmark throughput and latency on a random workload")
    modes = bench.add_subparsers(dest="bench_command", required=True)

    off = modes.add_parser("offline", help="run the workload through the engine in this process (no HTTP)")
    off.add_argument("--model", required=True, help="model location, as for `ferrum serve --model`")
    off.add_argument("--backend", default="auto", help="auto | cpu | cuda | cuda:N | mps (default auto)")
    off.add_argument("--dtype", help="auto | float32 | bfloat16 | float16 (default auto)")
    off.add_argument("--quantization", "-q", metavar="METHOD",
                     help="quantize the linear layers' weights as they load: int8 | int4 (group 128) | fp8 | "
                          "none (default none)")
    off.add_argument("--max-num-seqs", type=int, metavar="N", help="most sequences in one step")
    off.add_argument("--max-num-batched-tokens", type=int, metavar="N", help="token budget of one step")
    off.add_argument("--max-model-len", type=int, metavar="N", help="context length (default: the model's)")
    off.add_argument("--kv-cache-memory-gb", type=float, metavar="G", help="KV cache size")
    off.add_argument("--kv-cache-dtype", help="auto | bfloat16 | float16 | float32 | int8 | fp8 (default auto)")
    off.add_argument("--gpu-memory-utilization", type=float, metavar="F",
                     help="on GPUs: share of device memory for weights and KV cache")
    off.add_argument("--tensor-parallel-size", type=int, metavar="N",
                     help="split the model across N devices, one process each (default 1)")
    off.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    off.add_argument("--num-scheduler-steps", type=int, metavar="N",
                     help="GPU: greedy decode iterations per host round trip (default 16)")
    off.add_argument("--no-prefix-caching", action="store_true", help="turn prefix caching off")
    off.add_argument("--speculative-config", metavar="JSON",
                     help='speculative decoding, as for `ferrum serve`: {"method": "ngram", "num_speculative_tokens": '
                          '4}; the report gives the acceptance')
    off.add_argument("--kernels", type=_json_mapping, metavar="JSON",
                     help='the engine\'s kernel settings, as under `engine: {kernels: ...}` in the YAML: '
                          '{"max_decode_splits": 8, "int4_w8a8_rows": 129}')
    _workload_flags(off)

    srv = modes.add_parser("serve", help="stream the workload to a running server at several concurrencies")
    srv.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    srv.add_argument("--model", help="model name to request (default: the first of /v1/models)")
    srv.add_argument("--tokenizer", metavar="FOLDER",
                     help="a folder with the served model's tokenizer.json, for drawing prompt token ids "
                          "(default: --model, if it is such a folder)")
    srv.add_argument("--concurrency", type=_levels, default=(1, 16, 64), metavar="N[,N...]",
                     help="most requests in flight; the workload runs once per level (default 1,16,64)")
    srv.add_argument("--request-rate", type=_rate, default=math.inf, metavar="inf|RATE",
                     help="requests/s with Poisson arrivals, capped by the concurrency (default inf: all at once)")
    srv.add_argument("--timeout", type=float, default=3600.0, metavar="S", help="seconds per request (default 3600)")
    srv.add_argument("--plot", metavar="FILE.png", help="plot latencies and throughput against concurrency")
    srv.add_argument("--save-requests", action="store_true", help="put every request's timings in the JSON")
    srv.add_argument("--endpoint", choices=ENDPOINTS, default="completions",
                     help="completions: token-id prompts on /v1/completions (default); chat: the prompt as a "
                          "user message on /v1/chat/completions")
    srv.add_argument("--prompts-file", metavar="FILE",
                     help="a JSON list of prompt texts, handed out round-robin instead of random token ids "
                          "(--input-len is then unused); usually with --endpoint chat and --no-ignore-eos")
    srv.add_argument("--requests-per-level", type=_request_counts, metavar="N[,N...]",
                     help="the number of requests of each concurrency level, one per level "
                          "(default: --num-prompts at every level)")
    _workload_flags(srv)


def _workload(args: argparse.Namespace) -> WorkloadSpec:
    prompts_file = getattr(args, "prompts_file", None)
    prompts = load_prompts(prompts_file) if prompts_file else ()
    return WorkloadSpec(args.num_prompts, args.input_len, args.output_len, args.seed, args.ignore_eos,
                        args.prefix_len, prompts)


def _offline(args: argparse.Namespace) -> int:
    from ferrum.bench.offline import OfflineOptions, run_offline
    from ferrum.bench.report import offline_json, offline_table, write_json
    from ferrum.config.quantization import quantization_config

    engine: dict[str, Any] = {k: getattr(args, k) for k in ENGINE_FLAGS if getattr(args, k) is not None}
    if args.enforce_eager:
        engine["enforce_eager"] = True
    if args.no_prefix_caching:
        engine["enable_prefix_caching"] = False
    if args.quantization is not None:
        engine["quantization"] = quantization_config({"method": args.quantization})
    if args.kernels is not None:
        engine["kernels"] = args.kernels
    result = run_offline(OfflineOptions(args.model, _workload(args), args.backend, engine))
    print(offline_table(result), flush=True)
    if args.output_json:
        write_json(offline_json(result), args.output_json)
    if result.workload.ignore_eos and not result.output_tokens_as_requested:
        print(f"ferrum bench: error: {result.total_output_tokens} tokens generated, "
              f"{result.requested_output_tokens} requested (ignore_eos should make them equal)", file=sys.stderr)
        return 1
    return 0


def _counted_by_usage(level: LevelResult) -> bool:
    """Whether every output token count of the level came from the server's usage chunks."""
    return set(level.token_sources) <= {"usage"}


def _serve(args: argparse.Namespace) -> int:
    from ferrum.bench.plot import plot_levels, require_matplotlib
    from ferrum.bench.report import level_table, serve_header, serve_json, summary_table, write_json
    from ferrum.bench.serve import ServeOptions, run_serve

    if args.plot:
        require_matplotlib()  # fail before the run, not after it
    options = ServeOptions(args.url, _workload(args), args.concurrency, args.request_rate, args.model,
                           args.tokenizer, args.timeout, endpoint=args.endpoint,
                           requests_per_level=args.requests_per_level)
    result = asyncio.run(run_serve(options))
    levels = [run.result for run in result.levels]
    print(serve_header(result), flush=True)
    for run in result.levels:
        print(level_table(run.result), flush=True)
        if run.speculation is not None:
            print(f"Speculative decoding: {run.speculation.num_drafts:.0f} drafts, acceptance "
                  f"{run.speculation.acceptance_rate:.1%}, mean accepted length "
                  f"{run.speculation.mean_accepted_length:.2f}", flush=True)
    print(summary_table(levels), flush=True)
    if args.output_json:
        document = serve_json(result, args.save_requests)
        document["workload"]["prompts_file"] = args.prompts_file
        write_json(document, args.output_json)
    if args.plot:
        plot_levels(levels, args.plot, f"ferrum bench serve: {result.model}")
    failed = sum(level.failed for level in levels)
    if failed:
        print(f"ferrum bench: error: {failed} requests failed", file=sys.stderr)
        return 1
    if result.workload.ignore_eos and any(lv.total_output_tokens != lv.requested_output_tokens
                                          for lv in levels if _counted_by_usage(lv)):
        print("ferrum bench: error: the server generated other token counts than requested "
              "(ignore_eos should make them equal)", file=sys.stderr)
        return 1
    return 0


def run_bench(args: argparse.Namespace) -> int:
    """The exit status: 0, 1 when requests failed (or generated other token counts than asked), 2 for
    a benchmark that could not run."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return _offline(args) if args.bench_command == "offline" else _serve(args)
    except (BenchError, ValueError) as exc:
        log.debug("benchmark stopped", exc_info=True)
        print(f"ferrum bench: error: {exc}", file=sys.stderr)
        return 2
