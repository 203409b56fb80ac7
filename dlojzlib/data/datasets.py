"""Data pipeline for dlojz: where the images come from, the datasets and the loaders (the decode
paths are data.decode).

- resolve_data_source(): --data-dir, then $DLOJZ_DATA_DIR, $ALL_CCFRSCRATCH/imagenet, $DSDIR/imagenet, else the
  built-in synthetic JPEG dataset (generated once into --cache-dir).
- ImageFolderDataset: ImageFolder layout, PIL decode of whatever real ImageNet holds (grayscale, CMYK,
  PNG named .JPEG, progressive), bad files either stop the run with their path or are replaced and counted.
- Augmentation randomness is drawn per sample from (seed, epoch, index), not from a worker's RNG, so a
  batch is the same whatever --num-workers is and a resumed run sees the same crops as an uninterrupted one.
- Batches leave the workers as uint8 (4x fewer bytes over PCIe than float32); normalisation happens on
  the device (see dlojz.py: to_device).
"""
import contextlib
import math
import multiprocessing as mp
import os
import sys
from dataclasses import dataclass

import torch
from PIL import ImageFile

from dlojzlib import failpoints
from dlojzlib.data import augment
from dlojzlib.data import decode, gpu_decode
from dlojzlib.data import handover
from dlojzlib.data import index
from dlojzlib.data import shards
from dlojzlib.data import stage
from dlojzlib.data.decode import BadImageError, Blob, source_name
from dlojzlib.data.folder import IMG_EXTENSIONS, find_classes, scan_imagefolder  # noqa: F401 (data.datasets's API too)
from dlojzlib.data.handover import SharedCollate
from dlojzlib.data.synthetic import (  # noqa: F401 (data.datasets's API too)
    SYNTH_VERSION, _texture, ensure_synthetic_dataset, synthetic_image)
from dlojzlib.data.workers import DataLoader, loader_kwargs  # noqa: F401 (API: DataLoader)
from dlojzlib.errors import DataError, UsageError

ImageFile.LOAD_TRUNCATED_IMAGES = False  # a truncated file is an error, never silently half-grey
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def normalisation(device):
    """ImageNet's mean and std x 255 on `device`, shaped (1, 3, 1, 1): made once per run."""
    return tuple(torch.tensor(v, device=device).view(1, 3, 1, 1) * 255
                 for v in (IMAGENET_MEAN, IMAGENET_STD))


def to_device(images, labels, device, norm, non_blocking=False, channels_last=False):
    """uint8 NCHW batch -> normalised float on the device (normalising there is 4x less PCIe
    traffic). norm: normalisation(device)."""
    mean, std = norm
    x = images.to(device, non_blocking=non_blocking)
    labels = labels.to(device, non_blocking=non_blocking)
    # --decode gpu --skip-bad-images: sample j took bad i's place
    for i, j in getattr(images, 'replaced', ()):
        labels[i] = labels[j]
    if channels_last:  # reorder the uint8 batch (1 byte per value), not a float copy of it
        x = x.contiguous(memory_format=torch.channels_last)
    return (x.float() - mean) / std, labels


# --------------------------------------------------------------------------------------------------
# Where the data comes from

@dataclass(frozen=True)
class DataSource:
    kind: str    # 'imagefolder', 'shards' (data.shards), 'synthetic' or 'fake'
    root: str    # folder holding train/ and val/ ('' for fake)
    reason: str  # one line for the user: why this source
    given: str = '--data-dir'  # how the user named root, for the sentence when it is missing


