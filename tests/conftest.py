"""Shared fixtures."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="module")
def fourfold_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A private FOURFOLD_CACHE (built-in corpus, CPU peak probe) for one test module, and one
    thread: these tiny models gain nothing from more, and on a busy machine several threads
    spin-wait for each other."""
    old_cache, old_threads = os.environ.get("FOURFOLD_CACHE"), torch.get_num_threads()
    os.environ["FOURFOLD_CACHE"] = str(tmp_path_factory.mktemp("fourfold-cache"))
    torch.set_num_threads(1)
    yield Path(os.environ["FOURFOLD_CACHE"])
    torch.set_num_threads(old_threads)
    if old_cache is None:
        del os.environ["FOURFOLD_CACHE"]
    else:
        os.environ["FOURFOLD_CACHE"] = old_cache
