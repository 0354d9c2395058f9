import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


def pytest_addoption(parser) -> None:
    parser.addoption("--shard", default=None, metavar="I/N",
                     help="run only every N-th collected test, starting at the I-th (1-based): a suite too "
                          "long for one sitting (the engine's GPU tests) split into N runs")


def pytest_collection_modifyitems(config, items) -> None:
    shard = config.getoption("--shard")
    if shard is None:
        return
    try:
        index, count = (int(part) for part in shard.split("/"))
    except ValueError:
        raise pytest.UsageError(f"--shard takes I/N, e.g. 1/2, not {shard!r}") from None
    if not 1 <= index <= count:
        raise pytest.UsageError(f"--shard {shard}: I must be 1 … N")
    config.hook.pytest_deselected(items=[item for i, item in enumerate(items) if i % count != index - 1])
    items[:] = items[index - 1::count]
