"""The ImageFolder layout (ROOT/train/<class>/<image>, ROOT/val/<class>/<image>): which classes and
files a tree holds, with the checks users need. Read by the data pipeline (data.datasets) and by the
shard writer (data.shards, `dlojz_data.py prepare`), so it imports neither."""
import os
import sys
import time

from dlojzlib.errors import DataError

IMG_EXTENSIONS = ('.jpeg', '.jpg', '.png', '.bmp', '.webp')


def warn_stderr(msg):
    print(f'dlojz: warning: {msg}', file=sys.stderr, flush=True)


def _shown(names, n=5):
    return ', '.join(names[:n]) + (f' and {len(names) - n} more' if len(names) > n else '')


# A folder whose modification time is this close to its listing (or later: a file server's clock
# ahead of this host's) may change again within the same tick of a coarse clock (1 s on some file
# systems) without its time moving: its listing is not reused (git's "racy" entries, the same cure).
RACY_NS = 2_000_000_000


def list_split(split_dir, known=None):
    """The class folders of one split -> ({name: {'mtime_ns', 'files', 'odd'}}, folders read). A
    folder of `known` (an earlier listing) whose modification time has not moved is taken from it
    unread: one stat instead of a listing. Only regular files (or links to them) are samples:
    opening a FIFO named x.JPEG blocks forever, a socket or a dangling link fails; those go to
    'odd', with any sub-folder or link the listing cannot follow, and folders it may not read."""
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
        if mtime is not None and known.get(name, {}).get('mtime_ns') == mtime:
            folders[name] = known[name]
            continue
        files, odd = _list_folder(os.path.join(split_dir, name))
        read += 1
        trusted = mtime is not None and mtime < started - RACY_NS
        folders[name] = {'mtime_ns': mtime if trusted else None, 'files': files, 'odd': odd}
    return folders, read


def _is(test):
    """entry.is_dir/is_file, False where the entry cannot be followed (a link that loops: ELOOP)."""
    try:
        return test()
    except OSError:
        return False


def _list_folder(folder):
    """-> (image files, sorted; names that look like images but are no regular file, or the folder
    itself when it cannot be read)."""
    files, odd = [], []
    try:
        with os.scandir(folder) as entries:
            for entry in entries:
                if not entry.name.lower().endswith(IMG_EXTENSIONS):
                    continue
                if _is(entry.is_file):  # follows links: a link to a regular file is a sample
                    files.append(entry.name)
                else:
                    odd.append(entry.name)
    except OSError as e:  # EACCES, or a folder gone since its parent was read
        return [], [f'(the folder: {e.strerror})']
    return sorted(files), sorted(odd)


def split_classes(split_dir, folders, warn=warn_stderr):
    """A split's listing (list_split) -> (classes: the folders holding an image, the class folders
    without one), with the warnings and errors users need."""
    classes = [name for name, folder in folders.items() if folder['files']]
    empty = [name for name, folder in folders.items() if not folder['files']]
    odd = sorted(os.path.join(name, f) for name, folder in folders.items() for f in folder['odd'])
    if odd:
        warn(f'{split_dir}: {len(odd)} image name(s) are not regular files (a FIFO, a socket, a '
             f'folder, a dangling link or one that loops) or could not be read, and are left out: '
             f'{_shown(odd)}.')
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
