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


# A folder whose modification time is this close to its listing (or later: a file server's clock ahead
# of this host's) may change again within the same tick of a coarse clock (1 s on some file systems)
# without its time moving: its listing is not reused (git's "racy" entries, the same cure).
RACY_NS = 2_000_000_000


def list_split(split_dir, known=None):
    """The class folders of one split -> ({name: {'mtime_ns', 'files', 'odd'}}, folders read). A
    folder of `known` (an earlier listing) whose modification time has not moved is taken from it
    unread: one stat instead of a listing. Only regular files (or links to them) are samples: opening
    a FIFO named x.JPEG blocks forever, a socket or a dangling link fails; those go to 'odd', with
    any sub-folder or link the listing cannot follow, and folders it may not read."""
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
        folders[name] = {'mtime_ns': mtime if mtime is not None and mtime < started - RACY_NS else None,
                         'files': files, 'odd': odd}
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


def split_samples(split_dir, folders, warn=warn_stderr):
    """A split's listing (list_split) -> (classes, samples, the class folders without an image), with
    the warnings and errors users need."""
    classes, samples, empty = [], [], []
    odd = [os.path.join(name, f) for name, folder in folders.items() for f in folder['odd']]
    for name, folder in folders.items():
        if not folder['files']:
            empty.append(name)
            continue
        samples.extend((os.path.join(split_dir, name, f), len(classes)) for f in folder['files'])
        classes.append(name)
    if odd:
        warn(f'{split_dir}: {len(odd)} image name(s) are not regular files (a FIFO, a socket, a folder, a '
             f'dangling link or one that loops) or could not be read, and are left out: {_shown(sorted(odd))}.')
    if not classes:
        flat = [f for f in os.listdir(split_dir) if f.lower().endswith(IMG_EXTENSIONS)]
        hint = (f' It holds {len(flat)} images directly: ImageNet\'s raw val/ is flat; sort it into class '
                f'folders (the usual valprep.sh script does it).') if flat else ''
        raise DataError(f'{split_dir} has no class folder with images; expected '
                        f'{split_dir}/<class>/*.JPEG.{hint}')
    return classes, samples, empty


def find_classes(split_dir, warn=warn_stderr):
    """Class folders of one split, sorted, each holding at least one image file; -> (classes,
    samples, the class folders without an image)."""
    return split_samples(split_dir, list_split(split_dir)[0], warn)


def scan_imagefolder(root, given='--data-dir', warn=warn_stderr):
    """(classes, train samples, val samples) with the train/val checks users need. given: how the
    user named root (--data-dir for training, SRC for `dlojz_data.py prepare`), for the messages."""
    if not os.path.isdir(root):
        what = 'is a file, not a folder' if os.path.exists(root) else 'does not exist'
        fallback = ' (or omit it to use the built-in synthetic dataset)' if given == '--data-dir' else ''
        raise DataError(f'{given} {root} {what}; give a folder with train/<class>/ and val/<class>/ '
                        f'folders of images{fallback}.')
    return imagefolder_samples(root, {split: list_split(os.path.join(root, split))[0] for split in ('train', 'val')},
                               warn)


def imagefolder_samples(root, listing, warn=warn_stderr):
    """{'train': list_split's folders, 'val': ...} -> (classes, train samples, val samples), checked."""
    train_classes, train, train_empty = split_samples(os.path.join(root, 'train'), listing['train'], warn)
    val_classes, val, val_empty = split_samples(os.path.join(root, 'val'), listing['val'], warn)
    if train_classes != val_classes:
        only_train = sorted(set(train_classes) - set(val_classes))[:3]
        only_val = sorted(set(val_classes) - set(train_classes))[:3]
        raise DataError(f'train/ and val/ of {root} hold different classes ({len(train_classes)} vs '
                        f'{len(val_classes)}; only in train: {only_train}, only in val: {only_val}); '
                        f'both splits need the same class folders.')
    dropped = sorted(set(train_empty) & set(val_empty))
    if dropped:
        warn(f'{root}: {len(dropped)} class folder(s) hold no image in train/ nor val/ and are not classes of '
             f'this run: {_shown(dropped)}.')
    return train_classes, train, val
