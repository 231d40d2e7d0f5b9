"""Shared test set-up.

* GPU tests are marked ``gpu`` and skip cleanly without a CUDA GPU. This is the one place that decides
  it: a test module marks itself (``pytestmark = pytest.mark.gpu``) and repeats no skip of its own;
  without a GPU the skip given here is the one reported, whatever other skips the module has.
* CI switches that turn specific skips into failures, where the environment promises what the
  skipped tests need: ``PURLIN_REQUIRE_SGLANG=1`` (SGLang is installed: a test skipped because
  ``sglang`` or a part of it does not import fails) and ``PURLIN_REQUIRE_GPU=1`` (a CUDA GPU is
  there: a test skipped for want of one fails) and ``PURLIN_REQUIRE_VLLM=1`` (the vLLM venv of
  tools/install-vllm-cpu.sh is there: tests/vllm's jobs that skip for want of it fail). ``.ci/run``
  sets the first and the third, the ``test`` step of tools/gpu.sh the second.
* ``PURLIN_FAILURE_LOG=FILE``: each failing test's report is appended to FILE as soon as it fails, so a
  run stopped before pytest's summary (a device call's budget) still says what failed and why
  (tools/gpu.sh's ``test`` step sets it), with the process's CUDA memory and its other live threads
  at that moment (a failure that follows from an earlier one's leak, or from a thread left running,
  shows there).
* ``--part K/N``: only the K-th of N contiguous parts of the collected tests, in their order (a suite
  too long for one device call, run over N calls; a failure that needs an earlier part's state shows
  only in a whole run).
"""

import os
import re
import threading

import pytest
import torch

GPU_SKIP = "needs a CUDA GPU (torch.cuda.is_available() is False)"
# (switch, the skip reasons it turns into failures)
REQUIRED = (
    ("PURLIN_REQUIRE_SGLANG", re.compile(r"could not import 'sglang\b|needs sglang", re.IGNORECASE)),
    ("PURLIN_REQUIRE_GPU", re.compile(r"needs a CUDA GPU")),
    ("PURLIN_REQUIRE_VLLM", re.compile(r"no vLLM venv")),
)


def pytest_addoption(parser):
    parser.addoption("--part", default=None, metavar="K/N",
                     help="run only the K-th of N contiguous parts of the collected tests, in their order")


def _take_part(config, items) -> None:
    spec = config.getoption("--part")
    if spec is None:
        return
    m = re.fullmatch(r"(\d+)/(\d+)", spec)
    if m is None or not 1 <= int(m[1]) <= int(m[2]):
        raise pytest.UsageError(f"--part wants K/N with 1 <= K <= N (got {spec!r})")
    k, n = int(m[1]), int(m[2])
    lo, hi = len(items) * (k - 1) // n, len(items) * k // n
    config.hook.pytest_deselected(items=items[:lo] + items[hi:])
    items[:] = items[lo:hi]


def pytest_collection_modifyitems(config, items):
    _take_part(config, items)
    if torch.cuda.is_available():
        return
    # a skipif put first on the item: pytest evaluates skipif marks before skip marks, in order, the
    # item's own before its module's, so another skip of the test or its module ("needs sglang",
    # "needs two GPUs") cannot hide this one
    skip = pytest.mark.skipif(True, reason=GPU_SKIP)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip, append=False)


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr)


def _fail_required_skip(report) -> None:
    """A skip that a set PURLIN_REQUIRE_* switch forbids becomes a failure naming the switch."""
    if not report.skipped or getattr(report, "wasxfail", None) is not None:
        return
    reason = _skip_reason(report)
    for switch, pattern in REQUIRED:
        if os.environ.get(switch) == "1" and pattern.search(reason):
            report.outcome = "failed"
            report.longrepr = f"{reason}\n{switch}=1: this skip is a failure here (the environment must provide it)"
            return


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _fail_required_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _fail_required_skip(outcome.get_result())


def pytest_runtest_logreport(report):
    path = os.environ.get("PURLIN_FAILURE_LOG")
    if not path or not report.failed:
        return
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"FAILED {report.nodeid} (in {report.when})\n{report.longreprtext}\n{_process_state()}\n\n")


def _process_state() -> str:
    """One line each: this process's CUDA memory (when a GPU is visible) and its other live threads."""
    lines = []
    if torch.cuda.is_available():
        try:
            free, total = torch.cuda.mem_get_info()
            gib = 1 << 30
            lines.append(f"cuda memory: {torch.cuda.memory_allocated() / gib:.2f} GiB allocated, "
                         f"{torch.cuda.memory_reserved() / gib:.2f} GiB reserved by torch, "
                         f"{free / gib:.2f} of {total / gib:.2f} GiB free on the device")
        except Exception as e:  # noqa: BLE001 - a broken context: say so and go on
            lines.append(f"cuda memory: unknown ({e})")
    others = [t.name for t in threading.enumerate() if t is not threading.current_thread()]
    lines.append(f"other live threads: {', '.join(others) if others else 'none'}")
    return "\n".join(lines)
