"""The files of a shards folder and of its staged copy, read back through dlojzlib/readers.py
(issue 49: nothing read on trust):

- index.json: every field checked (counts are integers that match the tables, shard names plain
  names of the folder: `../x` or `/etc/passwd` is never opened, nor written to by staging);
- the index-<split>.npy tables: read without pickles and without allocating what a damaged header
  promises, checked against index.json (shards, labels, offsets inside the shard files);
- a FIFO, a folder or a device at any of these paths, at a shard, at the staging journal or its
  marker, or at prepare's own files: refused in one sentence, without blocking;
- the staging journal: a damaged line means its file is copied again; prepare's sidecar: a damaged
  one means its shard is written again; a damaged prepare.json is named with the fix;
- property tests: any bytes or JSON at each of these files gives a value or one sentence within a
  second.

Run: python -m pytest -q tests/test_shards_reader.py"""
import io
import json
import os
import shutil
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from hypothesis.extra import numpy as hnp
from PIL import Image

from dlojzlib.data import shards as S
from dlojzlib.data import stage as G
from dlojzlib.errors import DataError
from strategies import json_values, paths_of, replaced

JSON = json_values(text=12, keys=8, size=4, leaves=12)
# the fixture's shards: 2048 bytes each; rows of (shard, offset, size, label), 2 classes
SHARD_BYTES = 2048
TABLES = {'train': [[0, 512, 100, 0], [0, 1024, 50, 1], [1, 512, 200, 1]],
          'val': [[0, 512, 10, 0], [0, 1536, 512, 1]]}
NAMES = {'train': ['train-00000.tar', 'train-00001.tar'], 'val': ['val-00000.tar']}
FAST = dict(deadline=1000, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                  HealthCheck.too_slow])


def make_shards(root):
    """A shards folder as prepare writes it, by hand: small shards of dummy bytes (load_index reads
    their sizes only; staging copies them)."""
    os.makedirs(root)
    index = {'format': S.FORMAT, 'classes': ['a', 'b'], 'max_side': None, 'splits': {}}
    for split, rows in TABLES.items():
        np.save(os.path.join(root, f'index-{split}.npy'), np.array(rows, dtype=np.int64))
        for name in NAMES[split]:
            with open(os.path.join(root, name), 'wb') as f:
                f.write(bytes(SHARD_BYTES))
        index['splits'][split] = {
            'shards': [{'name': n, 'samples': sum(r[0] == k for r in rows)}
                       for k, n in enumerate(NAMES[split])],
            'samples': len(rows)}
    with open(os.path.join(root, 'prepare.json'), 'w') as f:
        json.dump({}, f)
    with open(os.path.join(root, S.INDEX), 'w') as f:
        json.dump(index, f)
    return index


@pytest.fixture(scope='module')
def folder(tmp_path_factory):
    """-> (a shards folder, its index): tests that damage it restore it."""
    root = str(tmp_path_factory.mktemp('shards') / 'ds')
    return root, make_shards(root)


@pytest.fixture
def fresh(tmp_path):
    root = str(tmp_path / 'ds')
    return root, make_shards(root)


def write_index(root, index):
    with open(os.path.join(root, S.INDEX), 'w') as f:
        json.dump(index, f)


def one_sentence(e, names):
    """A DataError: one line naming the damaged file, with the fix."""
    text = str(e)
    assert '\n' not in text and 'Traceback' not in text, text
    assert any(n in text for n in names), text
    return text


def checked(root, value):
    """What load_index gives is safe to read by: names inside the folder, rows inside the shards."""
    classes, splits = value
    assert classes and all(c and '/' not in c and c not in ('.', '..') for c in classes)
    for names, table in splits.values():
        assert all('/' not in n and not n.startswith('.') for n in names)
        assert table.dtype == np.int64 and table.ndim == 2 and table.shape[1] == 4
        shard, offset, size, label = table.T
        assert shard.min() >= 0 and shard.max() < len(names) and label.min() >= 0
        assert label.max() < len(classes) and offset.min() >= 0 and size.min() > 0
        ends = [os.path.getsize(os.path.join(root, n)) for n in names]
        assert all(o + s <= ends[k] for k, o, s, _ in table.tolist())


