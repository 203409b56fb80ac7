"""How a run ends. translate() maps each outside exception to its status and exit code (the table in
errors), and every way a run can end, driven through cli() with a fault injected at a known step,
leaves a summary.json with that status, the exit code, one sentence on stderr (a traceback only for
a crash), the power meter stopped, metrics.jsonl closed and wandb finished with the exit code.

Run: python -m pytest -q tests/test_exits.py"""
import json
import os
import signal

import pytest
import torch

from conftest import TINY, free_port
import dlojz
from dlojzlib import errors as E
from dlojzlib.data.decode import BadImageError

ARGS = dlojz.get_args_parser().parse_args(['--arch', 'resnet18-heads', '-b', '7', '--dist-timeout', '2'])
WORKER_MESSAGE = ('Caught BadImageError in DataLoader worker process 0.\nOriginal Traceback (most recent call '
                  'last):\n  File "dlojz_data.py", line 300, in __getitem__\n    raise BadImageError(msg)\n'
                  'dlojzlib.data.datasets.BadImageError: cannot decode image '
                  '/data/train/n01/x.JPEG (truncated); pass '
                  '--skip-bad-images to skip such files.')
UNUSED = ('Expected to have finished reduction in the prior iteration before starting a new one. This error '
          'indicates that your module has parameters that were not used in producing loss. You can enable unused '
          'parameter detection by passing the keyword argument `find_unused_parameters=True` to DDP')
GLOO_PEER = '[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:40321'


class DynamoFailure(RuntimeError):
    """Stands for torch._dynamo's exceptions, recognised by their module."""


DynamoFailure.__module__ = 'torch._dynamo.exc'


@pytest.mark.parametrize('exc, distributed, kind, status, code, words', [
    (torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB'), False, E.OutOfMemory, 'oom', 2,
     'out of memory at step 7 with batch size 7'),
    (DynamoFailure('backend inductor failed'), False, None, None, None, None),  # not compiling: a crash
    (RuntimeError(UNUSED), True, E.UsageError, 'failed', 2, 'rerun with --find-unused-parameters'),
    (RuntimeError(GLOO_PEER), True, E.CommFailure, 'failed', 4, 'another rank died or stopped answering'),
    (RuntimeError(GLOO_PEER), False, None, None, None, None),  # one process has no peer
    (BadImageError(WORKER_MESSAGE), False, E.DataError, 'failed', 2, 'cannot decode image /data/train/n01/x.JPEG'),
    (KeyboardInterrupt(), False, E.Interrupted, 'interrupted', 130, 'interrupted'),
    (E.NonFiniteLoss(5), False, E.NonFiniteLoss, 'nan', 3, 'NaN or infinite at step 5'),
    (E.Preempted('stopped', requeued=True), True, E.Preempted, 'preempted', 0, 'stopped'),
    (E.Preempted('stopped'), True, E.Preempted, 'preempted', 5, 'stopped'),
    (ValueError('a bug'), False, None, None, None, None),
])
def test_translate_table(exc, distributed, kind, status, code, words):
    err = E.translate(exc, ARGS, rank=1, distributed=distributed, step=7)
    if kind is None:
        assert err is None
        return
    assert type(err) is kind and (err.status, err.exit_code) == (status, code)
    assert words in str(err) and '\n' not in str(err)
    if kind not in (E.NonFiniteLoss, E.Preempted):
        assert err.extra['failed_step'] == 7


def test_translate_compile_failure_only_when_compiling():
    compiling = dlojz.get_args_parser().parse_args(['--compile'])
    err = E.translate(DynamoFailure('backend inductor failed\nlong trace'), compiling, step=1)
    assert type(err) is E.UsageError and 'rerun with --no-compile' in str(err) and '\n' not in str(err)


def test_comm_failure_patterns():
    assert E.is_comm_failure(RuntimeError('[gloo/pair.cc:545] Read error: Connection reset by peer.'))
    assert E.is_comm_failure(RuntimeError('Timed out waiting 5000ms for recv operation to complete'))
    # what rank 0's backward raised in CI when its peer was SIGSTOPped (DDP's reducer, gloo, torch
    # 2.15)
    assert E.is_comm_failure(RuntimeError('Application timeout caused pair closure'))
    assert E.is_comm_failure(RuntimeError('[gloo/transport/tcp/unbound_buffer.cc:81] Socket Timeout'))
    assert not E.is_comm_failure(RuntimeError('CUDA error: device-side assert triggered'))
    assert not E.is_comm_failure(ValueError('Connection reset by peer'))


# ------------------------------------------------------------------------------------- every exit path

class FakeWandb:
    def __init__(self):
        self.logged, self.exit_code = [], 'not finished'

    def log(self, numbers, step=None):
        self.logged.append((step, numbers))

    def finish(self, exit_code=None):
        self.exit_code = exit_code


