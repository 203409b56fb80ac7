"""ImageNet as WebDataset-style tar shards, and a dataset that reads them by index.

    python dlojz_data.py prepare SRC DST [--max-side 320] [--shard-size 256]
    python dlojz.py --data-dir DST ...

A parallel file system pays for every file opened: 1.28 M JPEG opens per epoch (and as many inodes
in the quota) for ImageFolder, against a few per worker and shard here. The shards are plain tar
files in WebDataset's layout (`<key>.jpg` and `<key>.cls` side by side, in order), readable by
`webdataset` and by `tar`. dlojz reads them by index instead of streaming them: `index-<split>.npy`
holds each sample's shard, byte offset, size and label, so that training keeps everything it has on
folders: the same sampler and per-sample augmentation seeds (determinism, mid-epoch resume), exact
distributed validation, and bad samples skipped by name.

prepare writes each shard under a temporary name, fsyncs and renames it, then its sidecar (the
offsets of its samples); an interrupted prepare restarted with the same arguments keeps the finished
shards and continues. `--max-side N` re-encodes images whose longer side exceeds N pixels (JPEG
quality 90): fewer pixels to decode (FFCV's lesson), at the cost of the detail a 224 px crop of a
large image had."""
import argparse
import hashlib
import io
import json
import math
import os
import re
import stat
import sys
import tarfile

import numpy as np
from PIL import Image

from dlojzlib import files, readers
from dlojzlib.data.folder import scan_imagefolder
from dlojzlib.errors import DataError, DlojzError, disk_full, writable
from dlojzlib.flags import number
from dlojzlib.readers import Dict, Int, List, Maybe, Name, Num, Row, Str, Unreadable

FORMAT = 'dlojz-shards-v1'
INDEX = 'index.json'

# The shapes of what prepare writes, each read back through dlojzlib/readers.py. A name read from
# them is a plain name of the folder (no folder part, not hidden, NAME_MAX = 255 bytes): never
# '../x' or '/etc/passwd', nor staging's own '.dlojz-*' files.
NAME = Str(r'[A-Za-z0-9][A-Za-z0-9._-]*', 'a file name of the folder', max_len=255)
_HEAD = {'format': Str(re.escape(FORMAT), f'"{FORMAT}"'),
         'classes': List(Name('a class name (a folder name)'),
                         expected='a list of class names'),
         'max_side': Maybe(Int(1))}
SPLIT = Dict({'shards': List(Dict({'name': NAME, 'samples': Int(0)})), 'samples': Int(0)},
             expected='a split (its shards and samples)')
INDEX_SHAPE = Dict({**_HEAD, 'splits': Dict({'train': SPLIT, 'val': SPLIT})})  # index.json
SPEC = Dict({**_HEAD, 'shard_size_mb': Num(0),  # prepare.json: the arguments of the prepare
             'files': Str('[0-9a-f]{64}', 'a SHA-256 in hex')})
# <shard>.json, the sidecar: per sample its key, the offset of its bytes in the shard (after its
# 512-byte header), their size, its label and the extension of its member
SIDECAR = List(Row(Str('[0-9]{8}', 'a key of 8 digits'), Int(512), Int(0), Int(0),
                   Str(max_len=255)))


def _write(path, data):
    """Atomic (files.write_atomic): a reader sees no file or the whole file; a full disk is one
    sentence."""
    files.write_atomic(path, data, full=lambda p: disk_full(p, then=(
        'the finished shards are kept: free some space (or choose another DST) and run `python '
        'dlojz_data.py prepare` again with the same SRC and options.')))


