"""An emulated shared parallel file system (a GPFS/Lustre-like metadata server), for tests and
measurements.

A FUSE pass-through of SOURCE, read-only, served by ONE thread (libfuse's -s, nothreads) that sleeps
--latency before each operation and counts it by name: N processes listing an ImageNet-shaped tree
queue on one server, as the clients of a busy metadata server do. It runs in its own process,
outside the code it measures.

    python tests/fsemu.py tree ROOT --classes 1000   # make_tree(): 1000 x (10 + 2) tiny JPEGs, ~1 s
    python tests/fsemu.py serve ROOT MNT --latency 0.0005 --stats counts.json &
    kill -USR1 $!   # counts.json <- {"seq": n, "latency": L, "counts": {"getattr": 6004, ...}}
    kill -USR2 $!   # zeroes the counts, then writes the file
    with mounted(ROOT, MNT) as fs: fs.reset(); os.listdir(MNT); fs.counts()   # in a test

Mount options (libfuse 3.14, mfusepy 3.1.1), given as -o rather than through mfusepy's fuse_config
struct, whose layout changed within libfuse 3.14: ro, entry_timeout=0, attr_timeout=0,
negative_timeout=0 (libfuse's defaults are 1, 1 and 0 s), neither kernel_cache nor auto_cache (file
pages are dropped at each open). There is no readdir cache to turn off: the kernel keeps a listing
only when opendir sets fuse_file_info.cache_readdir, which mfusepy leaves 0. Checked by counting: a
second os.stat or os.listdir of a path is counted again (tests/test_fsemu.py), and so are a second
failed stat and a second read of a file (by hand).

Reading the counts (measured on Linux 6.18):
- libfuse's high-level API serves the kernel's LOOKUP with getattr, and with entry_timeout=0 the
  kernel looks every component up again: os.stat('MNT/train/c') is 3 getattr (train, c, then c's
  attributes).
- A listing is opendir, one readdir whatever its length (libfuse fills its buffer in one call),
  releasedir; the kernel sends releasedir (and release) asynchronously after close: it may be
  counted a moment later.
- readdir gives each name with its type (st_mode & S_IFMT, from the source's d_type, as Lustre and
  GPFS give d_type), so os.scandir's entry.is_file()/is_dir() ask nothing. With --names-only
  (DT_UNKNOWN) every entry.is_file() is an lstat, about 4 getattr per entry of MNT/train/c/: walking
  1000 classes x 12 files counted 60009 getattr instead of 6005.
- At latency 0 an operation costs 20-40 us (25,000-50,000 op/s); at latency L about L + 0.1-0.2 ms.
"""
import argparse
import contextlib
import errno
import ctypes
import functools
import importlib
import io
import json
import os
import random
import shutil
import signal
import stat as statmod
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.abspath(__file__)
OPTIONS = dict(ro=True, fsname='fsemu', entry_timeout=0, attr_timeout=0, negative_timeout=0)
STAT_FIELDS = ('st_mode', 'st_nlink', 'st_uid', 'st_gid', 'st_size', 'st_blocks', 'st_blksize',
               'st_rdev')


def serve(source, mountpoint, latency, stats_file, names_only=False):
    """Mount and serve until unmounted (fusermount3 -u) or SIGTERM/SIGINT (libfuse unmounts)."""
    import mfusepy
    source = os.path.abspath(source)
    counts, lock, seq = {}, threading.Lock(), [0]

    def write():
        with lock:
            seq[0] += 1
            state = {'seq': seq[0], 'latency': latency, 'counts': dict(counts)}
        tmp = f'{stats_file}.{os.getpid()}.tmp'
        with open(tmp, 'w') as f:
            json.dump(state, f)
        os.replace(tmp, stats_file)   # a reader never sees half a file

    def on_signals():
        # Signals are handled by sigwait in this helper thread, not by a Python handler: the serving
        # thread sits in libfuse's C loop, where a Python handler would run only at the next file
        # system operation.
        while True:
            if signal.sigwait({signal.SIGUSR1, signal.SIGUSR2}) == signal.SIGUSR2:
                with lock:
                    counts.clear()
            write()

    def counted(name, func):
        @functools.wraps(func)
        def op(*args):
            if latency:
                time.sleep(latency)
            with lock:
                counts[name] = counts.get(name, 0) + 1
            return func(*args)
        return op

    class Passthrough(mfusepy.Operations):
        use_ns = True

        def getattr(self, path, fh=None):
            st = os.lstat(source + path)   # by path with a handle too: opendir's is 0, not an fd
            attrs = {k: getattr(st, k) for k in STAT_FIELDS}
            attrs.update(st_atime=st.st_atime_ns, st_mtime=st.st_mtime_ns, st_ctime=st.st_ctime_ns)
            return attrs

        def readdir(self, path, fh):
            with os.scandir(source + path) as it:
                entries = [(e.name, 0 if names_only else type_bits(e), 0) for e in it]
            return [('.', statmod.S_IFDIR, 0), ('..', statmod.S_IFDIR, 0)] + entries

        def opendir(self, path):   # the kernel opens only what getattr called a folder
            return 0

        def releasedir(self, path, fh):
            return 0

        def flush(self, path, fh):
            return 0

        def open(self, path, flags):
            return os.open(source + path, os.O_RDONLY)

        def read(self, path, size, offset, fh):
            return os.pread(fh, size, offset)

        def release(self, path, fh):
            return os.close(fh)

        def readlink(self, path):
            return os.readlink(source + path)

        def access(self, path, amode):
            if not os.access(source + path, amode):
                raise mfusepy.FuseOSError(errno.EACCES)
            return 0

        def statfs(self, path):
            sv = os.statvfs(source + path)
            return {k: getattr(sv, k) for k in dir(sv) if k.startswith('f_')}

    for name in ('getattr', 'readdir', 'opendir', 'releasedir', 'open', 'read', 'flush', 'release',
                 'readlink', 'access', 'statfs'):
        setattr(Passthrough, name, counted(name, getattr(Passthrough, name)))

    # Linux's timer slack (50 us) would lengthen every sleep
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(29, 1, 0, 0, 0)   # PR_SET_TIMERSLACK, 1 ns
    # before any thread starts
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1, signal.SIGUSR2})
    write()   # the file exists (seq 1) before the mount appears
    threading.Thread(target=on_signals, daemon=True).start()
    mfusepy.FUSE(Passthrough(), mountpoint, foreground=True, nothreads=True, **OPTIONS)


