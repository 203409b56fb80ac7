"""The run folder: its name (--output-dir, --run-name, the default), one owner at a time
(FolderLock: flock, or an O_EXCL claim where the file system has none), what a fresh, continued or
replaced run finds in it, and metrics.jsonl cut back to a resumed checkpoint."""
import datetime
import errno
import fcntl
import json
import os
import shutil
import socket
import subprocess
import time
from contextlib import contextmanager

from dlojzlib import failpoints, files, formats, readers
from dlojzlib.dist import launch
from dlojzlib.errors import Complete, UsageError, disk_full, writable
from dlojzlib.readers import Dict, Either, Int, Maybe, Str, Unreadable, fields
from dlojzlib.record.checkpoint import CHECKPOINT_RE, remove, remove_partial_checkpoints
from dlojzlib.record.log import write_json


def default_output_dir(args, dist):
    if args.run_name:
        return named_run_dir(args.run_name, continues=bool(args.resume), job_id=dist.job_id)
    tag = dist.job_id or datetime.datetime.now().strftime('%Y%m%d-%H%M%S')
    # the loader modes build no model: their folders are named after what they measure, not after
    # --arch
    what = 'loader' if args.loader_only else 'tune-loader' if args.tune_loader else \
        args.arch.replace(':', '-')  # timm:vit_base_patch16_224: no ':' in a folder name (PATHs)
    return os.path.join('runs', f'{tag}_{what}_bs{args.batch_size}')


# A run that ended this way is over: continuing it would only repeat its end (an OOM, a NaN).
# 'failed' is not among them: a dead peer (exit 4) is worth continuing, and a refused flag is
# refused again with its sentence; nor is 'completed': a completed run is resubmitted into its own
# folder, which says it is complete (Complete) or trains it further (a larger -e).
FINISHED = ('nan', 'oom')


def not_a_record(e):
    """A FIFO, a folder or a device where dlojz keeps a run's record (or a file larger than it
    writes): no run leaves one, and reading it could block."""
    return UsageError(f'{e}: it is not the record dlojz writes there; remove it (or move it '
                      f'aside), or pass another --output-dir.')


def read_record(path, shape, say=None):
    """A run folder's JSON record at `path` -> a value of `shape`, or None when there is none (or
    this user may not read it) or it is damaged (cut by a kill, edited: `say` is told). Anything
    but a regular file is refused (not_a_record), without blocking."""
    try:
        data = readers.read_bytes(path)
    except Unreadable as e:
        raise not_a_record(e) from None
    except OSError:
        return None
    try:
        return readers.parse_json(path, data, shape)
    except Unreadable as e:
        if say:
            say(f'Note: {e}; it is read as the record of a run killed before it wrote it.')
        return None


def run_record(path, say=None):
    """The summary.json in `path` (of formats.SUMMARY's shape), or None: none there, or a damaged
    one, which is what a run killed before it wrote its record leaves (docs/errors.md; `say` is
    told why)."""
    return read_record(os.path.join(path, 'summary.json'), formats.SUMMARY, say)


def run_status(path):
    """The status in a run folder's summary.json; None when there is none (fresh, running or
    killed)."""
    return (run_record(path) or {}).get('status')


OWNER = 'owner.json'  # the SLURM job that runs in a named run folder


