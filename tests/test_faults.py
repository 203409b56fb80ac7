"""Fault injection: what a run folder holds after a stop signal at any point, a concurrent start, a
NaN in validation, must be what an uninterrupted run's holds, or say why not.

- A stop signal (SIGUSR2 or SIGTERM to the whole process group, DataLoader workers included, as Slurm sends
  it) after any step of a 2-epoch run with 2 workers, or during a validation, then --resume auto: the
  validation records, the losses (each step logged once), best top-1, best.pt and time to accuracy equal the
  uninterrupted run's. The signal comes from the test-only seam DLOJZ_FAULT=signal-step:<n>:<SIG> (or
  signal-val:<batch>:<SIG>), which the process sends to its own group at that exact point. The whole matrix
  is marked slow (each point is two runs, 25-45 s on 2 shared cores); test_a_stop_loses_no_validation holds
  its representative points (an epoch's last step, a validation): run it first.
- Two runs started in one folder: exactly one runs, the other gets one sentence and exit 2 and writes
  nothing; with flock, and with the O_EXCL fallback of file systems without it (DLOJZ_FAULT=no-flock; the
  fallback's rules are also tested in-process, fast, in tests/test_output_dir.py). Subprocess runs: slow.
- A non-finite validation loss ends with status 'nan' and exit 3, never 'completed'.
- tools.report counts a step once in a metrics.jsonl written before resumes trimmed it.

Run: python -m pytest -q tests/test_faults.py            (the full matrix: -m slow)"""
import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import DLOJZ, ROOT, TINY, run_main
import dlojz

RUN = ['-e', '2', '--log-interval', '1', '--num-workers', '2', '--chkpt', '--target-top1', '0.3']
VAL_KEYS = ('epoch', 'global_step', 'loss', 'top1', 'top5', 'images', 'batches', 'train_images')


def records(out):
    with open(os.path.join(out, 'metrics.jsonl')) as f:
        return [json.loads(line) for line in f]