def in_thread(fn, unblock, limit_s=5):
    """fn() in a thread -> what it returned or raised; fails (after unblocking it) if it blocks."""
    out = []

    def run():
        try:
            out.append(fn())
        except BaseException as e:  # noqa: B902 - handed back to the test
            out.append(e)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(limit_s)
    if t.is_alive():
        unblock()
        t.join(limit_s)
        pytest.fail(f'{fn} blocked')
    return out[0]


def special(path, kind):
    """Put a FIFO, a folder or a device (a link to /dev/zero) at path -> what unblocks a reader."""
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)
    make = {'fifo': os.mkfifo, 'folder': os.mkdir, 'device': lambda p: os.symlink('/dev/zero', p)}
    make[kind](path)

    def unblock():
        if kind == 'fifo':
            fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)  # a writer and a reader: the open returns
            os.close(fd)
    return unblock


# ------------------------------------------------------------------------------------------------
# index.json and the tables

@pytest.mark.parametrize('name', ['../../escape.tar', '/etc/passwd', 'sub/train-00000.tar',
                                  '.dlojz-staged.json', '..', ''])
def test_a_shard_name_out_of_the_folder_is_never_opened(fresh, name):
    """Before: '/etc/passwd' was opened and its size read ('/etc/passwd is damaged'), '../x' was
    looked for outside the folder ('incomplete')."""
    root, index = fresh
    index['splits']['train']['shards'][0]['name'] = name
    write_index(root, index)
    with pytest.raises(DataError) as e:
        S.load_index(root)
    text = one_sentence(e.value, [root])
    assert f'{os.path.join(root, S.INDEX)} is damaged' in text and \
        'splits.train.shards[0].name' in text and f'delete {root} and prepare it again' in text


@pytest.mark.parametrize('edit, words', [
    (lambda i: i['splits']['train'].update(samples='3'), "the text '3' at splits.train.samples"),
    (lambda i: i['splits']['val']['shards'][0].update(samples=-1), 'splits.val.shards[0].samples'),
    (lambda i: i['splits']['train']['shards'][1].update(samples=2), 'train-00001.tar'),
    (lambda i: i['splits']['val'].update(samples=3), '3 samples'),
    (lambda i: i.update(format='dlojz-shards-v9'), 'at format'),
    (lambda i: i.update(classes=[]), 'no class'),
], ids=['a count that is text', 'a negative count', 'a shard count the table contradicts',
        'a split count the table contradicts', 'another format', 'no classes'])
def test_counts_are_integers_that_match_the_tables(fresh, edit, words):
    """Before: index.json's counts and format were never read, so any value passed."""
    root, index = fresh
    edit(index)
    write_index(root, index)
    with pytest.raises(DataError) as e:
        S.load_index(root)
    assert words in one_sentence(e.value, [root]), str(e.value)


@pytest.mark.parametrize('name', [S.INDEX, 'index-train.npy', 'train-00001.tar'])
@pytest.mark.parametrize('kind', ['fifo', 'folder', 'device'])
def test_a_special_file_in_a_shards_folder_is_refused_without_blocking(fresh, name, kind):
    """Before: a FIFO index.json blocked is_shards and load_index forever; a folder index.json made
    the folder an ImageFolder tree; a FIFO table or shard was called missing."""
    root, _ = fresh
    path = os.path.join(root, name)
    unblock = special(path, kind)
    assert in_thread(lambda: S.is_shards(root), unblock) is True
    e = in_thread(lambda: S.load_index(root), unblock)
    assert isinstance(e, DataError), e
    text = one_sentence(e, [path])
    assert f'{path} is damaged' in text and 'not a file' in text, text


def npy(shape, descr='<i8', data=b''):
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {'descr': descr, 'fortran_order': False,
                                               'shape': shape})
    return buf.getvalue() + data


@pytest.mark.parametrize('data, words', [
    (npy((10 ** 12, 4), data=bytes(64)), 'not a table numpy can read'),
    (npy((10 ** 6, 4), data=bytes(64)), 'not a table numpy can read'),
    (b'PK\x03\x04' + bytes(100), 'not a table numpy can read'),
    (npy((3, 4), '|O', bytes(24)), 'where prepare writes rows of 4 integers'),
], ids=['a header of 10^12 rows', 'a header of more rows than bytes', 'a zip (npz)', 'objects'])
def test_a_table_is_read_by_its_header_without_trusting_it(fresh, data, words):
    """Before: numpy allocated what the header promised (MemoryError, a traceback), and read a zip
    at that name as an npz archive (AttributeError)."""
    root, _ = fresh
    path = os.path.join(root, 'index-train.npy')
    with open(path, 'wb') as f:
        f.write(data)
    with pytest.raises(DataError) as e:
        S.load_index(root)
    assert f'{path} is damaged' in one_sentence(e.value, [path]) and words in str(e.value)


