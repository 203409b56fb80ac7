"""The JSC course's ResNet-50 with PyTorch Lightning ("Getting Started with AI on Supercomputers:
Parallelize Training"), as the course wrote it: a DataModule, a LightningModule and a Trainer, on 1
to N GPUs under srun. Two things are swapped in (docs/lightning.md):
- dlojz's ImageFolderDataModule for the course's ImageNetDataModule: dlojz's loaders (region
  decode, shards, the kept index, exact distributed validation);
- dlojz's Chronometer in the Trainer's callbacks: the '>>>' lines, summary.json and metrics.jsonl
  of dlojz.py (--no-chronometer leaves it out: the plain Lightning form).
dlojz adds a validation step (torchmetrics: every rank's counts added, so exact at any world size)
and builds the network in setup(), once the data's classes are known (the course: ImageNet's 1000).

    python examples/lightning_resnet50.py --arch resnet18 --image-size 64 -b 16 --max-steps 20
    srun python examples/lightning_resnet50.py --data-dir /p/scratch/training2324/data  # JUWELS
    sbatch slurm/jsc-booster-4gpu-lightning.slurm --max-epochs 10           # 1 node, 4 GPUs
"""
import argparse
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository

try:  # dlojzlib.lightning first: without Lightning it says what to install
    from dlojzlib.lightning import Chronometer, ImageFolderDataModule
    import lightning.pytorch as pl
except ModuleNotFoundError as e:
    if e.name != 'lightning':
        raise
    print(f'lightning_resnet50: error: {e}', file=sys.stderr)
    sys.exit(2)
import torch
import torch.nn.functional as F
import torchmetrics
import torchvision
from lightning.pytorch.plugins.environments import SLURMEnvironment
from lightning.fabric.utilities.exceptions import MisconfigurationException

from dlojzlib import flags
from dlojzlib.dist import launch
from dlojzlib.dist.launch import get_dist_info
from dlojzlib.environment import read
from dlojzlib.errors import UsageError


class resnet50Model(pl.LightningModule):  # the course's name
    def __init__(self, arch='resnet50', lr=0.02, optimizer='adam'):
        super().__init__()
        self.arch, self.lr, self.optimizer = arch, lr, optimizer

    def setup(self, stage):
        if not hasattr(self, 'model'):
            classes = len(self.trainer.datamodule.classes)
            self.model = torchvision.models.get_model(self.arch, weights=None, num_classes=classes)
            self.val_loss = torchmetrics.MeanMetric()
            self.val_top1 = torchmetrics.classification.MulticlassAccuracy(classes, average='micro')

    def forward(self, x):
        return self.model(x)

    def training_step(self, batch):
        x, labels = batch
        pred = self.forward(x)
        train_loss = F.cross_entropy(pred, labels)
        self.log("training_loss", train_loss)
        return train_loss

    def validation_step(self, batch):
        x, labels = batch
        pred = self.forward(x)
        self.val_loss.update(F.cross_entropy(pred, labels), weight=len(labels))
        self.val_top1.update(pred, labels)
        self.log('val_loss', self.val_loss, on_epoch=True)
        self.log('val_top1', self.val_top1, on_epoch=True)

    def configure_optimizers(self):
        if self.optimizer == 'sgd':  # dlojz.py's default optimizer: the side-by-side's same work
            return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        return torch.optim.Adam(self.parameters(), lr=self.lr)


LIMIT = flags.number(int, lambda v: v >= -1, '-1 (no limit) or more')  # Lightning's epochs, steps


def model_name(text):
    if text not in torchvision.models.list_models(module=torchvision.models):
        raise argparse.ArgumentTypeError(f'{text!r} is not a torchvision classification model; '
                                         f'torchvision.models.list_models() lists them')
    return text


def devices(text):
    """Lightning's devices: auto, a count, or a list of device indices such as 0,1."""
    if text == 'auto' or text == '-1' or all(p.isascii() and p.isdigit() for p in text.split(',')):
        return text
    raise argparse.ArgumentTypeError(f'must be auto, a number of devices or indices such as 0,1 '
                                     f'(got {text})')


