"""Shared test set-up: GPU tests are marked ``gpu`` and skip cleanly without a CUDA GPU."""

import os

# Loopback ranks are one stream each in one process; CUDA maps streams onto this many hardware
# queues (default 8). Eight ranks plus torch's default stream then share a queue, and work queued
# behind another rank's spinning kernel can wait for it (suspected cause of the intermittent
# world-8 timeouts in test_payloads_larger_than_staging, docs/RESULTS.md). Read at context creation.
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
