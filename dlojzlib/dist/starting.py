"""A stop signal (SIGTERM, SIGUSR2) that comes while the command is starting ends it within
seconds, whatever call the start-up is blocked in.

Once steps run, the stop handler only sets a flag that the loop reads at step boundaries
(launch.StopSignal): a checkpoint needs a consistent state, and checkpointing inside a handler can
deadlock. Before the first step there is nothing to checkpoint, and a start-up can block in a call
for as long as the call takes: open() of a FIFO or of a hung file system, a lock, a peer. A handler
that returns lets Python retry the interrupted system call (PEP 475), so the flag alone let
`scancel` and Slurm's time limit wait for SIGKILL (issue 49: 764 s). So from dlojz.py's cli() to
the first step (arm, disarm) the handler raises Stopped, which no system call retries; cli() and
_main turn it into the stop's usual end (preempted(): status 'preempted', exit 5, or 0 once
SIGUSR2 has requeued the job). A run inside another program (main() called by a test or a
notebook) is never armed: its caller owns its signals.

Where raising is safe. A handler runs in the main thread between two bytecodes of the Python code
running there, and an exception raised in it leaves that code at that point. Library code that
holds a lock outside a `with` on a C lock (threading.Condition.__enter__, multiprocessing's
Queue.get between its acquire and its try, logging's handlers, the import system's module locks,
subprocess's waitpid lock, torch's loader iterator) would keep the lock, and the shutdown that
follows would wait for it forever: torch's DataLoader raises from its SIGCHLD handler, and so hung
2 runs of a test in 60, in a Queue.put whose lock an interrupted Condition.__enter__ had kept
(tests/test_preempt.py). The lock is held by the frame that took it, so the handler raises only
when the innermost Python frame is outside such modules (LOCKING), and no loader iterator is being
built further up the stack (BUILDING); otherwise it asks for SIGALRM 0.1 s later and decides again
then, so that a start-up that leaves the library and blocks in a call of its own still ends.
dlojz's own start-up takes no lock outside a `with` (its loader's signal mask, data.workers, is
under BUILDING). With peers, each rank ends where it is: one waiting in a collective for a rank
that has ended fails when the process group sees it gone (--dist-timeout at worst)."""
import os
import signal
import threading

from dlojzlib.errors import EARLY_SIGNALS, Preempted

STOPS = (signal.SIGUSR2, signal.SIGTERM)
LOCKING = ('threading', 'multiprocessing', 'queue', 'concurrent', 'logging', 'importlib',
           '_frozen_importlib', '_frozen_importlib_external', 'subprocess', 'asyncio',
           'torch.utils.data', 'torch.multiprocessing')
# Frames anywhere on the stack under which an exception would leave a loader iterator half built:
# torch's _MultiProcessingDataLoaderIter.__init__ does not stop the workers it started (data.workers
# abandons it for its own _StartStopped only, which the stop's flag raises at the next fork).
BUILDING = (('torch.utils.data.dataloader', '_MultiProcessingDataLoaderIter.__init__'),
            ('dlojzlib.data.workers', '_WorkerProcess.start'))
RETRY_S = 0.1


class Stopped(BaseException):
    """A stop signal during start-up. A BaseException: code that catches Exception (a checkpoint
    that cannot be read is skipped, torch's loader, launch.on_ranks) lets it through."""

    def __init__(self, name):
        super().__init__(name)
        self.signal = name


_armed = False
_pending = None  # the stop signal a frame in LOCKING deferred
_old_alarm = None  # SIGALRM's handler before a deferral


def record_early(signum, frame):
    """The stop handler before the run's own (StopSignal, which takes the names over)."""
    EARLY_SIGNALS.append(signal.Signals(signum).name)
    stop_if_starting(EARLY_SIGNALS[-1], frame)


def install_early():
    """dlojz.py's first lines: importing torch, scanning the data and building the model take
    seconds to minutes on a loaded node, and Slurm's warning (--signal=USR2@N) or a scancel may come
    then; the default action would end the job without a record (measured: exit 140 on a real
    Slurm)."""
    for s in STOPS:
        signal.signal(s, record_early)