def resolve_data_source(args, environ=os.environ):
    if args.fake_data:
        return DataSource('fake', '',
                          '--fake-data: random uint8 batches held in memory, no decoding')
    # an empty name ("$DATA" where DATA is unset) would fall back to the synthetic data without a
    # word: refused, as an empty --stage-dir is
    if args.data_dir is not None and not args.data_dir.strip():
        raise UsageError('--data-dir is empty (what "$VAR" gives where the variable is unset); '
                         'give the folder holding train/ and val/, or leave --data-dir out to use '
                         'the built-in synthetic dataset.')
    if args.data_dir:
        kind = 'shards' if shards.is_shards(args.data_dir) else 'imagefolder'
        return DataSource(kind, args.data_dir, '--data-dir')
    if 'DLOJZ_DATA_DIR' in environ and not environ['DLOJZ_DATA_DIR'].strip():
        raise UsageError('$DLOJZ_DATA_DIR is set but empty; set it to the folder holding train/ '
                         'and val/, or unset it (unset DLOJZ_DATA_DIR) to use the built-in '
                         'synthetic dataset.')
    if environ.get('DLOJZ_DATA_DIR'):  # named as the variable, never as a flag not given
        root = environ['DLOJZ_DATA_DIR']
        kind = 'shards' if shards.is_shards(root) else 'imagefolder'
        return DataSource(kind, root, '$DLOJZ_DATA_DIR is set', '$DLOJZ_DATA_DIR')
    # Jean Zay: a copy on the user's scratch, then the centre's dataset store $DSDIR (read-only,
    # shared)
    for var, sub in (('ALL_CCFRSCRATCH', 'imagenet'), ('DSDIR', 'imagenet'),
                     ('DSDIR', 'imagenet/RawImages')):
        root = os.path.join(environ[var], sub) if environ.get(var) else None
        if root and os.path.isdir(os.path.join(root, 'train')):
            return DataSource('imagefolder', root, f'${var}/{sub} holds train/ (Jean Zay)')
    root = synthetic_root(args)
    return DataSource('synthetic', root,
                      'no --data-dir, $DLOJZ_DATA_DIR, $ALL_CCFRSCRATCH/imagenet or '
                      '$DSDIR/imagenet: using the built-in synthetic JPEG dataset')


def synthetic_root(args):
    counts = (f'c{args.synthetic_classes}-n{args.synthetic_train_per_class}'
              f'-v{args.synthetic_val_per_class}-s{args.synthetic_seed}')
    name = f'synthetic-v{SYNTH_VERSION}-{counts}'
    return os.path.join(os.path.expanduser(args.cache_dir), name)


# --------------------------------------------------------------------------------------------------
# Datasets, samplers, loaders

class ImageFolderDataset(torch.utils.data.Dataset):
    """Indexable by an int (validation) or by (index, epoch) from EpochSampler (training)."""

    def __init__(self, samples, transform, seed=0, skip_bad_images=False):
        self.samples, self.transform, self.seed = samples, transform, seed
        self.skip_bad_images = skip_bad_images
        self.resolution = None  # epoch -> training image size (--res-start)
        # Shared with the loader workers (inherited at their start) so the main process can count.
        self.bad_count = mp.get_context('fork').Value('i', 0) if skip_bad_images else None

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, key):
        index, epoch = key if isinstance(key, tuple) else (key, 0)
        if isinstance(key, tuple):
            failpoints.train_sample()
        if self.resolution is not None:  # progressive resizing: this process's transform, this epoch's size
            self.transform.size = self.resolution(epoch)
        rng = decode.sample_rng(self.seed, epoch, index)
        for attempt in range(len(self.samples)):
            src, label = self.source((index + attempt) % len(self.samples))
            try:
                return self.transform(src, rng), label
            except BadImageError:
                if not self.skip_bad_images:
                    raise
                with self.bad_count.get_lock():
                    self.bad_count.value += 1
                print(f'dlojz: warning: skipped bad image {source_name(src)}; using the next file '
                      f'instead', file=sys.stderr)
        raise BadImageError('every image of the dataset failed to decode; check the data '
                            'directory.')

    def source(self, i):
        """-> (what the transform decodes: a path, label)."""
        return self.samples[i]

    @property
    def bad_images(self):
        return self.bad_count.value if self.bad_count is not None else 0


class ShardDataset(ImageFolderDataset):
    """The same dataset read from tar shards by index (data.shards): samples are rows of (shard,
    offset, size, label); each process keeps one open file per shard it reads."""

    def __init__(self, root, names, table, transform, seed=0, skip_bad_images=False):
        super().__init__(table, transform, seed, skip_bad_images)
        self.root, self.names = root, names
        self.open_count = mp.get_context('fork').Value('i', 0)  # every process's opens, for the summary
        self.reader = shards.ShardReader(root, names, self.open_count)

    def source(self, i):
        shard, offset, size, label = (int(v) for v in self.samples[i])
        try:
            data = self.reader.read(shard, offset, size)
        except OSError as e:
            raise DataError(f'cannot read shard {os.path.join(self.root, self.names[shard])} '
                            f'({e.strerror}); check --data-dir (a missing shard: run dlojz_data.py '
                            f'prepare again).') from None
        if len(data) < size:  # the file ends before the sample does: the shard's fault, not the image's
            path = os.path.join(self.root, self.names[shard])
            raise DataError(f'shard {path} is truncated: it holds {offset + len(data)} bytes and '
                            f'sample {i} ends at byte {offset + size}; copy it again from where '
                            f'the shards were prepared, or run dlojz_data.py prepare again.')
        return Blob(data, f'{self.names[shard]}:{i:08d}'), label

    @property
    def file_opens(self):
        return self.open_count.value


