"""One listing of the dataset per job, and one per dataset version.

Every rank listing ImageNet's 2 000 class folders itself multiplies the metadata operations of a job
by its number of ranks, on a metadata server that every job of the cluster shares. Here global rank
0 lists (or reads the index a previous job kept) and the others receive the file lists in one
broadcast. The index is kept in the cache folder (--cache-dir/index/, never in the data folder,
which may be read-only), one file per data folder, and the next job reuses each class folder's list
whose modification time has not moved (one stat per folder instead of its listing: 2 002 stats for
ImageNet instead of 1.33 M entries read). docs/data.md says what this can miss and how to force a
new listing (--rescan-data).

The shards' index.json and its tables are read once per job too, by rank 0."""
import hashlib
import json
import os
import socket
import tempfile

from dlojzlib.data import folder
from dlojzlib.dist import launch
from dlojzlib.files import fsync_replace

VERSION = 1  # of the index file's layout: another one is listed again


def index_path(cache_dir, root):
    """The index of data folder `root`: named after its real path, so a link to it shares it."""
    real = os.path.realpath(root)
    name = hashlib.sha256(real.encode()).hexdigest()[:20] + '.json'
    return os.path.join(os.path.expanduser(cache_dir), 'index', name)


def read_index(path, root):
    """-> the kept listing of `root` ({'train': folders, 'val': folders}), or None when there is
    none usable (missing, unreadable, half-written by a killed job, another layout or another
    folder)."""
    try:
        with open(path) as f:
            kept = json.load(f)
        if kept.get('version') == VERSION and kept.get('root') == os.path.realpath(root):
            return kept['splits']
    except (OSError, ValueError, AttributeError):
        pass
    return None


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
    kept = None if rescan else read_index(path, root)
    listing, read = {}, 0
    for split in ('train', 'val'):
        listing[split], n = folder.list_split(os.path.join(root, split), (kept or {}).get(split))
        read += n
    classes = folder.imagefolder_classes(root, listing, warn)  # each rank makes its samples
    total = sum(len(folders) for folders in listing.values())
    cost = {'index': path, 'folders': total, 'folders_listed': read, 'rescan': bool(rescan),
            'kept_index': kept is not None}
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
