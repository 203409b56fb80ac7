"""The dataset's index (data.index): one listing per job, kept in the cache folder and reused class
folder by class folder while their modification times do not move; a change (a file gained or lost),
a folder too recent to trust, a damaged index or --rescan-data lists again. The file lists are those
of a fresh scan. Odd entries (FIFO, socket, dangling or looping link, unreadable folder) are named,
never a traceback.

The metadata operations of a multi-rank start on a slow shared file system:
tests/test_fsemu_start.py.

python -m pytest -q tests/test_index.py"""
import os
import socket

import pytest

from dlojzlib.data import folder, index
from dlojzlib.errors import DataError

OLD = 1_600_000_000  # 2020: far older than the racy window


def make_tree(root, classes=3, per_class=4, val=2):
    for split, n in (('train', per_class), ('val', val)):
        for c in range(classes):
            d = root / split / f'c{c}'
            d.mkdir(parents=True)
            for i in range(n):
                (d / f'{i}.JPEG').write_bytes(b'x')
    age(root)
    return root


def age(root, when=OLD):
    """Folders' modification times into the past, as a dataset copied long ago."""
    for dirpath, _, _ in os.walk(root):
        os.utime(dirpath, (when, when))


class Scans:
    """Counts os.scandir calls: the listing of a folder."""

    def __init__(self, monkeypatch):
        self.paths = []
        real = os.scandir
        monkeypatch.setattr(os, 'scandir', lambda p: (self.paths.append(str(p)), real(p))[1])


def listing(root):
    """Both splits' folders, listed afresh."""
    return {s: folder.list_split(str(root / s))[0] for s in ('train', 'val')}


def listed(root, cache, **kw):
    compact, cost = index.list_imagefolder(str(root), str(cache), **kw)
    return index.expand(str(root), compact), cost


def test_the_second_job_lists_nothing_and_gets_the_same_lists(tmp_path, monkeypatch):
    root, cache = make_tree(tmp_path / 'data'), tmp_path / 'cache'
    first, cost = listed(root, cache)
    assert first == folder.scan_imagefolder(str(root))  # the fresh scan's classes and samples
    assert (cost['folders'], cost['folders_listed'], cost['kept_index']) == (6, 6, False)
    scans = Scans(monkeypatch)
    second, cost = listed(root, cache)
    assert second == first and (cost['folders_listed'], cost['kept_index']) == (0, True)
    # the split folders: one read each
    assert sorted(scans.paths) == [str(root / 'train'), str(root / 'val')]


def test_a_changed_class_folder_is_listed_again(tmp_path, monkeypatch):
    root, cache = make_tree(tmp_path / 'data'), tmp_path / 'cache'
    listed(root, cache)
    (root / 'train' / 'c1' / 'new.JPEG').write_bytes(b'x')  # a file gained: c1's time moves
    os.remove(root / 'val' / 'c2' / '0.JPEG')               # a file lost
    (root / 'train' / 'c3').mkdir()                         # a class gained
    (root / 'train' / 'c3' / '0.JPEG').write_bytes(b'x')
    (root / 'val' / 'c3').mkdir()
    (root / 'val' / 'c3' / '0.JPEG').write_bytes(b'x')
    for changed in ('train/c1', 'val/c2', 'train/c3', 'val/c3'):  # a while ago, after the listing
        age(root / changed, OLD + 3600)
    scans = Scans(monkeypatch)
    (classes, train, val), cost = listed(root, cache)
    read = list(scans.paths)
    assert (classes, train, val) == folder.scan_imagefolder(str(root))
    assert cost['folders_listed'] == 4 and len(classes) == 4
    assert str(root / 'train' / 'c1' / 'new.JPEG') in [p for p, _ in train]
    assert str(root / 'val' / 'c2' / '0.JPEG') not in [p for p, _ in val]
    assert str(root / 'train' / 'c0') not in read and str(root / 'train' / 'c1') in read


def test_a_folder_changed_just_now_is_not_trusted_next_time(tmp_path):
    root, cache = make_tree(tmp_path / 'data'), tmp_path / 'cache'
    # its time is now: a coarse clock could hide another change
    (root / 'train' / 'c0' / 'late.JPEG').write_bytes(b'x')
    assert listed(root, cache)[1]['folders_listed'] == 6
    assert listed(root, cache)[1]['folders_listed'] == 1       # c0 again, and only c0


