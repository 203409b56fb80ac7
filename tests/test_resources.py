"""Resource errors by name: each ends in one sentence (no traceback) before or instead of a crash.

- Host memory exhausted (--image-size 22400, a typo for 224, under an address-space limit so that the test
  never pressures this machine): status 'oom' and exit 2, as a GPU's out of memory (it crashed with torch's
  allocator traceback, exit 1); translate() recognises the ways it shows (MemoryError, torch's CPU
  allocator, also as a loader worker re-raises it, ENOMEM, a worker killed by the OOM killer).
- A folder that cannot be written: --cache-dir (where the synthetic dataset is generated), --output-dir, and
  `dlojz_data.py prepare`'s destination, each with one sentence before any work (tracebacks before).
- --wandb online without an API key or without the network: the run logs offline, says so in one line within
  seconds, and records the mode it used (wandb_mode takes the facts as arguments; one real run without a key).

Run: python -m pytest -q tests/test_resources.py
"""
import argparse
import errno
import json
import os
import resource
import subprocess
import sys

import pytest

from conftest import DLOJZ, ROOT, TINY
from dlojzlib.errors import OutOfMemory, translate
from dlojzlib.record.log import wandb_mode


def run(*flags, env=None, limit_bytes=None):
    def limited():
        if limit_bytes:
            resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))
    return subprocess.run([sys.executable, DLOJZ, *TINY, *map(str, flags)], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, 'OMP_NUM_THREADS': '1', **(env or {})}, timeout=300,
                          preexec_fn=limited)


@pytest.mark.parametrize('workers', [pytest.param(0, marks=pytest.mark.slow), 1])  # 4 s each
def test_host_memory_exhausted_is_oom_in_one_sentence(tmp_path, cache_dir, workers):
    out = tmp_path / 'run'
    r = run('--cache-dir', cache_dir, '--output-dir', out, '--test-nsteps', 2, '--image-size', 22400,
            '--num-workers', workers, limit_bytes=4 * 10**9)
    assert r.returncode == 2 and 'Traceback' not in r.stderr, r.stderr[-3000:]
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith('dlojz: error: the host ran out of memory at step 1 (an allocation of ') and \
        'a batch of -b 8 images at --image-size 22400 is 11 GiB as uint8' in line, line
    summary = json.load(open(out / 'summary.json'))
    assert summary['status'] == 'oom' and summary['failed_step'] == 1


@pytest.mark.parametrize('exc', [
    MemoryError(),
    OSError(errno.ENOMEM, 'Cannot allocate memory'),
    RuntimeError('Caught RuntimeError in DataLoader worker process 0.\nOriginal Traceback (most recent call last):\n'
                 '  File "x.py", line 1\nRuntimeError: [enforce fail at alloc_cpu.cpp:127] err == 0. '
                 'DefaultCPUAllocator: can\'t allocate memory: you tried to allocate 1505280000 bytes.'),
    RuntimeError('DataLoader worker (pid(s) 4242) exited unexpectedly: DataLoader worker (pid 4242) is killed by '
                 'signal: Killed. '),
], ids=['MemoryError', 'ENOMEM', 'allocator-in-worker', 'worker-killed'])
def test_translate_names_host_memory(exc):
    args = argparse.Namespace(batch_size=8, image_size=224, compile=False, arch='resnet18', dist_timeout=None)
    err = translate(exc, args, step=3)
    assert isinstance(err, OutOfMemory) and err.status == 'oom' and err.extra['failed_step'] == 3
    assert str(err).startswith('the host ran out of memory at step 3 (')
    assert 'allocation of 1.4 GiB failed' in str(err) if 'tried to allocate' in str(exc) else True


def test_unwritable_folders_are_one_sentence_before_any_work(tmp_path, cache_dir, capsys):
    import dlojz
    from dlojzlib.data import datasets
    from dlojzlib.data import shards
    a_file = tmp_path / 'a-file'
    a_file.write_text('not a folder')
    cli = lambda *flags: dlojz.cli([*TINY, '--test-nsteps', '1', *map(str, flags)])
    assert cli('--cache-dir', a_file / 'cache', '--output-dir', tmp_path / 'run') == 2
    assert capsys.readouterr().err == (f'dlojz: error: cannot write to --cache-dir {a_file}/cache (Not a directory); '
                                       f'the synthetic dataset is generated there, once: pass --cache-dir with a '
                                       f'writable folder.\n')
    assert not (tmp_path / 'run').exists()
    assert cli('--cache-dir', cache_dir, '--output-dir', a_file / 'run') == 2
    assert capsys.readouterr().err.startswith(f'dlojz: error: cannot write to output directory {a_file}/run')
    src = str(tmp_path / 'src')
    datasets.ensure_synthetic_dataset(src, 2, 2, 1, seed=0, workers=1, log=lambda m: None)
    assert shards.main(['prepare', src, str(a_file / 'shards')]) == 2
    assert capsys.readouterr().err == (f'dlojz_data.py prepare: error: cannot write to the shards folder '
                                       f'{a_file}/shards (Not a directory); pass a writable DST.\n')


def test_wandb_online_without_a_key_or_network_logs_offline():
    def unreachable(address, timeout):
        raise OSError(errno.ENETUNREACH, 'Network is unreachable')

    def reachable(address, timeout):
        reached.append(address)
        return open(os.devnull)
    reached = []
    assert wandb_mode('offline', environ={}) == ('offline', None)
    mode, warning = wandb_mode('online', environ={'NETRC': '/nonexistent'}, connect=reachable)
    assert mode == 'offline' and warning.startswith('--wandb online: no API key for api.wandb.ai') and reached == []
    mode, warning = wandb_mode('online', environ={'WANDB_API_KEY': 'k'}, connect=unreachable)
    assert mode == 'offline' and 'api.wandb.ai:443 cannot be reached from this node (Network is unreachable)' in warning
    assert wandb_mode('online', environ={'WANDB_API_KEY': 'k', 'WANDB_BASE_URL': 'http://wandb.lab:8080'},
                      connect=reachable) == ('online', None)
    assert reached == [('wandb.lab', 8080)]


@pytest.mark.slow  # 5 s: a whole run with wandb imported
def test_a_run_with_wandb_online_and_no_key_trains_and_records_offline(tmp_path, cache_dir):
    out = tmp_path / 'run'
    env = {'HOME': str(tmp_path), 'WANDB_API_KEY': '', 'NETRC': str(tmp_path / 'netrc')}
    r = run('--cache-dir', cache_dir, '--output-dir', out, '--test-nsteps', 1, '--wandb', 'online', env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert 'Warning: --wandb online: no API key for api.wandb.ai' in r.stdout
    assert json.load(open(out / 'config.json'))['wandb'] == 'offline' and (out / 'wandb').is_dir()