def test_a_good_folder_reads_whole(fresh):
    root, index = fresh
    checked(root, S.load_index(root))


# ------------------------------------------------------------------------------------------------
# Property tests: any bytes or JSON at each file

def restore(root, name, data):
    path = os.path.join(root, name)
    if os.path.isdir(path):
        shutil.rmtree(path)
    with open(path, 'wb') as f:
        f.write(data)


def answer(root, index):
    try:
        value = S.load_index(root)
    except DataError as e:
        one_sentence(e, [root])
    else:
        checked(root, value)


@settings(max_examples=100, **FAST)
@given(st.binary(max_size=400))
def test_any_bytes_at_index_json_give_the_index_or_one_sentence(folder, data):
    root, index = folder
    path = os.path.join(root, S.INDEX)
    keep = open(path, 'rb').read()
    try:
        restore(root, S.INDEX, data)
        assert S.is_shards(root) in (True, False)
        answer(root, index)
    finally:
        restore(root, S.INDEX, keep)


@settings(max_examples=100, **FAST)
@given(data=st.data())
def test_any_json_in_index_json_gives_the_index_or_one_sentence(folder, data):
    """Each place of a good index replaced by any JSON value (a name, a count, a split...)."""
    root, index = folder
    at = data.draw(st.sampled_from(list(paths_of(index))))
    new = data.draw(JSON | st.sampled_from(['../x', '/etc/passwd', 'val-00000.tar', -1, 10 ** 30]))
    keep = open(os.path.join(root, S.INDEX), 'rb').read()
    try:
        write_index(root, replaced(index, at, new))
        answer(root, index)
    finally:
        restore(root, S.INDEX, keep)


TABLE = hnp.arrays(st.sampled_from([np.int64, np.int32, np.uint64, np.float64, np.bool_]),
                   hnp.array_shapes(min_dims=1, max_dims=3, max_side=5))


@settings(max_examples=100, **FAST)
@given(st.binary(max_size=300) | TABLE.map(lambda a: npy(a.shape, a.dtype.str, a.tobytes()))
       | st.builds(lambda n, d: npy((n, 4), data=d), st.integers(0, 10 ** 15),
                   st.binary(max_size=200)))
def test_any_bytes_at_a_table_give_the_index_or_one_sentence(folder, data):
    root, index = folder
    keep = open(os.path.join(root, 'index-train.npy'), 'rb').read()
    try:
        restore(root, 'index-train.npy', data)
        answer(root, index)
    finally:
        restore(root, 'index-train.npy', keep)


@settings(max_examples=100, **FAST)
@given(hnp.arrays(np.int64, st.tuples(st.integers(1, 6), st.just(4)),
                  elements=st.integers(-2, 3000) | st.integers(-2 ** 63, 2 ** 63 - 1)))
def test_any_rows_in_a_table_give_the_index_or_one_sentence(folder, table):
    """Rows of 4 integers: whatever their values, load_index gives rows that read inside their
    shards, or one sentence."""
    root, index = folder
    keep = open(os.path.join(root, 'index-train.npy'), 'rb').read()
    try:
        np.save(os.path.join(root, 'index-train.npy'), table)
        answer(root, index)
    finally:
        restore(root, 'index-train.npy', keep)


# ------------------------------------------------------------------------------------------------
# Staging: the source's index, the journal and the marker

def quiet(m):
    pass


def same_copy(root, dest):
    names = [n for n, _, _ in G.files_to_copy(root)]
    return all(open(os.path.join(root, n), 'rb').read() == open(os.path.join(dest, n), 'rb').read()
               for n in names)


@pytest.fixture
def staged(fresh, tmp_path):
    """-> (the shards folder, --stage-dir, the complete copy's folder)."""
    root, _ = fresh
    stage_dir = str(tmp_path / 'local')
    os.makedirs(stage_dir)
    G.stage(root, stage_dir, log=quiet)
    return root, stage_dir, G.destination(root, stage_dir)


