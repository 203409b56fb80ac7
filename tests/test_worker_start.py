"""Loader workers far beyond the cores, and a stop signal while they start (issue 28, item 4).

- `--num-workers` above 8 per usable core is refused in one sentence, before anything is written (1000
  workers on 2 cores took minutes to start);
- SIGTERM to the process group while the synthetic dataset is generated no longer hangs (its pool's workers
  died of it and the pool waited for their lost tasks forever): the dataset is finished, the run stops;
- SIGTERM to the process group while the training loader's workers start (slowed by the failpoint
  slow-worker-start, 2 s after each fork, as hundreds of workers on a few cores are): the run ends within
  seconds, not after the whole start-up and a step; before the first step with no checkpoint (exit 5),
  at the start of the second epoch with the checkpoint of the step that ran last.

Run: python -m pytest -q tests/test_worker_start.py -m "slow or not slow"
"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, TINY, run_cli
from dlojzlib.data import datasets as D
from dlojzlib.record.checkpoint import list_checkpoints


def test_worker_counts_far_above_the_cores_are_refused(cache_dir, tmp_path):
    cores = len(os.sched_getaffinity(0))
    r = run_cli(*TINY, '--cache-dir', cache_dir, '--test-nsteps', '1', '--num-workers', 8 * cores + 1,
                '--output-dir', tmp_path / 'run')
    assert r.returncode == 2 and 'Traceback' not in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip() == (f'dlojz: error: --num-workers {8 * cores + 1} is more than 8 workers per usable core '
                                f'({cores} here); so many processes take minutes to start and slow the node down: '
                                f'use at most {8 * cores} (a few per core is usually best; --tune-loader measures '
                                f'it).')
    assert not os.path.exists(tmp_path / 'run')


def _cmdline(pid):
    try:
        with open(f'/proc/{pid}/cmdline', 'rb') as f:
            return f.read()
    except OSError:
        return None


def children(pid):
    """The forked children (loader workers, pool processes): those running the parent's own command line, not
    a short-lived subprocess (git, nproc...)."""
    try:
        with open(f'/proc/{pid}/task/{pid}/children') as f:
            kids = set(map(int, f.read().split()))
    except OSError:
        return set()
    mine = _cmdline(pid)
    return {k for k in kids if _cmdline(k) == mine}


def start(cache_dir, out, *flags):
    D.ensure_synthetic_dataset(os.path.join(cache_dir, 'synthetic-v1-c4-n24-v6-s0'), 4, 24, 6, 0, log=lambda m: None)
    return subprocess.Popen([sys.executable, os.path.join(ROOT, 'dlojz.py'), *TINY, '--cache-dir', cache_dir,
                             '--output-dir', str(out), *map(str, flags)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True,
                            env={**os.environ, 'DLOJZ_FAULT': 'slow-worker-start:2'})


def term_and_time(p):
    """SIGTERM to the whole group (Slurm signals every process of the step) -> (seconds to exit, stdout, err)."""
    t0 = time.monotonic()
    os.killpg(p.pid, signal.SIGTERM)
    try:
        out, err = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)  # a hung run must not outlive the test
        out, err = p.communicate()
        pytest.fail(f'still running 60 s after SIGTERM: {err[-2000:]}')
    return time.monotonic() - t0, out, err


@pytest.mark.slow
def test_a_stop_while_the_first_workers_start_ends_at_once_with_nothing_to_keep(cache_dir, tmp_path):
    """6 workers at 2 s each: the start takes 12 s. The signal comes after the first fork; the old loader
    held it until all 6 were up and a step had run (measured: 13 s, then a checkpoint of step 1)."""
    out = tmp_path / 'run'
    p = start(cache_dir, out, '--num-workers', '6', '-e', '1')
    deadline = time.monotonic() + 120
    while not children(p.pid) and time.monotonic() < deadline:  # the first worker is forked
        time.sleep(0.02)
    assert children(p.pid), p.communicate(timeout=60)
    seconds, stdout, err = term_and_time(p)
    assert p.returncode == 5 and 'Traceback' not in err, err[-3000:]
    assert 'stopped by SIGTERM at step 0; no checkpoint (no step had run).' in err
    assert seconds < 6, seconds  # the rest of one 2 s fork, the workers stopped, the summary written
    assert list_checkpoints(str(out)) == []
    with open(out / 'summary.json') as f:
        assert json.load(f)['status'] == 'preempted'


@pytest.mark.slow
def test_a_stop_while_the_next_epochs_workers_start_keeps_the_last_step(cache_dir, tmp_path):
    """Workers that do not persist start again for the second epoch (no validation between: --val-every 2);
    the signal during that start checkpoints step 12, the first epoch's last, within seconds."""
    out = tmp_path / 'run'
    p = start(cache_dir, out, '--num-workers', '4', '--no-persistent-workers', '-e', '2', '--val-every', '2',
              '--log-interval', '1')
    deadline = time.monotonic() + 300
    first = set()
    while len(first) < 4 and time.monotonic() < deadline:  # the first epoch's 4 workers, all up
        first = children(p.pid)
        assert p.poll() is None, p.communicate()
        time.sleep(0.01)
    while time.monotonic() < deadline:  # then gone, and a new worker that stays (not a subprocess's fork
        now = children(p.pid) - first    # before its exec, which shows the same command line for a moment)
        if now and not (children(p.pid) & first):
            time.sleep(0.1)
            if now & children(p.pid):
                break
        assert p.poll() is None, p.communicate()
        time.sleep(0.01)
    seconds, stdout, err = term_and_time(p)
    assert p.returncode == 5 and 'Traceback' not in err, err[-3000:]
    assert 'stopped by SIGTERM at step 12;' in err and seconds < 6, (seconds, err[-2000:])
    assert list_checkpoints(str(out))[-1].endswith('checkpoint-00000012.pt')


@pytest.mark.slow
def test_a_stop_while_the_synthetic_dataset_is_generated_does_not_hang(tmp_path):
    """The demo's first run generates its dataset in a pool, and Slurm's SIGTERM reaches the pool's workers
    too: one killed by it lost its task and the pool waited for it forever (the previous code: still running
    after 60 s). The workers now finish; the run stops before its first step, exit 5."""
    cache = tmp_path / 'cache'
    p = subprocess.Popen([sys.executable, os.path.join(ROOT, 'dlojz.py'), '--synthetic-classes', '4',
                          '--synthetic-train-per-class', '150', '--arch', 'resnet18', '--image-size', '32',
                          '--wandb', 'off', '--cache-dir', str(cache), '--output-dir', str(tmp_path / 'run')],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True)
    deadline = time.monotonic() + 120
    while not children(p.pid) and time.monotonic() < deadline:  # the pool is up
        time.sleep(0.02)
    time.sleep(0.5)
    seconds, out, err = term_and_time(p)
    assert p.returncode == 5 and 'Traceback' not in err, err[-3000:]
    assert 'stopped by SIGTERM at step 0; no checkpoint (no step had run).' in err
    assert os.path.isfile(cache / 'synthetic-v1-c4-n150-v16-s0' / 'COMPLETE.json')  # the dataset was finished
