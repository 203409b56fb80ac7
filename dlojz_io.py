"""Run directory, console and metrics logger, JSON outputs, provenance and atomic checkpoints for dlojz."""
import datetime
import errno
import fcntl
import hashlib
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager

import torch

from dlojz_errors import NO_SPACE, UsageError, disk_full

SUMMARY_VERSION = 1


def default_output_dir(args, dist):
    if args.run_name:
        return named_run_dir(args.run_name, continues=bool(args.resume), job_id=dist.job_id)
    tag = dist.job_id or datetime.datetime.now().strftime('%Y%m%d-%H%M%S')
    # the loader modes build no model: their folders are named after what they measure, not after --arch
    what = 'loader' if args.loader_only else 'tune-loader' if args.tune_loader else args.arch
    return os.path.join('runs', f'{tag}_{what}_bs{args.batch_size}')


# A run that ended this way is over: continuing it would only repeat its end (an OOM, a NaN). 'failed' is not
# among them: a dead peer (exit 4) is worth continuing, and a refused flag is refused again with its sentence.
FINISHED = ('completed', 'nan', 'oom')


def run_status(path):
    """The status in a run folder's summary.json; None when there is none (fresh, running or killed)."""
    try:
        with open(os.path.join(path, 'summary.json')) as f:
            return json.load(f).get('status')
    except (OSError, ValueError, AttributeError):
        return None


OWNER = 'owner.json'  # the SLURM job that runs in a named run folder


def job_alive(job_id):
    """Whether SLURM still has this job (pending or running); False when squeue is absent or fails."""
    try:
        r = subprocess.run(['squeue', '-h', '-j', str(job_id), '-o', '%T'], capture_output=True, text=True,
                           timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return r.returncode == 0 and bool(r.stdout.strip())


def held_by_another_job(path, job_id, alive=job_alive):
    try:
        with open(os.path.join(path, OWNER)) as f:
            owner = str(json.load(f).get('job_id'))
    except (OSError, ValueError, AttributeError):
        return False
    return owner != str(job_id) and alive(owner)


def named_run_dir(name, continues, root='runs', job_id=None, alive=job_alive):
    """runs/<name> for a run named independently of the job id, so that a resubmitted job (a new job id)
    continues the run of the job it follows. Continuing (--resume auto), a folder whose run is over, or that
    another live SLURM job is writing (the same script and flags submitted twice), is kept and the run goes
    to the first of <name>.2, <name>.3, ... that is neither: the next submission of a finished benchmark is
    a new run, a preempted or crashed one is continued, a requeued one (same job id) finds its own."""
    path, k = os.path.join(root, name), 1
    while continues and (run_status(path) in FINISHED or held_by_another_job(path, job_id, alive)):
        k += 1
        path = os.path.join(root, f'{name}.{k}')
    return path


LOCK = '.dlojz.lock'         # flocked by the process that owns a run folder; says who it is
LOCK_EXCL = '.dlojz.owner'   # the same, created with O_EXCL, where the file system has no flock
NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)  # Lustre/GPFS/NFS mounts without it


