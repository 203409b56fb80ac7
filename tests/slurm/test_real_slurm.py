"""The project's own slurm/ scripts submitted with sbatch to a real Slurm brought up on localhost
(slurmctld + two emulated nodes with 16 fake GPUs each; dlojz falls back to CPU/gloo inside the
jobs):

- cpu.slurm and jz-a100-8gpu.slurm (8 tasks) train a few steps and write their summary, logs named
  after job name, id, nodes and tasks;
- generic-4gpu.slurm across the two nodes (world size 4);
- SIGUSR2 to the batch shell only (the script passes it on), and the real time limit with --signal=USR2@50
  (Slurm signals every process of the step, DataLoader workers included): checkpoint, requeue, restart,
  the uninterrupted losses;
- `scancel --signal=TERM` with workers: checkpoint, exit 5; the script resubmitted with the same flags
  (a new job id, the same run name) continues the run bit-exactly;
- `scancel --full --signal=TERM`: srun kills its tasks at once; the resubmitted job continues from the last
  --chkpt-every checkpoint;
- a job SIGKILLed while writing a checkpoint leaves the previous one; the rerun resumes from it;
- scancel of a running DDP job leaves no process behind.

They start Slurm and munge daemons, so they run only when asked: as root, with slurmctld, slurmd,
slurm-client and munge installed (the tests install nothing and leave /etc/hosts alone; ports are
picked free), `DLOJZ_SLURM_SETUP=1 python -m pytest -q -m slurm tests/slurm` (about 5 min on 2
cores); skipped otherwise, with that reason. CI (.ci/run) installs the packages and sets the
variable."""
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time

import pytest

from conftest import ROOT, TINY
from cluster import Cluster, why_unavailable
from dlojzlib.record.checkpoint import list_checkpoints

pytestmark = pytest.mark.slurm
LONG = ['-e', '2', '--log-interval', '1']  # 24 steps of 8 images
LONGER = ['-e', '8', '--log-interval', '1']  # 96 steps: time to signal the job before it ends


@pytest.fixture(scope='module')
def slurm(tmp_path_factory):
    reason = why_unavailable()
    if reason:
        pytest.skip(f'no local Slurm: {reason}')
    cluster = Cluster(tmp_path_factory.mktemp('slurm-state'))
    try:
        cluster.up()
    except Exception as e:  # noqa: BLE001 - the reason goes into the skip message
        cluster.down()
        pytest.skip(f'could not start a local Slurm: {e}')
    yield cluster
    cluster.down()


@pytest.fixture(scope='module')
def workdir(tmp_path_factory):
    """A copy of the project (its Python files and the dlojzlib package) to submit from (the scripts
    use relative paths), plus shims: `module` (a no-op here, the Jean Zay scripts call it) and an
    activate script for the generic/CPU scripts."""
    d = tmp_path_factory.mktemp('submit')
    for name in os.listdir(ROOT):
        if name.endswith('.py'):
            shutil.copy(os.path.join(ROOT, name), d)
    shutil.copytree(os.path.join(ROOT, 'dlojzlib'), d / 'dlojzlib',
                    ignore=shutil.ignore_patterns('__pycache__'))
    shutil.copytree(os.path.join(ROOT, 'slurm'), d / 'slurm', ignore=shutil.ignore_patterns('*.out', '*.err'))
    shutil.copytree(os.path.join(ROOT, 'examples'), d / 'examples')  # the Lightning scripts run one
    os.makedirs(d / 'slurm' / 'log', exist_ok=True)
    shims = d / 'shims'
    (shims / 'bin').mkdir(parents=True)
    # what the sites' set-up lines call, recorded in $DLOJZ_STUB_LOG with the node and its
    # $SLURM_TMPDIR
    record = 'echo "$(basename "$0") $* node=$SLURMD_NODENAME tmp=$SLURM_TMPDIR" >> "${DLOJZ_STUB_LOG:-/dev/null}"\n'
    for name in ('module', 'conda'):
        (shims / 'bin' / name).write_text('#!/bin/sh\n' + record)
    (shims / 'bin' / 'nvidia-cuda-mps-control').write_text(  # without arguments it reads commands (quit)
        '#!/bin/sh\n[ $# -eq 0 ] && set -- "stdin=$(cat)"\n' + record)
    # virtualenv DIR: an environment whose python is the tests' own and whose pip only records
    python_dir = os.path.dirname(sys.executable)
    (shims / 'bin' / 'virtualenv').write_text(
        '#!/bin/sh\n' + record + 'for d; do :; done\nmkdir -p "$d/bin"\n'
        f'printf \'export PATH=%s/bin:{python_dir}:$PATH\\n\' "$d" > "$d/bin/activate"\n'
        'printf \'#!/bin/sh\\n%s\' \'' + record.replace("$(basename \"$0\")", 'pip').replace("'", "") +
        '\' > "$d/bin/pip"\nchmod +x "$d/bin/pip"\n')
    for name in ('module', 'conda', 'nvidia-cuda-mps-control', 'virtualenv'):
        (shims / 'bin' / name).chmod(0o755)
    (shims / 'bin' / 'activate').write_text(f'export PATH={python_dir}:$PATH\n')
    return d