class EpochSampler(torch.utils.data.distributed.DistributedSampler):
    """torch's DistributedSampler (same shuffle from seed + epoch, same padding, same shard per
    rank), plus a start offset for mid-epoch resume; yields (index, epoch) so that the dataset seeds
    its augmentations per sample. Every rank gets ceil(n / world) samples, so every rank runs the
    same number of steps."""

    def __init__(self, dataset, seed, shuffle=True, rank=0, world_size=1):
        super().__init__(dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed,
                         drop_last=False)
        self.start = 0

    def set_epoch(self, epoch, start_sample=0):
        super().set_epoch(epoch)
        self.start = start_sample

    def __len__(self):
        return self.num_samples - self.start

    def __iter__(self):
        return iter((i, self.epoch) for i in list(super().__iter__())[self.start:])


class StepBatchSampler(torch.utils.data.Sampler):
    """The training batches, in order. With --accum-steps N this process stands for N ranks of a
    world N times larger (ranks rank x N ... rank x N + N - 1 of world x N): optimizer step s takes
    micro-batch s of each, so one GPU accumulating N micro-batches sees the very batches N GPUs
    would, BatchNorm groups included. With N = 1 it batches EpochSampler's order as a DataLoader
    would."""

    def __init__(self, dataset, seed, batch_size, drop_last=False, rank=0, world_size=1, accum=1):
        self.parts = [EpochSampler(dataset, seed, True, rank * accum + k,
                                   world_size * accum) for k in range(accum)]
        self.batch_size, self.drop_last = batch_size, drop_last

    def set_epoch(self, epoch, start_sample=0):
        """start_sample: samples already taken by each of the N virtual ranks (optimizer steps x
        batch)."""
        for part in self.parts:
            part.set_epoch(epoch, start_sample)

    def steps(self):
        n = len(self.parts[0])
        return n // self.batch_size if self.drop_last or self.single_last else -(-n // self.batch_size)

    @property
    def single_last(self):
        """Whether the epoch's last batch would hold one image (on every rank: the shares are padded
        to one length). BatchNorm cannot normalise a batch of one in training ("Expected more than 1
        value per channel"), so that image is left out of the epoch, as --drop-last would do, and
        only it: the batch size the user chose is kept. The next epoch's shuffle gives it its turn
        again."""
        return self.batch_size > 1 and len(self.parts[0]) % self.batch_size == 1

    def __len__(self):
        return self.steps() * len(self.parts)

    def __iter__(self):
        orders, b = [list(part) for part in self.parts], self.batch_size
        for s in range(self.steps()):
            for order in orders:
                yield order[s * b:(s + 1) * b]


class Accumulate:
    """The training loop's iterable with --accum-steps N: each item is one optimizer step's N
    micro-batches, as ([images], [labels])."""

    def __init__(self, loader, n):
        self.loader, self.n = loader, n

    def __len__(self):
        return len(self.loader) // self.n

    def __iter__(self):
        it = iter(self.loader)
        for _ in range(len(self)):
            micro = [next(it) for _ in range(self.n)]
            yield [x for x, _ in micro], [y for _, y in micro]


class ShardSampler(torch.utils.data.Sampler):
    """Validation: rank r takes samples r, r + world, r + 2 world... with no padding, so that every
    image is evaluated exactly once whatever the world size (ranks may differ by one sample)."""

    def __init__(self, n, rank=0, world_size=1):
        self.indices = range(rank, n, world_size)

    def __len__(self):
        return len(self.indices)

    def __iter__(self):
        return iter(self.indices)