def arm():
    """cli() has started: a stop from here ends the start-up; one that came while Python imported
    the modules (nothing could catch Stopped there) ends it now."""
    global _armed
    _armed = True
    if EARLY_SIGNALS:
        disarm()
        raise Stopped(EARLY_SIGNALS[-1])


def armed():
    return _armed


def _module(frame):
    return frame.f_globals.get('__name__', '')


def may_raise(frame):
    """Whether an exception raised in `frame` (a handler's) leaves no lock taken and no loader half
    built (above)."""
    if frame is None or any(_module(frame) == m or _module(frame).startswith(m + '.')
                            for m in LOCKING):
        return False
    while frame is not None:
        name = getattr(frame.f_code, 'co_qualname', frame.f_code.co_name)  # Python < 3.11: the name
        if any(_module(frame) == m and (name == f or f.endswith('.' + name)) for m, f in BUILDING):
            return False
        frame = frame.f_back
    return True


def stop_if_starting(name, frame):
    """Raise Stopped(name) while armed where may_raise(frame); else try again RETRY_S later."""
    global _pending, _old_alarm
    if not _armed:
        return
    if may_raise(frame):
        disarm()
        raise Stopped(name)
    _pending = name
    if _old_alarm is None:
        _old_alarm = signal.signal(signal.SIGALRM, _again)
    signal.setitimer(signal.ITIMER_REAL, RETRY_S)


def _again(signum, frame):
    stop_if_starting(_pending, frame)


def disarm():
    """The first step (or a mode's own work) begins: a stop is a flag again."""
    global _armed, _pending, _old_alarm
    _armed, _pending = False, None
    if _old_alarm is not None and threading.current_thread() is threading.main_thread():
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, _old_alarm)
        _old_alarm = None


def release():
    """--tune and --tune-loader (no StopSignal): back to the default actions, a stop signal that
    came during start-up delivered again."""
    disarm()
    if signal.getsignal(signal.SIGUSR2) is record_early:
        for s in STOPS:
            signal.signal(s, signal.SIG_DFL)
        if EARLY_SIGNALS:
            os.kill(os.getpid(), getattr(signal, EARLY_SIGNALS[-1]))


def preempted(e, args, dist, requeue, step=None):
    """Stopped -> the Preempted a stop ends a run with, in the words of record.state.preempt.
    step: where the run stands (None: not known yet, before a checkpoint is read). Nothing is
    checkpointed: no step ran, and a resumed run's checkpoint stays. On SIGUSR2 with --requeue rank
    0 requeues the SLURM job (requeue: launch.requeue, which imports this module), without a
    collective (the ranks may stop at different points)."""
    if args.loader_only:  # nothing to resume or requeue
        return Preempted(f'stopped by {e.signal} before the loader was measured to its end; run it '
                         f'again.', checkpoint=None)
    requeued, detail = False, '--no-requeue'
    if args.requeue:
        requeued, detail = requeue(dist, e.signal) if dist.is_main else \
            (False, 'rank 0 asks for it')
    if step is None and args.resume:
        where = 'during start-up; no checkpoint (no step had run; those of --resume are kept)'
    else:
        where = f'at step {step or 0}; ' + ('no checkpoint (no step had run)' if not step else
                                           'no checkpoint (no step had run since its own)')
    return Preempted(f'stopped by {e.signal} {where}. ' + (
        'The SLURM job was requeued and will start again (--resume auto).' if requeued else
        f'Not requeued ({detail}); ' + (
            'run it again.' if not (args.run_name or args.output_dir) else
            f'resubmit with the same flags to continue it (run name {args.run_name}).'
            if args.run_name and args.resume == 'auto' else
            f'continue with --resume auto --run-name {args.run_name}.' if args.run_name
            else f'continue with --resume auto --output-dir {args.output_dir}.')),
        requeued=requeued, checkpoint=None)
