"""--stage-dir DIR: copy the shards to the node's local disk once per node, then read them there.

A cluster's shared file system serves a whole machine room; a node's local disk ($SLURM_TMPDIR on
Alliance Canada) serves one job. Alliance Canada's advice for a large dataset is to copy it there at
the start of the job as a few large files and read it locally; dlojz's shards (`dlojz_data.py
prepare`) are those files.

- One process per node copies (local rank 0); the node's other ranks wait for it (dist.launch.on_ranks), and a
  second job on the same node waits on a lock instead of copying the same files beside it.
- Each file is copied under a temporary name, fsynced, renamed, then entered in a journal with the
  source's size and mtime; the folder is complete once `.dlojz-staged.json` (written last) lists
  every file. A copy killed mid-way is never taken for a complete one: its next start keeps the
  journaled files and copies the rest. A requeued job whose node still holds the complete copy
  copies nothing; a file of the copy deleted or truncated since (its size no longer the one copied)
  is copied again. Bytes changed at the same size are not seen here (the decoder names that sample).
- The local disk's free space is checked before the first byte; a disk that fills during the copy gets the
  same sentence (DiskFull, exit 6) and the unfinished file is removed.
- Only shards are staged: an ImageFolder tree (a million small files) is what the advice says not to copy.
  With other data, --stage-dir is noted as not used and the data are read where they are.
"""
import fcntl
import hashlib
import json
import os
import shutil
import socket
import stat
import time

from dlojzlib import readers
from dlojzlib.data import shards
from dlojzlib.dist import launch
from dlojzlib.errors import DataError, DiskFull, NO_SPACE, UsageError, writable
from dlojzlib.files import write_atomic
from dlojzlib.readers import Dict, Int, List, Row, Str, Unreadable

DONE = '.dlojz-staged.json'      # written last: the copy is complete
JOURNAL = '.dlojz-staging.jsonl'  # one line per file copied whole
LOCK = '.lock'
# a file copied whole: [its name, the source's bytes and st_mtime_ns], a line of the journal
ENTRY = Row(shards.NAME, Int(0), Int())
MARKER = Dict({'source': Str(), 'files': List(ENTRY)})  # DONE: the source and all its files
CHUNK = 16 * 2**20               # bytes per read/write: large sequential I/O on both file systems
PROGRESS_S = 5.0                 # seconds between progress lines


def files_to_copy(src):
    """The shards folder's files a run reads -> [(name, bytes, mtime_ns)]: the index, the split
    tables and every shard (prepare's per-shard sidecars are not read by training). Names come
    from the checked index (plain names of the folder: the copy never writes outside its own)."""
    splits = shards.read_index(src)['splits']
    names = [shards.INDEX] + [f'index-{split}.npy' for split in ('train', 'val')] + \
        [s['name'] for split in ('train', 'val') for s in splits[split]['shards']]
    out = []
    for name in names:
        st = shards.stat_file(src, name)  # not a file: damaged (a FIFO would block the copy)
        if st is None:
            raise shards.incomplete(src, name)
        out.append((name, st.st_size, st.st_mtime_ns))
    return out


def destination(src, stage_dir):
    """The copy's folder under stage_dir: named after the source, so that two datasets never share
    one."""
    src = os.path.realpath(src)
    digest = hashlib.sha1(src.encode()).hexdigest()[:8]
    return os.path.join(stage_dir, f'dlojz-{os.path.basename(src)}-{digest}')


def _mb(n):
    return f'{n / 1e6:,.0f} MB' if n < 1e10 else f'{n / 1e9:,.1f} GB'


