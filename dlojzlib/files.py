"""Files written whole or not at all, by one writer: a temporary name in the same folder, fsynced,
then renamed over the file (os.replace is atomic on POSIX: a reader sees the old file or the new
one, never half of one). The run's JSON records, checkpoints (torch.save into the temporary file,
then fsync_replace), the run folder's marker, shards and their index, the stage's completion marker.
"""
import os

from dlojzlib.errors import NO_SPACE


def fsync_replace(tmp, path):
    """Flush `tmp` to the disk, then rename it to `path`."""
    with open(tmp, 'rb+') as f:
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_atomic(path, data, opener=None, full=None):
    """Write `data` (bytes or str) to `path` atomically. A failed write (a full disk, an interrupt)
    leaves the previous file, if any, and no temporary file. On a full disk (ENOSPC, EDQUOT) raise
    full(path), the caller's one sentence, when given. opener: what opens the temporary file (the
    full-disk tests' seam, record.log.open_for_write); the built-in open by default."""
    tmp = f'{path}.tmp'
    try:
        # a leftover of a killed writer; one that is a FIFO would block the open for writing until a
        # reader came
        os.remove(tmp)
    except FileNotFoundError:
        pass
    try:
        with (opener or open)(tmp, 'wb' if isinstance(data, bytes) else 'w') as f:
            f.write(data)
        fsync_replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        if full is not None and isinstance(e, OSError) and e.errno in NO_SPACE:
            raise full(path) from None
        raise
