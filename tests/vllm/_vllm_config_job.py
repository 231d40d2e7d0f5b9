"""Run by the vLLM venv's python (tests/vllm/test_vllm_moe.py): what purlin's plugin does to vLLM 0.33.0's
configuration and CLI, with vLLM's real objects on the CPU platform. Prints one JSON line of facts:

* ``help``: whether ``--additional-config`` (purlin's switch) is in the help of the parser ``vllm serve``
  builds (``vllm.entrypoints.common.cli_args.make_arg_parser``; building it loads the general plugins),
  whether it is an option of that parser, and whether purlin's start-up hooks were in effect afterwards;
* ``fuse``: ``pass_config.fuse_allreduce_rms`` of a ``VllmConfig`` asked for that pass, with and without
  ``additional_config.purlin``;
* ``bad_moe_dtype``: the error a ``moe.dtype`` the vLLM adapter does not serve raises at config time.

    python tests/vllm/_vllm_config_job.py
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def main() -> int:
    from vllm.config import VllmConfig
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from purlin_sglang.vllm import hooks

    facts: dict = {"hooks_before_parser": hooks.missing(hooks.START_UP)}
    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    facts["help"] = {"has_flag": "--additional-config" in parser.format_help(),
                     "is_an_option": "--additional-config" in parser._option_string_actions,
                     "hooks_after_parser": hooks.missing(hooks.START_UP)}
    fuse = {"pass_config": {"fuse_allreduce_rms": True}}
    facts["fuse"] = {
        "purlin": VllmConfig(additional_config={"purlin": True}, compilation_config=fuse)
        .compilation_config.pass_config.fuse_allreduce_rms,
        "without": VllmConfig(compilation_config=fuse).compilation_config.pass_config.fuse_allreduce_rms,
    }
    try:
        VllmConfig(additional_config={"purlin": {"moe": {"dispatcher": "purlin", "dtype": "fp8"}}})
        facts["bad_moe_dtype"] = None
    except Exception as e:  # noqa: BLE001 - recorded for the test
        facts["bad_moe_dtype"] = f"{type(e).__name__}: {e}"
    print("RESULT " + json.dumps(facts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