def check_decodes(data, path):
    """Refuse a file that does not decode, by its source path: packed, it would stop training much
    later under a shard:key name (or be skipped unseen with --skip-bad-images). A JPEG is decoded at
    1/8 scale (PIL's draft: libjpeg's DCT scaling), which reads every byte of its compressed data,
    truncation and corruption included, for a fraction of a full decode's time."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            img.draft('RGB', (1, 1))
            img.load()
    except Exception as e:
        raise DataError(f'{path} cannot be decoded ({type(e).__name__}: {str(e)[:120]}); replace '
                        f'it with a good copy and run the same command again (the finished shards '
                        f'are kept), or delete it and start again in an empty DST.') from None


def encode(path, max_side, quality=90):
    """The bytes stored for one image and their extension: the file itself, or with --max-side a
    JPEG of the image resized so that its longer side is max_side (only when it is longer). A file
    that does not decode is refused (check_decodes)."""
    with open(path, 'rb') as f:
        data = f.read()
    ext = os.path.splitext(path)[1].lower().lstrip('.') or 'jpg'
    check_decodes(data, path)
    if not max_side:
        return data, ext
    img = Image.open(io.BytesIO(data))
    if max(img.size) <= max_side:
        return data, ext
    # imported here: decode imports torch, which the tool's --help and refusals need not wait for
    # (0.2 s instead of 4 s on 2 cores)
    from dlojzlib.data.decode import to_rgb
    img = to_rgb(img)
    scale = max_side / max(img.size)
    img = img.resize((max(1, round(img.width * scale)), max(1, round(img.height * scale))),
                     Image.BILINEAR,
                     reducing_gap=3.0)
    buf = io.BytesIO()
    img.save(buf, 'JPEG', quality=quality)
    return buf.getvalue(), 'jpg'


def _member(tar, name, data):
    """Append one file; -> the byte offset of its data in the tar (after its one 512-byte USTAR
    header)."""
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o644  # mtime 0: the same input gives the same bytes
    header = info.tobuf(tarfile.USTAR_FORMAT, tarfile.ENCODING, 'surrogateescape')
    start = tar.offset
    tar.addfile(info, io.BytesIO(data))
    return start + len(header)


def _write_shard(path, samples, first, max_side):
    """One tar of samples[i] for i from `first`; -> the sidecar: (key, offset, size, label, ext) per
    sample."""
    buf = io.BytesIO()
    rows = []
    with tarfile.open(fileobj=buf, mode='w', format=tarfile.USTAR_FORMAT) as tar:
        for i, (src, label) in enumerate(samples):
            key = f'{first + i:08d}'
            data, ext = encode(src, max_side)
            rows.append((key, _member(tar, f'{key}.{ext}', data), len(data), label, ext))
            _member(tar, f'{key}.cls', str(label).encode())
    _write(path, buf.getvalue())
    return rows


def _finished(path, side, samples, first):
    """The sidecar of a shard that a prepare finished before an interruption, or None: the shard is
    written again. Trusted only if it is these samples' (keys, labels, as many) and its offsets are
    those of a tar of its sizes (_member's layout) inside the shard's bytes: a cut, damaged or
    stale sidecar, a shard cut short or anything but a file at either name means a new shard."""
    try:
        st = os.stat(path)
        rows = readers.read_json(side, SIDECAR)
    except (OSError, Unreadable):
        return None
    if not stat.S_ISREG(st.st_mode) or len(rows) != len(samples):
        return None
    at = 512  # each member: a 512-byte header, then its data padded to 512-byte blocks
    for i, ((key, off, size, label, _), (_, y)) in enumerate(zip(rows, samples)):
        if key != f'{first + i:08d}' or label != y or off != at:
            return None
        at += -(-size // 512) * 512 + 512 + 512 + 512  # the data, the .cls header and its block
    return rows if at - 512 + 1024 <= st.st_size else None  # + the tar's two closing blocks


def plan(samples, shard_bytes):
    """Shard boundaries from the source files' sizes (known before any encoding, so a restart draws
    the same boundaries): consecutive samples until their size passes shard_bytes. -> [(first,
    end)]."""
    bounds, first, total = [], 0, 0
    for i, (path, _) in enumerate(samples):
        total += os.path.getsize(path)
        if total >= shard_bytes:
            bounds.append((first, i + 1))
            first, total = i + 1, 0
    if first < len(samples):
        bounds.append((first, len(samples)))
    return bounds


def prepare(src, dst, max_side=None, shard_size_mb=256, log=print, stop_after=None):
    """ImageFolder tree src -> shards + index in dst. stop_after: for the tests, stop after that
    many new shards (as an interruption would)."""
    classes, train, val = scan_imagefolder(src, given='SRC')
    spec = {'format': FORMAT, 'classes': classes, 'max_side': max_side,
            'shard_size_mb': shard_size_mb,
            # relative paths: the same tree named another way (relative, absolute, a link) resumes
            'files': hashlib.sha256('\n'.join(f'{os.path.relpath(p, src)}\t{y}' for p, y in train + val)
                                    .encode()).hexdigest()}
    writable(dst, 'the shards folder', 'pass a writable DST')
    spec_path = os.path.join(dst, 'prepare.json')
    try:
        old = readers.read_json(spec_path, SPEC)
    except FileNotFoundError:
        _write(spec_path, json.dumps(spec, indent=1).encode())
    except Unreadable as e:  # the shards there may be of any source: not ours to reuse or delete
        raise DataError(f'{spec_path} is damaged (it {e.why}); choose another DST, or delete '
                        f'{dst} and prepare it again.') from None
    else:
        if old != spec:
            changed = ', '.join(k for k in spec if old.get(k) != spec[k])
            raise DataError(f'{dst} holds a prepare with other arguments or another source '
                            f'({changed}); choose another DST or delete it.')
    written, index = 0, {'format': FORMAT, 'classes': classes, 'max_side': max_side, 'splits': {}}
    for split, samples in (('train', train), ('val', val)):
        table, shards = [], []
        bounds = plan(samples, shard_size_mb * 2**20)
        for k, (first, end) in enumerate(bounds):
            name = f'{split}-{k:05d}.tar'
            path, side = os.path.join(dst, name), os.path.join(dst, name + '.json')
            rows = _finished(path, side, samples[first:end], first)
            if rows is None:
                if stop_after is not None and written >= stop_after:
                    raise KeyboardInterrupt(f'stopped after {written} shards')
                rows = _write_shard(path, samples[first:end], first, max_side)
                _write(side, json.dumps(rows).encode())
                written += 1
                log(f'{name}: {len(rows)} samples, {os.path.getsize(path) / 2**20:.1f} MiB')
            table += [(k, off, size, label) for _, off, size, label, _ in rows]
            shards.append({'name': name, 'samples': len(rows)})
        arr = np.array(table, dtype=np.int64).reshape(-1, 4)
        buf = io.BytesIO()
        np.save(buf, arr)
        _write(os.path.join(dst, f'index-{split}.npy'), buf.getvalue())
        index['splits'][split] = {'shards': shards, 'samples': len(arr)}
    _write(os.path.join(dst, INDEX), json.dumps(index, indent=1).encode())  # last: the shards are whole
    log(f'{dst}: {len(train)} train and {len(val)} val samples in '
        f'{sum(len(s["shards"]) for s in index["splits"].values())} shards, {len(classes)} classes')
    return index


def is_shards(root):
    """Whether root is a shards folder: its index.json says so, or it cannot be read but the
    prepare's other files are there (load_index then says what is damaged)."""
    try:
        index = readers.read_json(os.path.join(root, INDEX))  # its format alone: the rest is later
    except Unreadable:  # not JSON, a FIFO, a folder...
        index = None
    except OSError:
        return False
    if isinstance(index, dict) and index.get('format') == FORMAT:
        return True
    return any(os.path.exists(os.path.join(root, n)) for n in ('prepare.json', 'index-train.npy'))


