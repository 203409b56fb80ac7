"""One listing of the dataset per job, and one per dataset version.

Every rank listing ImageNet's 2 000 class folders itself multiplies the metadata operations of a job
by its number of ranks, on a metadata server that every job of the cluster shares. Here global rank
0 lists (or reads the index a previous job kept) and the others receive the file lists in one
broadcast. The index is kept in the cache folder (--cache-dir/index/, never in the data folder,
which may be read-only), one file per data folder, and the next job reuses each class folder's list
whose modification time has not moved (one stat per folder instead of its listing: 2 002 stats for
ImageNet instead of 1.33 M entries read). docs/data.md says what this can miss and how to force a
new listing (--rescan-data). The index is read through dlojzlib.readers against its shape (INDEX,
SPLITS below): an index of any other shape, or a special file at its path, is a new listing and a
note, never a failure, and no file name read from it leads out of its class folder.

The shards' index.json and its tables are read once per job too, by rank 0."""
import hashlib
import json
import os
import socket
import tempfile

from dlojzlib import readers
from dlojzlib.data import folder
from dlojzlib.dist import launch
from dlojzlib.files import fsync_replace

VERSION = 2  # of the index file's layout: another one is listed again (2: sub-folders walked)


NAME = readers.Name('a folder name')  # one component: a class folder
PATH = readers.Rel()
# What write_index writes, field by field (folder.list_split's listing of each split).
FOLDER = readers.Dict({'mtime_ns': readers.Maybe(readers.Int()),
                       'subdirs': readers.Map(readers.Int(), key=PATH),
                       'files': readers.List(PATH, expected='a list of file names in the folder'),
                       'odd': readers.List(readers.Str())},
                      expected='a class folder\'s listing')
SPLITS = readers.Dict({split: readers.Map(FOLDER, key=NAME) for split in ('train', 'val')})
# version and root first: another layout or another folder is not damage, only not this index
INDEX = readers.Dict({'version': readers.Any, 'root': readers.Any, 'splits': readers.Any})


def index_path(cache_dir, root):
    """The index of data folder `root`: named after its real path, so a link to it shares it."""
    real = os.path.realpath(root)
    name = hashlib.sha256(real.encode()).hexdigest()[:20] + '.json'
    return os.path.join(os.path.expanduser(cache_dir), 'index', name)


def read_index(path, root):
    """-> the kept listing of `root` ({'train': folders, 'val': folders} of SPLITS' shape), or None
    where there is none (no file, another layout's, another folder's). readers.Unreadable where the
    file is damaged: any other shape, a special file (a FIFO is refused, never waited on), a file
    that cannot be read. A job killed while writing leaves no half file (write_index)."""
    try:
        kept = readers.read_json(path, INDEX)
    except (FileNotFoundError, NotADirectoryError):  # no index yet; a cache "folder" that is a file
        return None
    except OSError as e:
        raise readers.Unreadable(path, f'cannot be read ({e.strerror})') from None
    if kept['version'] != VERSION or kept['root'] != os.path.realpath(root):
        return None
    try:
        return SPLITS.check(kept['splits'], 'splits')
    except readers.Wrong as e:
        raise readers.Unreadable(path, str(e)) from None


def write_index(path, root, listing):
    """Keep the listing for the next job: written under a name of its own and renamed, so that two
    jobs writing at once, or a job killed while writing, never leave a half file under `path`."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f'.{os.path.basename(path)}.{socket.gethostname()}.',
                               dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, 'w') as f:
            json.dump({'version': VERSION, 'root': os.path.realpath(root), 'splits': listing}, f,
                      separators=(',', ':'))
        fsync_replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def list_imagefolder(root, cache_dir, rescan=False, log=print, warn=folder.warn_stderr,
                     given='--data-dir'):
    """Rank 0's part: the listing of `root`, from the kept index where its folders have not changed.
    -> (the compact lists every rank expands, what it cost). given: how the user named root."""
    folder.require_root(root, given)
    path = index_path(cache_dir, root)
    kept = None
    try:
        kept = None if rescan else read_index(path, root)
    except readers.Unreadable as e:
        log(f'Note: the dataset index {path} {e.why}; {root} is listed again (nothing to do: '
            f'the new listing replaces it).')
    listing, read = {}, 0
    for split in ('train', 'val'):
        listing[split], n = folder.list_split(os.path.join(root, split), (kept or {}).get(split))
        read += n
    classes = folder.imagefolder_classes(root, listing, warn)  # each rank makes its samples
    total = sum(len(folders) for folders in listing.values())
    cost = {'index': path, 'folders': total, 'folders_listed': read, 'rescan': bool(rescan),
            'kept_index': kept is not None and read < total}  # a kept listing was used
    if read:
        try:
            write_index(path, root, listing)
        except OSError as e:
            log(f'Note: the dataset index could not be kept in {os.path.dirname(path)} '
                f'({e.strerror}); the next job lists {root} again. Give --cache-dir a writable '
                f'folder to keep it.')
            cost['index'] = None
    compact = {'classes': classes,
               'train': [listing['train'][c]['files'] for c in classes],
               'val': [listing['val'][c]['files'] for c in classes]}
    return compact, cost


def expand(root, compact):
    """The compact lists -> (classes, train samples, val samples): ImageFolder's (path, label)."""
    classes = compact['classes']
    return (classes, *(folder.samples(os.path.join(root, split), classes, compact[split])
                       for split in ('train', 'val')))


def shared(fn, dist, on_ranks):
    """fn() on global rank 0; every rank gets its result (one broadcast), or rank 0's error. A
    process outside any process group (a tool, a test standing in for one rank) has no one to hear
    from, and runs fn itself."""
    return launch.broadcast_object(on_ranks(fn, when=dist.rank == 0 or not launch.grouped()))