def _flock(fd, operation):
    if _fault_arg('no-flock') is not None:  # the tests' stand-in for a file system without flock
        raise OSError(errno.ENOLCK, 'No locks available')
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
    """One owner per run folder at a time, taken atomically before anything in the folder is read, deleted
    or written: two runs in one folder would interleave metrics.jsonl and prune each other's checkpoints.

    fcntl.flock on <folder>/.dlojz.lock, which the OS releases when the process dies (Lustre and GPFS mounted
    with flock support it across nodes). A file system without flock raises ENOLCK/EOPNOTSUPP: then the claim
    is the creation of <folder>/.dlojz.owner with O_EXCL, removed at the end; one left by a killed run is stale
    when its pid is dead on this host, when it is an earlier attempt of this Slurm job (requeued), or when
    squeue no longer knows its job. Both files hold the owner's pid, host, Slurm job id and start time, for
    the sentence a second run gets (exit 2, nothing written). Rank 0 alone holds it under DDP.
    flock, host, pid, alive: injected by tests (a flock that raises ENOLCK, another host)."""

    def __init__(self, flock=_flock, host=None, pid=None, alive=job_alive, say=print, wait_s=10.0):
        self.flock, self.alive, self.say, self.wait_s = flock, alive, say, wait_s
        self.host, self.pid = host or socket.gethostname(), pid or os.getpid()
        self.fd = self.path = self.token = self.folder = None

    def acquire(self, folder, job_id=None):
        try:
            os.makedirs(folder, exist_ok=True)
            os.close(os.open(os.path.join(folder, LOCK), os.O_RDWR | os.O_CREAT, 0o644))
        except OSError as e:
            raise UsageError(f'cannot write to output directory {folder} ({e.strerror}); pass --output-dir with a '
                             f'writable folder.') from None
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
                # A killed run's DataLoader workers keep its lock until they notice (about 5 s): wait for them.
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
                # set the stale file aside under a name of our own, and check it is still the one judged stale
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
                self.say(f'Removed the stale claim {token} of a run that is over ({describe_owner(owner)})')
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
        """Idempotent. The lock file is removed while still held, so that a process waiting on it retries."""
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


def _read_owner(path):
    try:
        with open(path) as f:
            owner = json.load(f)
        return owner if isinstance(owner, dict) else None
    except (OSError, ValueError):
        return None


def describe_owner(owner):
    if not owner:
        return 'its owner is not recorded'
    job = f", Slurm job {owner['job_id']}" if owner.get('job_id') else ''
    return f"pid {owner.get('pid')} on {owner.get('host')}{job}, since {owner.get('since')}"


def busy_sentence(folder, owner):
    return (f'--output-dir {folder} is in use by another dlojz run ({describe_owner(owner)}) and two runs in one '
            f'folder would mix their records; wait for it to end, or pass another --output-dir.')


def trim_metrics(path, size, global_step):
    """A resumed run continues metrics.jsonl from where its checkpoint was written: the records of the steps
    after it, which the resumed run writes again, are dropped, so that no reader has to deduplicate. `size`:
    the file's length the checkpoint recorded; None (an older checkpoint): records of steps after
    `global_step` are dropped. Atomic (temp file + rename). -> the number of records dropped."""
    try:
        with open(path, 'rb') as f:
            data = f.read()
    except FileNotFoundError:
        return 0
    if size is not None and size <= len(data) and (size == 0 or data[size - 1:size] == b'\n'):
        kept = data[:size]
    else:  # an older checkpoint, or a file that is not the one it saw
        lines = data.splitlines(keepends=True)
        kept = b''.join(line for line in lines if not _after(line, global_step))
    if len(kept) == len(data):
        return 0
    dropped = data[len(kept):].count(b'\n') if data.startswith(kept) else \
        len(data.splitlines()) - len(kept.splitlines())
    tmp = f'{path}.tmp'
    with open(tmp, 'wb') as f:
        f.write(kept)
    _fsync_replace(tmp, path)
    return dropped


def _after(line, global_step):
    try:
        step = json.loads(line).get('global_step')
    except (ValueError, AttributeError):
        return True  # a line cut by a kill
    return isinstance(step, int) and step > global_step


RUN_FILES = ('config.json', 'metrics.jsonl', 'summary.json', 'best.pt')


def run_files(path):
    """The files of a dlojz run in a folder (sorted), [] for a fresh or unrelated one."""
    try:
        names = os.listdir(path)
    except OSError:
        return []
    return sorted(n for n in names if n in RUN_FILES or CHECKPOINT_RE.fullmatch(n))