def stage(src, stage_dir, log=print, clock=time.monotonic, usage=shutil.disk_usage):
    """Copy the shards of src into stage_dir (see the module's docstring) -> the record for
    summary.json: {'dir', 'host', 'bytes' (of the dataset), 'copied_bytes', 'seconds', 'mb_per_s',
    'skipped'}."""
    writable(stage_dir, '--stage-dir',
             'pass a folder on the node\'s local disk that you can write, such as $SLURM_TMPDIR')
    dest = destination(src, stage_dir)
    os.makedirs(dest, exist_ok=True)
    files = files_to_copy(src)
    total = sum(size for _, size, _ in files)
    record = {'dir': dest, 'host': os.environ.get('SLURMD_NODENAME') or socket.gethostname(),
              'bytes': total,
              'copied_bytes': 0, 'seconds': 0.0, 'mb_per_s': None, 'skipped': True}
    _own(dest, LOCK)
    with open(os.path.join(dest, LOCK), 'a') as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another job on this node copying the same data: wait for it
        done = _read_marker(dest)
        changed = _changed(dest, files)
        if done == {'source': os.path.realpath(src), 'files': [list(f) for f in files]}:
            if not changed:
                log(f'Staging: {dest} already holds the {len(files)} files of {src} '
                    f'({_mb(total)}); nothing to copy')
                return record
            log(f'Staging: {len(changed)} file(s) of the copy in {dest} changed since it was made '
                f'({changed[0]} first: removed, or not the size copied); copying them again')
        kept = _journaled(dest, files)
        todo = [f for f in files if tuple(f) not in kept]
        need = sum(size for _, size, _ in todo)
        free = usage(stage_dir).free
        if need > free:
            raise DiskFull(f'--stage-dir {stage_dir} has {_mb(free)} free and the shards need '
                           f'{_mb(need)} more; pass a larger local disk (or ask Slurm for one), or '
                           f'leave --stage-dir out to read {src} in place.')
        if os.path.exists(os.path.join(dest, DONE)):
            os.remove(os.path.join(dest, DONE))  # about to change the folder: it is no longer a complete copy
        log(f'Staging: copying {len(todo)} files ({_mb(need)}) from {src} to {dest}' +
            (f'; {len(files) - len(todo)} kept from an earlier, unfinished copy' if kept else ''))
        t0 = last = clock()
        copied = 0
        try:
            with open(os.path.join(dest, JOURNAL), 'a') as journal:
                for name, size, mtime in todo:
                    try:
                        copied, last = _copy(os.path.join(src, name), os.path.join(dest, name),
                                             stage_dir, copied,
                                             need, t0, clock, log, last, usage)
                    except Unreadable as e:  # the source's file replaced since files_to_copy
                        raise shards.damaged(src, name, f'it {e.why}') from None
                    journal.write(json.dumps([name, size, mtime]) + '\n')
                    journal.flush()
                    os.fsync(journal.fileno())
            write_atomic(os.path.join(dest, DONE), json.dumps(  # atomic, as prepare's files
                {'source': os.path.realpath(src), 'files': [list(f) for f in files]}).encode())
        except OSError as e:  # the journal or the marker on a disk that just filled: the same sentence
            if e.errno not in NO_SPACE:
                raise
            raise _filled(stage_dir, copied, need, usage) from None
        seconds = clock() - t0
        rate = copied / seconds / 1e6 if seconds > 0 else None
        log(f'Staging: {_mb(copied)} copied in {seconds:.1f} s'
            + (f' ({rate:,.0f} MB/s)' if rate else ''))
        record.update(copied_bytes=copied, seconds=round(seconds, 3),
                      mb_per_s=rate and round(rate, 1),
                      skipped=False)
        return record


def _copy(src, dst, stage_dir, copied, need, t0, clock, log, last, usage):
    """One file, under a temporary name, fsynced then renamed -> (bytes copied so far, last progress
    time)."""
    tmp = dst + '.part'
    if os.path.lexists(tmp) and not os.path.isdir(tmp):
        os.remove(tmp)  # a killed copy's leftover (a FIFO there would block the open below)
    try:
        with readers.open_file(src) as fin, open(tmp, 'wb') as fout:
            while True:
                buf = fin.read(CHUNK)
                if not buf:
                    break
                fout.write(buf)
                copied += len(buf)
                now = clock()
                if now - last >= PROGRESS_S:
                    rate = copied / max(now - t0, 1e-9)
                    log(f'Staging: {_mb(copied)} of {_mb(need)}, {rate / 1e6:,.0f} MB/s, '
                        f'{(need - copied) / rate:.0f} s left')
                    last = now
            fout.flush()
            os.fsync(fout.fileno())
        os.replace(tmp, dst)
    except OSError as e:
        try:
            os.remove(tmp)  # the local disk is the job's: give its space back
        except OSError:
            pass
        if e.errno in NO_SPACE:
            raise _filled(stage_dir, copied, need, usage) from None
        raise
    return copied, last


def _filled(stage_dir, copied, need, usage):
    return DiskFull(f'--stage-dir {stage_dir} filled during the copy ({_mb(copied)} of {_mb(need)} '
                    f'copied, {_mb(usage(stage_dir).free)} free); pass a larger local disk (or ask '
                    f'Slurm for one), or leave --stage-dir out to read the shards in place.')


