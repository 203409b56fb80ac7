"""The emulated shared file system (tests/fsemu.py) counts, slows down and serializes what it
serves. Each check would fail with a server that cached in the kernel, did not sleep, or served
several requests at once."""
import contextlib
import os
import subprocess
import sys
import tempfile
import time

import pytest

import fsemu

pytestmark = pytest.mark.slow

K = 40              # files in the listed folder
LATENCY = 0.002     # seconds per operation: 40 stats (about 120 operations) take 0.24 s or more


@pytest.fixture(scope='module')
def source(tmp_path_factory):
    root = tmp_path_factory.mktemp('fsemu-source')
    (root / 'd').mkdir()
    for i in range(K):
        (root / 'd' / f'f{i:02d}.JPEG').write_bytes(b'x')
    return str(root)


@contextlib.contextmanager
def mount(source, **kwargs):
    reason = fsemu.why_unavailable()
    if reason:
        pytest.skip(reason)
    mountpoint = tempfile.mkdtemp(prefix='fsemu-mnt-')
    try:
        with fsemu.mounted(source, mountpoint, **kwargs) as fs:
            yield fs
    finally:
        os.rmdir(mountpoint)   # not rmtree: were it still mounted, that would walk the source


@pytest.fixture(scope='module')
def fs(source):
    with mount(source, latency=LATENCY) as fs:
        yield fs


def quiet_reset(fs):
    """reset() once the kernel's asynchronous releases (releasedir after a listing) have been
    served."""
    time.sleep(0.1)
    fs.reset()


def test_a_listing_and_every_stat_are_counted_each_time(fs):
    folder = os.path.join(fs.mountpoint, 'd')
    quiet_reset(fs)
    names = os.listdir(folder)
    assert len(names) == K
    counts = fs.counts()
    assert counts.get('opendir', 0) >= 1 and counts.get('readdir', 0) >= 1, counts
    quiet_reset(fs)
    for name in names:
        os.stat(os.path.join(folder, name))
    first = fs.counts()
    assert first.get('getattr', 0) >= K, first
    fs.reset()
    for name in names:
        os.stat(os.path.join(folder, name))
    assert fs.counts() == first   # no kernel cache of entries or attributes: the same operations
    quiet_reset(fs)
    os.listdir(folder)
    os.listdir(folder)
    assert fs.counts().get('readdir', 0) >= 2   # nor of listings


def test_each_operation_waits_for_the_latency(fs):
    folder = os.path.join(fs.mountpoint, 'd')
    quiet_reset(fs)
    start = time.perf_counter()
    for i in range(K):
        os.stat(os.path.join(folder, f'f{i:02d}.JPEG'))
    elapsed = time.perf_counter() - start
    ops = fs.total()
    assert ops >= K
    assert elapsed >= ops * LATENCY, (elapsed, ops)


def test_reset_zeroes_the_counts(fs):
    os.listdir(os.path.join(fs.mountpoint, 'd'))
    assert fs.total(['opendir', 'readdir']) >= 2
    quiet_reset(fs)
    assert fs.counts() == {}
    assert fs.total() == 0


CLIENT = r'''
import os, sys, time
folder, passes = sys.argv[1], int(sys.argv[2])
print('ready', flush=True)
sys.stdin.readline()   # go: both clients are up
began = time.time()
for _ in range(passes):
    for name in os.listdir(folder):
        os.stat(os.path.join(folder, name))
print(began, time.time())
'''


def test_two_processes_are_served_one_operation_at_a_time(fs):
    """Two clients listing at the same time: a server handling their requests concurrently would
    finish in about half the sum of the latencies; one thread cannot finish before that sum."""
    folder = os.path.join(fs.mountpoint, 'd')
    quiet_reset(fs)
    clients = [subprocess.Popen([sys.executable, '-c', CLIENT, folder, '3'], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True) for _ in range(2)]
    for client in clients:   # started together, once both interpreters are up
        assert client.stdout.readline() == 'ready\n'
    for client in clients:
        client.stdin.write('go\n')
        client.stdin.flush()
    spans = []
    for client in clients:
        out, _ = client.communicate(timeout=60)
        assert client.returncode == 0
        spans.append([float(x) for x in out.split()])
    time.sleep(0.1)   # the last releasedir
    ops = fs.total()
    assert ops >= 2 * 3 * K
    assert max(b for b, _ in spans) < min(e for _, e in spans), spans   # they ran at the same time
    wall = max(e for _, e in spans) - min(b for b, _ in spans)
    # - 2: the releasedirs served after a client's last clock read
    assert wall >= (ops - 2) * LATENCY, (wall, ops)


def test_names_only_listing_costs_a_getattr_per_entry(source):
    """With the entries' types in readdir (the default, as Lustre and GPFS give d_type),
    os.scandir's entry.is_file() asks the server nothing; with names only (DT_UNKNOWN) it costs an
    lstat per entry."""
    getattrs = {}
    for names_only in (False, True):
        with mount(source, latency=0, names_only=names_only) as fs:
            quiet_reset(fs)
            with os.scandir(os.path.join(fs.mountpoint, 'd')) as entries:
                assert sum(entry.is_file() for entry in entries) == K
            getattrs[names_only] = fs.counts().get('getattr', 0)
    assert getattrs[False] < 5 and getattrs[True] >= K, getattrs


def test_make_tree_is_imagenet_shaped_with_decodable_jpegs(tmp_path):
    from PIL import Image
    counts = fsemu.make_tree(str(tmp_path), classes=3, train_per_class=2, val_per_class=1)
    assert counts == {'classes': 3, 'train': 6, 'val': 3, 'files': 9, 'dirs': 8}
    classes = sorted(os.listdir(tmp_path / 'train'))
    assert classes == sorted(os.listdir(tmp_path / 'val'))
    assert all(c.startswith('n') for c in classes)
    first = classes[0]
    assert sorted(os.listdir(tmp_path / 'train' / first)) == [f'{first}_0.JPEG', f'{first}_1.JPEG']
    val_names = sorted(n for c in classes for n in os.listdir(tmp_path / 'val' / c))
    assert val_names == [f'ILSVRC2012_val_{i:08d}.JPEG' for i in (1, 2, 3)]
    with Image.open(tmp_path / 'val' / classes[2] / val_names[2]) as im:
        assert im.format == 'JPEG' and im.size == (32, 32)
        im.load()
