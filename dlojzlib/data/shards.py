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
import sys
import tarfile

import numpy as np
from PIL import Image

from dlojzlib import files
from dlojzlib.data.folder import scan_imagefolder
from dlojzlib.errors import DataError, DlojzError, disk_full, writable
from dlojzlib.flags import number

FORMAT = 'dlojz-shards-v1'
INDEX = 'index.json'


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
    if os.path.exists(spec_path):
        with open(spec_path) as f:
            old = json.load(f)
        if old != spec:
            changed = ', '.join(k for k in spec if old.get(k) != spec[k])
            raise DataError(f'{dst} holds a prepare with other arguments or another source '
                            f'({changed}); choose another DST or delete it.')
    else:
        _write(spec_path, json.dumps(spec, indent=1).encode())
    written, index = 0, {'format': FORMAT, 'classes': classes, 'max_side': max_side, 'splits': {}}
    for split, samples in (('train', train), ('val', val)):
        table, shards = [], []
        bounds = plan(samples, shard_size_mb * 2**20)
        for k, (first, end) in enumerate(bounds):
            name = f'{split}-{k:05d}.tar'
            path, side = os.path.join(dst, name), os.path.join(dst, name + '.json')
            rows = None
            if os.path.exists(side) and os.path.exists(path):  # finished before an interruption
                with open(side) as f:
                    rows = json.load(f)
                rows = rows if len(rows) == end - first else None  # else rewritten
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
        with open(os.path.join(root, INDEX)) as f:
            return json.load(f).get('format') == FORMAT
    except OSError:
        return False
    except (ValueError, AttributeError):  # unparseable, or not an object
        others = ('prepare.json', 'index-train.npy')
        return any(os.path.exists(os.path.join(root, n)) for n in others)


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


def load_index(root):
    """-> (classes, {split: (shard names, table)}); the table's rows: shard, offset, size, label.
    Every part checked before a worker reads by it: index.json's form, each table's shape, type and
    ranges (shard numbers, labels below the classes, samples inside their shard's size), and that
    the shards are there."""
    try:
        with open(os.path.join(root, INDEX)) as f:
            index = json.load(f)
    except FileNotFoundError:
        raise incomplete(root, INDEX) from None
    except (ValueError, UnicodeDecodeError) as e:
        raise damaged(root, INDEX, f'not JSON: {e}') from None
    splits_meta = index.get('splits') if isinstance(index, dict) else None
    classes = index.get('classes') if isinstance(index, dict) else None
    if not isinstance(classes, list) or not classes or not all(isinstance(c, str) for c in classes):
        raise damaged(root, INDEX, 'no list of class names')
    if not isinstance(splits_meta, dict) or not {'train', 'val'} <= set(splits_meta):
        raise damaged(root, INDEX, 'it lists no train and val splits')
    splits = {}
    for split, meta in splits_meta.items():
        shard_list = meta.get('shards') if isinstance(meta, dict) else None
        named = lambda s: isinstance(s, dict) and isinstance(s.get('name'), str)  # noqa: E731
        if not isinstance(shard_list, list) or not all(map(named, shard_list)):
            raise damaged(root, INDEX, f'the {split} split has no list of shards')
        names = [s['name'] for s in shard_list]
        name = f'index-{split}.npy'
        path = os.path.join(root, name)
        if not os.path.isfile(path):
            raise incomplete(root, name)
        missing = [n for n in names if not os.path.isfile(os.path.join(root, n))]
        if missing:
            raise incomplete(root, f"{len(missing)} shard(s) of {split}, {missing[0]} first,")
        try:
            table = np.load(path, allow_pickle=False)
        except (ValueError, OSError, EOFError) as e:
            raise damaged(root, name, f'not a table numpy can read: {e}') from None
        splits[split] = (names, check_table(root, name, table, names, len(classes)))
    return classes, splits


def check_table(root, name, table, names, n_classes):
    """A split's table as prepare wrote it (int64 rows of shard, offset, size, label), or the
    sentence saying how it is not. What it cannot see: bytes changed inside a shard (the decoder
    names that sample, or --skip-bad-images skips it)."""
    if table.ndim != 2 or table.shape[1] != 4 or table.dtype.kind not in 'iu' or len(table) == 0:
        raise damaged(root, name, f'a {table.dtype} array of shape {table.shape}, where prepare '
                                  f'writes rows of 4 integers')
    shard, offset, size, label = table.T
    if shard.min() < 0 or shard.max() >= len(names):
        raise damaged(root, name, f'shard numbers from {shard.min()} to {shard.max()} for '
                                  f'{len(names)} shards')
    if label.min() < 0 or label.max() >= n_classes:
        raise damaged(root, name, f'labels from {label.min()} to {label.max()} for the {n_classes} '
                                  f'classes of {INDEX}')
    if offset.min() < 0 or size.min() <= 0:
        raise damaged(root, name, 'a negative offset or an empty sample')
    ends = np.zeros(len(names), dtype=np.int64)
    np.maximum.at(ends, shard, offset + size)
    for k, end in enumerate(ends):
        if end > os.path.getsize(os.path.join(root, names[k])):
            size = os.path.getsize(os.path.join(root, names[k]))
            raise damaged(root, names[k], f'{size} bytes, where {name} reads up to byte {end}')
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
            f = self.files[shard] = open(os.path.join(self.root, self.names[shard]), 'rb')
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