def prepare_output_dir(path, continues=False, overwrite=False):
    """Create the run folder and check it is writable. A folder that already holds a run is used only when
    this run continues it (`continues`: --resume, the way a requeued job starts again) or replaces it
    (`overwrite`: its run files are deleted first): two runs in one folder would mix their metrics, and the
    newer run's checkpoints would be pruned in favour of the older run's higher steps."""
    found = run_files(path)
    if found and not continues and not overwrite:
        shown = ', '.join(found[:4]) + (f' and {len(found) - 4} more' if len(found) > 4 else '')
        raise UsageError(f'--output-dir {path} already holds a run ({shown}); pass --resume auto to continue it, '
                         f'--overwrite to replace it, or another --output-dir.')
    if found and overwrite and not continues:
        for name in found:
            os.remove(os.path.join(path, name))
    if continues or overwrite:
        remove_partial_checkpoints(path)
    try:
        os.makedirs(path, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=path, prefix='.write-test-', delete=True)
        probe.close()
    except OSError as e:
        raise UsageError(f'cannot write to output directory {path} ({e.strerror}); '
                         f'pass --output-dir with a writable folder.') from None
    return path


PARTIAL_RE = re.compile(r'\.checkpoint-\w+\.tmp$')  # save_checkpoint's temporary files


def remove_partial_checkpoints(path, say=print):
    """Delete the temporary files of checkpoint writes that a kill interrupted (up to a checkpoint's size each).
    Called by the folder's owner only (FolderLock): no other process is writing one."""
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
        say(f'Removed {len(names)} partial checkpoint file(s) ({size / 2**20:.1f} MiB) left in {path} by an '
            f'interrupted checkpoint write')


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


def _fsync_replace(tmp, path):
    with open(tmp, 'rb+') as f:
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the new one, never half of one


# The seams the full-disk tests drive: every file a run writes is opened by open_for_write, and the free space
# is read by disk_usage (bytes, shutil's named tuple).
open_for_write = open
disk_usage = shutil.disk_usage


def no_space(e):
    return isinstance(e, OSError) and e.errno in NO_SPACE


def write_json(path, obj):
    """Atomic: a failed write (a full disk) leaves the previous file and no temp file."""
    tmp = f'{path}.tmp'
    try:
        with open_for_write(tmp, 'w') as f:
            json.dump(obj, f, indent=2, default=_json_default)
            f.write('\n')
        _fsync_replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        if no_space(e):
            raise disk_full(path, disk_usage) from None
        raise


def run_for_summary(cmd, out):
    """A dlojz process of its own (a trial of the loader doctor or the tuner) -> (its out/summary.json or None,
    exit code, its last stderr line)."""
    r = subprocess.run(cmd, capture_output=True, text=True)
    try:
        with open(os.path.join(out, 'summary.json')) as f:
            summary = json.load(f)
    except (OSError, ValueError):
        summary = None
    return summary, r.returncode, (r.stderr.strip().splitlines() or ['no output'])[-1]


def _json_default(o):
    if isinstance(o, (torch.device, torch.dtype)):
        return str(o)
    if hasattr(o, 'item'):
        return o.item()
    return repr(o)


class Console:
    """print() on rank 0 only. On a terminal it goes through tqdm, so that a progress bar is not torn, and
    bar() draws one; elsewhere (batch jobs, pipes, tests) tqdm is not even imported."""

    def __init__(self, enabled=True, tty=None):
        self.enabled = enabled
        self.tty = enabled and (sys.stdout.isatty() if tty is None else tty)

    def __call__(self, msg):
        if not self.enabled:
            return
        if self.tty:
            from tqdm import tqdm
            tqdm.write(str(msg))
        else:
            print(msg)
        sys.stdout.flush()

    def bar(self, total, desc):
        if not self.tty:
            return _NoBar()
        from tqdm import tqdm
        return tqdm(total=total, leave=False, desc=desc)


class _NoBar:
    def update(self, n=1):
        return None

    def close(self):
        return None