def incomplete(root, missing):
    """The DataError for a shards folder that a prepare has not finished (it writes index.json
    last)."""
    return DataError(f'{root} looks like an incomplete `dlojz_data.py prepare` ({missing} is '
                     f'missing); finish it by running `python dlojz_data.py prepare SRC {root}` '
                     f'again with the same SRC and options (it resumes, keeping the shards already '
                     f'written).')


def damaged(root, name, what):
    """The DataError for a file of a shards folder that something changed after prepare wrote it."""
    return DataError(f'{os.path.join(root, name)} is damaged ({what}); delete {root} and prepare '
                     f'it again: python dlojz_data.py prepare SRC {root}.')


def _unreadable(root, name, e):
    """The DataError for a file of a shards folder that is there but cannot be opened."""
    return DataError(f'{os.path.join(root, name)} cannot be read ({e.strerror}); make it readable, '
                     f'or delete {root} and prepare it again.')


def stat_file(root, name):
    """os.stat of a file of the folder, None if it is missing. Anything but a regular file there is
    damage (a FIFO would block its reader for ever): the DataError names what it is."""
    path = os.path.join(root, name)
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            readers.open_file(path).close()  # refuses it, naming what it is, before opening it
    except FileNotFoundError:
        return None
    except Unreadable as e:
        raise damaged(root, name, f'it {e.why}') from None
    except OSError as e:
        raise _unreadable(root, name, e) from None
    return st


