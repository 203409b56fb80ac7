"""Checkpoint files: their names, atomic save (temp file, fsync, rename) and pruning, load, the
newest readable one, the partial files a kill leaves, and the free space the next one needs. What a
checkpoint holds, and restoring it, are record.state's.

A checkpoint is one torch.save file, checkpoint-<step>.pt, or, where FSDP2 slices the model
(--shard gradients, full), a torch.distributed.checkpoint folder, checkpoint-<step>.dcp: each rank
writes its own slices, no rank gathers the model."""
import io
import logging
import os
import re
import shutil
import signal
import tempfile
import threading
from contextlib import contextmanager

import torch

from dlojzlib import compat, failpoints, files, readers
from dlojzlib.errors import UsageError, disk_full
from dlojzlib.record import log


CHECKPOINT_RE = re.compile(r'checkpoint-(\d+)\.(?:pt|dcp)$')
SHARDED = '.dcp'  # a torch.distributed.checkpoint folder's suffix


def checkpoint_path(run_dir, global_step, sharded=False):
    return os.path.join(run_dir, f'checkpoint-{global_step:08d}{SHARDED if sharded else ".pt"}')


def is_sharded_checkpoint(path):
    return str(path).rstrip('/').endswith(SHARDED)


def remove(path):
    """Delete a checkpoint, a file or a folder."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.remove(path)


def size_of(path):
    """A checkpoint's bytes: the file's, or every file's of the folder."""
    if not os.path.isdir(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(path) for n in names)


def list_checkpoints(run_dir):
    """Complete checkpoints of a run directory (temp files excluded), oldest first."""
    try:
        names = os.listdir(run_dir)
    except OSError:
        return []
    found = sorted((int(m.group(1)), n) for n in names if (m := CHECKPOINT_RE.fullmatch(n)))
    return [os.path.join(run_dir, n) for _, n in found]


PARTIAL_RE = re.compile(r'\.checkpoint-\w+\.tmp$')  # the saves' temporary files and folders


def remove_partial_checkpoints(path, say=print):
    """Delete the temporary files of checkpoint writes that a kill interrupted (up to a checkpoint's
    size each). Called by the folder's owner only (FolderLock): no other process is writing one."""
    try:
        names = [n for n in os.listdir(path) if PARTIAL_RE.fullmatch(n)]
    except OSError:
        return
    size = 0
    for n in names:
        try:
            size += size_of(os.path.join(path, n))
            remove(os.path.join(path, n))
        except OSError:
            pass
    if names:
        say(f'Removed {len(names)} partial checkpoint file(s) ({size / 2**20:.1f} MiB) left in '
            f'{path} by an interrupted checkpoint write')