def job_alive(job_id):
    """Whether SLURM still has this job (pending or running); False when squeue is absent or fails."""
    try:
        r = subprocess.run(['squeue', '-h', '-j', str(job_id), '-o', '%T'], capture_output=True,
                           text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return r.returncode == 0 and bool(r.stdout.strip())


# owner.json as taken() writes it: the job squeue -j is asked about, digits only (formats.JOB_ID)
OWNER_SHAPE = Dict({'job_id': Either(Int(0), formats.JOB_ID)})


def held_by_another_job(path, job_id, alive=job_alive):
    """Whether another live Slurm job writes in `path` (its owner.json); a damaged owner.json holds
    nothing."""
    owner = read_record(os.path.join(path, OWNER), OWNER_SHAPE)
    if owner is None:
        return False
    owner = str(owner['job_id'])
    return owner != str(job_id) and alive(owner)


def completed_run(path, say=None):
    """summary.json of the completed run in `path`, else None."""
    summary = run_record(path, say)
    return summary if summary is not None and summary.get('status') == 'completed' else None


def complete_sentence(path, summary):
    top1 = (summary.get('val') or {}).get('top1')
    score = f', validation top-1 {top1:.4f}' if top1 is not None else ''
    return (f"the run in {path} is complete (step {summary.get('global_step')}{score}); "
            f"this command asks nothing more of it and changes nothing in it: pass a larger -e (or "
            f"--test-nsteps) to train it further, or another --output-dir (or --run-name) for a "
            f"new run.")


def asks_nothing_more(summary, args, world_size):
    """Whether `args` asks a completed run (its `summary`) for no step beyond those it ran: the same
    length flags (-e, --test-nsteps), or others that end at the same step (from the summary's steps
    per epoch, for the same global batch). record.state.check_resume decides the cases this cannot
    (another global batch)."""
    config = summary.get('config') or {}
    length = lambda test, epochs, nsteps: (epochs, bool(test), nsteps if test else None)
    if length(config.get('test'), config.get('epochs'), config.get('test_nsteps')) == \
            length(args.test, args.epochs, args.test_nsteps):
        return True
    per_epoch = (summary.get('data') or {}).get('batches_per_epoch')
    if not per_epoch or summary.get('global_batch') != args.batch_size * world_size * args.accum_steps:
        return False
    total = args.epochs * per_epoch
    return (min(args.test_nsteps, total) if args.test else total) == summary.get('global_step')


def named_run_dir(name, continues, root='runs', job_id=None, alive=job_alive):
    """runs/<name> for a run named independently of the job id, so that a resubmitted job (a new job
    id) continues the run of the job it follows. Continuing (--resume auto), a folder whose run is
    over (NaN, OOM), or that another live SLURM job is writing (the same script and flags submitted
    twice), is kept and the run goes to the first of <name>.2, <name>.3, ... that is neither: a
    preempted or crashed run is continued, a completed one says so (or is trained further), a
    requeued one (same job id) finds its own."""
    path, k = os.path.join(root, name), 1
    while continues and (run_status(path) in FINISHED or held_by_another_job(path, job_id, alive)):
        k += 1
        path = os.path.join(root, f'{name}.{k}')
    return path


LOCK = '.dlojz.lock'         # flocked by the process that owns a run folder; says who it is
LOCK_EXCL = '.dlojz.owner'   # the same, created with O_EXCL, where the file system has no flock
NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)  # Lustre/GPFS/NFS mounts without it


def _flock(fd, operation):
    failpoints.before_flock()  # the tests' stand-in for a file system without flock
    fcntl.flock(fd, operation)


def pid_alive(pid):
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, TypeError, OverflowError):
        return True  # another user's process, or no pid to test: assume it lives
    return True


class FolderLock:
    """One owner per run folder at a time, taken atomically before anything in the folder is read,
    deleted or written: two runs in one folder would interleave metrics.jsonl and prune each other's
    checkpoints.

    fcntl.flock on <folder>/.dlojz.lock, which the OS releases when the process dies (Lustre and
    GPFS mounted with flock support it across nodes). A file system without flock raises
    ENOLCK/EOPNOTSUPP: then the claim is the creation of <folder>/.dlojz.owner with O_EXCL, removed
    at the end; one left by a killed run is stale when its pid is dead on this host, when it is an
    earlier attempt of this Slurm job (requeued), or when squeue no longer knows its job. Both files
    hold the owner's pid, host, Slurm job id and start time, for the sentence a second run gets
    (exit 2, nothing written). Rank 0 alone holds it under DDP. flock, host, pid, alive: injected by
    tests (a flock that raises ENOLCK, another host)."""

    def __init__(self, flock=_flock, host=None, pid=None, alive=job_alive, say=print, wait_s=10.0):
        self.flock, self.alive, self.say, self.wait_s = flock, alive, say, wait_s
        self.host, self.pid = host or socket.gethostname(), pid or os.getpid()
        self.fd = self.path = self.token = self.folder = None

    def acquire(self, folder, job_id=None):
        try:
            os.makedirs(folder, exist_ok=True)
            os.close(os.open(os.path.join(folder, LOCK), os.O_RDWR | os.O_CREAT, 0o644))
        except OSError as e:
            raise UsageError(f'cannot write to output directory {folder} ({e.strerror}); pass '
                             f'--output-dir with a writable folder.') from None
        me = json.dumps({'pid': self.pid, 'host': self.host, 'job_id': job_id,
                         'since': datetime.datetime.now().isoformat(timespec='seconds')}).encode()
        path, deadline = os.path.join(folder, LOCK), time.time() + self.wait_s
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                self.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno in NO_FLOCK:
                    self.path = path  # created above, empty: removed with the claim
                    return self._acquire_exclusive(folder, me, job_id)
                if e.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                    raise
                owner = _read_owner(path)
                # A killed run's DataLoader workers keep its lock until they notice (about 5 s):
                # wait for them.
                if owner and owner.get('host') == self.host and not pid_alive(owner.get('pid')) \
                        and time.time() < deadline:
                    time.sleep(0.5)
                    continue
                raise UsageError(busy_sentence(folder, owner)) from None
            try:  # the owner removes the file as it ends: a lock on a removed file is no claim, take the new one
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, me)
        self.fd, self.path, self.folder = fd, path, folder
        return self

    def _acquire_exclusive(self, folder, me, job_id):
        token = os.path.join(folder, LOCK_EXCL)
        for _ in range(3):
            try:
                fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                owner = _read_owner(token)
                if not self._stale(token, owner, job_id):
                    raise UsageError(busy_sentence(folder, owner)) from None
                # set the stale file aside under a name of our own, and check it is still the one
                # judged stale
                aside = f'{token}.stale-{self.host}-{self.pid}'
                try:
                    os.rename(token, aside)
                except FileNotFoundError:
                    continue
                if _read_owner(aside) != owner:  # another process claimed it meanwhile: give it back
                    try:
                        os.link(aside, token)
                    except OSError:
                        pass
                    os.remove(aside)
                    raise UsageError(busy_sentence(folder, _read_owner(token))) from None
                os.remove(aside)
                self.say(f'Removed the stale claim {token} of a run that is over '
                         f'({describe_owner(owner)})')
                continue
            with os.fdopen(fd, 'wb') as f:
                f.write(me)
                f.flush()
                os.fsync(f.fileno())
            self.token, self.folder = token, folder
            return self
        raise UsageError(busy_sentence(folder, _read_owner(token)))

    def _stale(self, token, owner, job_id):
        if owner is None:  # a claim with no content: its process died between creating and writing it
            try:
                return time.time() - os.path.getmtime(token) > 60
            except OSError:
                return True
        if owner.get('host') == self.host and not pid_alive(owner.get('pid')):
            return True
        owned_by = owner.get('job_id')
        if owned_by and job_id and str(owned_by) == str(job_id):
            return owner.get('host') != self.host or not pid_alive(owner.get('pid'))  # this job, requeued
        return bool(owned_by) and shutil.which('squeue') is not None and not self.alive(owned_by)

    def release(self):
        """Idempotent. The lock file is removed while still held, so that a process waiting on it
        retries."""
        if self.fd is not None:
            try:
                os.remove(self.path)
            except OSError:
                pass
            os.close(self.fd)
            self.fd = None
        if self.token is not None:
            mine = (_read_owner(self.token) or {}).get('pid') == self.pid
            for path in ([self.token] if mine else []) + [self.path]:
                try:
                    os.remove(path)
                except OSError:
                    pass
            self.token = None


