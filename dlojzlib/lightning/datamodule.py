"""dlojz's loaders as a LightningDataModule: the training and validation loaders of dlojz.py
(data.datasets.build_data) with their region decode, shards, staging, kept index and exact
distributed validation, for a Lightning Trainer.

    dm = ImageFolderDataModule('/path/imagenet', batch_size=256, num_workers=10,
                               flags=['--image-size', '176'])

Each rank reads its own share of every epoch, the same share dlojz.py's rank would, so Lightning
must not put a DistributedSampler in: the loaders are handed to it as plain iterables, which it
leaves as they are. The validation share of each rank is unpadded (every image counted once over
the ranks); a module that sums its metrics' counts over the ranks (torchmetrics) then reports the
exact validation at any world size. Batches leave the workers as uint8 and are normalised on the
device (transfer_batch_to_device), as dlojz.py's."""
import contextlib
import copy
import time

import lightning.pytorch as pl
import torch

from dlojzlib.data import datasets
from dlojzlib.dist import launch
from dlojzlib.errors import UsageError
from dlojzlib.flags import check_args, get_args_parser
from dlojzlib.record.log import Console


def data_flags(data_dir, batch_size, num_workers, flags):
    """-> dlojz's flags (an argparse.Namespace), checked by dlojz's own parser."""
    argv = [*flags, '--batch-size', str(batch_size)]
    argv += ['--data-dir', str(data_dir)] if data_dir is not None else []
    argv += ['--num-workers', str(num_workers)] if num_workers is not None else []
    parser = get_args_parser()

    def refuse(message):  # argparse's sentence, raised instead of printed with an exit
        # a flag's control characters (a newline) shown escaped: the sentence stays one line
        message = ''.join(c if c.isprintable() else repr(c)[1:-1] for c in message)
        raise UsageError(f'ImageFolderDataModule: {message} (its flags are dlojz.py\'s data '
                         f'flags: python dlojz.py --help)')
    parser.error = refuse
    if '-h' in argv or '--help' in argv:  # argparse would print the help and exit
        refuse('--help is no data flag')
    args = parser.parse_args(argv)
    if args.accum_steps != 1:
        raise UsageError('ImageFolderDataModule: --accum-steps is the Trainer\'s '
                         'accumulate_grad_batches; pass that instead.')
    if args.decode == 'gpu':
        raise UsageError('ImageFolderDataModule: --decode gpu is not offered (its batches are '
                         'decoded in the training loop); use --decode fast.')
    return args


def dist_of(trainer):
    """The launch as the Trainer set it up, in dlojz's terms (dist.launch.DistInfo): its ranks,
    the cluster environment Lightning detected, Slurm's job id."""
    from lightning.pytorch.plugins.environments import SLURMEnvironment
    env = getattr(trainer.strategy, 'cluster_environment', None)  # None: one device
    env = type(env).__name__ if env is not None else \
        'SLURMEnvironment' if SLURMEnvironment.detect() else type(trainer.strategy).__name__
    return launch.DistInfo(rank=trainer.global_rank, local_rank=trainer.local_rank,
                           world_size=trainer.world_size, local_world_size=trainer.num_devices,
                           launcher=f'lightning ({env})', job_id=launch.get_dist_info().job_id)


class ImageFolderDataModule(pl.LightningDataModule):
    """data_dir: an ImageFolder tree or a shards folder (None: $DLOJZ_DATA_DIR, then the built-in
    synthetic data, as dlojz.py); batch_size: images per process; num_workers: None as dlojz.py
    (SLURM_CPUS_PER_TASK, else up to 8); flags: any other dlojz.py data flag."""

    def __init__(self, data_dir=None, batch_size=256, num_workers=None, flags=()):
        super().__init__()
        self.args = data_flags(data_dir, batch_size, num_workers, list(flags))
        self.batch_size = batch_size
        self.data = None
        self.timer = None     # a dlojzlib.lightning.Chronometer: it times the wait and the copy
        self.last_wait = 0.0  # seconds the training loader's last batch was waited for
        self._norm = None

    def setup(self, stage):
        if self.data is not None:
            return
        trainer = self.trainer
        device = trainer.strategy.root_device
        backend = torch.distributed.get_backend() if torch.distributed.is_initialized() else None
        args = check_args(copy.copy(self.args), device, trainer.world_size, backend=backend)
        view = dist_of(trainer)
        say = Console(trainer.is_global_zero)
        self.data = datasets.build_data(args, view, log=say, on_ranks=launch.on_ranks,
                                        device=device)
        self.args = args
        say(f'Data: {self.data.source.kind} {self.data.source.root} ({self.data.source.reason}); '
            f'{self.data.n_train} train / {self.data.n_val} val images, '
            f'{len(self.data.classes)} classes')

    @property
    def classes(self):
        return self.data.classes

    def train_dataloader(self):
        return _Stamped(self)

    def val_dataloader(self):
        return _Sized(self.data.val_loader)

    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        images, labels = batch
        timer = self.timer if self.trainer is not None and self.trainer.training else None
        if timer is not None:
            timer.batch_arrived(batch, self.last_wait)
        if self._norm is None:
            self._norm = datasets.normalisation(device)
        with timer.phase('h2d') if timer is not None else contextlib.nullcontext():
            return datasets.to_device(images, labels, device, self._norm, self.args.non_blocking,
                                      bool(self.args.channels_last))


class _Sized:
    """A loader as a plain iterable with a length: Lightning then adds no sampler of its own."""

    def __init__(self, loader):
        self.loader = loader

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        return iter(self.loader)


class _Stamped(_Sized):
    """The training batches of the Trainer's current epoch, each one's wait stamped (seconds)."""

    def __init__(self, dm):
        super().__init__(dm.data.train_batches)
        self.dm = dm

    def __iter__(self):
        self.dm.data.set_epoch(self.dm.trainer.current_epoch)
        it = iter(self.loader)
        while True:
            t = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                return
            self.dm.last_wait = time.perf_counter() - t
            yield batch
