"""A stop signal before the first step ends the run within seconds, whatever call the start-up is
blocked in (issue 49; dist.starting):

- SIGTERM while the start-up sleeps in a failpoint (a system call that Python retries after a
  handler that returns, as it retried the open() of a FIFO): exit 5 in seconds, before the run's
  record (none written) and after it ('preempted');
- --loader-only stopped so records it in summary.json ('preempted', mode 'loader');
- the handler never raises inside code that may hold a lock (threading, multiprocessing, ...): it
  tries again 0.1 s later, and raises once the start-up is back in code of its own;
- the loader doctor's measure ends on a loader that yields nothing (it asked for epoch after epoch).

The subprocess versions (the real process, the whole group signalled) are in the long tier.

Run: python -m pytest -q tests/test_stop_start.py"""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import dlojz
from conftest import DLOJZ, ROOT, TINY
from dlojzlib import failpoints
from dlojzlib.dist import launch, starting
from dlojzlib.errors import EARLY_SIGNALS, DataError
from dlojzlib.modes import doctor


@pytest.fixture
def early_handlers():
    """The handlers dlojz.py installs at its first line, for an in-process cli(); the process's own
    afterwards, and no stop left behind for the next test's loaders (launch.stop_received)."""
    old = {s: signal.getsignal(s) for s in (*starting.STOPS, signal.SIGALRM)}
    starting.install_early()
    try:
        yield
    finally:
        starting.disarm()
        for s, handler in old.items():
            signal.signal(s, handler)
        EARLY_SIGNALS.clear()


def signal_in(function, sig=signal.SIGTERM, timeout=120, **args):
    """Send sig to this process once its main thread runs `function` with these arguments (the
    failpoint that blocks it). -> a dict whose 'at' is when it was sent."""
    main, sent = threading.main_thread().ident, {}

    def watch():
        deadline = time.time() + timeout
        while time.time() < deadline:
            frame = sys._current_frames().get(main)
            if frame is not None and frame.f_code.co_name == function and \
                    all(frame.f_locals.get(k) == v for k, v in args.items()):
                sent['at'] = time.time()
                os.kill(os.getpid(), sig)
                return
            time.sleep(0.01)
    threading.Thread(target=watch, daemon=True).start()
    return sent


def cli(out, cache_dir, *flags):
    return dlojz.cli([*TINY, '--cache-dir', cache_dir, '--output-dir', str(out), *flags])


def test_a_stop_while_the_start_up_sleeps_ends_it_before_its_record(tmp_path, cache_dir,
                                                                   early_handlers, monkeypatch,
                                                                   capfd):
    """The checkpoint phase sleeps 600 s (a failpoint standing for a blocking open()): SIGTERM ends
    the run in seconds, exit 5, with the stop's sentence; this attempt had written nothing, so no
    record (a fresh run folder is removed)."""
    monkeypatch.setattr(failpoints, 'ARMED', {'slow-phase': '0:checkpoint:600'})
    sent = signal_in('startup_phase', name='checkpoint')
    code = cli(tmp_path / 'run', cache_dir, '--test-nsteps', '2')
    took = time.time() - sent['at']
    err = capfd.readouterr().err
    assert code == 5 and took < 10, (code, took, err[-2000:])
    assert 'stopped by SIGTERM at step 0; no checkpoint (no step had run).' in err, err[-2000:]
    assert 'Traceback' not in err and not (tmp_path / 'run' / 'summary.json').exists()
    assert not starting.armed() and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_a_stop_after_the_record_is_written_records_it(tmp_path, cache_dir, early_handlers,
                                                       monkeypatch, capfd):
    """The same once summary.json says 'running' (the meters' phase, the run's own handler in
    place): 'preempted' at step 0, exit 5, in seconds."""
    monkeypatch.setattr(failpoints, 'ARMED', {'slow-phase': '0:meters:600'})
    sent = signal_in('startup_phase', sig=signal.SIGUSR2, name='meters')
    code = cli(tmp_path / 'run', cache_dir, '--test-nsteps', '2')
    took = time.time() - sent['at']
    err = capfd.readouterr().err
    assert code == 5 and took < 10, (code, took, err[-2000:])
    summary = json.loads((tmp_path / 'run' / 'summary.json').read_text())
    assert summary['status'] == 'preempted' and summary['global_step'] == 0, summary
    assert summary['error'] == ('stopped by SIGUSR2 at step 0; no checkpoint (no step had run). '
                                f'Not requeued (not running under srun); continue with --resume '
                                f'auto --output-dir {tmp_path / "run"}.') and 'Traceback' not in err