class FakePower:
    """PowerMeter's interface, recording start/stop."""
    made = []

    def __init__(self, device, gather=None):
        self.started = self.stopped = False
        self.energy_j = None
        FakePower.made.append(self)

    def start(self):
        self.started = True

    def stop(self):
        self.stopped = True

    def window_start(self):
        pass

    def window_stop(self, images):
        pass

    def summary(self):
        return {'available': False, 'peak_w': None, 'mean_w': None, 'energy_j': None, 'joules_per_image': None}


def at_step(n, action):
    """A train_step that runs `action` (raise, or signal) when the n-th step starts."""
    real, count = dlojz.train_step, [0]

    def step(run, images, labels):
        count[0] += 1
        if count[0] == n:
            action()
        return real(run, images, labels)
    return step


def raise_(exc):
    def action():
        raise exc
    return action


def usr2():
    os.kill(os.getpid(), signal.SIGUSR2)


PATHS = {  # name -> (fault, extra flags, summary status, exit code, stderr words)
    'completed': (None, [], 'completed', 0, None),
    'nan': (None, ['--lr', '1e30', '--scheduler', 'constant'], 'nan', 3, 'dlojz: error: the loss became NaN'),
    'oom': (raise_(torch.OutOfMemoryError('CUDA out of memory')), [], 'oom', 2, 'out of memory at step 2'),
    'data': (raise_(BadImageError(WORKER_MESSAGE)), [], 'failed', 2, 'dlojz: error: cannot decode image'),
    # at the first step, before the compiled model ever runs (inductor would take ~40 s here)
    'compile': (raise_(DynamoFailure('inductor failed')), ['--compile'], 'failed', 2, 'rerun with --no-compile'),
    'comm': (raise_(RuntimeError(GLOO_PEER)), ['--launch'], 'failed', 4, 'another rank died'),
    'unused': (raise_(RuntimeError(UNUSED)), ['--launch'], 'failed', 2, 'rerun with --find-unused-parameters'),
    'preempted': (usr2, [], 'preempted', 5, 'dlojz: stopped by SIGUSR2 at step 2'),
    'interrupted': (raise_(KeyboardInterrupt()), [], 'interrupted', 130,
                    'dlojz: interrupted at step 2; no checkpoint was written'),
    # Ctrl-C, like SIGTERM, names the checkpoint to continue from and how (step 1's, from
    # --chkpt-every 1)
    'interrupted_after_checkpoint': (raise_(KeyboardInterrupt()), ['--chkpt-every', '1'], 'interrupted', 130,
                                     'checkpoint-00000001.pt: continue with --resume auto --output-dir'),
    'crashed': (raise_(ValueError('a bug')), [], 'crashed', None, None),
}


@pytest.mark.parametrize('name', list(PATHS))
def test_every_exit_path(name, tmp_path, cache_dir, monkeypatch, capsys):
    fault, flags, status, code, words = PATHS[name]
    wandb, loggers = FakeWandb(), []

    class Logger(dlojz.Logger):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            loggers.append(self)
    monkeypatch.setattr(dlojz, 'build_wandb', lambda args, dist: wandb)
    monkeypatch.setattr(dlojz, 'PowerMeter', FakePower)
    monkeypatch.setattr(dlojz, 'Logger', Logger)
    step = 1 if name == 'compile' else 2
    if fault:
        monkeypatch.setattr(dlojz, 'train_step', at_step(step, fault))
    if '--launch' in flags:  # as torchrun starts one process: gloo group and DDP at world size 1
        flags = [f for f in flags if f != '--launch']
        for k, v in dict(RANK='0', WORLD_SIZE='1', LOCAL_RANK='0', MASTER_ADDR='127.0.0.1',
                         MASTER_PORT=str(free_port())).items():
            monkeypatch.setenv(k, v)
    FakePower.made.clear()
    argv = [*TINY, '--cache-dir', cache_dir, '--output-dir', str(tmp_path), '--test-nsteps', '4', '--wandb',
            'offline', '--chkpt', *flags]
    if code is None:
        with pytest.raises(ValueError, match='a bug'):  # a bug keeps its traceback
            dlojz.cli(argv)
    else:
        assert dlojz.cli(argv) == code
    summary = json.load(open(tmp_path / 'summary.json'))
    assert summary['status'] == status
    err = capsys.readouterr().err
    if words:
        lines = [line for line in err.splitlines() if line.startswith('dlojz:')]
        assert len(lines) == 1 and words in lines[0] and 'Traceback' not in err, err
    if status == 'completed':
        assert summary['error'] is None and summary['global_step'] == 4
    elif status == 'preempted':
        assert os.path.exists(summary['checkpoint']) and summary['global_step'] == 2
    else:  # nan: step 1's update at lr 1e30 makes step 2's loss infinite
        assert summary['failed_step'] == step
    [power] = FakePower.made
    [log] = loggers
    assert power.started and power.stopped
    assert log.f is None  # metrics.jsonl closed
    assert wandb.exit_code == (1 if code is None else code)
