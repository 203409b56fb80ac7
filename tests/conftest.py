"""Shared helpers: a small synthetic dataset generated once per session, and ways to run dlojz."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import dlojz  # noqa: E402

# Small enough for a CPU test, big enough that a ResNet-18 learns it in a few dozen steps.
TINY = ['--synthetic-classes', '4', '--synthetic-train-per-class', '24', '--synthetic-val-per-class', '6',
        '--arch', 'resnet18', '--image-size', '32', '--val-resize', '36', '--val-image-size', '32',
        '-b', '8', '--val-batch-size', '16', '--num-workers', '0', '--wandb', 'off']


@pytest.fixture(scope='session')
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp('cache'))


def run_main(out_dir, cache_dir, *flags):
    """Run dlojz.main in-process and return (summary dict, metrics records)."""
    argv = TINY + ['--cache-dir', cache_dir, '--output-dir', str(out_dir)] + [str(f) for f in flags]
    summary = dlojz.main(dlojz.get_args_parser().parse_args(argv))
    with open(os.path.join(out_dir, 'metrics.jsonl')) as f:
        records = [json.loads(line) for line in f]
    return summary, records


def run_cli(*flags, env=None, timeout=300):
    """Run `python dlojz.py FLAGS` in a subprocess; returns CompletedProcess with text output."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, os.path.join(ROOT, 'dlojz.py')] + [str(f) for f in flags],
                          capture_output=True, text=True, env=full_env, timeout=timeout, cwd=ROOT)
