"""The kept dataset index read through dlojzlib.readers (issue 49), and the training set as
torchvision's ImageFolder sees it. An index of any other shape (a list where a class map belongs,
a class entry without files or null, numbers or `..` as file names, a FIFO at its path) is a new
listing equal to --rescan-data's, with a note, never a traceback, a hang or a sample outside its
class folder; `kept_index` is true only where a kept listing was used. The listing walks sub-folders
and reads torchvision's extensions (same samples, same labels as ImageFolder's); the training and
validation decoders accept the same images (size limits included); an empty $DLOJZ_DATA_DIR is
refused.

python -m pytest -q tests/test_index_reader.py"""
import json
import os
import threading
from argparse import Namespace

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from PIL import Image

from dlojzlib.data import datasets as D
from dlojzlib.data import decode, folder, gpu_decode, index
from dlojzlib.errors import UsageError
from strategies import json_values

OLD = 1_600_000_000  # s: 2020, far older than the racy window


def make_tree(root, classes=('cat', 'dog'), per_class=3, val=2):
    for split, n in (('train', per_class), ('val', val)):
        for c in classes:
            d = root / split / c
            d.mkdir(parents=True)
            for i in range(n):
                (d / f'{c}{i:03d}.jpg').write_bytes(b'x')
    age(root)
    return root


def age(root):
    for dirpath, _, _ in os.walk(root):
        os.utime(dirpath, (OLD, OLD))


def listed(root, cache, notes=None, **kw):
    notes = [] if notes is None else notes
    compact, cost = index.list_imagefolder(str(root), str(cache), log=notes.append,
                                           warn=lambda m: None, **kw)
    return index.expand(str(root), compact), cost


def tamper(root, cache, change):
    """The index a first job kept, changed by `change(kept)` and written back."""
    listed(root, cache)
    path = index.index_path(str(cache), str(root))
    with open(path) as f:
        kept = json.load(f)
    change(kept)
    with open(path, 'w') as f:
        json.dump(kept, f)
    return path


def fresh(root):
    return folder.scan_imagefolder(str(root), warn=lambda m: None)


def inside(got, root):
    """Every sample's path lies in its own class folder of its split."""
    classes, train, val = got
    for split, samples in (('train', train), ('val', val)):
        for path, label in samples:
            top = os.path.join(str(root), split, classes[label]) + os.sep
            assert os.path.normpath(path).startswith(top), path


def first_class(kept):
    return kept['splits']['train']['cat']


@pytest.mark.parametrize('change', [
    lambda k: k['splits'].__setitem__('train', list(k['splits']['train'].values())),
    lambda k: first_class(k).pop('files'),
    lambda k: k['splits']['train'].__setitem__('cat', None),
    lambda k: first_class(k).__setitem__('files', [0, 1, 2]),
    lambda k: first_class(k).__setitem__('files', 'cat000.jpg'),  # read letter by letter
    lambda k: first_class(k)['files'].append('../../val/dog/dog000.jpg'),
    lambda k: first_class(k)['files'].append('/etc/passwd'),
], ids=['train-a-list', 'no-files', 'null-class', 'numbers', 'a-string', 'dotdot', 'absolute'])
def test_an_index_of_the_wrong_shape_is_listed_again_with_a_note(tmp_path, change):
    root, cache = make_tree(tmp_path / 'data'), tmp_path / 'cache'
    path = tamper(root, cache, change)
    notes = []
    got, cost = listed(root, cache, notes)
    assert got == fresh(root)
    inside(got, root)
    assert cost['folders_listed'] == cost['folders'] and not cost['kept_index']
    assert len(notes) == 1 and path in notes[0] and 'listed again' in notes[0], notes
    assert listed(root, cache)[1]['kept_index']  # the new index is whole: the next job uses it


def test_an_index_without_splits_is_not_called_kept(tmp_path):
    root, cache = make_tree(tmp_path / 'data'), tmp_path / 'cache'
    tamper(root, cache, lambda k: k.__setitem__('splits', []))
    got, cost = listed(root, cache)
    assert got == fresh(root) and cost['folders_listed'] == 4 and cost['kept_index'] is False


def test_a_fifo_or_a_folder_at_the_index_path_does_not_block(tmp_path):
    root, cache = make_tree(tmp_path / 'data'), tmp_path / 'cache'
    path = index.index_path(str(cache), str(root))
    os.makedirs(os.path.dirname(path))
    os.mkfifo(path)
    result = {}
    t = threading.Thread(target=lambda: result.update(got=listed(root, cache)), daemon=True)
    t.start()
    t.join(20)
    if t.is_alive():  # today's open() waits for a writer: give it one, then fail
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        t.join(5)
        pytest.fail('the listing blocked on a FIFO at the index path')
    assert result['got'][0] == fresh(root)
    os.remove(path)
    os.mkdir(path)  # a folder: the index cannot be written there; a note, the same listing
    notes = []
    assert listed(root, cache, notes)[0] == fresh(root) and 'could not be kept' in notes[-1]