def type_bits(entry):
    """The S_IFMT bits of a source entry, from its d_type (no stat of the source)."""
    return (statmod.S_IFLNK if entry.is_symlink()
            else statmod.S_IFDIR if entry.is_dir(follow_symlinks=False)
            else statmod.S_IFREG if entry.is_file(follow_symlinks=False) else 0)


class Mount:
    """A running server, as `mounted` yields it."""

    def __init__(self, proc, mountpoint, stats_file, log_file):
        self.proc, self.pid, self.mountpoint, self.stats_file, self.log_file = (
            proc, proc.pid, mountpoint, stats_file, log_file)

    def counts(self):
        """{operation name: count} since the start or the last reset()."""
        return self._ask(signal.SIGUSR1)

    def reset(self):
        self._ask(signal.SIGUSR2)

    def total(self, kinds=None):
        counts = self.counts()
        return sum(n for k, n in counts.items() if kinds is None or k in kinds)

    def stderr(self):
        with open(self.log_file, errors='replace') as f:
            return f.read()

    def _read(self):
        with contextlib.suppress(FileNotFoundError, ValueError):
            with open(self.stats_file) as f:
                return json.load(f)
        return None

    def _ask(self, sig, timeout=10.0):
        before = (self._read() or {}).get('seq', 0)
        os.kill(self.pid, sig)
        deadline = time.monotonic() + timeout
        while True:
            state = self._read()
            if state and state['seq'] > before:
                return state['counts']
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f'fsemu server (pid {self.pid}, exit {self.proc.poll()}) wrote '
                                   f'no counts within {timeout} s; its stderr:\n{self.stderr()}')
            time.sleep(0.001)


