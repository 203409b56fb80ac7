"""The ImageFolder layout (ROOT/train/<class>/<image>, ROOT/val/<class>/<image>): which classes and
files a tree holds, with the checks users need. Read by the data pipeline (data.datasets) and by the
shard writer (data.shards, `dlojz_data.py prepare`), so it imports neither."""
import os
import sys
import time

from dlojzlib.errors import DataError

# torchvision.datasets.folder.IMG_EXTENSIONS (tests/test_index_reader.py compares them): the files
# torchvision's ImageFolder trains on, in any case ('.JPEG', '.Tif'), are the files dlojz trains on.
IMG_EXTENSIONS = ('.jpg', '.jpeg', '.png', '.ppm', '.bmp', '.pgm', '.tif', '.tiff', '.webp')


def warn_stderr(msg):
    print(f'dlojz: warning: {msg}', file=sys.stderr, flush=True)


def _shown(names, n=5):
    return ', '.join(names[:n]) + (f' and {len(names) - n} more' if len(names) > n else '')


# A folder whose modification time is this close to its listing (or later: a file server's clock
# ahead of this host's) may change again within the same tick of a coarse clock (1 s on some file
# systems) without its time moving: its listing is not reused (git's "racy" entries, the same cure).
RACY_NS = 2_000_000_000


def list_split(split_dir, known=None):
    """The class folders of one split -> ({name: {'mtime_ns', 'subdirs', 'files', 'odd'}}, folders
    read). A class folder is walked as torchvision's ImageFolder walks it (its sub-folders, links
    to folders followed): 'files' are paths relative to it, in torchvision's order; 'subdirs' maps
    each sub-folder to its modification time. A folder of `known` (an earlier listing, of that
    shape) whose modification time has not moved, nor any of its sub-folders', is taken from it
    unread: one stat per folder instead of a listing. Only regular files (or links to them) are
    samples: opening a FIFO named x.JPEG blocks forever, a socket or a dangling link fails; those
    go to 'odd', with any link the listing cannot follow or that leads back up, and folders it may
    not read."""
    if not os.path.isdir(split_dir):
        root = os.path.dirname(split_dir)
        raise DataError(f'{split_dir} does not exist; expected the ImageFolder layout '
                        f'{root}/train/<class>/*.JPEG and {root}/val/<class>/*.JPEG.')
    known, folders, read = known or {}, {}, 0
    try:
        with os.scandir(split_dir) as entries:
            subdirs = sorted((e.name, e) for e in entries if _is(e.is_dir))
    except OSError as e:
        raise DataError(f'cannot list {split_dir} ({e.strerror}); check its permissions.') from None
    for name, entry in subdirs:
        started = time.time_ns()
        try:
            mtime = entry.stat().st_mtime_ns
        except OSError:
            mtime = None
        path = os.path.join(split_dir, name)
        kept = known.get(name)
        if mtime is not None and kept and kept['mtime_ns'] == mtime and _unmoved(path, kept):
            folders[name] = kept
            continue
        files, odd, times = _list_folder(path)
        read += 1
        trusted = mtime is not None and max([mtime, *times.values()]) < started - RACY_NS
        folders[name] = {'mtime_ns': mtime if trusted else None, 'subdirs': times, 'files': files,
                         'odd': odd}
    return folders, read


def _unmoved(path, kept):
    """Whether every sub-folder of a kept class folder still has its kept modification time (a
    file added down there moves that sub-folder's time, not the class folder's)."""
    try:
        return all(os.stat(os.path.join(path, sub)).st_mtime_ns == t
                   for sub, t in kept['subdirs'].items())
    except OSError:  # a sub-folder gone: its parent's time has moved too, unless set back by hand
        return False


def _is(test):
    """entry.is_dir/is_file, False where the entry cannot be followed (a link that loops: ELOOP)."""
    try:
        return test()
    except OSError:
        return False


def _ids(path):
    """(st_dev, st_ino) of path's real folder and of every folder above it."""
    ids, path = set(), os.path.realpath(path)
    while True:
        st = os.stat(path)
        ids.add((st.st_dev, st.st_ino))
        if path == os.path.dirname(path):
            return ids
        path = os.path.dirname(path)