JSON = json_values(text=12, keys=8, size=4, leaves=24)
NAMES = st.sampled_from(['cat', 'dog', 'cat000.jpg', '..', '../dog', 'a/b.jpg', '', '/x', 0, None])
ENTRY = st.fixed_dictionaries({}, optional={
    # never the folders' real time (OLD): an index that names it is trusted by design (docs/data.md)
    'mtime_ns': st.sampled_from([None, 0, -1, OLD * 10 ** 9 + 1, 'x', 1.5]),
    'subdirs': st.one_of(JSON, st.dictionaries(NAMES.filter(lambda n: isinstance(n, str)),
                                               st.sampled_from([OLD * 10 ** 9 + 1, None, 'x']))),
    'files': st.one_of(JSON, st.lists(NAMES, max_size=4)),
    'odd': st.one_of(JSON, st.lists(NAMES, max_size=2))})
SPLITS = st.one_of(JSON, st.dictionaries(st.sampled_from(['train', 'val', 'x']), st.one_of(
    JSON, st.dictionaries(NAMES.filter(lambda n: isinstance(n, str)), st.one_of(JSON, ENTRY),
                          max_size=3)), max_size=3))


@pytest.fixture(scope='module')
def tree(tmp_path_factory):
    root = make_tree(tmp_path_factory.mktemp('prop') / 'data')
    (root / 'train' / 'cat' / 'sub').mkdir()
    (root / 'train' / 'cat' / 'sub' / 'deep.png').write_bytes(b'x')
    age(root)
    return root, fresh(root)


def check_any_index(tmp_path_factory, tree, data):
    root, want = tree
    cache = tmp_path_factory.mktemp('cache')
    path = index.index_path(str(cache), str(root))
    os.makedirs(os.path.dirname(path))
    with open(path, 'wb') as f:
        f.write(data)
    got, cost = listed(root, cache, [])
    assert got == want
    inside(got, root)
    assert cost['kept_index'] is False


@settings(deadline=1000, max_examples=60)
@given(data=st.binary(max_size=200))
def test_any_bytes_at_the_index_path_give_the_fresh_listing(tmp_path_factory, tree, data):
    check_any_index(tmp_path_factory, tree, data)


@settings(deadline=1000, max_examples=80)
@given(value=JSON, splits=SPLITS, envelope=st.booleans())
def test_any_json_at_the_index_path_gives_the_fresh_listing(tmp_path_factory, tree, value, splits,
                                                            envelope):
    root = os.path.realpath(tree[0])
    if envelope:  # this version and this folder: the splits' shape is all that is left to check
        value = {'version': index.VERSION, 'root': root, 'splits': splits}
    check_any_index(tmp_path_factory, tree, json.dumps(value).encode())


@settings(deadline=1000, max_examples=300)
@given(st.lists(st.text(st.sampled_from('a./\\\0'), max_size=5), max_size=4))
def test_the_file_lists_fast_check_is_the_names_one_by_one(names):
    shape = index.FOLDER.fields['files']
    try:
        shape.check(names, 'files')
    except index.readers.Wrong:
        assert not all(index.PATH.accepts(n) for n in names)
    else:
        assert all(index.PATH.accepts(n) for n in names)


# ------------------------------------------------------------------------------------------------
# The training set as torchvision's ImageFolder sees it

def image(path, fmt=None, mode='RGB', size=(24, 20)):
    rng = np.random.default_rng(len(str(path)))
    a = rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(a).convert(mode).save(path, fmt)


def odd_tree(root):
    """Sub-folders, .tif/.tiff/.ppm/.pgm/.webp/.bmp, upper-case suffixes, a non-image file, a TIFF
    named .jpg, in the order torchvision walks (a class folder's own files before its sub-folders',
    'a-b' before 'a/')."""
    for split in ('train', 'val'):
        for c in ('cat', 'dog'):
            d = root / split / c
            (d / 'a' / 'z').mkdir(parents=True)
            (d / 'a-b').mkdir()
            image(d / 'zz.jpg', 'JPEG')
            image(d / 'B.JPG', 'JPEG')
            image(d / 'a' / 'x.png', 'PNG')
            image(d / 'a' / 'z' / 'deep.TIF', 'TIFF')
            image(d / 'a-b' / 'y.ppm', 'PPM')
            (d / 'notes.txt').write_text('not an image')
            if split == 'train':
                image(d / 'g.pgm', 'PPM', mode='L')
                image(d / 'h.tiff', 'TIFF')
                image(d / 'tiff-named.jpg', 'TIFF')
                image(d / 'i.Bmp', 'BMP')
                image(d / 'w.webp', 'WEBP')
    return root


