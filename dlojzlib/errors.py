"""How a dlojz run ends when it does not complete: one family of exceptions, each carrying the
status that summary.json records and the exit code, and one function (`translate`) that turns the
outside world's exceptions (out of memory, torch.compile, DDP's reducer, a dead peer, a DataLoader
worker's error, Ctrl-C) into them. Anything it does not recognise is a bug: status 'crashed',
traceback kept.

    status        exit  when
    failed          2   a user error: bad flags, data, checkpoint, compile, unused parameters
    oom             2   CUDA out of memory
    nan             3   the loss became NaN or infinite
    failed          4   another rank died or stopped answering
    preempted     5 / 0 SIGUSR2/SIGTERM: checkpoint written (0 when SLURM requeued the job)
    completed       0   --resume on a completed run that the command would not train further: nothing written
    interrupted   130   Ctrl-C
    disk_full       6   no space left (or quota exceeded) where a checkpoint, summary.json, metrics.jsonl or
                        config.json was being written; earlier checkpoints are kept, continue with --resume
                        auto once there is room
    crashed         1   anything else (a bug: the traceback is printed)
"""
import errno
import os
import re
import shutil
import socket
import sys
import tempfile


class DlojzError(Exception):
    """An end of run that is not a crash. The message is one sentence for the user; `extra` goes
    into summary.json (failed_step, checkpoint, ...)."""
    status = 'failed'
    exit_code = 2
    label = 'error'  # stderr line: 'dlojz: error: <message>'; None: 'dlojz: <message>'

    def __init__(self, msg='', **extra):  # one positional argument: DataLoader workers re-raise as cls(msg)
        super().__init__(msg)
        self.extra = extra


class UsageError(DlojzError):
    """A user error: what is wrong and what to do."""


class DataError(DlojzError):
    """A problem with the user's data (missing folder, undecodable image)."""


class OutOfMemory(DlojzError):
    status = 'oom'


class NonFiniteLoss(DlojzError):
    status, exit_code = 'nan', 3

    def __init__(self, step):
        super().__init__(f'the loss became NaN or infinite at step {step}; training stopped there '
                         f'and no checkpoint was written after it; lower --lr, use --amp bf16/off, '
                         f'or check the data.',
                         failed_step=step)


class NonFiniteValidation(NonFiniteLoss):
    """The validation loss is NaN or infinite while training's was finite (weights or BatchNorm
    statistics gone non-finite): the same status and exit code as a training NaN, never 'completed'.
    """

    def __init__(self, epoch, step):
        DlojzError.__init__(
            self, f'the validation loss of epoch {epoch} (after step {step}) is NaN or infinite '
            f'although the training loss was finite: the weights or the BatchNorm statistics hold '
            f'non-finite values; the run stopped before the checkpoint that closes the epoch; '
            f'resume from an earlier checkpoint with a lower --lr or --amp bf16/off, or check the '
            f'data.', failed_step=step)


class CommFailure(DlojzError):
    exit_code = 4


class Preempted(DlojzError):
    """Stopped by SIGUSR2/SIGTERM at a step boundary, after writing a checkpoint (training) or
    keeping the curve so far (--findlr). Exit 0 when SLURM requeued the job: the job is not over."""
    status, label = 'preempted', None

    def __init__(self, msg, requeued=False, **extra):
        super().__init__(msg, requeued=requeued, **extra)
        self.exit_code = 0 if requeued else 5


class DiskFull(DlojzError):
    """A write failed for want of space (ENOSPC) or quota (EDQUOT). Its own status and exit code:
    not the user's flags (2) nor a bug (1), and a job script may free space and resubmit."""
    status, exit_code = 'disk_full', 6


# Stop signals received before the run's own handler exists (dlojz.py records them; the run's
# handler takes them over): a stop during start-up, the synthetic dataset's generation included, is
# honoured.
EARLY_SIGNALS = []

