"""Checkpoint files: their names, atomic save (temp file, fsync, rename) and pruning, load, the
newest readable one, the partial files a kill leaves, and the free space the next one needs. What a
checkpoint holds, and restoring it, are record.state's."""
import os
import re
import signal
import tempfile
import threading
from contextlib import contextmanager

import torch

from dlojzlib import failpoints, files
from dlojzlib.errors import UsageError, disk_full
from dlojzlib.record import log


CHECKPOINT_RE = re.compile(r'checkpoint-(\d+)\.pt$')


def checkpoint_path(run_dir, global_step):
    return os.path.join(run_dir, f'checkpoint-{global_step:08d}.pt')


def list_checkpoints(run_dir):
    """Complete checkpoints of a run directory (temp files excluded), oldest first."""
    try:
        names = os.listdir(run_dir)
    except OSError:
        return []
    found = sorted((int(m.group(1)), n) for n in names if (m := CHECKPOINT_RE.fullmatch(n)))
    return [os.path.join(run_dir, n) for _, n in found]


PARTIAL_RE = re.compile(r'\.checkpoint-\w+\.tmp$')  # save_checkpoint's temporary files


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
            size += os.path.getsize(os.path.join(path, n))
            os.remove(os.path.join(path, n))
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
    neither the disk nor the file."""

    def __init__(self, f):
        self.f, self.error = f, None

    def write(self, b):
        try:
            return self.f.write(b)
        except OSError as e:
            self.error = e
            raise

    def flush(self):
        return self.f.flush()


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
        for old in list_checkpoints(os.path.dirname(path) or '.')[:-keep]:
            os.remove(old)


def space_warning(folder, usage=None):
    """A sentence when the folder may not hold the next checkpoint: less free space than twice the
    size of its newest one (this write and the next); None otherwise or when there is no checkpoint
    yet."""
    found = list_checkpoints(folder)
    if not found:
        return None
    try:
        size, free = os.path.getsize(found[-1]), (usage or log.disk_usage)(folder).free
    except OSError:
        return None
    if free >= 2 * size:
        return None
    return (f'{folder} has {free / 2**20:.0f} MiB free and a checkpoint takes '
            f'{size / 2**20:.0f} MiB: '
            f'{"the next checkpoint will not fit" if free < size else "room for one more checkpoint only"}; '
            f'free some space or lower --keep-checkpoints.')


def load_checkpoint(path):
    if os.path.isdir(path):
        raise UsageError(f'--resume {path} is a folder, not a checkpoint file; pass a '
                         f'checkpoint-*.pt file, or --resume auto --output-dir {path} to continue '
                         f'the run it holds.')
    if not os.path.isfile(path):
        raise UsageError(f'checkpoint {path} does not exist; pass --resume with the path of a '
                         f'checkpoint-*.pt written by --chkpt, or --resume auto.')
    try:
        # weights_only=False: the checkpoint holds our own args namespace and RNG states, written by
        # us.
        return torch.load(path, map_location='cpu', weights_only=False)
    except Exception as e:
        raise UsageError(f'checkpoint {path} cannot be read ({type(e).__name__}); it may be '
                         f'truncated, resume from another checkpoint.') from None


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
