"""Shared helpers: a small synthetic dataset generated once per session, and ways to run dlojz."""
import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

# matplotlib (the report's figures) writes its font cache under ~/.cache and ~/.config unless told where: the
# tests leave the home folder alone, so it goes to a temporary folder, inherited by the runs they launch.
if 'MPLCONFIGDIR' not in os.environ:
    os.environ['MPLCONFIGDIR'] = tempfile.mkdtemp(prefix='dlojz-tests-matplotlib-')
    atexit.register(shutil.rmtree, os.environ['MPLCONFIGDIR'], True)
# dlojz's own cache (the synthetic data, each data folder's index) defaults to
# $XDG_CACHE_HOME/dlojz: a test that leaves --cache-dir out writes to a temporary folder, never to
# the user's cache.
os.environ['XDG_CACHE_HOME'] = tempfile.mkdtemp(prefix='dlojz-tests-cache-')
atexit.register(shutil.rmtree, os.environ['XDG_CACHE_HOME'], True)

import dlojz  # noqa: E402 - after MPLCONFIGDIR
from dlojzlib.dist import launch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Small enough for a CPU test, big enough that a ResNet-18 learns it in a few dozen steps.
TINY = ['--synthetic-classes', '4', '--synthetic-train-per-class', '24', '--synthetic-val-per-class', '6',
        '--arch', 'resnet18', '--image-size', '32', '--val-resize', '36', '--val-image-size', '32',
        '-b', '8', '--val-batch-size', '16', '--num-workers', '0', '--wandb', 'off']


@pytest.fixture(scope='session')
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp('cache'))


@pytest.fixture(scope='session')
def two_epochs(tmp_path_factory, cache_dir):
    """The reference run several tests compare with: the tiny config, 2 epochs (24 steps), a log line per
    step. -> (summary, metrics records)."""
    return run_main(tmp_path_factory.mktemp('two-epochs'), cache_dir, '-e', '2', '--log-interval', '1')


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


@pytest.fixture(scope='session', autouse=True)
def not_launched():
    """dlojz reads RANK/SLURM_* itself; the test process must not look launched even when pytest runs inside
    a job or under torchrun. Restored at the end of the session."""
    saved = {k: os.environ.pop(k) for k in launch.launch_variables()}
    yield
    os.environ.update(saved)


# ------------------------------------------------------------------------------------ multi-process launches
DLOJZ = os.path.join(ROOT, 'dlojz.py')


def free_port(lo=20000, hi=40000):
    import random
    import socket
    for _ in range(200):
        port = random.randrange(lo, hi)
        with socket.socket() as s:
            try:
                s.bind(('127.0.0.1', port))
                return port
            except OSError:
                continue
    raise RuntimeError('no free port')


def torchrun(n, *flags, timeout=300, script=DLOJZ, env=None):
    """`torchrun --nproc_per_node n dlojz.py FLAGS` -> CompletedProcess (text). The launcher and its
    workers run in a session of their own, ended as a whole when the wait ends early (a timeout, or
    the KeyboardInterrupt of a time limit's SIGINT): subprocess.run killed the launcher alone, and
    its workers lived on, orphaned, on the GPU node."""
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node', str(n), '--master_port',
           str(free_port()), script] + [str(f) for f in flags]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                          env={**os.environ, 'OMP_NUM_THREADS': '1', **(env or {})},
                          start_new_session=True) as p:
        try:
            out, err = p.communicate(timeout=timeout)
        except BaseException:
            end_group(p)
            raise
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def end_group(p, grace_s=10):
    """SIGTERM to the process group `p` leads (torchrun passes it on to its workers), then SIGKILL
    to whatever is left of it after grace_s."""
    import signal
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, None)):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            return
        try:
            p.communicate(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def on_ranks(n, target, args, results, wait):
    """target(rank, *args, queue) in n spawned processes; -> (what they put in the queue, up to
    `results` items or until `wait` s pass without one (a rank hung), their exit codes)."""
    import multiprocessing as mp
    import queue
    ctx = mp.get_context('spawn')
    result = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, *args, result)) for r in range(n)]
    for p in procs:
        p.start()
    seen = []
    try:
        while len(seen) < results:
            seen.append(result.get(timeout=wait))
    except queue.Empty:
        pass
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    return seen, [p.exitcode for p in procs]


def srun_like(n, *flags, log_dir, job_id=None):
    """Start n dlojz tasks with the variables srun gives one task per process on one node; the job id is
    chosen so that dlojz's port (20000 + id % 10000) is free. -> list of Popen, outputs in
    log_dir."""
    job_id = free_port(20000, 30000) - 20000 if job_id is None else job_id
    procs = []
    for rank in range(n):
        env = {**{k: v for k, v in os.environ.items() if k != 'MASTER_PORT'},
               'OMP_NUM_THREADS': '1',
               'SLURM_JOB_ID': str(job_id), 'SLURM_STEP_ID': '0',
               'SLURM_PROCID': str(rank), 'SLURM_LOCALID': str(rank), 'SLURM_NODEID': '0',
               'SLURM_NTASKS': str(n), 'SLURM_STEP_NUM_TASKS': str(n), 'SLURM_STEP_NODELIST': 'localhost',
               'SLURM_JOB_NODELIST': 'localhost', 'SLURM_STEP_TASKS_PER_NODE': str(n)}
        out = open(os.path.join(log_dir, f'rank{rank}.out'), 'w')
        err = open(os.path.join(log_dir, f'rank{rank}.err'), 'w')
        procs.append(subprocess.Popen([sys.executable, DLOJZ] + [str(f) for f in flags], stdout=out, stderr=err,
                                      env=env, cwd=ROOT))
    return procs


def wait_all(procs, timeout=300):
    try:
        return [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def stderr_of(log_dir, codes):
    """The end of each failed rank's stderr (srun_like's logs), for an assertion's message."""
    return '\n'.join(f'rank {r} exited {c}: ' + open(os.path.join(log_dir, f'rank{r}.err')).read()[-2000:]
                     for r, c in enumerate(codes) if c != 0)


def latest(run_dir):
    """The newest checkpoint-<step>.pt of a run directory."""
    from dlojzlib.record.checkpoint import list_checkpoints
    import pathlib
    found = list_checkpoints(str(run_dir))
    assert found, f'no checkpoint in {run_dir}'
    return pathlib.Path(found[-1])