def test_staging_never_writes_out_of_its_folder(fresh, tmp_path):
    """Before: a shard named '../escape.tar' in index.json was copied to --stage-dir/escape.tar,
    beside the copy's folder."""
    root, index = fresh
    with open(tmp_path / 'escape.tar', 'wb') as f:
        f.write(bytes(SHARD_BYTES))
    index['splits']['train']['shards'][0]['name'] = '../escape.tar'
    write_index(root, index)
    stage_dir = tmp_path / 'local'
    with pytest.raises(DataError) as e:
        G.stage(root, str(stage_dir), log=quiet)
    assert f'{os.path.join(root, S.INDEX)} is damaged' in one_sentence(e.value, [root])
    assert not (stage_dir / 'escape.tar').exists()


def test_a_damaged_index_is_one_sentence_when_staging(fresh, tmp_path):
    """Before: AttributeError ('list' object has no attribute 'values')."""
    root, index = fresh
    write_index(root, dict(index, splits=[]))
    with pytest.raises(DataError) as e:
        G.stage(root, str(tmp_path / 'local'), log=quiet)
    assert f'{os.path.join(root, S.INDEX)} is damaged' in one_sentence(e.value, [root])


@pytest.mark.parametrize('lines', [b'5\n', b'[[1]]\n', b'\xff\xfe\n', b'["index.json", 1'],
                         ids=['a number', 'a list in a list', 'not UTF-8', 'a cut line'])
def test_a_damaged_journal_means_copying_again(staged, lines):
    """Before: TypeError (a number, a list in a list) or UnicodeDecodeError at the next start."""
    root, stage_dir, dest = staged
    os.remove(os.path.join(dest, G.DONE))  # killed before the marker: the journal is read
    with open(os.path.join(dest, G.JOURNAL), 'wb') as f:
        f.write(lines)
    record = G.stage(root, stage_dir, log=quiet)
    assert record['copied_bytes'] == record['bytes'] and same_copy(root, dest)
    assert G.stage(root, stage_dir, log=quiet)['skipped']


@pytest.mark.parametrize('where', ['journal', 'marker', 'lock', 'source shard'])
@pytest.mark.parametrize('kind', ['fifo', 'folder'])
def test_a_special_file_when_staging_is_refused_without_blocking(staged, where, kind):
    """Before: a FIFO blocked the start for ever (journal, marker, lock, a source shard); a folder
    marker raised IsADirectoryError."""
    root, stage_dir, dest = staged
    path = {'journal': os.path.join(dest, G.JOURNAL), 'marker': os.path.join(dest, G.DONE),
            'lock': os.path.join(dest, '.lock'),
            'source shard': os.path.join(root, 'train-00001.tar')}[where]
    if where == 'journal':
        os.remove(os.path.join(dest, G.DONE))
    unblock = special(path, kind)
    e = in_thread(lambda: G.stage(root, stage_dir, log=quiet), unblock)
    assert isinstance(e, DataError), e
    assert 'not a file' in one_sentence(e, [path])


@settings(max_examples=30, **FAST)
@given(which=st.sampled_from([G.JOURNAL, G.DONE]),
       data=st.binary(max_size=200) | st.lists(JSON, max_size=4).map(
           lambda v: '\n'.join(map(json.dumps, v)).encode()))
def test_any_bytes_at_the_journal_or_marker_give_a_whole_copy(staged, which, data):
    root, stage_dir, dest = staged
    if which == G.JOURNAL and os.path.exists(os.path.join(dest, G.DONE)):
        os.remove(os.path.join(dest, G.DONE))
    with open(os.path.join(dest, which), 'wb') as f:
        f.write(data)
    G.stage(root, stage_dir, log=quiet)
    assert same_copy(root, dest) and G.stage(root, stage_dir, log=quiet)['skipped']


# ------------------------------------------------------------------------------------------------
# prepare's re-read of an earlier prepare: prepare.json and the sidecars

@pytest.fixture(scope='module')
def source(tmp_path_factory):
    """An ImageFolder tree of 8x8 JPEGs (~600 bytes): 2 classes, 3 train and 1 val image each."""
    root = tmp_path_factory.mktemp('src')
    for split, n in (('train', 3), ('val', 1)):
        for c, colour in (('a', 'red'), ('b', 'blue')):
            os.makedirs(root / split / c)
            for i in range(n):
                Image.new('RGB', (8, 8), colour).save(root / split / c / f'{i}.JPEG', quality=90)
    return str(root)


