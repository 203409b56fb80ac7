"""Failpoints: the faults the crash tests inject into a real dlojz process, named, read once from
DLOJZ_FAULT when this module is imported (environment.faults parses it), and no-ops when it is
unset (as etcd's gofail and FoundationDB's BUGGIFY).

DLOJZ_FAULT=kill-in-checkpoint:2 python dlojz.py ...     # comma-separated <name>[:<argument>]
entries

  kill-in-checkpoint:<n>    SIGKILL this process halfway through writing its n-th checkpoint (a node failure)
  no-flock                  flock raises ENOLCK, as on a file system without it: the O_EXCL claim is used
  slow-steps:<s>            sleep s seconds after each training step, in a Slurm job's first attempt only (a
                            requeued job has SLURM_RESTART_COUNT >= 1), so that a run of a few tiny steps lasts
                            until Slurm's time-limit signal comes
  signal-step:<n>:<SIG>     send SIG to this process's whole group (DataLoader workers included, as Slurm does)
                            once global step n is done
  signal-val:<n>:<SIG>      the same after the n-th validation batch this process runs
  slow-loader:<r>:<s>       the loader of rank r (RANK or SLURM_PROCID) sleeps s seconds per training image:
                            a straggler whose cause is outside the code that measures it
  slow-worker-start:<s>     the main process sleeps s seconds after forking each DataLoader worker: a start-up
                            as slow as hundreds of workers' on a few cores, for the signal tests
  kill-generator:<n>        SIGKILL a process generating the synthetic dataset at its n-th image (the OOM
                            killer)
  slow-phase:<r>:<name>:<s> rank r sleeps s seconds on entering start-up phase <name>
                            (measure.startup): the cause the start-up line must name, not the
                            other ranks' wait for it; a start-up Slurm stops (first attempt only)

docs/development.md lists them beside the tests that use them. The code under test says one word
(after_step, after_val_batch, train_sample, worker_started, checkpoint_write, before_flock,
generator_image, startup_phase); with DLOJZ_FAULT unset each is one test of a constant and reads no
environment, so the training loop pays nothing for them."""
import errno
import os
import signal
import time

from dlojzlib.environment import faults
from dlojzlib.errors import UsageError

try:
    ARMED = faults()
except UsageError:  # not a traceback at import: environment.check_environment says it at start-up
    ARMED = {}
_hits = {}  # name -> times reached in this process


def _nth(name):
    """Whether failpoint `name`, armed with a count n, is reached for the n-th time now."""
    _hits[name] = _hits.get(name, 0) + 1
    return _hits[name] == int(ARMED[name].split(':')[0])


def _this_rank():
    """The launcher's rank of this process (torchrun's RANK, srun's SLURM_PROCID), as text."""
    return os.environ.get('RANK') or os.environ.get('SLURM_PROCID') or '0'


def _signal_group(name):
    os.killpg(os.getpgrp(), getattr(signal, ARMED[name].split(':')[1]))


def after_step(global_step):
    """The training loop's one call, once global step `global_step` is done."""
    if not ARMED:
        return
    if 'slow-steps' in ARMED:
        time.sleep(float(ARMED['slow-steps']))
    if 'signal-step' in ARMED and global_step == int(ARMED['signal-step'].split(':')[0]):
        _signal_group('signal-step')


def train_sample():
    """Called as a loader (a worker or the main process) reads a training image."""
    if ARMED and 'slow-loader' in ARMED:
        rank, seconds = ARMED['slow-loader'].split(':')
        if _this_rank() == rank:
            time.sleep(float(seconds))


def worker_started():
    """Called in the main process after each DataLoader worker is forked."""
    if ARMED and 'slow-worker-start' in ARMED:
        time.sleep(float(ARMED['slow-worker-start']))


def generator_image():
    """Called before each synthetic image is generated."""
    if ARMED and 'kill-generator' in ARMED and _nth('kill-generator'):
        os.kill(os.getpid(), signal.SIGKILL)


def startup_phase(name):
    """Called as start-up phase `name` begins."""
    if ARMED and 'slow-phase' in ARMED:
        rank, phase, seconds = ARMED['slow-phase'].split(':')
        if phase == name and _this_rank() == rank:
            time.sleep(float(seconds))


def after_val_batch():
    if ARMED and 'signal-val' in ARMED and _nth('signal-val'):
        _signal_group('signal-val')


def before_flock():
    if ARMED and 'no-flock' in ARMED:
        raise OSError(errno.ENOLCK, 'No locks available')


def checkpoint_write(f, state):
    """Called with the open temporary file before a checkpoint is written into it."""
    if ARMED and 'kill-in-checkpoint' in ARMED and _nth('kill-in-checkpoint'):
        _die_half_written(f, state)


def _die_half_written(f, state):
    import io

    import torch
    buf = io.BytesIO()
    torch.save(state, buf)
    f.write(buf.getvalue()[:buf.tell() // 2])
    f.flush()
    os.fsync(f.fileno())
    os.kill(os.getpid(), signal.SIGKILL)