def read_index(root):
    """index.json -> its value, of INDEX_SHAPE; or the DataError: missing (an unfinished prepare)
    or damaged (named, with the fix)."""
    try:
        index = readers.read_json(os.path.join(root, INDEX), INDEX_SHAPE)
    except FileNotFoundError:
        raise incomplete(root, INDEX) from None
    except Unreadable as e:
        raise damaged(root, INDEX, f'it {e.why}') from None
    except OSError as e:
        raise _unreadable(root, INDEX, e) from None
    if not index['classes']:
        raise damaged(root, INDEX, 'it lists no class')
    return index


def load_index(root):
    """-> (classes, {split: (shard names, table)}); the table's rows: shard, offset, size, label.
    Every part checked before a worker reads by it: index.json's shape (read_index), each table's
    header, type and ranges against index.json (shard numbers and their counts, labels below the
    classes, samples inside their shard's size), and that the shards are files."""
    index = read_index(root)
    classes, splits = index['classes'], {}
    for split in ('train', 'val'):
        meta = index['splits'][split]
        names = [s['name'] for s in meta['shards']]
        name = f'index-{split}.npy'
        if stat_file(root, name) is None:
            raise incomplete(root, name)
        sizes = [stat_file(root, n) for n in names]
        missing = [n for n, st in zip(names, sizes) if st is None]
        if missing:
            raise incomplete(root, f"{len(missing)} shard(s) of {split}, {missing[0]} first,")
        table = read_table(root, name)
        splits[split] = (names, check_table(root, name, table, meta,
                                            [st.st_size for st in sizes], len(classes)))
    return classes, splits


def read_table(root, name):
    """index-<split>.npy -> its rows as int64, read by its header: the rows the header declares
    must fill the file exactly before any is read (a damaged header must not allocate terabytes),
    and never a pickle or an npz archive."""
    path = os.path.join(root, name)
    try:
        with readers.open_file(path) as f:
            shape, fortran, dtype = _header(f)
            if len(shape) != 2 or shape[1] != 4 or dtype.kind not in 'iu' or not shape[0]:
                raise damaged(root, name, f'a {dtype} array of shape {shape}, where prepare '
                                          f'writes rows of 4 integers')
            size = math.prod(shape) * dtype.itemsize
            held = os.fstat(f.fileno()).st_size - f.tell()
            if held != size:
                raise ValueError(f'its header declares {size} bytes of rows, it holds {held}')
            data = f.read(size)
            if len(data) != size:
                raise ValueError('it was cut while it was read')
    except FileNotFoundError:
        raise incomplete(root, name) from None
    except Unreadable as e:
        raise damaged(root, name, f'it {e.why}') from None
    except OSError as e:
        raise _unreadable(root, name, e) from None
    except ValueError as e:
        raise damaged(root, name, f'not a table numpy can read: {e}') from None
    table = np.frombuffer(data, dtype).reshape(shape, order='F' if fortran else 'C')
    return table.astype(np.int64)  # a uint64 beyond int64 wraps negative: refused as such below


def _header(f):
    """An .npy file's header -> (shape, Fortran order, dtype), or ValueError."""
    try:
        version = np.lib.format.read_magic(f)
        if version not in ((1, 0), (2, 0)):  # what np.save writes for an int64 table
            raise ValueError(f'npy version {version[0]}.{version[1]}')
        return getattr(np.lib.format, f'read_array_header_{version[0]}_0')(f)
    except ValueError:
        raise
    except Exception as e:  # numpy parses the header with Python's tokenizer: TokenError, ...
        raise ValueError(f'its header: {type(e).__name__}') from None