class FakeLoader:
    """In-memory random uint8 batches: the compute ceiling, no decode and no worker."""

    def __init__(self, n_images, batch_size, image_size, num_classes, pin_memory, drop_last, seed):
        """n_images: this rank's share of the epoch."""
        g = torch.Generator().manual_seed(seed)
        self.batches = []
        for _ in range(2):  # two distinct batches so the model does not see one constant input
            images = torch.randint(0, 256, (batch_size, 3, image_size, image_size),
                                   dtype=torch.uint8, generator=g)
            labels = torch.randint(0, num_classes, (batch_size,), generator=g)
            if pin_memory:
                images, labels = images.pin_memory(), labels.pin_memory()
            self.batches.append((images, labels))
        self.batch_size = batch_size
        self.n_batches = n_images // batch_size if drop_last else math.ceil(n_images / batch_size)
        self.start = 0

    def set_epoch(self, epoch, start_sample=0):
        self.start = start_sample // self.batch_size

    def __len__(self):
        return self.n_batches - self.start

    def __iter__(self):
        return (self.batches[i % 2] for i in range(self.start, self.n_batches))


# --------------------------------------------------------------------------------------------------
# Loaders

@dataclass
class Data:
    source: DataSource
    classes: list
    train_loader: object
    val_loader: object
    train_dataset: object = None
    n_train: int = 0
    n_val: int = 0
    accum: int = 1  # --accum-steps: micro-batches per optimizer step
    ahead: object = None  # --decode gpu --decode-ahead: the device the batches are decoded on, one batch ahead
    staging: dict = None  # --stage-dir: what was copied where (data.stage), or why it was not used
    index: dict = None    # the listing's cost: folders read, the kept index used (data.index)

    @property
    def train_batches(self):
        """The training loader's batches, decoded one batch ahead with --decode gpu --decode-ahead."""
        if self.ahead is None:
            return self.train_loader
        return gpu_decode.DecodeAhead(self.train_loader, self.ahead)

    @property
    def train_steps(self):
        """What the training loop iterates: batches, or groups of --accum-steps micro-batches."""
        return self.train_batches if self.accum == 1 else Accumulate(self.train_batches, self.accum)

    @property
    def bad_images(self):
        """Training images replaced (--skip-bad-images): by the workers, and on the device (--decode
        gpu)."""
        if self.train_dataset is None:
            return 0
        return self.train_dataset.bad_images + gpu_decode.DEVICE_DECODE.bad

    @property
    def gpu_decode(self):
        """--decode gpu: which decoder decoded on the device (nvImageCodec, else torchvision's), why
        not nvImageCodec, the images each of its backends decoded and the libnvjpeg it bound
        (DeviceDecode.record); the images decoded elsewhere: on the host in the workers (files
        nvJPEG does not read: CMYK, PNG named .JPEG), by torchvision's decoder after nvImageCodec
        refused them, on the host after nvJPEG refused them; None for the other paths."""
        transform = getattr(self.train_dataset, 'transform', None)
        if not isinstance(transform, gpu_decode.GpuTrainTransform):
            return None
        return {**gpu_decode.DEVICE_DECODE.record(), 'cpu_in_workers': transform.in_workers.value}

    @property
    def fast_decode(self):
        """--decode fast (and the host path of --decode gpu): which decoder took how many training
        images, and why the region decoder was not used when it was not; None for --decode pil."""
        if self.dali is not None:
            return None
        transform = getattr(self.train_dataset, 'transform', None)
        transform = getattr(transform, 'transform', transform)  # under worker-side augmentations
        transform = getattr(transform, 'cpu', transform)  # --decode gpu's host path
        if not isinstance(transform, decode.FastTrainTransform):
            return None
        r = decode.REGION
        return {'region_decoder': f'nvimgcodec {r.version}' if r.why_not is None else None,
                'why_not': r.why_not,
                'images_region': r.counts[0], 'images_whole_file': r.counts[1],
                'images_pil': r.counts[2]}

    @property
    def dali(self):
        """--loader dali: DALI's version, where it decodes and its threads; None for the native
        loader."""
        summary = getattr(self.train_loader, 'summary', None)  # a DaliLoader's (data.dali)
        return summary() if summary else None

    @property
    def handover(self):
        """How the training loader's workers handed their batches over (data.handover); None without
        workers or for --decode gpu."""
        collate = getattr(self.train_loader, 'collate_fn', None)
        return collate.stats() if isinstance(collate, SharedCollate) else None

    @property
    def file_opens(self):
        """Shard files opened by the training set's processes so far; None for other sources
        (ImageFolder opens one file per sample read)."""
        return getattr(self.train_dataset, 'file_opens', None)

    def record(self, batches_per_epoch):
        """summary.json's 'data': where the images came from, how many, how they were read."""
        return {'source': self.source.kind, 'root': self.source.root, 'reason': self.source.reason,
                'classes': len(self.classes), 'train_images': self.n_train,
                'val_images': self.n_val, 'batches_per_epoch': batches_per_epoch,
                'bad_images_skipped': self.bad_images, 'shard_file_opens': self.file_opens,
                'gpu_decode': self.gpu_decode, 'fast_decode': self.fast_decode,
                'handover': self.handover, 'dali': self.dali, 'staging': self.staging,
                'index': self.index}

    def set_epoch(self, epoch, start_sample=0):
        """start_sample: optimizer steps done in the epoch x images per micro-batch."""
        if self.train_dataset is not None:
            self.train_loader.batch_sampler.set_epoch(epoch, start_sample)
        else:  # one stream of batches: the N micro-batches of each step follow each other
            self.train_loader.set_epoch(epoch, start_sample * self.accum)