NO_SPACE = (errno.ENOSPC, errno.EDQUOT)  # no space left, disk quota exceeded


RESUME_AFTER_FULL = ('earlier checkpoints are kept: free some space (or choose another '
                     '--output-dir) and continue with --resume auto.')


def disk_full(path, usage=None, then=RESUME_AFTER_FULL):
    """The DiskFull for a failed write to `path`: where, how much room is left there (MiB), and what
    to do (`then`: a training run's by default)."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        free = f'{(usage or shutil.disk_usage)(folder).free / 2**20:.0f} MiB free'
    except OSError:
        free = 'free space unknown'
    return DiskFull(f'no space left on {folder} ({free}) while writing {os.path.basename(path)}; '
                    f'{then}', disk_full_path=path)


class Complete(DlojzError):
    """The run in the folder is complete and the command asks nothing more of it (a resubmitted
    job): one line, exit 0, nothing written."""
    status, exit_code, label = 'completed', 0, None


class Interrupted(DlojzError, KeyboardInterrupt):
    """Ctrl-C (or a time limit's SIGINT), with the run's record written. A KeyboardInterrupt as
    well, so that whoever called the run in its own process (pytest, a notebook, a sweep script)
    stops as Ctrl-C asked, instead of taking it for an ordinary failure and going on."""
    status, exit_code, label = 'interrupted', 130, None


def writable(folder, name, fix):
    """Create `folder` if needed and check that a file can be written in it, before any work starts:
    one sentence otherwise ('cannot write to <name> <folder> (<why>); <fix>.')."""
    try:
        os.makedirs(folder, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=folder, prefix='.write-test-')
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise UsageError(f'cannot write to {name} {folder} ({e.strerror}); {fix}.') from None
    return folder


# A host allocation that failed: Python's, torch's CPU allocator (also as re-raised from a loader
# worker), or a worker ended by SIGKILL, which on a node without other killers is the kernel's OOM
# killer.
HOST_OOM_PATTERNS = ("defaultcpuallocator: can't allocate memory", 'cannot allocate memory',
                     'is killed by signal: killed')


def is_host_oom(exc):
    return isinstance(exc, MemoryError) or (isinstance(exc, OSError) and exc.errno == errno.ENOMEM) or \
        (isinstance(exc, RuntimeError) and any(p in str(exc).lower() for p in HOST_OOM_PATTERNS))


def first_line(e):
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:300]


# Messages of a collective that lost its peer, lower case (gloo's strings are read from
# libtorch_cpu.so's gloo/transport/tcp; a hung peer in the middle of DDP's backward gives
# "Application timeout caused pair closure", not "Timed out waiting"). Gloo raises them as plain
# RuntimeErrors, some through autograd's engine.
COMM_FAILURE_PATTERNS = ('connection reset by peer', 'connection closed by peer', 'timed out waiting',
                         'application timeout caused pair closure', 'socket timeout',
                         'connect timeout', 'broken pipe', 'nccl communicator was aborted',
                         'watchdog caught collective', 'distbackenderror', 'processgroupnccl',
                         'processgroupgloo', 'gloo/transport')


def is_comm_failure(exc):
    """A collective that failed because another rank died or hung (gloo raises a plain
    RuntimeError)."""
    import torch.distributed as tdist
    if isinstance(exc, getattr(tdist, 'DistError', ())):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(p in text for p in COMM_FAILURE_PATTERNS)


def loader_error_message(exc):
    """The user sentence from an exception that may have crossed a DataLoader worker boundary (the
    worker's traceback is in the message; its last line is the original exception)."""
    text = str(exc).strip().splitlines()
    last = text[-1] if text else ''
    # the class as the traceback names it, with or without its module's path (which moves with the
    # code)
    return _DATA_ERROR_PREFIX.sub('', last, count=1)


_DATA_ERROR_PREFIX = re.compile(r'^(?:[\w.]+\.)?(?:BadImageError|DataError): ')


def translate(e, args, rank=0, distributed=False, step=0):
    """The DlojzError that `e`, raised while running step `step` (1-based), stands for; None for a
    crash. Facts come in as arguments so that every row of the table above is tested without a GPU
    or a peer."""
    import torch
    failed = {'failed_step': step}
    if isinstance(e, DlojzError):
        if isinstance(e, DataError):  # from a worker: keep the sentence, drop the worker's traceback
            return DataError(loader_error_message(e), **{**failed, **e.extra})
        if not isinstance(e, (NonFiniteLoss, Preempted)):
            e.extra = {**failed, **e.extra}
        return e
    if isinstance(e, OSError) and e.errno in NO_SPACE:  # a write site not wrapped (a profiler trace)
        d = disk_full(e.filename or '.')
        d.extra.update(failed)
        return d
    if isinstance(e, KeyboardInterrupt):
        return Interrupted('interrupted', **failed)
    if isinstance(e, torch.OutOfMemoryError):
        return OutOfMemory(f'out of memory at step {step} with batch size {args.batch_size}; lower '
                           f'-b, or use --amp bf16/--grad-checkpointing.', **failed)
    if is_host_oom(e):  # a uint8 image is 3 bytes per pixel, 12 as the float32 the model takes
        batch = args.batch_size * 3 * args.image_size ** 2 / 2**30
        tried = re.search(r'tried to allocate (\d+) bytes', str(e))  # torch's CPU allocator says how much
        why = f'an allocation of {int(tried.group(1)) / 2**30:.3g} GiB failed' if tried else \
            next((line.strip() for line in str(e).splitlines()  # a worker's error: the line that says it
                  if any(p in line.lower() for p in HOST_OOM_PATTERNS)), first_line(e))
        return OutOfMemory(f'the host ran out of memory at step {step} ({why[:120]}); a batch of '
                           f'-b {args.batch_size} images at --image-size {args.image_size} is '
                           f'{batch:.2g} GiB as uint8 and 4x that as float32, and each loader '
                           f'worker holds --prefetch-factor batches: lower -b, --image-size or '
                           f'--num-workers.', **failed)
    if args.compile and type(e).__module__.startswith(('torch._dynamo', 'torch._inductor')):
        return UsageError(f'torch.compile failed ({type(e).__name__}: {first_line(e)[:200]}); '
                          f'rerun with --no-compile or another --compile-mode.', **failed)
    if isinstance(e, RuntimeError) and 'find_unused_parameters' in str(e):  # DDP's reducer error
        return UsageError(f'--arch {args.arch} leaves some parameters without a gradient in a step '
                          f'(e.g. the classifier heads not chosen) and DDP cannot finish its '
                          f'gradient all-reduce; rerun with --find-unused-parameters.', **failed)
    if distributed and is_comm_failure(e):
        timeout = f'{args.dist_timeout:g} min' if args.dist_timeout else "PyTorch's default timeout"
        return CommFailure(f'a collective failed on rank {rank} at step {step}: another rank died '
                           f'or stopped answering ({first_line(e)[:160]}); look for the first '
                           f'error in the other ranks\' output (waits are bounded by '
                           f'--dist-timeout, now {timeout}).', **failed)
    return None


def report_error(e, dist):
    """Every rank that fails says why on its own stderr, tagged with its rank and host when there
    are several: before the process group exists as after (a rank that cannot reach rank 0, a bad
    image, an OOM, a dead peer), since in a 32-rank job the one rank that failed is the one whose
    log matters. A stop (preempted, interrupted, complete) is not an error: rank 0 says it."""
    if e.label is None:
        if dist is None or dist.is_main:
            print(f'dlojz: {e}', file=sys.stderr, flush=True)
        return
    several = dist is not None and dist.world_size > 1
    tag = f'[rank {dist.rank} on {socket.gethostname()}] ' if several else ''
    print(f'dlojz: {e.label}: {tag}{e}', file=sys.stderr, flush=True)