def start(out, cache_dir, *flags, fault=None):
    """dlojz in its own process group (session), as Slurm starts a step's tasks."""
    env = dict(os.environ)
    if fault:
        env['DLOJZ_FAULT'] = fault
    return subprocess.Popen([sys.executable, DLOJZ, *TINY, '--cache-dir', cache_dir, '--output-dir', str(out),
                             *map(str, flags)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, env=env, start_new_session=True)


@pytest.fixture(scope='module')
def reference(two_epochs):
    """What the uninterrupted run records (the session's 2-epoch run: 0 workers, no checkpoints;
    neither changes a loss), and what best.pt and time to accuracy must then say, worked out from
    its records."""
    _, recs = two_epochs
    vals = [{k: r[k] for k in VAL_KEYS} for r in recs if r['type'] == 'val']
    assert [v['epoch'] for v in vals] == [1, 2]
    best = max(vals, key=lambda v: v['top1'])  # max() keeps the first of equals, as best.pt does
    reached = next((v for v in vals if v['top1'] >= 0.3), None)
    return {'losses': [(r['global_step'], r['loss']) for r in recs if r['type'] == 'train'], 'vals': vals,
            'best': best, 'reached': reached}


def check_like_reference(out, ref):
    recs = records(out)
    assert [(r['global_step'], r['loss']) for r in recs if r['type'] == 'train'] == ref['losses']  # once each
    assert [{k: r[k] for k in VAL_KEYS} for r in recs if r['type'] == 'val'] == ref['vals']
    summary = json.load(open(out / 'summary.json'))
    assert summary['status'] == 'completed'
    assert summary['val']['epoch'] == 2 and summary['val']['top1'] == ref['vals'][-1]['top1']
    tta = summary['time_to_accuracy']
    assert tta['best_top1'] == ref['best']['top1']
    reached = ref['reached']
    if reached is None:
        assert tta['raw'] is None
    else:
        assert {k: tta['raw'][k] for k in ('epoch', 'global_step', 'train_images', 'top1')} == \
            {k: reached[k] for k in ('epoch', 'global_step', 'train_images', 'top1')}
    best = torch.load(out / 'best.pt', map_location='cpu', weights_only=False)
    assert best['global_step'] == ref['best']['global_step'] and best['race']['best_top1'] == ref['best']['top1']
    assert not best['end_due']  # best.pt holds a closed epoch
    assert not [n for n in os.listdir(out) if n.endswith('.tmp')]


def stop_and_resume(tmp_path, cache_dir, ref, fault):
    out = tmp_path / 'run'
    p = start(out, cache_dir, *RUN, fault=fault)
    _, err = p.communicate(timeout=300)
    sig = fault.rsplit(':', 1)[1]
    if fault.startswith('signal-val') and int(fault.split(':')[1]) > 2:  # the last validation: nothing to stop
        assert p.returncode == 0, err[-2000:]
    else:
        assert p.returncode == 5 and f'stopped by {sig}' in err and 'Traceback' not in err, err[-2000:]
        assert json.load(open(out / 'summary.json'))['status'] == 'preempted'
        run_main(out, cache_dir, *RUN, '--resume', 'auto')
    check_like_reference(out, ref)


# The representative points: the last step of epoch 1 (its validation is owed) and the first
# validation.
QUICK = ['signal-step:12:SIGTERM', 'signal-val:1:SIGUSR2']
MATRIX = [f"signal-step:{n}:{'SIGUSR2' if n % 2 else 'SIGTERM'}" for n in range(1, 25)] + \
    [f"signal-val:{n}:{'SIGUSR2' if n % 2 else 'SIGTERM'}" for n in range(1, 5)]


@pytest.mark.slow  # 25 s and 43 s on the 2 shared cores (load 5): over the 15 s a default test may take
@pytest.mark.parametrize('fault', QUICK)
def test_a_stop_loses_no_validation(tmp_path, cache_dir, reference, fault):
    stop_and_resume(tmp_path, cache_dir, reference, fault)


@pytest.mark.slow
@pytest.mark.parametrize('fault', [f for f in MATRIX if f not in QUICK])
def test_a_stop_anywhere_loses_nothing(tmp_path, cache_dir, reference, fault):
    stop_and_resume(tmp_path, cache_dir, reference, fault)


# ------------------------------------------------------------------------------------ one owner per folder

def wait_for_step(out, proc, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if os.path.exists(out / 'metrics.jsonl') and any(r['type'] == 'train' for r in records(out)):
            return
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        time.sleep(0.05)
    raise AssertionError('training did not start')


@pytest.mark.slow  # 23 s
@pytest.mark.parametrize('fault', ['slow-steps:0.5', 'slow-steps:0.5,no-flock'])
def test_a_second_run_in_a_busy_folder_is_refused(tmp_path, cache_dir, fault):
    """A run is training in the folder; a second start there, fresh or --resume auto, gets one
    sentence and exit 2 and changes nothing; the first ends as if alone. no-flock: the O_EXCL
    fallback."""
    out = tmp_path / 'run'
    first = start(out, cache_dir, '--test-nsteps', '8', '--log-interval', '1', fault=fault)
    wait_for_step(out, first)
    for flags in ([], ['--resume', 'auto']):
        second = start(out, cache_dir, '--test-nsteps', '8', '--seed', '7', *flags, fault=fault)
        _, err = second.communicate(timeout=120)
        assert second.returncode == 2, err[-2000:]
        assert err.startswith(f'dlojz: error: --output-dir {out} is in use by another dlojz run (pid {first.pid} on ')
        assert len(err.strip().splitlines()) == 1
    _, err = first.communicate(timeout=120)
    assert first.returncode == 0, err[-2000:]
    assert [r['global_step'] for r in records(out) if r['type'] == 'train'] == list(range(1, 9))
    assert json.load(open(out / 'config.json'))['seed'] == 123
    assert sorted(os.listdir(out)) == ['config.json', 'metrics.jsonl', 'summary.json']  # the claim is gone


@pytest.mark.slow
@pytest.mark.parametrize('fault', ['slow-steps:0.5', 'slow-steps:0.5,no-flock'])
def test_two_runs_started_together_in_one_folder(tmp_path, cache_dir, fault):
    """Two jobs with --resume auto started at the same moment: exactly one runs."""
    out = tmp_path / 'run'
    procs = [start(out, cache_dir, '--test-nsteps', '6', '--log-interval', '1', '--resume', 'auto', fault=fault)
             for _ in range(2)]
    results = [(p.returncode, err) for p in procs for _, err in [p.communicate(timeout=300)]]
    assert sorted(code for code, _ in results) == [0, 2], results
    loser = next(err for code, err in results if code == 2)
    assert 'is in use by another dlojz run' in loser and len(loser.strip().splitlines()) == 1
    assert [r['global_step'] for r in records(out) if r['type'] == 'train'] == list(range(1, 7))
    assert json.load(open(out / 'summary.json'))['status'] == 'completed'


# ------------------------------------------------------------------------------------ non-finite validation

def test_a_nan_validation_loss_is_not_completed(tmp_path, cache_dir, capsys):
    """BatchNorm running statistics gone NaN: training (batch statistics) stays finite, validation
    does not."""
    out = tmp_path / 'run'
    run_main(out, cache_dir, '--test-nsteps', '2', '--chkpt')
    ckpt = out / 'checkpoint-00000002.pt'
    state = torch.load(ckpt, map_location='cpu', weights_only=False)
    state['model']['bn1.running_var'][:] = float('nan')
    torch.save(state, ckpt)
    capsys.readouterr()
    code = dlojz.cli([*TINY, '--cache-dir', cache_dir, '--output-dir', str(out), '--test-nsteps', '3', '--chkpt',
                      '--resume', 'auto', '--log-interval', '1'])
    err = capsys.readouterr().err
    assert code == 3, err
    assert 'the validation loss of epoch 1 (after step 3) is NaN or infinite' in err and 'Traceback' not in err
    summary = json.load(open(out / 'summary.json'))
    assert summary['status'] == 'nan' and summary['failed_step'] == 3
    recs = records(out)
    assert recs[-2]['type'] == 'train' and recs[-2]['global_step'] == 3 and math.isfinite(recs[-2]['loss'])
    assert recs[-1]['type'] == 'val' and math.isnan(recs[-1]['loss'])  # recorded
    assert not os.path.exists(out / 'checkpoint-00000003.pt')


# ------------------------------------------------------------------------------------ the report

def test_the_report_counts_a_repeated_step_once(tmp_path):
    """metrics.jsonl of a run resumed by an older dlojz: steps 3-4 logged by the killed attempt,
    then again."""
    from dlojzlib.tools.report.runs import load_run
    lines = [{'type': 'train', 'global_step': s, 'loss': 1.0 / s} for s in (1, 2, 3, 4)] + \
        [{'type': 'train', 'global_step': s, 'loss': 2.0 / s} for s in (3, 4, 5)] + \
        [{'type': 'val', 'global_step': 5, 'epoch': 1, 'top1': 0.5, 'wall_s': 1.0, 'train_images': 40}]
    (tmp_path / 'metrics.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in lines))
    run = load_run(str(tmp_path))
    train = [(r['global_step'], r['loss']) for r in run.records if r['type'] == 'train']
    assert train == [(1, 1.0), (2, 0.5), (3, 2.0 / 3), (4, 0.5), (5, 0.4)]  # the resumed attempt's
    assert any('2 record(s)' in n for n in run.notes)


# ------------------------------------------------------------------------------------------- the failpoints

def test_failpoints_parse_their_names_and_refuse_what_would_inject_nothing():
    """DLOJZ_FAULT is read once: the names of failpoints' table with their arguments; a misspelt
    name or a malformed argument is refused (it would inject nothing, and the crash test around it
    would pass without its crash); a requeued Slurm attempt (SLURM_RESTART_COUNT >= 1) runs without
    its slow steps and its slow phase."""
    from dlojzlib.environment import fault_points
    assert fault_points(None) == {} and fault_points('') == {}
    assert fault_points('slow-steps:0.5,no-flock') == {'slow-steps': '0.5', 'no-flock': ''}
    assert fault_points('signal-step:5:SIGUSR2, kill-in-checkpoint:2') == {
        'signal-step': '5:SIGUSR2', 'kill-in-checkpoint': '2'}
    assert fault_points('slow-steps:0.2,signal-val:3:SIGTERM', restart_count=1) == {
        'signal-val': '3:SIGTERM'}
    assert fault_points('slow-phase:0:model:600,no-flock', restart_count=2) == {'no-flock': ''}
    assert fault_points('slow-phase:0:model:600', restart_count=0) == {'slow-phase': '0:model:600'}
    for bad in ('kill-in-checkpiont:2', 'slow_steps:1', 'kill-in-checkpoint', 'kill-in-checkpoint:x',
                'signal-step:5', 'signal-step:5:SIGNOPE', 'no-flock:1', 'slow-steps:'):
        with pytest.raises(ValueError, match='DLOJZ_FAULT'):
            fault_points(bad)


def test_failpoints_fire_where_they_are_armed(monkeypatch):
    """The n-th checkpoint write (the 1st and 3rd reach the file untouched), the signal after global
    step n only, flock's ENOLCK; and nothing at all when nothing is armed."""
    import errno

    from dlojzlib import failpoints as F
    from dlojzlib.environment import fault_points
    killed, sent, slept = [], [], []
    monkeypatch.setattr(F, '_die_half_written', lambda f, state: killed.append(state))
    monkeypatch.setattr(F.os, 'killpg', lambda pgid, sig: sent.append(sig))
    monkeypatch.setattr(F.time, 'sleep', slept.append)
    monkeypatch.setattr(F, '_hits', {})
    monkeypatch.setattr(F, 'ARMED', fault_points(
        'kill-in-checkpoint:2,signal-step:3:SIGUSR2,signal-val:2:SIGTERM,no-flock,slow-steps:0.25'))
    for k in range(1, 4):
        F.checkpoint_write(None, k)
    for step in range(1, 6):
        F.after_step(step)
    for _ in range(4):
        F.after_val_batch()
    assert killed == [2] and sent == [signal.SIGUSR2, signal.SIGTERM] and slept == [0.25] * 5
    with pytest.raises(OSError) as e:
        F.before_flock()
    assert e.value.errno == errno.ENOLCK
    monkeypatch.setattr(F, 'ARMED', {})
    killed.clear(), sent.clear(), slept.clear()
    F.checkpoint_write(None, 1), F.after_step(3), F.after_val_batch(), F.before_flock()
    assert killed == sent == slept == []


def environment_reads(fn, *args):
    """Run fn(*args) and return the environment reads made meanwhile (os.environ[...], .get, `in`,
    iteration, os.getenv), each with the innermost frame of this repository's code that led to it.
    """
    environ_code = {os._Environ.__getitem__.__code__, os._Environ.__iter__.__code__, os.getenv.__code__}
    reads = []

    def watch(frame, event, arg):
        if event == 'call' and frame.f_code in environ_code:
            f = frame.f_back
            while f is not None and not f.f_code.co_filename.startswith(ROOT):
                f = f.f_back
            reads.append((frame.f_locals.get('key'), f and f'{os.path.basename(f.f_code.co_filename)}:'
                                                           f'{f.f_code.co_name}:{f.f_lineno}'))
    sys.setprofile(watch)
    try:
        fn(*args)
    finally:
        sys.setprofile(None)
    return reads


def test_failpoints_cost_nothing_when_unset(tmp_path, cache_dir, monkeypatch):
    """With DLOJZ_FAULT unset, the training loop's steps read no environment variable: the
    failpoints were read once, at import (the loop called a function that parsed DLOJZ_FAULT, and
    SLURM_RESTART_COUNT, after every step before they moved to failpoints). The watch can see a
    read: the same loop armed with a fault that reads the environment at each step is caught."""
    from dlojzlib import failpoints
    from dlojzlib import flags
    from dlojzlib.record.log import Console
    from dlojzlib.record.state import Progress
    assert failpoints.ARMED == {}, 'run the tests with DLOJZ_FAULT unset'
    argv = [*TINY, '--cache-dir', cache_dir, '--output-dir', str(tmp_path), '--test-nsteps', '6', '--log-interval',
            '3', '--metric-step', '3', '--chkpt-every', '0']
    device = torch.device('cpu')
    args = flags.check_args(dlojz.get_args_parser().parse_args(argv), device)
    dlojz.seed_everything(args.seed)
    run, _ = dlojz.build_run(args, dlojz.get_dist_info(), device, Console(False))
    run.data.set_epoch(0)
    progress = Progress()
    assert environment_reads(dlojz.train_one_epoch, run, progress, 3) == []
    assert progress.global_step == 3  # the steps ran

    def reads_each_step(step):  # a failpoint that reads its configuration where it fires: the positive control
        os.environ.get('DLOJZ_FAULT')
    monkeypatch.setattr(failpoints, 'after_step', reads_each_step)
    reads = environment_reads(dlojz.train_one_epoch, run, progress, 3)
    assert [key for key, _ in reads] == ['DLOJZ_FAULT'] * 3 and 'test_faults.py' in reads[0][1]
    run.log.close()