@contextlib.contextmanager
def mounted(source, mountpoint, latency=0.0005, names_only=False, timeout=20.0):
    """Serve SOURCE at MOUNTPOINT (an existing empty folder) in a subprocess; yields a Mount.
    Unmounts and stops that process on exit, exceptions included."""
    mountpoint, work = os.path.realpath(mountpoint), tempfile.mkdtemp(prefix='fsemu-')
    stats_file, log_file = os.path.join(work, 'counts.json'), os.path.join(work, 'server.log')
    cmd = [sys.executable, HERE, 'serve', source, mountpoint, '--latency', str(latency),
           '--stats', stats_file] + (['--names-only'] if names_only else [])
    with open(log_file, 'w') as log:   # a file, not a pipe: a full pipe would block the server
        proc = subprocess.Popen(cmd, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
    fs = Mount(proc, mountpoint, stats_file, log_file)
    try:
        deadline = time.monotonic() + timeout
        while not is_mounted(mountpoint):
            if proc.poll() is not None or time.monotonic() > deadline:
                exited = proc.poll() is not None
                why = f'its server exited ({proc.returncode})' if exited else f'after {timeout} s'
                raise RuntimeError(f'fsemu: {mountpoint} not mounted: {why}; its stderr:\n'
                                   f'{fs.stderr()}')
            time.sleep(0.01)
        yield fs
    finally:
        unmount(mountpoint)   # the server returns from its loop once unmounted
        for stop in (None, proc.terminate, proc.kill):   # this process only, by its pid
            if stop:
                stop()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
                break
        unmount(mountpoint)   # a killed server leaves a dead mount (ENOTCONN)
        shutil.rmtree(work, ignore_errors=True)


def is_mounted(mountpoint):
    """From the mount table: os.path.ismount would ask the server (a counted getattr) and calls a
    dead FUSE mount (ENOTCONN) not mounted."""
    with open('/proc/self/mounts') as f:
        return any(line.split()[1] == mountpoint.replace(' ', '\\040') for line in f)


def unmount(mountpoint):
    if not is_mounted(mountpoint):
        return
    tool = ['fusermount3', '-u'] if shutil.which('fusermount3') else ['umount']
    if subprocess.run(tool + [mountpoint], capture_output=True).returncode != 0:
        # busy: detach it now, freed when closed
        subprocess.run(tool + ['-z', mountpoint], capture_output=True)


@functools.lru_cache(maxsize=None)
def why_unavailable():
    """None when the emulator works here, else one sentence saying why not (for pytest.skip)."""
    if os.geteuid() != 0:
        return 'the emulated shared file system (tests/fsemu.py) mounts FUSE as root; not root'
    if not os.path.exists('/dev/fuse'):
        return 'no /dev/fuse: this machine or container cannot serve FUSE file systems'
    if not shutil.which('fusermount3'):
        return 'fusermount3 not found: apt-get install fuse3 libfuse3-3'
    try:
        importlib.import_module('mfusepy')
    except Exception as e:   # ImportError, or OSError when libfuse is missing
        return (f'the FUSE binding mfusepy is not usable ({e}): pip install mfusepy==3.1.1 '
                f'(libfuse3-3 from apt)')
    with tempfile.TemporaryDirectory(prefix='fsemu-trial-') as d:
        src, mnt = os.path.join(d, 'src'), os.path.join(d, 'mnt')
        os.makedirs(os.path.join(src, 'x'))
        os.makedirs(mnt)
        try:
            with mounted(src, mnt, latency=0, timeout=10) as fs:
                if os.listdir(mnt) != ['x'] or not fs.counts().get('readdir'):
                    return 'a trial FUSE mount listed the wrong names or counted no readdir'
        except Exception as e:
            return f'a trial FUSE mount failed: {str(e).strip()[:300]}'
    return None


def make_tree(root, classes=1000, train_per_class=10, val_per_class=2, seed=0):
    """An ImageNet-shaped tree: root/train/<wnid>/<wnid>_<i>.JPEG and
    root/val/<wnid>/ILSVRC2012_val_<n>.JPEG, every file a decodable 32x32 JPEG of a random colour
    per class (one encoding per class, its bytes reused). Returns the counts of classes, files and
    folders."""
    from PIL import Image
    rng = random.Random(seed)
    wnids = [f'n{w:08d}' for w in sorted(rng.sample(range(1_000_000, 16_000_000), classes))]
    n_val = 0
    for wnid in wnids:
        buf = io.BytesIO()
        colour = tuple(rng.randrange(256) for _ in range(3))
        Image.new('RGB', (32, 32), colour).save(buf, 'JPEG', quality=90)
        data = buf.getvalue()
        names = [('train', f'{wnid}_{i}.JPEG') for i in range(train_per_class)]
        names += [('val', f'ILSVRC2012_val_{n_val + i + 1:08d}.JPEG') for i in range(val_per_class)]
        n_val += val_per_class
        for split in ('train', 'val'):
            os.makedirs(os.path.join(root, split, wnid), exist_ok=True)
        for split, name in names:   # os.open/write/close: 3 system calls, half of what open() makes
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
            fd = os.open(os.path.join(root, split, wnid, name), flags, 0o644)
            os.write(fd, data)
            os.close(fd)
    train, val = classes * train_per_class, classes * val_per_class
    return {'classes': classes, 'train': train, 'val': val, 'files': train + val,
            'dirs': 2 + 2 * classes}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    sub = p.add_subparsers(dest='command', required=True)
    s = sub.add_parser('serve', help='serve SOURCE read-only at MOUNTPOINT, in the foreground')
    s.add_argument('source'), s.add_argument('mountpoint')
    s.add_argument('--latency', type=float, default=0.0005,
                   help='seconds slept before each operation')
    s.add_argument('--stats', required=True,
                   help='JSON file the counts are written to on SIGUSR1/SIGUSR2')
    s.add_argument('--names-only', action='store_true',
                   help='readdir gives no type bits (DT_UNKNOWN)')
    t = sub.add_parser('tree', help='make an ImageNet-shaped tree of tiny JPEGs (make_tree)')
    t.add_argument('root')
    for flag, default in (('--classes', 1000), ('--train-per-class', 10), ('--val-per-class', 2)):
        t.add_argument(flag, type=int, default=default)
    args = p.parse_args(argv)
    if args.command == 'serve':
        serve(args.source, args.mountpoint, args.latency, os.path.abspath(args.stats),
              args.names_only)
    else:
        counts = make_tree(args.root, args.classes, args.train_per_class, args.val_per_class)
        print(json.dumps(counts))


if __name__ == '__main__':
    main()