def job_env(workdir, **extra):
    path = f'{workdir}/shims/bin:{os.path.dirname(sys.executable)}:{os.environ["PATH"]}'
    return {'PATH': path, 'DLOJZ_VENV': str(workdir / 'shims'), 'OMP_NUM_THREADS': '1', **extra}


def submit(slurm, workdir, script, *flags, options=(), **env):
    return slurm.sbatch(f'slurm/{script}', *flags, env=job_env(workdir, **env), cwd=workdir, options=options)


def job_log(workdir, job_id, ext='out'):
    found = [n for n in os.listdir(workdir / 'slurm' / 'log') if f'_{job_id}_' in n and n.endswith(ext)]
    return (workdir / 'slurm' / 'log' / found[0]).read_text() if found else ''


def summary(out):
    with open(os.path.join(out, 'summary.json')) as f:
        return json.load(f)


def train_losses(out):
    losses = {}
    with open(os.path.join(out, 'metrics.jsonl')) as f:
        for line in f:
            r = json.loads(line)
            if r['type'] == 'train':
                assert losses.setdefault(r['global_step'], r['loss']) == r['loss']
    return losses


def wait_for_steps(slurm, job_id, out, n, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if os.path.exists(os.path.join(out, 'metrics.jsonl')) and len(train_losses(out)) >= n:
            return
        info = slurm.job(job_id)
        assert info.get('JobState') in ('PENDING', 'RUNNING', 'CONFIGURING'), info
        time.sleep(0.1)
    raise AssertionError(f'job {job_id} did not reach step {n}: {slurm.job(job_id)}')


def test_cpu_and_a100_node_scripts_train(slurm, workdir, cache_dir, tmp_path):
    common = [*TINY, '--cache-dir', cache_dir, '--test-nsteps', '3']
    cpu = submit(slurm, workdir, 'cpu.slurm', *common, '--output-dir', tmp_path / 'cpu')
    a100 = submit(slurm, workdir, 'jz-a100-8gpu.slurm', *common, '--output-dir', tmp_path / 'a100')
    for job, out, world in ((cpu, 'cpu', 1), (a100, 'a100', 8)):
        info = slurm.wait(job, timeout=300)
        assert info['JobState'] == 'COMPLETED', job_log(workdir, job, 'err')[-3000:]
        s = summary(tmp_path / out)
        assert (s['status'], s['world_size'], s['provenance']['slurm_job_id']) == ('completed', world, job)
        assert len(s['timing']['ranks'] if world > 1 else [1]) == world
    names = os.listdir(workdir / 'slurm' / 'log')
    assert f'dlojz-cpu_{cpu}_1nodes_1tasks.out' in names
    assert f'dlojz-jz-a100-8gpu_{a100}_1nodes_8tasks.out' in names
    assert 'srun python -u dlojz.py' in job_log(workdir, a100, 'err')  # set -x trace


def test_two_node_job(slurm, workdir, cache_dir, tmp_path):
    if len(slurm.nodes) < 2:
        pytest.skip(f'one emulated node only: no second name resolves to this machine ({slurm.nodes})')
    job = submit(slurm, workdir, 'generic-4gpu.slurm', *TINY, '--cache-dir', cache_dir, '--test-nsteps', '3',
                 '--output-dir', tmp_path / 'run', options=['--nodes=2', '--ntasks-per-node=2', '--gres=gpu:2'])
    info = slurm.wait(job, timeout=300)
    assert info['JobState'] == 'COMPLETED', job_log(workdir, job, 'err')[-3000:]
    s = summary(tmp_path / 'run')
    assert (s['world_size'], s['num_nodes'], s['status']) == (4, 2, 'completed')
    assert [r['rank'] for r in s['timing']['ranks']] == [0, 1, 2, 3]


def wait_requeued(slurm, job, before_release=None):
    """Wait for the job to be requeued and running again -> (requeued, running again, released) in
    seconds from now. before_release(): called once the requeued job is pending (e.g. a longer time
    limit)."""
    t0 = time.time()
    restarted = None
    deadline = t0 + 300
    requeued = released = None
    while time.time() < deadline:  # the first attempt ends, the job is requeued and starts again
        info = slurm.job(job)
        if requeued is None and int(info.get('Restarts', 0)) >= 1:
            requeued = time.time() - t0
        if released is None and requeued is not None and info.get('JobState') == 'PENDING':
            # Slurm held the requeued job ~170 s before starting it again here (scheduler policy,
            # not dlojz's); an explicit start time releases it and keeps the test short. Not in
            # the requeue's second: slurmd refuses a batch launch whose credential is not newer,
            # in whole seconds, than the job's revocation at the requeue (slurm_cred.c,
            # `cred->ctime <= j->revoked`), and the job ends FAILED ("Job credential revoked":
            # the long tier, released 0.45 s after the requeue). Slurm's own hold is cred_expire.
            # One clock here (every daemon on localhost): the release waits until a whole second
            # lies between it and the second the requeue was seen in (1 to 2 s).
            # (StartTime=now+2 instead waited for the scheduler's next pass: 19 s.)
            if before_release:
                before_release()
            time.sleep(max(0.0, math.floor(time.time()) + 2 - time.time()))
            slurm.run('scontrol', 'update', f'JobId={job}', 'StartTime=now', check=False)
            released = time.time()
        if requeued is not None and info.get('JobState') == 'RUNNING':
            restarted = time.time() - t0
            break
        time.sleep(0.2)
    assert restarted is not None, f'job {job} was not requeued: {slurm.job(job)}'
    return requeued, restarted, (released - t0) if released else requeued


def test_signal_requeues_and_resumes_exactly(slurm, workdir, cache_dir, tmp_path):
    flags = [*TINY, '--cache-dir', cache_dir, *LONGER, '--num-workers', '2']
    job = submit(slurm, workdir, 'cpu.slurm', *flags, '--output-dir', tmp_path / 'run')
    wait_for_steps(slurm, job, tmp_path / 'run', 5)
    # to the batch shell only (as --signal=B:USR2@120 would): the script passes it on to srun, srun
    # to dlojz
    r = slurm.run('scancel', '--batch', '--signal=USR2', job, check=False)
    assert r.returncode == 0, (r.stderr, slurm.job(job), len(train_losses(tmp_path / 'run')))
    requeued, restarted, released = wait_requeued(slurm, job)
    info = slurm.wait(job, timeout=300)
    assert info['JobState'] == 'COMPLETED', job_log(workdir, job, 'err')[-3000:]
    print(f'signal -> job requeued: {requeued:.1f} s; running again {restarted - released:.1f} s after release')
    ref_job = submit(slurm, workdir, 'cpu.slurm', *flags, '--output-dir', tmp_path / 'ref')  # uninterrupted
    assert slurm.wait(ref_job, timeout=300)['JobState'] == 'COMPLETED'
    log = job_log(workdir, job, 'err')
    assert 'stopped by SIGUSR2' in log and 'was requeued' in log
    assert 'continuing from' in job_log(workdir, job)
    ref, got = train_losses(tmp_path / 'ref'), train_losses(tmp_path / 'run')
    assert sorted(got) == list(range(1, 97)) and got == ref  # bit-exact on CPU
    assert summary(tmp_path / 'run')['status'] == 'completed'


def test_a_stop_during_start_up_requeues_and_the_job_completes(slurm, workdir, cache_dir, tmp_path):
    """Slurm's signal may come while dlojz starts (a time limit's USR2 came 2.6 s after the start in
    the long tier): the start-up ends at once, the job is requeued, and the next attempt trains to
    the uninterrupted losses. The first attempt's start-up is held in its checkpoint phase
    (slow-phase, first attempt only); the signal goes once its run folder exists."""
    flags = [*TINY, '--cache-dir', cache_dir, *LONG, '--num-workers', '2']
    job = submit(slurm, workdir, 'cpu.slurm', *flags, '--output-dir', tmp_path / 'run',
                 DLOJZ_FAULT='slow-phase:0:checkpoint:600')
    deadline = time.time() + 120
    while not (tmp_path / 'run').exists():
        assert time.time() < deadline and slurm.job(job).get('JobState') in (
            'PENDING', 'RUNNING', 'CONFIGURING'), slurm.job(job)
        time.sleep(0.1)
    r = slurm.run('scancel', '--batch', '--signal=USR2', job, check=False)
    assert r.returncode == 0, (r.stderr, slurm.job(job))
    wait_requeued(slurm, job)
    info = slurm.wait(job, timeout=300)
    err = job_log(workdir, job, 'err')
    assert info['JobState'] == 'COMPLETED', err[-3000:]
    assert 'stopped by SIGUSR2 during start-up' in err and 'was requeued' in err, err[-3000:]
    assert 'Traceback' not in err and summary(tmp_path / 'run')['status'] == 'completed'
    assert train_losses(tmp_path / 'run') == reference_losses(cache_dir, tmp_path, *LONG)

def test_kill_during_checkpoint_then_rerun_resumes(slurm, workdir, cache_dir, tmp_path):
    flags = [*TINY, '--cache-dir', cache_dir, *LONG, '--chkpt-every', '5', '--output-dir', tmp_path / 'run']
    job = submit(slurm, workdir, 'cpu.slurm', *flags, DLOJZ_FAULT='kill-in-checkpoint:2')
    assert slurm.wait(job, timeout=300)['JobState'] == 'FAILED'
    ckpts = sorted(n for n in os.listdir(tmp_path / 'run') if n.startswith('checkpoint-'))
    assert ckpts == ['checkpoint-00000005.pt']
    rerun = submit(slurm, workdir, 'cpu.slurm', *flags)
    assert slurm.wait(rerun, timeout=300)['JobState'] == 'COMPLETED', job_log(workdir, rerun, 'err')[-3000:]
    assert 'continuing from' in job_log(workdir, rerun) and 'checkpoint-00000005.pt' in job_log(workdir, rerun)
    ref = subprocess.run([sys.executable, os.path.join(ROOT, 'dlojz.py'), *TINY, '--cache-dir', cache_dir, *LONG,
                          '--output-dir', tmp_path / 'ref', '--device', 'cpu'], capture_output=True, text=True,
                         env={**os.environ, 'OMP_NUM_THREADS': '1'}, timeout=300)
    assert ref.returncode == 0, ref.stderr[-2000:]
    assert train_losses(tmp_path / 'run') == train_losses(tmp_path / 'ref')


def test_scancel_leaves_no_process(slurm, workdir, tmp_path):
    out = tmp_path / 'scancel-run'
    job = submit(slurm, workdir, 'generic-4gpu.slurm', '--fake-data', '--fake-classes', '4', '--arch', 'resnet18',
                 '--image-size', '32', '-b', '8', '--num-workers', '2', '--wandb', 'off', '--log-interval', '1',
                 '--output-dir', out, options=['--ntasks-per-node=2', '--gres=gpu:2'])
    wait_for_steps(slurm, job, out, 2, timeout=240)
    slurm.run('scancel', job)
    info = slurm.wait(job, timeout=120)
    assert info['JobState'] == 'CANCELLED' and info['Restarts'] == '0'  # SIGTERM from scancel: no requeue
    deadline = time.time() + 30
    while time.time() < deadline:
        left = []
        for pid in filter(str.isdigit, os.listdir('/proc')):
            try:
                with open(f'/proc/{pid}/cmdline', 'rb') as f:
                    if str(out).encode() in f.read():
                        left.append(pid)
            except OSError:
                continue
        if not left:
            break
        time.sleep(0.5)
    assert not left, f'processes left behind: {left}'


_REFERENCES = {}


def reference_losses(cache_dir, tmp_path, *flags):
    """The losses of the same run uninterrupted, outside Slurm (same flags, no workers: the samples
    do not depend on them), computed once per flag list."""
    key = tuple(map(str, flags))
    if key not in _REFERENCES:
        out = tmp_path / 'reference'
        r = subprocess.run([sys.executable, os.path.join(ROOT, 'dlojz.py'), *TINY, '--cache-dir', cache_dir, *flags,
                            '--output-dir', out, '--device', 'cpu'], capture_output=True, text=True,
                           env={**os.environ, 'OMP_NUM_THREADS': '1'}, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        _REFERENCES[key] = train_losses(out)
    return _REFERENCES[key]


def script_run_name(job_name, flags):
    """What the scripts compute when neither DLOJZ_RUN nor --output-dir is given: job name and a
    checksum of the forwarded flags (computed here by cksum on the same bytes)."""
    text = ''.join(f'{f}\n' for f in flags)
    return f'{job_name}-' + subprocess.run(['cksum'], input=text, capture_output=True, text=True).stdout.split()[0]


def test_scancel_term_with_workers_checkpoints_and_a_resubmitted_job_continues(slurm, workdir, cache_dir, tmp_path):
    """`scancel --signal=TERM <job>` signals every process of the job's steps, DataLoader workers
    included: a checkpoint, status preempted, exit 5, no traceback. The same script resubmitted with
    the same flags is a new job id but the same run name: it continues that run, to the
    uninterrupted losses bit for bit."""
    flags = [*TINY, '--cache-dir', str(cache_dir), *LONGER, '--num-workers', '2']
    out = workdir / 'runs' / script_run_name('dlojz-cpu', flags)
    job = submit(slurm, workdir, 'cpu.slurm', *flags)
    wait_for_steps(slurm, job, out, random.Random(os.getpid()).randint(3, 30))
    slurm.run('scancel', '--signal=TERM', job)
    info = slurm.wait(job, timeout=120)
    err = job_log(workdir, job, 'err')
    assert info['ExitCode'] == '5:0' and 'stopped by SIGTERM' in err and 'Traceback' not in err, (info, err[-3000:])
    assert f'resubmit with the same flags to continue it (run name {out.name})' in err
    s = summary(out)
    assert s['status'] == 'preempted' and list_checkpoints(str(out))[-1].endswith(f"{s['global_step']:08d}.pt")
    again = submit(slurm, workdir, 'cpu.slurm', *flags)
    assert slurm.wait(again, timeout=300)['JobState'] == 'COMPLETED', job_log(workdir, again, 'err')[-3000:]
    assert f'continuing from runs/{out.name}/checkpoint-' in job_log(workdir, again)
    assert train_losses(out) == reference_losses(cache_dir, tmp_path, *LONGER)
    assert summary(out)['status'] == 'completed'


def test_scancel_full_kills_at_once_and_the_periodic_checkpoint_is_what_remains(slurm, workdir, cache_dir,
                                                                                 tmp_path):
    """`scancel --full --signal=TERM` signals srun too, and srun answers SIGTERM by SIGKILLing its tasks
    (Slurm's srun: "forcing job termination"): no checkpoint can be written then. What remains is the last
    --chkpt-every checkpoint; the resubmitted job continues from it to the uninterrupted losses."""
    flags = [*TINY, '--cache-dir', str(cache_dir), *LONGER, '--num-workers', '2', '--chkpt-every', '5']
    out = workdir / 'runs' / script_run_name('dlojz-cpu', flags)
    job = submit(slurm, workdir, 'cpu.slurm', *flags)
    wait_for_steps(slurm, job, out, 12)
    slurm.run('scancel', '--signal=TERM', '--full', job)
    slurm.wait(job, timeout=120)
    assert 'forcing job termination' in job_log(workdir, job, 'err')
    kept = list_checkpoints(str(out))[-1]
    again = submit(slurm, workdir, 'cpu.slurm', *flags)
    assert slurm.wait(again, timeout=300)['JobState'] == 'COMPLETED', job_log(workdir, again, 'err')[-3000:]
    assert f'continuing from runs/{out.name}/{os.path.basename(kept)}' in job_log(workdir, again)
    assert train_losses(out) == reference_losses(cache_dir, tmp_path, *LONGER)


def test_time_limit_signal_with_workers_requeues_and_resumes_exactly(slurm, workdir, cache_dir, tmp_path):
    """The scripts' --signal=USR2@<s> at a real time limit: Slurm signals every process of the step,
    the DataLoader workers included; dlojz checkpoints and requeues, the job continues (given a
    longer limit here) to the uninterrupted losses. Slurm checks the limit every ~30 s and may
    signal up to a minute early (--time=1 with USR2@50 signalled 2.6 s after the start, in the
    start-up: a stop with no worker and no checkpoint). So --time=2 with the signal 40 s before:
    from 20 to 80 s after the start, while steps slowed to 0.4 s (240 of them, 96 s) run."""
    flags = [*TINY, '--cache-dir', cache_dir, '-e', '20', '--log-interval', '1', '--num-workers', '2']
    job = submit(slurm, workdir, 'cpu.slurm', *flags, '--output-dir', tmp_path / 'run',
                 options=['--time=2', '--signal=USR2@40'], DLOJZ_FAULT='slow-steps:0.4')
    wait_requeued(slurm, job, before_release=lambda: slurm.run('scontrol', 'update', f'JobId={job}',
                                                              'TimeLimit=10', check=False))
    info = slurm.wait(job, timeout=300)
    assert info['JobState'] == 'COMPLETED', job_log(workdir, job, 'err')[-3000:]
    err = job_log(workdir, job, 'err')
    assert 'stopped by SIGUSR2' in err and 'was requeued' in err and 'Traceback' not in err
    assert 'during start-up' not in err and 'continuing from' in job_log(workdir, job)  # mid-run
    got = train_losses(tmp_path / 'run')
    assert sorted(got) == list(range(1, 241)) and got == reference_losses(cache_dir, tmp_path, '-e', '20',
                                                                          '--log-interval', '1')