@contextmanager
def deferred_sigchld():
    """PyTorch's DataLoader raises from its SIGCHLD handler when a worker dies: in the middle of a
    checkpoint write that would lose the checkpoint a stopping job exists to write. The handler's
    call is held back until the block ends (main thread only: Python runs signal handlers there)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old, seen = signal.getsignal(signal.SIGCHLD), []
    signal.signal(signal.SIGCHLD, lambda signum, frame: seen.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGCHLD, old)
        if seen and callable(old):
            old(signal.SIGCHLD, seen[0])


def save_checkpoint(path, state, keep=None):
    """Write a checkpoint atomically (temp file in the same folder, fsync, rename), then keep only
    the newest `keep` checkpoints of the folder. A crash at any point leaves the previous ones
    intact; a loader worker dying meanwhile is reported once the file is in place."""
    with deferred_sigchld():
        _save_checkpoint(path, state, keep)


class _Writes:
    """A file for torch.save that remembers the OSError a write raised: torch's zip writer replaces
    it with 'RuntimeError: [enforce fail at inline_container.cc] unexpected pos', which names
    neither the disk nor the file. errors: a list that collects it too."""

    def __init__(self, f, errors=None):
        self.f, self.error, self.errors = f, None, errors

    def write(self, b):
        try:
            return self.f.write(b)
        except OSError as e:
            self.error = e
            if self.errors is not None:
                self.errors.append(e)
            raise

    def flush(self):
        return self.f.flush()

    def __getattr__(self, name):  # tell, fileno, close: what DCP's writer asks of its files
        return getattr(self.f, name)


def _save_checkpoint(path, state, keep):
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or '.', prefix='.checkpoint-',
                               suffix='.tmp')
    os.close(fd)
    writes = None
    try:
        with log.open_for_write(tmp, 'wb') as f:
            failpoints.checkpoint_write(f, state)
            writes = _Writes(f)
            torch.save(state, writes)
        files.fsync_replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        if log.no_space(e) or (writes is not None and log.no_space(writes.error)):
            raise disk_full(path, log.disk_usage) from None
        if isinstance(e, RuntimeError) and isinstance(e.__context__, KeyboardInterrupt):
            # Ctrl-C inside torch.save: its zip writer's close raised 'unexpected pos' over it
            raise e.__context__ from None
        raise
    if keep:
        prune(os.path.dirname(path) or '.', keep)


def prune(folder, keep):
    for old in list_checkpoints(folder)[:-keep]:
        remove(old)


def space_warning(folder, usage=None):
    """A sentence when the folder may not hold the next checkpoint: less free space than twice the
    size of its newest one (this write and the next); None otherwise or when there is no checkpoint
    yet."""
    found = list_checkpoints(folder)
    if not found:
        return None
    try:
        size, free = size_of(found[-1]), (usage or log.disk_usage)(folder).free
    except OSError:
        return None
    if free >= 2 * size:
        return None
    return (f'{folder} has {free / 2**20:.0f} MiB free and a checkpoint takes '
            f'{size / 2**20:.0f} MiB: '
            f'{"the next checkpoint will not fit" if free < size else "room for one more checkpoint only"}; '
            f'free some space or lower --keep-checkpoints.')


def load_checkpoint(path, given='--resume'):
    """The checkpoint at `path`, or one sentence. given: how the user named it (dlojz.py's --resume,
    dlojz_export.py's CHECKPOINT), so that the sentence names what the user typed."""
    resume = given == '--resume'
    instead = ('pass a checkpoint-*.pt written by --chkpt, or --resume auto' if resume else
               'give a checkpoint-*.pt or checkpoint-*.dcp written by dlojz.py --chkpt')
    if os.path.isdir(path) and is_sharded_checkpoint(path):
        return load_sharded_checkpoint(path)
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.basename(path) == '.metadata' and is_sharded_checkpoint(parent):
        raise UsageError(f'{given} {path} is the metadata file of the sharded checkpoint {parent}; '
                         f'pass the folder {parent} itself.')
    if os.path.isdir(path):
        auto = f', or --resume auto --output-dir {path} to continue the run it holds' if resume \
            else ''
        raise UsageError(f'{given} {path} is a folder, not a checkpoint file; pass a '
                         f'checkpoint-*.pt file (or a checkpoint-*.dcp folder){auto}.')
    if not os.path.exists(path):
        raise UsageError(f'checkpoint {path} does not exist; {instead}.')
    try:  # torch.load would block on a FIFO: only a regular file is read, the one checked
        f = readers.open_file(path)
    except (readers.Unreadable, OSError) as e:
        why = e.why if isinstance(e, readers.Unreadable) else e.strerror
        raise UsageError(f'checkpoint {path} {why}; {instead}.') from None
    try:
        with f:
            # weights_only=False: the checkpoint holds our own args namespace and RNG states,
            # written by us.
            return torch.load(f, map_location='cpu', weights_only=False)
    except Exception as e:
        then = 'resume from another checkpoint' if resume else 'give another checkpoint'
        raise UsageError(f'checkpoint {path} cannot be read ({type(e).__name__}); it may be '
                         f'truncated, {then}.') from None


def load_latest_checkpoint(run_dir, warn=print):
    """--resume auto: the newest checkpoint of run_dir that loads; an unreadable one (truncated by a
    crash) is skipped with a warning. -> (path, state), or (None, None) when there is none."""
    for path in reversed(list_checkpoints(run_dir)):
        try:
            return path, load_checkpoint(path)
        except UsageError as e:
            warn(f'dlojz: warning: {e} Trying the previous one.')
    return None, None


def strip_prefixes(state_dict):
    """Remove the '_orig_mod.' (torch.compile) and 'module.' (DDP) prefixes."""
    out = {}
    for k, v in state_dict.items():
        for prefix in ('_orig_mod.', 'module.'):
            if k.startswith(prefix):
                k = k[len(prefix):]
        out[k] = v
    return out


# ------------------------------------------------------------------ sharded: a folder of slices

def save_sharded_checkpoint(path, slices, rest, keep=None, is_main=True):
    """Every rank calls it. torch.distributed.checkpoint writes each rank's slices of `slices`
    (model and optimizer state dicts whose parameters are DTensors) into one folder, in parallel, on
    the run folder's shared file system. `rest` (rank 0's: the position, the RNG states, the
    arguments) goes in as one entry, its torch.save bytes in a uint8 tensor: the folder alone is the
    checkpoint, and the one file torch's dcp_to_torch_save makes of it loads with torch.load's
    default weights_only=True (a bytes object would need weights_only=False).

    Atomic as save_checkpoint: written under a temporary name, renamed by rank 0 once dcp.save has
    returned (its coordinator writes the metadata after every rank's files), then pruned to the
    newest `keep`; best.dcp's replacement takes two renames (a crash between them loses the previous
    best). A full disk on any rank is DiskFull's sentence on every rank."""
    import torch.distributed.checkpoint as dcp

    from dlojzlib.dist import launch
    folder = os.path.dirname(path) or '.'
    # .checkpoint-00000008_dcp.tmp, .checkpoint-best_dcp.tmp: PARTIAL_RE's, for a killed run's
    stem = re.sub(r'\W', '_', os.path.basename(path).removeprefix('checkpoint-'))
    tmp = os.path.join(folder, f'.checkpoint-{stem}.tmp')

    def prepare():  # rank 0's alone: a failure here is every rank's (on_ranks), before DCP waits
        shutil.rmtree(tmp, ignore_errors=True)  # a killed attempt's: its files would mix in
        buffer = io.BytesIO()
        torch.save(rest, buffer)
        return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
    blob = launch.on_ranks(prepare, when=is_main)
    state = dict(slices, **({'dlojz': blob} if is_main else {}))
    try:
        with deferred_sigchld():
            dcp.save(state, storage_writer=_dcp_writer(dcp, tmp))
    except BaseException as e:
        if is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise _one_failure(e, path) from None
    launch.on_ranks(lambda: _publish(tmp, path, keep), when=is_main)


def _dcp_writer(dcp, path):
    """DCP's FileSystemWriter, its files' write errors collected: DCP writes each tensor with
    torch.save, whose zip writer replaces an OSError (a full disk) with 'unexpected pos' (_Writes),
    and hands that to every rank. Its write_data raises the OSError itself instead, so that every
    rank's DiskFull names the disk."""
    class Writer(dcp.FileSystemWriter):
        def __init__(self, path):
            super().__init__(path)
            self.fs = _RecordingFileSystem(self.fs, [])

        def write_data(self, plan, planner):
            try:
                written = super().write_data(plan, planner)
                written.wait()
                return written
            except BaseException:
                full = next((e for e in self.fs.errors if log.no_space(e)), None)
                if full is not None:
                    raise full from None
                raise
    return Writer(path)


class _RecordingFileSystem:
    """A DCP file system whose streams for writing are _Writes, collecting into `errors`."""

    def __init__(self, fs, errors):
        self.fs, self.errors = fs, errors

    def __getattr__(self, name):
        return getattr(self.fs, name)

    @contextmanager
    def create_stream(self, path, mode):
        with self.fs.create_stream(path, mode) as stream:
            yield _Writes(stream, self.errors) if 'w' in mode else stream


def _failures(e):
    """The exceptions of DCP's CheckpointException (each rank's, on every rank), or [e]."""
    found = [f[0] if isinstance(f, tuple) else f for f in getattr(e, 'failures', {}).values()]
    return [f for f in found if isinstance(f, BaseException)] or [e]


def _interrupt(e):
    """A Ctrl-C or an exit inside DCP, which wraps it in a CheckpointException: that, or None."""
    return next((f for f in _failures(e) if isinstance(f, (KeyboardInterrupt, SystemExit))), None)


def _one_failure(e, path):
    """DCP's CheckpointException (every rank's failures, raised on every rank; a BaseException) as
    one error: an interrupt as itself, DiskFull when a rank's disk was full, else the first rank's
    own."""
    failures, stop = _failures(e), _interrupt(e)
    if stop is not None:
        return stop
    if any(log.no_space(f) for f in failures + [e]):
        return disk_full(path, log.disk_usage)
    return failures[0]


def _publish(tmp, path, keep):
    """The written folder under its name; best.dcp replaces the previous best, which is set aside
    under a temporary name first (a folder cannot be renamed over a folder that holds files)."""
    aside = None
    if os.path.exists(path):
        aside = f'{tmp[:-len(".tmp")]}_old.tmp'
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(path, aside)
    os.rename(tmp, path)  # DCP's writer has fsynced each file (sync_files)
    if aside:
        shutil.rmtree(aside, ignore_errors=True)
    if keep:
        prune(os.path.dirname(path) or '.', keep)


def load_sharded_checkpoint(path):
    """A checkpoint-<step>.dcp folder, whatever world size and mode wrote it, as the one-file
    checkpoint's dict: whole tensors (every slice read), the optimizer's state by parameter index.
    """
    from torch.distributed.checkpoint import CheckpointException  # a BaseException
    _regular_files_only(path)
    try:
        with _quiet_logging():
            read = compat.load_whole_dcp(path)
        rest = io.BytesIO(read.pop('dlojz').numpy().tobytes())
        # weights_only=False: our own arguments and RNG states, written by us
        state = torch.load(rest, map_location='cpu', weights_only=False)
        return {**state, 'model': read.get('model'), 'optimizer': by_index(read.get('optimizer'))}
    except (Exception, CheckpointException) as e:
        if _interrupt(e) is not None:  # Ctrl-C while it read: not a damaged checkpoint
            raise _interrupt(e) from None
        raise UsageError(f'checkpoint {path} cannot be read ({type(e).__name__}); it may be '
                         f'incomplete, resume from another checkpoint.') from None


def _regular_files_only(path):
    """Refuse a .dcp folder that holds anything but files (DCP's reader would block on a FIFO)
    or a sub-folder (dcp.save writes none)."""
    try:
        names = sorted(os.listdir(path))
        for name in names:
            readers.open_file(os.path.join(path, name)).close()
    except (readers.Unreadable, OSError) as e:
        why = f'{name} {e.why}' if isinstance(e, readers.Unreadable) else e.strerror
        raise UsageError(f'checkpoint {path} cannot be read ({why}); it may be incomplete, '
                         f'resume from another checkpoint.') from None


@contextmanager
def _quiet_logging():
    """DCP logs a missing file's traceback on the root logger (WARNING) before it raises; what it
    raises is told the user, in one sentence."""
    old = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        yield
    finally:
        logging.disable(old)


def by_index(optimizer):
    """An optimizer state dict keyed by parameter name (DCP's) in torch's one-process form: each
    parameter by its place in the groups, in order."""
    # a pipeline's is by stage (dist.pipeline)
    if optimizer is None or 'param_groups' not in optimizer:
        return optimizer
    names = [n for g in optimizer['param_groups'] for n in g['params']]
    index = {n: i for i, n in enumerate(names)}
    # no state at all (SGD without momentum keeps none): DCP saves leaves only, and no 'state' comes
    return {'state': {index[n]: s for n, s in optimizer.get('state', {}).items()},
            'param_groups': [{**g, 'params': [index[n] for n in g['params']]}
                             for g in optimizer['param_groups']]}
