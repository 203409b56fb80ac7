"""The loader's worker processes: forked with the stop signals blocked, stopped half-way through
their start by a stop signal (the training loader), and deaf to SIGTERM and SIGUSR2 from anyone but
their parent.

Slurm signals every process of a step, DataLoader workers included; the main process owns those
signals and checkpoints at a step boundary (dist.launch.StopSignal)."""
import functools
import multiprocessing as mp
import os
import signal
import threading

import torch

from dlojzlib import compat
from dlojzlib import failpoints
from dlojzlib.data.handover import Materialized, SharedCollate
from dlojzlib.dist import launch


def ignore_preemption_signals(worker_id=None):
    """DataLoader workers survive SIGTERM and SIGUSR2 sent by anyone but their parent. Slurm signals
    every process of a step (scancel, the time limit, --signal=USR2@120), workers included; the main
    process owns these signals and checkpoints at a step boundary, while a worker killed by one made
    PyTorch raise in the middle of a step (measured: `timeout -s TERM` to the process group crashed
    4 runs in 4, twice inside torch.save). A signal that came before this runs is pending
    (DataLoader above) and is read here. SIGTERM from the parent (the loader's or multiprocessing's
    shutdown) still ends the worker: ignoring it too would leave the main process waiting for its
    workers at exit. A thread reads the sender of each SIGTERM (sigwaitinfo), blocked for the
    worker's other threads."""
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    # Ctrl-C reaches the terminal's whole foreground group, workers included: the main process's
    # interrupt ends them (the loader's shutdown), while their own KeyboardInterrupt printed a
    # worker's traceback when a second one came as they exited (issue 40)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if not hasattr(signal, 'sigwaitinfo'):  # not Linux: PyTorch's own handler stays
        return
    parent = os.getppid()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # threads made from here on inherit it

    def serve():
        while True:
            if signal.sigwaitinfo({signal.SIGTERM}).si_pid == parent:
                os._exit(0)  # as PyTorch's handler does for its parent's SIGTERM
    threading.Thread(target=serve, daemon=True, name='dlojz-sigterm').start()


PREEMPTION_SIGNALS = {signal.SIGTERM, signal.SIGUSR2}


class _StartStopped(Exception):
    """A stop signal came while the training loader's workers were being started."""


class _WorkerProcess(mp.context.ForkProcess):
    """A DataLoader worker forked with SIGTERM and SIGUSR2 blocked. A worker inherits the mask of
    the thread that forks it, so a signal sent to the process group while workers start (each
    validation without persistent workers, each epoch without them) waits for
    ignore_preemption_signals instead of reaching PyTorch's worker handler, which kills the worker
    (measured: 1 run in a test's 3 crashed this way, a validation's workers starting as the group
    got SIGTERM). The mask is restored after each fork, so the main process's own handler takes the
    signal between two forks, not after the last one (16 workers with a slow start once kept a
    SIGTERM waiting for the whole start-up); the training loader then starts no more workers
    (abort_on_stop)."""
    abort_on_stop = False

    def start(self):
        if self.abort_on_stop and launch.stop_received():
            raise _StartStopped
        old = signal.pthread_sigmask(signal.SIG_BLOCK, PREEMPTION_SIGNALS)
        try:
            super().start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
        failpoints.worker_started()


class ForkContext(mp.context.ForkContext):
    """The 'fork' start method (Linux's default; Python 3.14 makes forkserver the default) with
    _WorkerProcess: the workers inherit the shared counters and the blocked mask."""

    def __init__(self, abort_on_stop=False):
        super().__init__()
        self.abort_on_stop = abort_on_stop

    def Process(self, *args, **kwargs):  # noqa: N802 - multiprocessing's name
        p = _WorkerProcess(*args, **kwargs)
        p.abort_on_stop = self.abort_on_stop
        return p


class DataLoader(torch.utils.data.DataLoader):
    """torch's DataLoader with _WorkerProcess workers. With abort_on_stop (the training loader of a
    process without peers: with peers, every rank must stop at the same step, which StopSignal
    agrees on), a stop signal during the workers' start ends it within one fork: the workers started
    so far are stopped and the iteration is empty, so the training loop reaches its stop check at
    once (a checkpoint at the current step, or none before the first step) instead of waiting for
    every worker and the first batch."""

    def __init__(self, *args, abort_on_stop=False, **kwargs):
        if kwargs.get('num_workers'):
            kwargs['multiprocessing_context'] = ForkContext(abort_on_stop)
            # forked with SIGTERM blocked: without this init no one could stop them, the exit of
            # the main process included (multiprocessing terminates its daemons by SIGTERM)
            kwargs['worker_init_fn'] = functools.partial(_init_worker, kwargs.get('worker_init_fn'))
        super().__init__(*args, **kwargs)
        self.abort_on_stop = abort_on_stop

    def __iter__(self):
        if self.abort_on_stop and launch.stop_received():  # with or without workers: no batch to wait for
            return iter(())
        shared = isinstance(self.collate_fn, SharedCollate)
        if shared and not (self.persistent_workers and compat.loader_iterator(self) is not None):
            self.collate_fn.new_generation()  # workers are forked now: they get fresh permits
        try:
            it = super().__iter__()
        except _StartStopped as e:
            _abandon(e.__traceback__)
            return iter(())
        if compat.is_multiprocessing_iterator(it):
            it = StopsWorkersOnError(it)
        return Materialized(it) if shared else it


def _init_worker(init, worker_id):
    """The caller's worker_init_fn, then the signals' (a signal that came meanwhile is pending)."""
    if init is not None:
        init(worker_id)
    ignore_preemption_signals(worker_id)


class StopsWorkersOnError:
    """A loader iterator with workers, stopped at once when a batch raises (a bad image, a worker
    killed): otherwise its workers would wait for the garbage collector and be terminated 5 s
    later (compat.shutdown_workers). The run ends on such an error; the iterator is not used
    again. Other attributes are the wrapped iterator's."""

    def __init__(self, it):
        self._it = it

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self._it)
        except StopIteration:
            raise
        except BaseException:
            compat.shutdown_workers(self._it)
            raise

    def __len__(self):
        return len(self._it)

    def __getattr__(self, name):
        return getattr(self._it, name)


def _abandon(tb):
    """Stop the workers of the loader iterator whose start was stopped (found in the traceback:
    PyTorch's __init__ raised half-way), and mark it shut down so that its __del__ does not tear
    down what it never finished building."""
    while tb is not None:
        it = tb.tb_frame.f_locals.get('self')
        if compat.is_multiprocessing_iterator(it):
            compat.abandon_iterator(it)
            return
        tb = tb.tb_next


def loader_kwargs(args):
    kw = dict(num_workers=args.num_workers, pin_memory=args.pin_memory)
    if args.num_workers > 0:
        # torch refuses these without workers
        kw.update(persistent_workers=args.persistent_workers, prefetch_factor=args.prefetch_factor)
    return kw