class Logger:
    """One record, emitted once, to three places on rank 0: a console line, metrics.jsonl (one JSON object
    per line, flushed per line so that a crashed run keeps what it logged) and wandb.

    lines: record type -> function(record) -> console text (types without one are not printed);
    wandb: a wandb run or None; it gets the record's numbers as '<type>/<key>' at step global_step."""
    NOT_METRICS = {'type', 'epoch', 'step', 'global_step'}

    def __init__(self, path, console, append=False, lines=None, wandb=None):
        # A resumed run continues its log; a fresh run in a reused folder starts a new one.
        self.console = console
        self.path = path
        try:
            # unbuffered bytes: a record a full disk refuses is cut off whole (log), never left half-written
            self.f = open_for_write(path, 'ab' if append else 'wb', buffering=0) if console.enabled else None
        except OSError as e:
            if no_space(e):
                raise disk_full(path, disk_usage) from None
            raise
        self.lines = lines or {}
        self.wandb = wandb

    def print(self, msg):
        self.console(msg)

    def bar(self, total, desc):
        return self.console.bar(total, desc)

    def log(self, **record):
        if self.f is None:
            return
        line = memoryview((json.dumps(record, default=_json_default) + '\n').encode())
        end = self.f.tell()
        try:
            while line:  # a raw write may be short
                line = line[self.f.write(line):]
        except OSError as e:
            try:  # the part of the line that was written goes: a resumed run appends after whole lines only
                self.f.truncate(end)
            except OSError:
                pass
            if no_space(e):
                raise disk_full(self.path, disk_usage) from None
            raise
        line = self.lines.get(record['type'])
        if line:
            self.console(line(record))
        if self.wandb is not None:
            numbers = {f"{record['type']}/{k}": v for k, v in record.items()
                       if k not in self.NOT_METRICS and isinstance(v, (int, float)) and not isinstance(v, bool)}
            if numbers:
                self.wandb.log(numbers, step=record.get('global_step'))

    def size(self):
        """Bytes of metrics.jsonl written so far (each record is flushed), None off rank 0: a checkpoint keeps it,
        so that a run resumed from it drops the records of the steps after it (trim_metrics)."""
        return os.fstat(self.f.fileno()).st_size if self.f is not None else None

    def close(self, exit_code=0):
        """Idempotent: every exit path calls it."""
        if self.f is not None:
            f, self.f = self.f, None
            try:
                f.close()
            except OSError:  # the flush of a line a full disk refused: that error was reported already
                pass
        if self.wandb is not None:
            self.wandb.finish(exit_code=exit_code)
            self.wandb = None


def host_memory(pid='self'):
    """Peak and current resident set size of a process (this one by default), bytes (Linux /proc; None
    elsewhere or when the process is gone)."""
    out = {'host_peak_rss_bytes': None, 'host_rss_bytes': None}
    try:
        with open(f'/proc/{pid}/status') as f:
            for line in f:
                if line.startswith('VmHWM:'):
                    out['host_peak_rss_bytes'] = int(line.split()[1]) * 1024
                elif line.startswith('VmRSS:'):
                    out['host_rss_bytes'] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return out


def git_sha():
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        sha = subprocess.run(['git', '-C', here, 'rev-parse', 'HEAD'], capture_output=True, text=True,
                             timeout=5).stdout.strip()
        dirty = subprocess.run(['git', '-C', here, 'status', '--porcelain', '--untracked-files=no'],
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return (sha + ('-dirty' if dirty else '')) or None
    except (OSError, subprocess.SubprocessError):
        return None


def file_hash(path):
    with open(path, 'rb') as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


def usable_cores():
    """Cores this process may run on (its affinity mask: what Slurm's cgroup or taskset gives it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def intra_op_threads(num_workers, cpu_device, local_ranks=1, usable=None, node=None, environ=os.environ):
    """torch's intra-op threads for this process, or None to leave them to OMP_NUM_THREADS when it is set.
    torch's default is every core of the affinity mask; ranks that share one mask (torchrun or mpirun without
    binding) would each take all of them, and on a GPU the main process, which mostly launches kernels,
    would compete with its own loader workers. On CPU the model is the work (the workers sleep once their
    prefetch queue is full), so it gets the process's share of the cores."""
    if environ.get('OMP_NUM_THREADS'):
        return None
    usable = usable or usable_cores()
    node = node or os.cpu_count() or usable
    share = usable // local_ranks if local_ranks > 1 and usable >= node else usable
    return max(1, share if cpu_device else share - num_workers)