def test_rescan_a_damaged_index_and_an_unwritable_cache(tmp_path):
    root, cache = make_tree(tmp_path / 'data'), tmp_path / 'cache'
    listed(root, cache)
    assert listed(root, cache, rescan=True)[1]['folders_listed'] == 6
    path = index.index_path(str(cache), str(root))
    # a job killed while writing cannot leave this (written and renamed), but a disk can
    with open(path, 'r+b') as f:
        f.truncate(100)
    got, cost = listed(root, cache)
    assert cost['folders_listed'] == 6 and got == folder.scan_imagefolder(str(root))
    notes = []
    blocked = tmp_path / 'file'
    blocked.write_text('')  # a cache "folder" that is a file: the index cannot be kept there
    got, cost = index.list_imagefolder(str(root), str(blocked), log=notes.append)
    assert cost['index'] is None
    assert 'could not be kept' in notes[0] and 'the next job lists' in notes[0]
    # no temporary file left
    assert not [n for n in os.listdir(os.path.dirname(path)) if n.startswith('.')]


def test_another_folder_never_reads_this_index(tmp_path):
    a, b = make_tree(tmp_path / 'a'), make_tree(tmp_path / 'b', classes=2)
    cache = tmp_path / 'cache'
    listed(a, cache)
    (classes, _, _), cost = listed(b, cache)
    assert classes == ['c0', 'c1'] and cost['folders_listed'] == 4
    os.symlink(a, tmp_path / 'link')  # the same folder by another name shares its index
    assert listed(tmp_path / 'link', cache)[1]['folders_listed'] == 0


def test_odd_entries_are_named_never_a_traceback(tmp_path):
    root = make_tree(tmp_path / 'data')
    c0 = root / 'train' / 'c0'
    os.mkfifo(c0 / 'fifo.JPEG')
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(c0 / 'sock.JPEG'))
    os.symlink('nowhere.JPEG', c0 / 'dangling.JPEG')
    os.symlink('loop.JPEG', c0 / 'loop.JPEG')
    os.symlink('loopdir', root / 'train' / 'loopdir')  # a class "folder" that loops: not a class
    warnings = []
    classes, train, _ = folder.imagefolder_samples(str(root), listing(root), warnings.append)
    assert classes == ['c0', 'c1', 'c2'] and len(train) == 12
    assert len(warnings) == 1 and '4 image name(s) are not regular files' in warnings[0]
    for name in ('fifo.JPEG', 'sock.JPEG', 'dangling.JPEG', 'loop.JPEG'):
        assert name in warnings[0]


def test_an_unreadable_class_folder_is_named(tmp_path, monkeypatch):
    root = make_tree(tmp_path / 'data')
    real = os.scandir

    def scandir(p):  # root reads every folder: EACCES as a user would meet it
        if str(p).endswith(os.path.join('train', 'c1')):
            raise PermissionError(13, 'Permission denied')
        return real(p)
    monkeypatch.setattr(os, 'scandir', scandir)
    warnings = []
    with pytest.raises(DataError, match='train/ and val/ of .* hold different classes'):
        folder.imagefolder_samples(str(root), listing(root), warnings.append)
    assert 'c1/(the folder: Permission denied)' in warnings[0]


def test_missing_data_folder_keeps_its_sentence(tmp_path):
    with pytest.raises(DataError, match='does not exist; give a folder with train/'):
        index.list_imagefolder(str(tmp_path / 'nope'), str(tmp_path / 'cache'))


def test_a_process_outside_a_group_lists_for_itself_whatever_its_rank(tmp_path):
    """A tool or test standing in for rank 1 has no rank 0 to hear from: it lists the folder itself
    (CI's DALI stage got None here, and a TypeError)."""
    from types import SimpleNamespace
    root = make_tree(tmp_path / 'data')
    on_ranks = lambda fn, when=True: fn() if when else None  # noqa: E731 (no group: launch's way)
    got = index.shared(lambda: index.list_imagefolder(str(root), str(tmp_path / 'cache')),
                       SimpleNamespace(rank=1, world_size=2), on_ranks)
    by_hand = tuple([(str(root / split / f'c{c}' / f'{i}.JPEG'), c) for c in range(3)
                     for i in range(n)] for split, n in (('train', 4), ('val', 2)))
    assert index.expand(str(root), got[0])[1:] == by_hand


def test_the_default_cache_follows_xdg_cache_home():
    from dlojzlib import flags
    got = flags.default_cache_dir({'XDG_CACHE_HOME': '/scratch/me/cache'})
    assert got == '/scratch/me/cache/dlojz'
    for unset in ({}, {'XDG_CACHE_HOME': ''}, {'XDG_CACHE_HOME': 'relative'}):
        assert flags.default_cache_dir(unset) == '~/.cache/dlojz'
    # the test session's own: a temporary folder (conftest), so no test writes to the user's cache
    assert flags.get_args_parser().parse_args([]).cache_dir.startswith(os.environ['XDG_CACHE_HOME'])
    assert not flags.get_args_parser().parse_args([]).cache_dir.startswith(os.path.expanduser('~'))
