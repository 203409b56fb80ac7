"""dlojzlib.lightning on a GPU (what tests/test_lightning.py cannot show on CPU): the callback's
phases on the device clock (CUDA events) with no phase outside its step, its own hooks under 1 % of
the steps, and its img/s and verdict beside dlojz.py's on the same model, data, batch and
precision, each run's figures printed for BENCHMARKS.md.

Run: python -m pytest -q -s tests/gpu/test_gpu_lightning.py
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, TINY, run_cli

SAME = ['--arch', 'resnet50', '--image-size', '128', '-b', '64', '--num-workers', '6',
        '--warmup-steps', '5']
DATA = ['--synthetic-classes', '4', '--synthetic-train-per-class', '400',
        '--synthetic-val-per-class', '6', '--val-resize', '146', '--val-image-size', '128']


def test_the_callback_times_on_the_device_clock_beside_dlojz_py(tmp_path, cache_dir):
    # Skipped in the test, not at import: a module skipped at import has no test for
    # quick.txt's node id to name, and counts as a skip before the DLOJZ_REQUIRE_GPU check.
    pytest.importorskip('lightning', reason='the node has Lightning; pip install -r '
                        'requirements-lightning.txt elsewhere')
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip('bf16 needs compute capability 8.0')
    ours = tmp_path / 'dlojz_py'
    p = run_cli(*TINY, *DATA, *SAME, '--cache-dir', cache_dir, '--output-dir', ours,
                '--test-nsteps', '24', '--device', 'cuda', '--amp', 'bf16', '--no-channels-last',
                '--optimizer', 'sgd', '--wd', '0', '--label-smoothing', '0', '--scheduler',
                'constant', '--lr', '0.02', timeout=400)
    assert p.returncode == 0, p.stderr[-3000:]
    theirs = tmp_path / 'lightning'
    q = subprocess.run([sys.executable, os.path.join(ROOT, 'examples', 'lightning_resnet50.py'),
                        *SAME, '--max-steps', '24', '--max-epochs', '1', '--precision',
                        'bf16-mixed', '--optimizer', 'sgd', '--accelerator', 'gpu', '--devices',
                        '1', '--output-dir', str(theirs), f'--data-flag=--cache-dir={cache_dir}',
                        *(f'--data-flag={f}' for f in DATA)],
                       capture_output=True, text=True, cwd=ROOT, timeout=400)
    assert q.returncode == 0, q.stderr[-3000:]
    a = json.load(open(ours / 'summary.json'))['timing']
    s = json.load(open(theirs / 'dlojz' / 'summary.json'))
    b = s['timing']
    for name, t in (('dlojz.py', a), ('lightning', b)):
        print(f"{name}: {t['train_throughput']:.1f} img/s, gpu {t['gpu_throughput']:.1f} img/s, "
              f"bound {t['bound']}, shares {t['shares']}, phase medians (ms) "
              f"{ {k: round(t['stats'][k]['median'] * 1e3, 2) for k in t['stats']} }")
    print(f"callback share {s['lightning']['callback_share']:.5f}")
    assert b['clock'] == 'cuda-events' and b['phase_sum_error'] == 0.0
    assert s['lightning']['callback_share'] < 0.01
    assert b['bound'] == a['bound']
    assert 0.85 < b['train_throughput'] / a['train_throughput'] < 1.15