def check_table(root, name, table, meta, sizes, n_classes):
    """A split's table as prepare wrote it (rows of shard, offset, size, label) against index.json
    (meta: the split's entry; sizes: its shards' bytes), or the sentence saying how it is not. What
    it cannot see: bytes changed inside a shard (the decoder names that sample, or
    --skip-bad-images skips it)."""
    names = [s['name'] for s in meta['shards']]
    shard, offset, size, label = table.T
    if shard.min() < 0 or shard.max() >= len(names):
        raise damaged(root, name, f'shard numbers from {shard.min()} to {shard.max()} for '
                                  f'{len(names)} shards')
    if label.min() < 0 or label.max() >= n_classes:
        raise damaged(root, name, f'labels from {label.min()} to {label.max()} for the {n_classes} '
                                  f'classes of {INDEX}')
    if offset.min() < 0 or size.min() <= 0:
        raise damaged(root, name, 'a negative offset or an empty sample')
    if len(table) != meta['samples']:
        raise damaged(root, name, f'{len(table)} rows, where {INDEX} counts {meta["samples"]} '
                                  f'samples')
    counts = np.bincount(shard, minlength=len(names)).tolist()
    for k, s in enumerate(meta['shards']):
        if counts[k] != s['samples']:
            raise damaged(root, name, f'{counts[k]} rows in {names[k]}, where {INDEX} counts '
                                      f'{s["samples"]}')
    ends = np.asarray(sizes, dtype=np.int64)[shard]
    beyond = size > ends - offset  # offset + size > the shard's bytes, without an int64 overflow
    if beyond.any():
        k = int(shard[beyond.argmax()])
        end = max(int(o) + int(n) for o, n in zip(offset[shard == k], size[shard == k]))
        raise damaged(root, names[k], f'{sizes[k]} bytes, where {name} reads up to byte {end}')
    return table


class ShardReader:
    """Reads samples by (shard, offset, size), one open file per shard and process (a loader worker
    opens the shards it reads once and keeps them); counts its opens in `count` (a shared
    multiprocessing Value)."""

    def __init__(self, root, names, count=None, max_open=128):
        self.root, self.names, self.files, self.count = root, names, {}, count
        self.pid, self.max_open = None, max_open  # 128 files per process: far below the usual ulimit -n 1024

    def read(self, shard, offset, size):
        if self.pid != os.getpid():  # a forked worker must not share its parent's file positions
            self.files, self.pid = {}, os.getpid()
        f = self.files.get(shard)
        if f is None:
            if len(self.files) >= self.max_open:  # the oldest one goes (ImageNet-21k has thousands of shards)
                self.files.pop(next(iter(self.files))).close()
            try:  # a FIFO put there since load_index checked it would block the worker for ever
                f = readers.open_file(os.path.join(self.root, self.names[shard]))
            except Unreadable as e:
                raise damaged(self.root, self.names[shard], f'it {e.why}') from None
            self.files[shard] = f
            if self.count is not None:
                with self.count.get_lock():
                    self.count.value += 1
        f.seek(offset)
        return f.read(size)


# below 16 px an image keeps nothing of what it shows, and every training crop is upsampled from it
MAX_SIDE = number(int, lambda v: v >= 16, 'an integer of 16 pixels or more')
# a shard smaller than one file holds one image: the per-image file opens shards are there to save
SHARD_MB = number(float, lambda v: 1 <= v <= 2 ** 20 and math.isfinite(v), 'from 1 to 1048576 MiB')


def main(argv=None):
    """`python dlojz_data.py prepare SRC DST ...` (argv: what follows dlojz_data.py) -> exit code."""
    top = argparse.ArgumentParser(prog='dlojz_data.py',
                                  description='Data tools of dlojz. The training data itself needs '
                                  'none: dlojz.py reads ImageFolder trees and shards, and '
                                  'generates its synthetic dataset.',
                                  epilog='python dlojz_data.py prepare --help: its flags.')
    commands = top.add_subparsers(dest='command', required=True, metavar='COMMAND')
    description = ('ImageFolder tree -> WebDataset-style tar shards + an index, for dlojz.py '
                   '--data-dir DST: a few file opens per worker and shard instead of one per image '
                   '(a parallel file system\'s cost).')
    p = commands.add_parser('prepare', help=description, description=description)
    p.add_argument('src', help='ImageFolder root: SRC/train/<class>/*.JPEG, SRC/val/<class>/*.JPEG')
    p.add_argument('dst',
                   help='folder for the shards (created; an interrupted prepare continues there)')
    p.add_argument('--max-side', type=MAX_SIDE, default=None, help='re-encode images whose longer '
                   'side exceeds N pixels (JPEG quality 90; N >= 16); default: store the files as '
                   'they are')
    p.add_argument('--shard-size', type=SHARD_MB, default=256, help='shard size, MiB of source '
                   'files (default 256; at least 1)')
    a = top.parse_args(argv)
    try:
        prepare(a.src, a.dst, a.max_side, a.shard_size)
    except DlojzError as e:  # a usage error: exit 2, as dlojz.py's
        print(f'dlojz_data.py prepare: error: {e}', file=sys.stderr)
        return 2
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