def train_transform(args):
    """-> (the training transform of --decode with the worker-side augmentations, the loader's
    collate_fn: None for torch's default)."""
    if args.decode == 'gpu':
        gpu_decode.DEVICE_DECODE.skip_bad_images = args.skip_bad_images
        refused = decode.host_train_transform(args.image_size)  # files nvJPEG refuses
        return (gpu_decode.GpuTrainTransform(args.image_size, refused),
                gpu_decode.GpuCollate(args.image_size))
    transform = {'fast': decode.FastTrainTransform,
                 'pil': decode.TrainTransform}[args.decode](args.image_size)
    ops = augment.worker_ops(args)
    return (augment.Augmented(transform, ops) if ops else transform), None


def build_data(args, dist, log=print, on_ranks=None, device=None,
               phase=lambda name: contextlib.nullcontext()):
    """The data of a run (build_loaders), refused where an epoch cannot hold one training step."""
    data = build_loaders(args, dist, log, on_ranks, device, phase)
    if not (args.evaluate or args.loader_only or args.tune_loader):
        check_fits(args, dist.world_size, data)
    return data


def check_fits(args, world_size, data):
    """Refuse a global batch larger than the training set (its step would draw images twice, padded
    by the sampler) and an epoch with no step, before anything is trained or written."""
    gb = args.batch_size * args.accum_steps * world_size
    how = f'-b {args.batch_size} x --accum-steps {args.accum_steps} x {world_size} process(es)'
    if gb > data.n_train:
        raise UsageError(f'the global batch of {gb} images ({how}) is larger than the training set '
                         f'({data.n_train} images); lower -b or --accum-steps, or train on more '
                         f'data.')
    if len(data.train_steps) == 0:
        raise UsageError(f'an epoch of {data.n_train} training images holds no step of {gb} images '
                         f'({how}); lower -b or --accum-steps.')