def host_check(num_workers, cpu_device, cores=usable_cores, load=os.getloadavg, threads=torch.get_num_threads,
               node_cores=os.cpu_count):
    """What a benchmark's figures depend on besides the flags: usable cores, the node's load before the run,
    torch's intra-op threads, the workers; with a sentence for each way they can spoil the timings."""
    usable, load1, t = cores(), load()[0], threads()
    main = t if cpu_device else 1  # on a GPU the main process needs about a core to launch kernels
    warnings = []
    if num_workers + main > usable:
        warnings.append(f'{num_workers} loader workers + {main} compute thread(s) exceed the {usable} usable cores: '
                        f'they will compete (lower --num-workers, or OMP_NUM_THREADS on CPU).')
    total = node_cores() or usable
    if load1 > 0.75 * total:
        warnings.append(f'this node was already busy before the run (load average {load1:.1f} on {total} cores): '
                        f'timings may be slower than on an idle node.')
    return {'usable_cores': usable, 'node_cores': total, 'load_avg_1m_before': load1, 'torch_threads': t,
            'torch_threads_from': 'OMP_NUM_THREADS' if os.environ.get('OMP_NUM_THREADS') else 'dlojz',
            'num_workers': num_workers, 'warnings': warnings}


def provenance(device, dist):
    import torchvision
    prov = {
        'dlojz_sha': git_sha(), 'dlojz_py_sha256': file_hash(os.path.join(os.path.dirname(
            os.path.abspath(__file__)), 'dlojz.py')),
        'python': sys.version.split()[0], 'torch': torch.__version__, 'torchvision': torchvision.__version__,
        'cuda': torch.version.cuda, 'cudnn': torch.backends.cudnn.version() if torch.cuda.is_available() else None,
        'nccl': None, 'host': socket.gethostname(), 'platform': platform.platform(),
        'cpu_count': usable_cores(), 'slurm_job_id': dist.job_id or None,
        'launcher': dist.launcher, 'device': str(device), 'device_name': platform.processor() or 'cpu',
        'gpu_total_memory_bytes': None, 'driver': None,
        'time': datetime.datetime.now().isoformat(timespec='seconds'),
    }
    if device.type == 'cuda':
        p = torch.cuda.get_device_properties(device)
        prov.update(device_name=p.name, gpu_total_memory_bytes=p.total_memory,
                    compute_capability=f'{p.major}.{p.minor}')
        try:
            prov['nccl'] = '.'.join(map(str, torch.cuda.nccl.version()))
        except Exception:  # NCCL absent from this build
            pass
        try:
            import pynvml
            pynvml.nvmlInit()
            prov['driver'] = pynvml.nvmlSystemGetDriverVersion()
        except Exception:  # no NVML: driver left unknown
            pass
    return prov


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


@contextmanager
def deferred_sigchld():
    """PyTorch's DataLoader raises from its SIGCHLD handler when a worker dies: in the middle of a
    checkpoint write that would lose the checkpoint a stopping job exists to write. The handler's call is
    held back until the block ends (main thread only: Python runs signal handlers there)."""
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
    """Write a checkpoint atomically (temp file in the same folder, fsync, rename), then keep only the
    newest `keep` checkpoints of the folder. A crash at any point leaves the previous ones intact; a
    loader worker dying meanwhile is reported once the file is in place."""
    with deferred_sigchld():
        _save_checkpoint(path, state, keep)


class _Writes:
    """A file for torch.save that remembers the OSError a write raised: torch's zip writer replaces it with
    'RuntimeError: [enforce fail at inline_container.cc] unexpected pos', which names neither the disk nor
    the file."""

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
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or '.', prefix='.checkpoint-', suffix='.tmp')
    os.close(fd)
    writes = None
    try:
        with open_for_write(tmp, 'wb') as f:
            if _fault('kill-in-checkpoint'):
                _die_half_written(f, state)
            writes = _Writes(f)
            torch.save(state, writes)
        _fsync_replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        if no_space(e) or (writes is not None and no_space(writes.error)):
            raise disk_full(path, disk_usage) from None
        raise
    if keep:
        for old in list_checkpoints(os.path.dirname(path) or '.')[:-keep]:
            os.remove(old)