def test_a_stop_while_a_start_up_error_is_recorded_keeps_the_error(tmp_path, cache_dir,
                                                                   early_handlers, monkeypatch,
                                                                   capfd):
    """The start-up fails (still armed) and SIGTERM comes while its record is written: the
    handler raised Stopped inside the write, and the error and its record were lost."""
    def broken(*args):
        raise DataError('the data broke')

    real = dlojz.write_summary

    def write(run, progress, status, *args, **kw):
        if status != 'running':
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)  # the handler runs here, in this module's frame: it may raise
        return real(run, progress, status, *args, **kw)

    monkeypatch.setattr(dlojz, 'train', broken)
    monkeypatch.setattr(dlojz, 'write_summary', write)
    code = cli(tmp_path / 'run', cache_dir, '--test-nsteps', '2')
    err = capfd.readouterr().err
    summary = json.loads((tmp_path / 'run' / 'summary.json').read_text())
    assert code == 2 and summary['status'] == 'failed', (code, summary['status'], err[-2000:])
    assert summary['error'] == 'the data broke' and 'Traceback' not in err


def test_loader_only_stopped_records_it(tmp_path, cache_dir, early_handlers, monkeypatch):
    """--loader-only has no step to finish: a stop while it draws batches ends it at once, its
    record written ('preempted', mode 'loader'); it ended with no record before (the default
    action of SIGTERM)."""
    monkeypatch.setattr(failpoints, 'ARMED', {'slow-loader': '0:600'})
    sent = signal_in('train_sample')
    code = cli(tmp_path / 'run', cache_dir, '--loader-only', '--test-nsteps', '8')
    assert code == 5 and time.time() - sent['at'] < 10
    summary = json.loads((tmp_path / 'run' / 'summary.json').read_text())
    assert (summary['status'], summary['mode']) == ('preempted', 'loader'), summary
    assert summary['error'] == ('stopped by SIGTERM before the loader was measured to its end; '
                                'run it again.')


def test_the_handler_waits_outside_code_that_may_hold_a_lock(early_handlers):
    """Armed, a stop that comes while the main thread is inside threading (here a Condition's wait,
    where an exception could leave the lock taken) is not raised there: SIGALRM asks again every
    0.1 s, and the stop is raised once the thread is back in code of its own, in a blocking call
    (sleep) that the flag alone would have let run to its end. Disarmed, the handler only records
    the signal."""
    starting.arm()
    threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()
    t0 = time.time()
    with pytest.raises(starting.Stopped) as stopped:
        threading.Event().wait(1.0)  # the signal comes in here
        waited = time.time() - t0
        time.sleep(30)
    assert waited >= 1.0 and time.time() - t0 < waited + 2 and stopped.value.signal == 'SIGTERM'
    assert not starting.armed() and signal.getsignal(signal.SIGALRM) is not starting._again
    os.kill(os.getpid(), signal.SIGUSR2)  # disarmed: recorded, not raised
    time.sleep(0.05)
    assert EARLY_SIGNALS == ['SIGTERM', 'SIGUSR2']


def test_arming_after_an_early_stop_ends_the_start_up_at_once(early_handlers):
    """A stop that came while Python imported the modules (before cli() could catch anything) ends
    the start-up as cli() arms."""
    os.kill(os.getpid(), signal.SIGUSR2)
    time.sleep(0.05)
    with pytest.raises(starting.Stopped):
        starting.arm()
    assert not starting.armed()