# A lock file's owner (FolderLock.acquire writes it): what the busy sentence shows and a stale
# claim is judged by. A pid of 0 or below would name a process group to os.kill; job_id is ''
# outside Slurm (launch.DistInfo's).
CLAIM = fields(pid=Int(1), host=Str(max_len=256),
               job_id=Maybe(Either(Int(0), formats.JOB_ID, Str('', 'nothing'))),
               since=Str(max_len=64))


def _read_owner(path):
    """The owner a lock file names, or None: none, empty (its writer died before writing), damaged,
    or not a file (a FIFO is not opened for reading: it would block)."""
    try:
        return readers.read_json(path, CLAIM)
    except (OSError, Unreadable):
        return None


def describe_owner(owner):
    if not owner:
        return 'its owner is not recorded'
    job = f", Slurm job {owner['job_id']}" if owner.get('job_id') else ''
    return f"pid {owner.get('pid')} on {owner.get('host')}{job}, since {owner.get('since')}"


def busy_sentence(folder, owner):
    return (f'--output-dir {folder} is in use by another dlojz run ({describe_owner(owner)}) and '
            f'two runs in one folder would mix their records; wait for it to end, or pass another '
            f'--output-dir.')


def trim_metrics(path, size, global_step):
    """A resumed run continues metrics.jsonl from where its checkpoint was written: the records of
    the steps after it, which the resumed run writes again, are dropped, so that no reader has to
    deduplicate. `size`: the file's length the checkpoint recorded; None (an older checkpoint):
    records of steps after `global_step` are dropped. Atomic (temp file + rename). -> the number of
    records dropped."""
    try:
        data = readers.read_bytes(path, formats.METRICS_LIMIT)
    except FileNotFoundError:
        return 0
    except Unreadable as e:
        raise not_a_record(e) from None
    if size is not None and size <= len(data) and (size == 0 or data[size - 1:size] == b'\n'):
        kept = data[:size]
    else:  # an older checkpoint, or a file that is not the one it saw
        lines = data.splitlines(keepends=True)
        kept = b''.join(line for line in lines if not _after(line, global_step))
    if len(kept) == len(data):
        return 0
    dropped = data[len(kept):].count(b'\n') if data.startswith(kept) else \
        len(data.splitlines()) - len(kept.splitlines())
    files.write_atomic(path, kept, full=disk_full)
    return dropped