_FAULT_COUNT = {}


def _fault_arg(name):
    """The argument of fault `name` in DLOJZ_FAULT (comma-separated <name>:<argument> entries; <name> alone
    for a flag), '' for a flag, None when absent. Test seams only."""
    for entry in os.environ.get('DLOJZ_FAULT', '').split(','):
        key, _, arg = entry.partition(':')
        if key == name:
            return arg
    return None


def _fault(name):
    """Fault injection for the crash tests only: DLOJZ_FAULT=<name>:<n> fires at the n-th occurrence."""
    arg = _fault_arg(name)
    if not arg:
        return False
    _FAULT_COUNT[name] = _FAULT_COUNT.get(name, 0) + 1
    return _FAULT_COUNT[name] == int(arg)


def slow_step():
    """For the time-limit tests only: DLOJZ_FAULT=slow-steps:<s> sleeps s seconds after each training step, so
    that a run of a few tiny steps lasts until Slurm's signal comes (up to a minute early, checked every 30 s);
    in the job's first attempt only (a requeued job has SLURM_RESTART_COUNT >= 1)."""
    arg = _fault_arg('slow-steps')
    if arg and int(os.environ.get('SLURM_RESTART_COUNT') or 0) == 0:
        time.sleep(float(arg))


def signal_fault(where, step=None):
    """For the preemption tests only: DLOJZ_FAULT=signal-<where>:<n>:<SIGNAL> sends SIGNAL to this process's
    whole group, DataLoader workers included, as Slurm does: where='step' once global step n is done, 'val'
    after the n-th validation batch this process runs. The test starts dlojz in a session of its own."""
    arg = _fault_arg(f'signal-{where}')
    if not arg:
        return
    at, name = arg.split(':')
    if step is None:
        step = _FAULT_COUNT[where] = _FAULT_COUNT.get(where, 0) + 1
    if step == int(at):
        os.killpg(os.getpgrp(), getattr(signal, name))


def _die_half_written(f, state):
    """SIGKILL this process halfway through writing a checkpoint, as a node failure would."""
    import io
    import signal
    buf = io.BytesIO()
    torch.save(state, buf)
    f.write(buf.getvalue()[:buf.tell() // 2])
    f.flush()
    os.fsync(f.fileno())
    os.kill(os.getpid(), signal.SIGKILL)


def space_warning(folder, usage=None):
    """A sentence when the folder may not hold the next checkpoint: less free space than twice the size of
    its newest one (this write and the next); None otherwise or when there is no checkpoint yet."""
    found = list_checkpoints(folder)
    if not found:
        return None
    try:
        size, free = os.path.getsize(found[-1]), (usage or disk_usage)(folder).free
    except OSError:
        return None
    if free >= 2 * size:
        return None
    return (f'{folder} has {free / 2**20:.0f} MiB free and a checkpoint takes {size / 2**20:.0f} MiB: '
            f'{"the next checkpoint will not fit" if free < size else "room for one more checkpoint only"}; '
            f'free some space or lower --keep-checkpoints.')


def load_checkpoint(path):
    if os.path.isdir(path):
        raise UsageError(f'--resume {path} is a folder, not a checkpoint file; pass a checkpoint-*.pt file, '
                         f'or --resume auto --output-dir {path} to continue the run it holds.')
    if not os.path.isfile(path):
        raise UsageError(f'checkpoint {path} does not exist; pass --resume with the path of a checkpoint-*.pt '
                         f'written by --chkpt, or --resume auto.')
    try:
        # weights_only=False: the checkpoint holds our own args namespace and RNG states, written by us.
        return torch.load(path, map_location='cpu', weights_only=False)
    except Exception as e:
        raise UsageError(f'checkpoint {path} cannot be read ({type(e).__name__}); it may be truncated, '
                         f'resume from another checkpoint.') from None


def load_latest_checkpoint(run_dir, warn=print):
    """--resume auto: the newest checkpoint of run_dir that loads; an unreadable one (truncated by a crash)
    is skipped with a warning. -> (path, state), or (None, None) when there is none."""
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