def get_args_parser():
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0].replace('\n', ' '))
    p.add_argument('--data-dir', help='ImageFolder tree or shards folder (default: as dlojz.py)')
    p.add_argument('--arch', default='resnet50', type=model_name, help='a torchvision model name')
    p.add_argument('-b', '--batch-size', type=flags.POSITIVE_INT, default=256,
                   help='images per process')
    p.add_argument('--num-workers', type=flags.COUNT,
                   help='DataLoader workers per process (default: '
                   'SLURM_CPUS_PER_TASK, as the course)')
    p.add_argument('--image-size', type=flags.POSITIVE_INT, default=224,
                   help='training crop, pixels')
    p.add_argument('--lr', type=flags.NON_NEGATIVE, default=0.02,
                   help='the learning rate (the course\'s)')
    p.add_argument('--optimizer', choices=['adam', 'sgd'], default='adam',
                   help='adam (the course\'s) or sgd (momentum 0.9, as dlojz.py\'s default)')
    p.add_argument('--max-epochs', type=LIMIT, default=10, help='epochs (the course: 10)')
    p.add_argument('--max-steps', type=LIMIT, default=-1, help='stop after this many steps (-1: '
                   'the epochs)')
    p.add_argument('--accelerator', default='auto', help='gpu (the course), cpu or auto')
    tasks = read('SLURM_NTASKS_PER_NODE', default=None)  # devices = --ntasks-per-node
    p.add_argument('--devices', type=devices, default=str(tasks[0]) if tasks else 'auto',
                   help='processes per node (default: Slurm\'s --ntasks-per-node, else all '
                   'GPUs); a number outside Slurm to have Lightning start them')
    p.add_argument('--strategy', default='auto', help='Lightning\'s: auto (DDP on several '
                   'processes), ddp, ...')
    p.add_argument('--precision', default=None, help='Lightning\'s: 32, bf16-mixed, 16-mixed')
    p.add_argument('--seed', type=flags.SEED, default=0, help='weights and data order')
    p.add_argument('--output-dir', default=None, help='where Lightning\'s logs and dlojz\'s '
                   'record go (default: runs/lightning_<job id or time>_<arch>)')
    p.add_argument('--log-every-n-steps', type=flags.POSITIVE_INT, default=50, help='Lightning\'s')
    p.add_argument('--warmup-steps', type=flags.COUNT, default=1,
                   help='steps left out of the timings')
    p.add_argument('--no-chronometer', action='store_true', help='the plain Lightning form')
    p.add_argument('--data-flag', action='append', default=[], metavar='FLAG',
                   help='a dlojz.py data flag for the DataModule, e.g. --data-flag=--decode=pil')
    return p


def trainer_of(args, out, nnodes, callbacks, plugins):
    return pl.Trainer(max_epochs=args.max_epochs, max_steps=args.max_steps,
                      accelerator=args.accelerator, devices=args.devices, num_nodes=nnodes,
                      strategy=args.strategy, precision=args.precision, callbacks=callbacks,
                      plugins=plugins, default_root_dir=out,
                      logger=pl.loggers.CSVLogger(out, name='lightning_logs'),
                      log_every_n_steps=args.log_every_n_steps,
                      enable_progress_bar=sys.stderr.isatty())  # not into a batch job's log


def main(args):
    pl.seed_everything(args.seed, workers=True)
    nnodes = read('SLURM_NNODES', default=1)  # the course's line: Trainer(num_nodes=...)
    job = get_dist_info().job_id or 'local'
    out = args.output_dir or os.path.join('runs', f'lightning_{job}_{args.arch}')
    # 1. Organize the data
    datamodule = ImageFolderDataModule(args.data_dir, args.batch_size, args.num_workers,
                                       flags=['--image-size', str(args.image_size),
                                              '--seed', str(args.seed), *args.data_flag])
    # 2. Build the model using desired Task
    model = resnet50Model(args.arch, args.lr, args.optimizer)
    # 3. Create the trainer
    callbacks = [] if args.no_chronometer else \
        [Chronometer(os.path.join(out, 'dlojz'), warmup_steps=args.warmup_steps)]
    # Slurm's warning before the time limit (the scripts' --signal=USR2@120): Lightning saves
    # hpc_ckpt_<n>.ckpt in default_root_dir and requeues; the next attempt resumes from it
    plugins = [SLURMEnvironment(requeue_signal=signal.SIGUSR2)] if SLURMEnvironment.detect() else []
    try:  # what Lightning refuses (--precision 7, --strategy x) is one sentence, not a traceback
        trainer = trainer_of(args, out, nnodes, callbacks, plugins)
        os.makedirs(out, exist_ok=True)  # after the Trainer's checks: a refused run makes no folder
    except OSError as e:
        raise UsageError(f'--output-dir {out} cannot be made ({e.strerror}); give a folder you '
                         f'can write.') from None
    except (ValueError, TypeError, MisconfigurationException) as e:
        raise UsageError(f'Lightning refuses the Trainer\'s settings: {e}') from None
    # 4. Train the model
    trainer.fit(model, datamodule=datamodule)
    # 5. Save the model!
    trainer.save_checkpoint(os.path.join(out, "image_classification_model.pt"))
    # Lightning leaves its process group to the interpreter's exit, where gloo's threads can abort
    # the process (SIGABRT, 'terminate called without an active exception'): dlojz.py's cleanup
    launch.cleanup(synchronize=True)
    return trainer


if __name__ == '__main__':
    try:
        main(get_args_parser().parse_args())
    except UsageError as e:
        print(f'lightning_resnet50: error: {e}', file=sys.stderr)
        sys.exit(2)