def _changed(dest, files):
    """The names of the files whose copy in dest is missing or not the size copied (a file deleted
    or truncated on the local disk since). What it cannot see: bytes changed at the same size (the
    decoder names that sample, or --skip-bad-images skips it)."""
    out = []
    for name, size, _ in files:
        try:
            st = os.stat(os.path.join(dest, name))
        except OSError:
            out.append(name)
            continue
        if not stat.S_ISREG(st.st_mode):
            _own(dest, name)  # a folder there could not be replaced by the copy
        if st.st_size != size:
            out.append(name)
    return out


def _journaled(dest, files):
    """The files an earlier copy finished: journaled with the source's size and mtime, and present
    at that size (a source prepared again, or a file removed since, is copied again). A line of
    another shape (cut by a kill, damaged) is left out: its file is copied again."""
    wanted = {tuple(f) for f in files}
    _own(dest, JOURNAL)
    try:
        entries, _ = readers.read_jsonl(os.path.join(dest, JOURNAL), ENTRY)
    except (FileNotFoundError, Unreadable):  # Unreadable: larger than any journal dlojz writes
        return set()
    kept = set()
    for entry in map(tuple, entries):
        path = os.path.join(dest, entry[0])
        if entry in wanted and os.path.isfile(path) and os.path.getsize(path) == entry[1]:
            kept.add(entry)
    return kept


def _read_marker(dest):
    """DONE's value; None if it is missing or damaged (then the journal says what is copied)."""
    _own(dest, DONE)
    try:
        return readers.read_json(os.path.join(dest, DONE), MARKER)
    except (FileNotFoundError, Unreadable):
        return None


def _own(dest, name):
    """Refuse, in one sentence, anything but a file at one of the copy's names: a FIFO would block
    its reader or writer for ever, a folder cannot be replaced by a file."""
    path = os.path.join(dest, name)
    try:
        readers.open_file(path).close()
    except (FileNotFoundError, PermissionError):
        return  # what follows opens it and says so
    except Unreadable as e:
        raise DataError(f'{e}: dlojz writes a file there, in its copy of the shards; remove it and '
                        f'start again.') from None


def staged_source(source, stage_dir, dist, on_ranks, log=print):
    """-> (the DataSource to read, the staging record or the reason it was not used). Every rank of
    a node reads the copy its local rank 0 made; that rank reports its node's progress (log: rank
    0's console)."""
    asked, stage_dir = stage_dir, os.path.expandvars(stage_dir)  # '$SLURM_TMPDIR': each node's own, read here
    if '$' in stage_dir:
        raise UsageError(f'--stage-dir {asked}: {stage_dir[stage_dir.index("$"):].split("/")[0]} '
                         f'is not set on {socket.gethostname()}; give a folder on the node\'s '
                         f'local disk, or leave --stage-dir out.')
    if source.kind != 'shards':
        where = f' ({source.root})' if source.root else ''
        why = (f'--stage-dir {stage_dir} not used: the data are {source.kind}{where}; only shards '
               '(`python dlojz_data.py prepare`) are copied to the local disk, and these are read '
               'where they are')
        log(f'Note: {why}.')
        return source, {'asked': asked, 'used': False, 'reason': why}
    real, root = os.path.realpath(stage_dir), os.path.realpath(source.root)
    if real == root or real.startswith(root + os.sep):
        where = 'is' if real == root else 'is inside'
        raise UsageError(f'--stage-dir {stage_dir} {where} the shards folder {source.root}; pass a '
                         f'folder on the node\'s local disk, such as $SLURM_TMPDIR.')
    say = log if dist.rank == 0 else (lambda m: print(f'[rank {dist.rank}] {m}', flush=True))
    record = on_ranks(lambda: stage(source.root, stage_dir, say), when=dist.local_rank == 0)
    nodes = [r for r in launch.all_gather_object(record) if r]  # one per node, its local rank 0's
    dest = destination(source.root, stage_dir)
    staged = type(source)('shards', dest, f'{source.reason}, staged to --stage-dir {stage_dir}')
    return staged, {'asked': asked, 'used': True, 'from': source.root, 'dir': dest,
                    'bytes': nodes[0]['bytes'],
                    'copied_bytes': sum(r['copied_bytes'] for r in nodes),
                    'seconds': max(r['seconds'] for r in nodes), 'nodes': nodes}