def build_loaders(args, dist, log=print, on_ranks=None, device=None,
                  phase=lambda name: contextlib.nullcontext()):
    """on_ranks(fn, when): run fn where `when` holds, then let every rank learn of any failure
    (distributed). device: where the training batches go; with --decode gpu --decode-ahead the
    files' batches are decoded there one batch ahead (--fake-data has nothing to decode). phase: the
    start-up's clock (measure.startup), for the synthetic data, the staging and the index."""
    on_ranks = on_ranks or (lambda fn, when=True: fn() if when else None)
    source, staging, cost = resolve_data_source(args), None, None
    if args.stage_dir:
        with phase('staging'):
            source, staging = stage.staged_source(source, args.stage_dir, dist, on_ranks, log)
    if source.kind == 'fake':
        classes = [str(i) for i in range(args.fake_classes)]
        # Distinct batches per rank (seed + rank); train shares padded like DistributedSampler, val
        # shares exact.
        mk = lambda n, b, size, d: FakeLoader(n, b, size, len(classes), args.pin_memory, d,
                                              args.seed + dist.rank)
        train_share = math.ceil(args.fake_train_size / dist.world_size)
        val_share = len(range(dist.rank, args.fake_val_size, dist.world_size))
        return Data(source, classes,
                    mk(train_share, args.batch_size, args.image_size, args.drop_last),
                    mk(val_share, args.val_batch_size, args.val_image_size, False),
                    n_train=args.fake_train_size, n_val=args.fake_val_size, accum=args.accum_steps,
                    staging=staging)
    if source.kind == 'synthetic':  # one generator per node; the other ranks wait for it
        with phase('synthetic_data'):
            sizes = (args.synthetic_classes, args.synthetic_train_per_class,
                     args.synthetic_val_per_class, args.synthetic_seed)
            on_ranks(lambda: ensure_synthetic_dataset(source.root, *sizes, log=log),
                     when=dist.local_rank == 0)
    transform, collate = train_transform(args)
    if collate is None and args.num_workers > 0 and os.environ.get('DLOJZ_HANDOVER') != 'default':
        # the batches handed over in shared slots (data.handover); DLOJZ_HANDOVER=default: torch's
        # way
        collate, why_not = handover.make(args.num_workers, args.prefetch_factor, args.batch_size,
                                               max(args.image_size, args.res_start or 0))
        if why_not:
            log(f'Note: {why_not}; the workers hand each batch over in a new shared block '
                f'(PyTorch\'s way).')
    decode.REGION.reset()
    if args.decode == 'fast' and args.loader == 'native' and decode.REGION.why_not is not None:
        log(f'Note: {decode.REGION.why_not}: --decode fast decodes whole files, not the crop\'s '
            f'region alone.')
    val_transform = decode.ValTransform(args.val_resize, args.val_image_size)
    if source.kind == 'shards':
        with phase('dataset_index'):  # rank 0 reads index.json and its tables
            classes, splits = index.shared(lambda: shards.load_index(source.root), dist, on_ranks)
        train_set = ShardDataset(source.root, *splits['train'], transform, args.seed,
                                 args.skip_bad_images)
        val_set = ShardDataset(source.root, *splits['val'], val_transform, args.seed,
                               args.skip_bad_images)
    else:
        if os.path.exists(os.path.join(source.root, 'prepare.json')) and \
                not os.path.isdir(os.path.join(source.root, 'train')):  # prepare writes index.json last
            raise shards.incomplete(source.root, shards.INDEX)
        with phase('dataset_index'):  # rank 0 lists, or reuses the kept index (data.index)
            compact, cost = index.shared(
                lambda: index.list_imagefolder(source.root, args.cache_dir, args.rescan_data, log,
                                               given=source.given),
                dist, on_ranks)
            classes, train_samples, val_samples = index.expand(source.root, compact)
        train_set = ImageFolderDataset(train_samples, transform, args.seed, args.skip_bad_images)
        val_set = ImageFolderDataset(val_samples, val_transform, args.seed, args.skip_bad_images)
    if args.res_start is not None:
        train_set.resolution = lambda epoch: augment.resolution(epoch, args.res_start, args.image_size,
                                                                      args.res_end_epoch)
    batches = StepBatchSampler(train_set, args.seed, args.batch_size, args.drop_last, dist.rank,
                               dist.world_size, args.accum_steps)
    if batches.single_last and not args.drop_last:
        stream = 'process' if dist.world_size * args.accum_steps == 1 else 'micro-batch stream'
        log(f'Note: each epoch\'s last batch would hold a single image ({len(batches.parts[0])} '
            f'images per {stream}, -b {args.batch_size}), which BatchNorm cannot train on: that '
            f'image is left out of each epoch (as --drop-last would; another -b keeps it).')
    if args.loader == 'dali':  # the same samplers; DALI decodes (data.dali)
        from dlojzlib.data import dali
        dali_device = device if device is not None and device.type == 'cuda' else torch.device('cpu')
        val_batches = torch.utils.data.BatchSampler(ShardSampler(len(val_set), dist.rank, dist.world_size),
                                                    args.val_batch_size, drop_last=False)
        return Data(source, classes,
                    dali.DaliLoader(train_set, batches, True, args.image_size, args.seed,
                                    args.num_workers, dali_device),
                    dali.DaliLoader(val_set, val_batches, False, args.val_image_size, args.seed,
                                    args.num_workers, dali_device, val_resize=args.val_resize),
                    train_set, len(train_set), len(val_set), accum=args.accum_steps,
                    staging=staging, index=cost)
    # a lone process may skip its loader's start on a stop; ranks with peers agree at a step
    # boundary instead
    train_loader = DataLoader(train_set, batch_sampler=batches, collate_fn=collate,
                              abort_on_stop=dist.world_size == 1, **loader_kwargs(args))
    val_loader = DataLoader(val_set, batch_size=args.val_batch_size, drop_last=False,
                            **loader_kwargs(args),
                            sampler=ShardSampler(len(val_set), dist.rank, dist.world_size))
    return Data(source, classes, train_loader, val_loader, train_set, len(train_set), len(val_set),
                accum=args.accum_steps,
                ahead=device if args.decode == 'gpu' and args.decode_ahead else None,
                staging=staging, index=cost)