def _after(line, global_step):
    """Whether a line goes: a record of a step after `global_step`, or a line cut by a kill (or of
    another shape than formats.METRIC, which dlojz does not write). A record without a step (none
    is written today) is kept."""
    try:
        step = readers.parse_json('metrics.jsonl', line, formats.METRIC).get('global_step')
    except Unreadable:
        return True
    return step is not None and step > global_step


RUN_FILES = ('config.json', 'metrics.jsonl', 'summary.json', 'best.pt', 'best.dcp')


def run_files(path):
    """The files of a dlojz run in a folder (sorted), [] for a fresh or unrelated one."""
    try:
        names = os.listdir(path)
    except OSError:
        return []
    return sorted(n for n in names if n in RUN_FILES or CHECKPOINT_RE.fullmatch(n))


RECORDS = ('config.json', 'metrics.jsonl', 'summary.json')  # what a continued run opens by name


def _check_a_file(path):
    """Refuse a FIFO, folder or device where a continued run reads or appends its record: opening
    a FIFO (to read, or to append) blocks."""
    try:
        readers.open_file(path).close()
    except Unreadable as e:
        raise not_a_record(e) from None
    except OSError:
        pass  # gone since the listing, or not readable: its writer says what it needs


def prepare_output_dir(path, continues=False, overwrite=False):
    """Create the run folder and check it is writable. A folder that already holds a run is used
    only when this run continues it (`continues`: --resume, the way a requeued job starts again) or
    replaces it (`overwrite`: its run files are deleted first): two runs in one folder would mix
    their metrics, and the newer run's checkpoints would be pruned in favour of the older run's
    higher steps."""
    found = run_files(path)
    if continues:
        for name in found:
            if name in RECORDS:
                _check_a_file(os.path.join(path, name))
    if found and not continues and not overwrite:
        shown = ', '.join(found[:4]) + (f' and {len(found) - 4} more' if len(found) > 4 else '')
        raise UsageError(f'--output-dir {path} already holds a run ({shown}); pass --resume auto '
                         f'to continue it, --overwrite to replace it, or another --output-dir.')
    if found and overwrite and not continues:
        for name in found:
            remove(os.path.join(path, name))  # a sharded checkpoint is a folder
    if continues or overwrite:
        remove_partial_checkpoints(path)
    return writable(path, 'output directory', 'pass --output-dir with a writable folder')


def remove_if_empty(path):
    try:
        names = set(os.listdir(path))
        if names and names <= {OWNER, LOCK}:  # only claims on the folder: nothing of a run
            for name in names:
                os.remove(os.path.join(path, name))
    except OSError:
        pass
    try:
        os.rmdir(path)  # fails, as wanted, on a folder that holds anything
    except OSError:
        pass


@contextmanager
def taken(args, dist, lock=None):
    """The run folder, held for the block: rank 0 chooses it (a timestamp would differ between
    ranks), takes it (one run per folder at a time: the lock comes before anything in it is read or
    deleted) and prepares it; every rank gets it in args.output_dir. At the end the lock is
    released, and a folder the block left with nothing of a run in it (an error before anything was
    written: bad data, a refused checkpoint) is removed."""
    lock = lock or FolderLock()

    def take():
        path = lock.acquire(args.output_dir or default_output_dir(args, dist), dist.job_id).folder
        try:
            return prepare_output_dir(path, continues=bool(args.resume) and not args.evaluate,
                                      overwrite=args.overwrite)
        except BaseException:
            lock.release()
            raise
    args.output_dir = launch.broadcast_object(launch.on_ranks(take, when=dist.is_main))
    try:
        # the same command on a completed run (a resubmitted job): one line, exit 0, nothing written
        # in the folder
        training = args.resume and not (args.evaluate or args.tune)  # the other modes have their own records
        note = lambda line: print(line, flush=True)  # a damaged summary.json: a killed run's
        done = launch.on_ranks(lambda: completed_run(args.output_dir, note),
                               when=dist.is_main and training)
        if launch.broadcast_object(done is not None and asks_nothing_more(done, args, dist.world_size)):
            raise Complete(complete_sentence(args.output_dir, done or {}))
        if dist.is_main and args.run_name and os.path.basename(args.output_dir) != args.run_name:
            first = os.path.join('runs', args.run_name)
            why = f'a finished run ({run_status(first)})' if run_status(first) else 'the run of another live job'
            print(f'{first} holds {why}; this run goes to {args.output_dir}', flush=True)
        if dist.is_main and args.run_name and dist.job_id:  # who writes here: a duplicate job goes elsewhere
            write_json(os.path.join(args.output_dir, OWNER), {'job_id': dist.job_id})
        yield args.output_dir
    except BaseException:
        lock.release()
        if dist.is_main:
            remove_if_empty(args.output_dir)
        raise
    finally:
        lock.release()
