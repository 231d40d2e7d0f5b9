"""A FAKE stand-in for ``sglang.benchmark.offline_throughput`` (sglang 0.5.23), for tests only.

It serves nothing and measures nothing. Like the real module it exposes ``BenchArgs.add_cli_args``
and ``cli_main()``, parses ``sys.argv`` with SGLang's real ``ServerArgs.add_cli_args`` (so the
purlin plugin's flags must be in effect) and builds a real ``ServerArgs`` with
``ServerArgs.from_cli_args`` (so the plugin records ``--comm-backend`` on it). It then appends
one JSON line to ``--result-filename`` with the keys of the real benchmark's result line, filled
with MADE-UP numbers (a fixed time per request that depends on the backend), plus ``fake_*``
keys that report what it saw. ``FAKE_OFFLINE_FAIL=<backend>`` makes that backend's run fail.
"""

from __future__ import annotations

import argparse
import hashlib
import json

FAKE_SECONDS_PER_REQUEST = {"nccl": 0.010, "purlin": 0.008}  # invented, not measured


class BenchArgs:
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        a = parser.add_argument
        a("--backend", default="engine")
        a("--result-filename", default="")
        a("--dataset-name", default="sharegpt", choices=["sharegpt", "random", "generated-shared-prefix"])
        a("--dataset-path", default="")
        a("--num-prompts", type=int, default=1000)
        a("--random-input-len", type=int, default=1024)
        a("--random-output-len", type=int, default=1024)
        a("--seed", type=int, default=42)
        a("--skip-warmup", action="store_true")


def cli_main() -> None:
    from sglang.srt.server_args import ServerArgs

    from purlin_sglang.sglang import plugin

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    BenchArgs.add_cli_args(parser)
    args = parser.parse_args()
    server_args = ServerArgs.from_cli_args(args)
    backend = plugin.settings_of(server_args).backend
    with open(args.dataset_path, "rb") as f:
        data = f.read()
    n, t = args.num_prompts, FAKE_SECONDS_PER_REQUEST[backend] * args.num_prompts
    tin, tout = n * args.random_input_len, n * args.random_output_len
    result = {  # the real line's keys, made-up values
        "backend": args.backend, "successful_requests": n, "total_latency": t, "total_input_tokens": tin,
        "total_output_tokens": tout, "request_throughput": n / t, "input_throughput": tin / t,
        "output_throughput": tout / t, "total_throughput": (tin + tout) / t, "last_gen_throughput": tout / t,
        "fake": True, "fake_comm_backend": backend, "fake_purlin_config": plugin.settings_of(server_args).config_path,
        "fake_tp_size": server_args.tp_size, "fake_load_format": server_args.load_format,
        "fake_model_path": server_args.model_path, "fake_dataset_name": args.dataset_name,
        "fake_seed": args.seed, "fake_dataset_sha256": hashlib.sha256(data).hexdigest(),
    }
    with open(args.result_filename, "a") as f:
        f.write(json.dumps(result) + "\n")
    print(f"fake benchmark: {backend}: {n} requests, made-up latency {t:.3f} s")
