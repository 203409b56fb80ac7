"""tests/gpu needs a CUDA GPU: without one, every test of this folder is skipped with the reason, unless
DLOJZ_REQUIRE_GPU=1 (set by run.sh) says a GPU was meant: then the session stops with that reason as an
error, no test run. The fixtures and helpers of tests/conftest.py (cache_dir, TINY, run_main, torchrun,
latest) apply here too; progress.py's hooks name each test as it starts and ends (run.sh's
progress.txt); a test of the list run.sh runs gets a time limit from its planned seconds."""
import gc
import os
import pathlib

import pytest
import torch

from gpu import results
from gpu.progress import pytest_runtest_logfinish, pytest_runtest_logstart  # noqa: F401 - hooks

HERE = pathlib.Path(__file__).parent
LIST = 'DLOJZ_GPU_LIST'  # run.sh: the list file it runs, whose seconds size each test's time limit


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        limit_by_the_list(config, items, os.environ.get(LIST))
        return
    # this hook sees the items of the whole session: mark only this folder's
    ours = [item for item in items if HERE in item.path.parents]
    why = 'needs a CUDA GPU (torch.cuda.is_available() is False); run bash tests/gpu/run.sh on a GPU node'
    if ours and os.environ.get('DLOJZ_REQUIRE_GPU') == '1':
        raise pytest.UsageError(f'DLOJZ_REQUIRE_GPU=1 and tests/gpu {why} (python tests/gpu/cuda_check.py says why)')
    for item in ours:
        item.add_marker(pytest.mark.skip(reason=why))


def limit_by_the_list(config, items, list_path):
    """Each test of the list run gets results.timeout_for its planned seconds (pytest-timeout's
    marker, which beats run.sh's --timeout): a cold compile planned at 90 s is not stopped at 120.
    A parametrised case takes its line's limit."""
    if not list_path or not config.pluginmanager.hasplugin('timeout'):
        return
    plan = {node: seconds for node, seconds, _ in results.entries(list_path)}
    for item in items:
        seconds = plan.get(item.nodeid, plan.get(item.nodeid.split('[')[0]))
        if seconds and results.timeout_for(seconds) > results.timeout_for(None):
            item.add_marker(pytest.mark.timeout(results.timeout_for(seconds)))


def unavailable(reason):
    """A check this machine cannot make: skipped, unless DLOJZ_REQUIRE_GPU=1 says the node was meant
    to make it (run.sh sets it): then failed, so that a proof cannot vanish from a GPU run as a
    skip. For what the node must have (CUPTI for the profiler, NVML); a legitimate skip (2 GPUs,
    DALI, bf16 below sm80) stays a skip."""
    if os.environ.get('DLOJZ_REQUIRE_GPU') == '1':
        pytest.fail(f'{reason} (DLOJZ_REQUIRE_GPU=1: a GPU node must make this check)',
                    pytrace=False)
    pytest.skip(reason)


@pytest.fixture(autouse=True)
def release_gpu_memory():
    """In-process runs leave their blocks in PyTorch's caching allocator (GiB for a ResNet-50 step); the
    torchrun and CLI runs of later tests share the GPU with this process."""
    yield
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()