def test_the_listing_is_torchvision_imagefolders(tmp_path):
    from torchvision.datasets import ImageFolder
    from torchvision.datasets.folder import IMG_EXTENSIONS
    assert sorted(folder.IMG_EXTENSIONS) == sorted(IMG_EXTENSIONS)
    root = odd_tree(tmp_path / 'data')
    classes, train, val = fresh(root)
    for split, samples in (('train', train), ('val', val)):
        ref = ImageFolder(str(root / split))
        assert classes == ref.classes and samples == ref.samples, split
    assert len(train) == 2 * 10 and len(val) == 2 * 5
    assert listed(root, tmp_path / 'cache')[0] == (classes, train, val)
    age(root)
    listed(root, tmp_path / 'cache')
    got, cost = listed(root, tmp_path / 'cache')  # from the kept index, sub-folders' paths kept
    assert got == (classes, train, val) and cost['kept_index'] and cost['folders_listed'] == 0


def test_a_changed_sub_folder_is_listed_again(tmp_path):
    root = odd_tree(tmp_path / 'data')
    age(root)
    cache = tmp_path / 'cache'
    listed(root, cache)
    deep = root / 'train' / 'cat' / 'a' / 'z'
    image(deep / 'new.png', 'PNG')  # moves a/z's time, not cat's
    os.utime(deep, (OLD + 3600, OLD + 3600))
    got, cost = listed(root, cache)
    assert got == fresh(root) and cost['folders_listed'] == 1
    assert str(deep / 'new.png') in [p for p, _ in got[1]]


def test_a_link_back_up_is_walked_once(tmp_path):
    root = make_tree(tmp_path / 'data')
    os.symlink('..', root / 'train' / 'cat' / 'up')  # torchvision would walk it 40 times deep
    os.symlink('.', root / 'train' / 'dog' / 'self')
    warnings = []
    classes, train, _ = folder.scan_imagefolder(str(root), warn=warnings.append)
    assert [y for _, y in train] == [0, 0, 0, 1, 1, 1]
    assert len(warnings) == 1 and 'cat/up' in warnings[0] and 'dog/self' in warnings[0]


@pytest.mark.parametrize('name', ['a.tif', 'a.ppm', 'a.pgm', 'a.webp', 'tiff-named.jpg'])
def test_every_listed_extension_decodes_on_every_host_path(tmp_path, name):
    fmt = {'.tif': 'TIFF', '.ppm': 'PPM', '.pgm': 'PPM', '.webp': 'WEBP', '.jpg': 'TIFF'}
    path = tmp_path / name
    image(path, fmt[os.path.splitext(name)[1]], mode='L' if name.endswith('.pgm') else 'RGB')
    rng = decode.sample_rng(0, 0, 0)
    for t in (decode.TrainTransform(16), decode.FastTrainTransform(16)):
        assert t(str(path), rng).shape == (3, 16, 16)
    assert decode.ValTransform(18, 16)(str(path)).shape == (3, 16, 16)


def test_training_and_validation_accept_the_same_image_sizes(tmp_path, monkeypatch):
    """PIL refuses an image of more than 2 x Image.MAX_IMAGE_PIXELS (a decompression bomb) at
    validation and on --decode pil; --decode fast read the JPEG header and decoded it anyway."""
    path = tmp_path / 'big.jpg'
    image(path, 'JPEG', size=(64, 64))
    monkeypatch.setattr(Image, 'MAX_IMAGE_PIXELS', 1000)  # 4096 px > 2 x 1000: a "bomb"
    rng = decode.sample_rng(0, 0, 0)
    gpu = gpu_decode.GpuTrainTransform(16, decode.FastTrainTransform(16))  # its worker side
    for t in (decode.ValTransform(18, 16), decode.TrainTransform(16),
              decode.FastTrainTransform(16), gpu):
        with pytest.raises(decode.BadImageError, match='big.jpg .*exceeds limit'):
            t(str(path), rng)


def ns(**kw):
    base = dict(fake_data=False, data_dir=None, cache_dir='/c', synthetic_classes=2,
                synthetic_train_per_class=1, synthetic_val_per_class=1, synthetic_seed=0)
    return Namespace(**{**base, **kw})


@pytest.mark.parametrize('value', ['', '  '])
def test_an_empty_data_dir_variable_is_refused(value):
    with pytest.raises(UsageError, match=r'^\$DLOJZ_DATA_DIR is set but empty; .*unset it'):
        D.resolve_data_source(ns(), {'DLOJZ_DATA_DIR': value})
    with pytest.raises(UsageError, match=r'^--data-dir is empty \(what "\$VAR" gives'):
        D.resolve_data_source(ns(data_dir=value), {})
    assert D.resolve_data_source(ns(data_dir='/d'), {'DLOJZ_DATA_DIR': value}).root == '/d'
