"""--tune on a real GPU (dlojz_tune): the batch doubling reads GPU memory, the GPU configurations (fp16, bf16
where supported, channels-last, compile) run, and the winner rerun as a plain dlojz.py process reproduces the
table's img/s within 10 % (an idle GPU; the CPU test allows 50 % on a shared machine).

    bash tests/gpu/run.sh      # or: python -m pytest -q tests/gpu/test_tune_gpu.py on a GPU node
"""
import json

import pytest
import torch

import dlojz
import dlojz_flags
import dlojz_tune as T
from conftest import TINY, run_cli


@pytest.fixture(scope='module')
def gpu_sweep(tmp_path_factory, cache_dir):
    out = tmp_path_factory.mktemp('tune-gpu')
    parser = dlojz.get_args_parser()
    args = parser.parse_args(TINY + ['--cache-dir', cache_dir, '--output-dir', str(out), '--tune', '--tune-max-batch',
                                     '64', '--tune-steps', '20', '--tune-budget', '8', '--tune-machine', 'a100'])
    raw = dict(vars(args))
    device = torch.device('cuda', torch.cuda.current_device())
    dlojz_flags.check_args(args, device)
    lines = []
    return T.run_tune(args, raw, parser, device, lines.append), lines, out


def test_tune_on_a_gpu(gpu_sweep, cache_dir):
    record, lines, out = gpu_sweep
    names = [r['name'] for r in record['trials']]
    assert names[:4] == ['b8-off-cl-eager', 'b16-off-cl-eager', 'b32-off-cl-eager', 'b64-off-cl-eager']
    assert all(r['memory_bytes'] and r['memory_bytes'] > 0 for r in record['trials'] if r['status'] == 'completed')
    # the memory peak grows with the batch (activations): a host figure read by mistake would not
    mem = [r['memory_bytes'] for r in record['trials'][:4]]
    assert mem == sorted(mem) and mem[-1] > mem[0]
    assert any(r['amp'] == 'fp16' for r in record['trials']) and any(r['compile'] for r in record['trials']) \
        or record['skipped'], 'the GPU configurations neither ran nor were listed as skipped'
    best = next(r for r in record['trials'] if r['name'] == record['recommended']['trial'])
    again = out / 'again'
    r = run_cli(*TINY, '--cache-dir', cache_dir, *T.trial_argv(best['batch'], best['amp'], best['channels_last'],
                                                                 best['compile']),
                '--test-nsteps', 23, '--warmup-steps', 3, '-e', 1000, '--output-dir', again)
    assert r.returncode == 0, r.stderr[-2000:]
    measured = json.loads((again / 'summary.json').read_text())['timing']['steady_images_per_s']
    assert best['images_per_s'] == pytest.approx(measured, rel=0.10)