def _list_folder(top):
    """A class folder, walked as torchvision's make_dataset walks it (os.walk(followlinks=True),
    sorted) -> (image files relative to top, in that order; names that look like images but are
    no regular file, folders that cannot be read, links that lead back to a folder holding them
    (torchvision walks those until the kernel's 40 links per path stop it); {sub-folder:
    modification time in ns})."""
    files, odd, times = [], [], {}
    stack, above = [('', frozenset())], None  # above: the folders holding top, read at the 1st link
    while stack:
        rel, chain = stack.pop()
        path = os.path.join(top, rel) if rel else top
        try:
            if rel:
                st = os.stat(path)
                times[rel], chain = st.st_mtime_ns, chain | {(st.st_dev, st.st_ino)}
            with os.scandir(path) as it:
                entries = list(it)
        except OSError as e:  # EACCES, or a folder gone since its parent was read
            odd.append(os.path.join(rel, f'(the folder: {e.strerror})'))
            continue
        for entry in entries:
            name = f'{rel}/{entry.name}' if rel else entry.name
            if _is(entry.is_dir):
                if _is(entry.is_symlink):
                    try:
                        above = above if above is not None else _ids(top)
                        st = entry.stat()
                    except OSError:
                        odd.append(name)
                        continue
                    if (st.st_dev, st.st_ino) in above | chain:
                        odd.append(f'{name} (a link to a folder holding it)')
                        continue
                stack.append((name, chain))
            elif entry.name.lower().endswith(IMG_EXTENSIONS):
                if _is(entry.is_file):  # follows links: a link to a regular file is a sample
                    files.append((rel, entry.name))
                else:
                    odd.append(name)
    # torchvision sorts os.walk's (folder, sub-folders, files) and then each folder's files: the
    # class folder's own files first, then its sub-folders' by path ('a-b' before 'a/z')
    return [f'{rel}/{f}' if rel else f for rel, f in sorted(files)], sorted(odd), times


def split_classes(split_dir, folders, warn=warn_stderr):
    """A split's listing (list_split) -> (classes: the folders holding an image, the class folders
    without one), with the warnings and errors users need."""
    classes = [name for name, folder in folders.items() if folder['files']]
    empty = [name for name, folder in folders.items() if not folder['files']]
    odd = sorted(os.path.join(name, f) for name, folder in folders.items() for f in folder['odd'])
    if odd:
        warn(f'{split_dir}: {len(odd)} image name(s) are not regular files (a FIFO, a socket, a '
             f'dangling link or one that loops), or folders could not be read or lead back up, and '
             f'are left out: {_shown(odd)}.')
    if not classes:
        flat = [f for f in os.listdir(split_dir) if f.lower().endswith(IMG_EXTENSIONS)]
        hint = (f' It holds {len(flat)} images directly: ImageNet\'s raw val/ is flat; sort it '
                f'into class folders (the usual valprep.sh script does it).') if flat else ''
        raise DataError(f'{split_dir} has no class folder with images; expected '
                        f'{split_dir}/<class>/*.JPEG.{hint}')
    return classes, empty


def samples(split_dir, classes, files):
    """(path, label) of every image, as ImageFolder's; files: each class's file names, in order."""
    return [(os.path.join(split_dir, c, f), label)
            for label, (c, names) in enumerate(zip(classes, files)) for f in names]


def find_classes(split_dir, warn=warn_stderr):
    """Class folders of one split, sorted, each holding at least one image file; -> (classes,
    samples, the class folders without an image)."""
    folders = list_split(split_dir)[0]
    classes, empty = split_classes(split_dir, folders, warn)
    return classes, samples(split_dir, classes, [folders[c]['files'] for c in classes]), empty


def require_root(root, given='--data-dir'):
    """The one sentence for a data folder that is missing or a file. given: how the user named root
    (--data-dir for training, SRC for `dlojz_data.py prepare`)."""
    if not os.path.isdir(root):
        what = 'is a file, not a folder' if os.path.exists(root) else 'does not exist'
        how = {'--data-dir': 'omit', '$DLOJZ_DATA_DIR': 'unset'}.get(given)
        fallback = f' (or {how} it to use the built-in synthetic dataset)' if how else ''
        raise DataError(f'{given} {root} {what}; give a folder with train/<class>/ and '
                        f'val/<class>/ folders of images{fallback}.')


def scan_imagefolder(root, given='--data-dir', warn=warn_stderr):
    """(classes, train samples, val samples) with the train/val checks users need."""
    require_root(root, given)
    listing = {split: list_split(os.path.join(root, split))[0] for split in ('train', 'val')}
    return imagefolder_samples(root, listing, warn)


def imagefolder_samples(root, listing, warn=warn_stderr):
    """{'train': list_split's folders, 'val': ...} -> (classes, train samples, val samples),
    checked."""
    classes = imagefolder_classes(root, listing, warn)
    files = {split: [listing[split][c]['files'] for c in classes] for split in ('train', 'val')}
    return (classes, *(samples(os.path.join(root, split), classes, files[split])
                       for split in ('train', 'val')))


def imagefolder_classes(root, listing, warn=warn_stderr):
    """The classes of both splits' listings, checked: the same in train/ and val/."""
    train_classes, train_empty = split_classes(os.path.join(root, 'train'), listing['train'], warn)
    val_classes, val_empty = split_classes(os.path.join(root, 'val'), listing['val'], warn)
    if train_classes != val_classes:
        only_train = sorted(set(train_classes) - set(val_classes))[:3]
        only_val = sorted(set(val_classes) - set(train_classes))[:3]
        raise DataError(f'train/ and val/ of {root} hold different classes ({len(train_classes)} '
                        f'vs {len(val_classes)}; only in train: {only_train}, only in val: '
                        f'{only_val}); both splits need the same class folders.')
    dropped = sorted(set(train_empty) & set(val_empty))
    if dropped:
        warn(f'{root}: {len(dropped)} class folder(s) hold no image in train/ nor val/ and are not '
             f'classes of this run: {_shown(dropped)}.')
    return train_classes