class Epochs:
    """A loader of `batches` batches in its first epoch and none after."""

    def __init__(self, batches):
        self.batches, self.epochs = batches, 0

    def __iter__(self):
        self.epochs += 1
        assert self.epochs < 5, 'asked for epoch after epoch'  # the defect: ends the test
        n = self.batches if self.epochs == 1 else 0
        return iter([(torch.zeros(2, 3), torch.zeros(2))] * n)


@pytest.mark.parametrize('batches', [0, 3])
def test_measure_ends_on_a_loader_that_yields_nothing(batches):
    with pytest.raises(DataError, match=f'no batch in epoch {1 if batches == 0 else 2}'):
        doctor.measure(Epochs(batches), 5, 1, torch.device('cpu'))


def test_measure_says_a_stop_when_the_loader_was_stopped(monkeypatch):
    """A stop signal empties the training loader of a lone process (data.workers): the doctor's
    measure ends as a stop, which --loader-only records."""
    monkeypatch.setattr(launch, '_received', 'SIGTERM')
    with pytest.raises(starting.Stopped):
        doctor.measure(Epochs(0), 5, 1, torch.device('cpu'))


def start(out, cache_dir, *flags, env):
    return subprocess.Popen([sys.executable, DLOJZ, *TINY, '--cache-dir', cache_dir, '--output-dir',
                             str(out), *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT, env={**os.environ, **env}, start_new_session=True)


def end(p, timeout):
    """-> (exit code, stderr) within timeout seconds; the group killed after it (the defect)."""
    try:
        _, err = p.communicate(timeout=timeout)
        return p.returncode, err
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        _, err = p.communicate()
        return f'still running after {timeout} s', err


@pytest.mark.slow  # 6 s: a process of its own; the fast tier runs cli() in-process above
def test_sigterm_to_a_blocked_start_up_ends_the_process_in_seconds(tmp_path, cache_dir):
    """As scancel or Slurm's time limit send it, to the whole group: the process blocked in its
    start-up (a resubmitted job's: --resume auto; the checkpoint phase sleeps 600 s once the run
    folder is taken) ends within 10 s, exit 5. It waited for the block's end before (a FIFO's
    open(): 764 s, until SIGKILL)."""
    out = tmp_path / 'run'
    p = start(out, cache_dir, '--test-nsteps', '2', '--resume', 'auto',
              env={'DLOJZ_FAULT': 'slow-phase:0:checkpoint:600'})
    deadline = time.time() + 120
    while not out.exists() and time.time() < deadline and p.poll() is None:
        time.sleep(0.05)
    time.sleep(0.5)  # into the phase's sleep
    os.killpg(p.pid, signal.SIGTERM)
    code, err = end(p, 10)
    assert code == 5, (code, err[-2000:])
    assert 'dlojz: stopped by SIGTERM during start-up; no checkpoint (no step had run; those of ' \
        '--resume are kept). Not requeued' in err and 'Traceback' not in err, err[-2000:]


@pytest.mark.slow  # 8 s: a process of its own
def test_loader_only_stopped_by_sigterm_records_it(tmp_path, cache_dir):
    """The command itself, SIGTERM to its group while it draws batches (2 workers, 600 s an image):
    exit 5 in seconds and summary.json 'preempted' (before: killed by the signal, no record)."""
    out = tmp_path / 'run'
    p = start(out, cache_dir, '--loader-only', '--test-nsteps', '8', '--num-workers', '2',
              env={'DLOJZ_FAULT': 'slow-loader:0:600'})
    deadline = time.time() + 120
    while not (out / 'config.json').exists() and time.time() < deadline and p.poll() is None:
        time.sleep(0.05)
    time.sleep(0.5)
    os.killpg(p.pid, signal.SIGTERM)
    code, err = end(p, 20)
    assert code == 5, (code, err[-2000:])
    summary = json.loads((out / 'summary.json').read_text())
    assert (summary['status'], summary['mode']) == ('preempted', 'loader')
