"""The ImageFolder layout (ROOT/train/<class>/<image>, ROOT/val/<class>/<image>): which classes and
files a tree holds, with the checks users need. Read by the data pipeline (data.datasets) and by the
shard writer (data.shards, `dlojz_data.py prepare`), so it imports neither."""
import os
import sys

from dlojzlib.errors import DataError

IMG_EXTENSIONS = ('.jpeg', '.jpg', '.png', '.bmp', '.webp')


def warn_stderr(msg):
    print(f'dlojz: warning: {msg}', file=sys.stderr, flush=True)


def _shown(names, n=5):
    return ', '.join(names[:n]) + (f' and {len(names) - n} more' if len(names) > n else '')


def find_classes(split_dir, warn=warn_stderr):
    """Class folders of one split, sorted, each holding at least one image file; -> (classes,
    samples, the class folders without an image). Only regular files (or links to them) are samples:
    opening a FIFO named x.JPEG blocks forever, a socket or a dangling link fails; those are named
    in a warning."""
    if not os.path.isdir(split_dir):
        root = os.path.dirname(split_dir)
        raise DataError(f'{split_dir} does not exist; expected the ImageFolder layout '
                        f'{root}/train/<class>/*.JPEG and {root}/val/<class>/*.JPEG.')
    classes, samples, empty, odd = [], [], [], []
    for name in sorted(os.listdir(split_dir)):
        folder = os.path.join(split_dir, name)
        if not os.path.isdir(folder):
            continue
        files = []
        with os.scandir(folder) as entries:
            for entry in entries:
                if not entry.name.lower().endswith(IMG_EXTENSIONS):
                    continue
                if entry.is_file():  # follows links: a link to a regular file is a sample
                    files.append(entry.name)
                else:
                    odd.append(os.path.join(name, entry.name))
        if not files:
            empty.append(name)
            continue
        samples.extend((os.path.join(folder, f), len(classes)) for f in sorted(files))
        classes.append(name)
    if odd:
        warn(f'{split_dir}: {len(odd)} image name(s) are not regular files (a FIFO, a socket, a folder or a '
             f'dangling link) and are left out: {_shown(sorted(odd))}.')
    if not classes:
        flat = [f for f in os.listdir(split_dir) if f.lower().endswith(IMG_EXTENSIONS)]
        hint = (f' It holds {len(flat)} images directly: ImageNet\'s raw val/ is flat; sort it into class '
                f'folders (the usual valprep.sh script does it).') if flat else ''
        raise DataError(f'{split_dir} has no class folder with images; expected '
                        f'{split_dir}/<class>/*.JPEG.{hint}')
    return classes, samples, empty


def scan_imagefolder(root, given='--data-dir', warn=warn_stderr):
    """(classes, train samples, val samples) with the train/val checks users need. given: how the
    user named root (--data-dir for training, SRC for `dlojz_data.py prepare`), for the messages."""
    if not os.path.isdir(root):
        what = 'is a file, not a folder' if os.path.exists(root) else 'does not exist'
        fallback = ' (or omit it to use the built-in synthetic dataset)' if given == '--data-dir' else ''
        raise DataError(f'{given} {root} {what}; give a folder with train/<class>/ and val/<class>/ '
                        f'folders of images{fallback}.')
    train_classes, train, train_empty = find_classes(os.path.join(root, 'train'), warn)
    val_classes, val, val_empty = find_classes(os.path.join(root, 'val'), warn)
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