KB = 1 / 1024  # prepare's shard size is in MiB: 1 KiB holds two of these images


@pytest.fixture
def prepared(source, tmp_path):
    dst = str(tmp_path / 'dst')
    S.prepare(source, dst, shard_size_mb=KB, log=quiet)
    tables = {s: open(os.path.join(dst, f'index-{s}.npy'), 'rb').read() for s in ('train', 'val')}
    return dst, tables


def shifted(dst):
    """The first sidecar's rows, one byte off: as many rows as its shard, each of the right type."""
    path = os.path.join(dst, 'train-00000.tar.json')
    rows = json.load(open(path))
    with open(path, 'w') as f:
        json.dump([[k, off + 1, size, label, ext] for k, off, size, label, ext in rows], f)


@pytest.mark.parametrize('damage', [
    shifted,
    lambda dst: open(os.path.join(dst, 'train-00000.tar.json'), 'w').write('[["00000000", 5'),
    lambda dst: special(os.path.join(dst, 'train-00000.tar.json'), 'fifo'),
    lambda dst: special(os.path.join(dst, 'train-00000.tar'), 'fifo'),
], ids=['rows one byte off', 'a sidecar cut short', 'a FIFO sidecar', 'a FIFO shard'])
def test_a_damaged_sidecar_means_its_shard_is_written_again(source, prepared, damage):
    """Before: the shifted rows went into index-train.npy (every sample of the shard read one byte
    off), a cut sidecar was a JSONDecodeError, a FIFO sidecar blocked, a FIFO shard was listed."""
    dst, tables = prepared
    unblock = damage(dst) or (lambda: None)
    # stop_after=1: that shard alone is written again (a second one would raise KeyboardInterrupt)
    e = in_thread(lambda: S.prepare(source, dst, shard_size_mb=KB, log=quiet, stop_after=1),
                  unblock)
    assert not isinstance(e, BaseException), e
    assert open(os.path.join(dst, 'index-train.npy'), 'rb').read() == tables['train']
    checked(dst, S.load_index(dst))


def test_a_finished_prepare_is_kept_whole(source, prepared):
    """The sidecars prepare writes pass their own check: a second prepare writes no shard."""
    dst, tables = prepared
    assert len(os.listdir(dst)) == 12  # 3 train shards and 1 val shard, their sidecars, 4 files
    S.prepare(source, dst, shard_size_mb=KB, log=quiet, stop_after=0)
    assert open(os.path.join(dst, 'index-train.npy'), 'rb').read() == tables['train']


@pytest.mark.parametrize('damage', ['[1]', '{"format": ', 'fifo', 'folder'])
def test_a_damaged_prepare_json_is_named_with_the_fix(source, prepared, damage):
    """Before: AttributeError, JSONDecodeError, a start blocked for ever, IsADirectoryError."""
    dst, _ = prepared
    path = os.path.join(dst, 'prepare.json')
    if damage in ('fifo', 'folder'):
        unblock = special(path, damage)
    else:
        unblock = lambda: None  # noqa: E731
        open(path, 'w').write(damage)
    e = in_thread(lambda: S.prepare(source, dst, shard_size_mb=KB, log=quiet), unblock)
    assert isinstance(e, DataError), e
    assert 'choose another DST' in one_sentence(e, [path])


@settings(max_examples=30, **FAST)
@given(which=st.sampled_from(['prepare.json', 'train-00001.tar.json']),
       data=st.binary(max_size=200) | JSON.map(lambda v: json.dumps(v).encode()))
def test_any_bytes_at_prepares_own_files_give_the_same_shards_or_one_sentence(
        source, prepared, which, data):
    dst, tables = prepared
    path = os.path.join(dst, which)
    keep = open(path, 'rb').read()
    try:
        restore(dst, which, data)
        try:
            S.prepare(source, dst, shard_size_mb=KB, log=quiet)
        except DataError as e:
            assert which == 'prepare.json' and 'choose another DST' in one_sentence(e, [path])
        else:
            assert open(os.path.join(dst, 'index-train.npy'), 'rb').read() == tables['train']
    finally:
        restore(dst, which, keep)
