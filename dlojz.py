"""dlojz: train torchvision ResNets on ImageNet (or a built-in JPEG dataset) and measure why a run is
fast or slow.

    python dlojz.py --test-nsteps 20 --arch resnet18 --image-size 64 -b 16 --num-workers 2   # CPU demo
    python dlojz.py --test-nsteps 50 --amp bf16 --channels-last --data-dir /path/imagenet      # one GPU
    torchrun --standalone --nproc_per_node 4 dlojz.py --test-nsteps 50 --amp bf16              # 4 GPUs, DDP
    srun --ntasks-per-node=4 --gres=gpu:4 --cpus-per-task=10 python dlojz.py --num-workers 10  # SLURM, DDP
    sbatch slurm/jz-a100-8gpu.slurm --amp bf16 -b 256                      # batch job, requeued on SIGUSR2

Outputs go to --output-dir (default runs/<job id or timestamp>_<arch>_bs<b>): config.json,
metrics.jsonl, summary.json, checkpoint-<step>.pt (--chkpt), profiler traces (--prof), wandb files.
"""
import argparse
import inspect
import itertools
import math
import os
import random
import shutil
import socket
import sys
import time
import warnings
from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn as nn
from torchmetrics import MeanMetric, SumMetric
from tqdm import tqdm
from torchmetrics.classification import MulticlassAccuracy

import custom_models
from dlojz_chrono import Chronometer, PowerMeter
from dlojz_data import IMAGENET_MEAN, IMAGENET_STD, DataError, build_data, loader_error_message
import dlojz_dist
from dlojz_dist import get_dist_info
from dlojz_io import (SUMMARY_VERSION, JsonlWriter, UsageError, checkpoint_path, default_output_dir, host_memory,
                      load_checkpoint, load_latest_checkpoint, prepare_output_dir, provenance, save_checkpoint,
                      strip_prefixes, write_json)


class NonFiniteLoss(Exception):
    def __init__(self, step):
        super().__init__(f'the loss became NaN or infinite at step {step}; training stopped there and no '
                         f'checkpoint was written after it; lower --lr, use --amp bf16/off, or check the data.')
        self.step = step


def print0(msg, dist=None):
    """Print on rank 0 only; through tqdm so an active progress bar is not torn."""
    if dist is None or dist.is_main:
        tqdm.write(str(msg))
        sys.stdout.flush()


# ------------------------------------------------------------------------------------------------ config

def get_args_parser(add_help=True):
    p = argparse.ArgumentParser(description='dlojz: ResNet training and benchmarking', add_help=add_help)
    B = argparse.BooleanOptionalAction
    g = p.add_argument_group('data')
    g.add_argument('--data-dir', help='ImageNet in ImageFolder layout (DIR/train/<class>/*.JPEG, DIR/val/...); '
                   'default $DLOJZ_DATA_DIR, then $ALL_CCFRSCRATCH/imagenet, else the built-in synthetic dataset')
    g.add_argument('--cache-dir', default='~/.cache/dlojz', help='where the synthetic dataset is generated, once')
    g.add_argument('--synthetic-classes', type=int, default=10, help='synthetic dataset: number of classes')
    g.add_argument('--synthetic-train-per-class', type=int, default=64, help='synthetic: train images per class')
    g.add_argument('--synthetic-val-per-class', type=int, default=16, help='synthetic: val images per class')
    g.add_argument('--synthetic-seed', type=int, default=0, help='synthetic dataset content seed')
    g.add_argument('--fake-data', action='store_true', help='random uint8 batches in memory, no decoding: '
                   'the compute ceiling')
    g.add_argument('--fake-train-size', type=int, default=1281167, help='--fake-data: images per epoch')
    g.add_argument('--fake-val-size', type=int, default=50000, help='--fake-data: validation images')
    g.add_argument('--fake-classes', type=int, default=1000, help='--fake-data: number of classes')
    g.add_argument('--image-size', type=int, default=224, help='train RandomResizedCrop size, pixels')
    g.add_argument('--val-resize', type=int, default=None, help='validation: shorter side resized to, pixels '
                   '(default 256, i.e. val-image-size x 256/224)')
    g.add_argument('--val-image-size', type=int, default=None, help='validation: center crop, pixels (default '
                   '224 when --image-size is 224, else --image-size)')
    g.add_argument('--skip-bad-images', action='store_true', help='replace undecodable files and count them '
                   'instead of stopping')
    g = p.add_argument_group('loader')
    g.add_argument('-b', '--batch-size', type=int, default=128, help='images per device; global batch = this x '
                   'world size')
    g.add_argument('--val-batch-size', type=int, default=250, help='validation images per device')
    g.add_argument('--num-workers', type=int, default=None, help='DataLoader worker processes (train and val; '
                   'default $SLURM_CPUS_PER_TASK under SLURM, else 8)')
    g.add_argument('--persistent-workers', action=B, default=None, help='keep workers between epochs '
                   '(default: on when --num-workers > 0)')
    g.add_argument('--pin-memory', action=B, default=None, help='page-locked batches (default: on with CUDA)')
    g.add_argument('--non-blocking', action=B, default=True, help='asynchronous host-to-device copies')
    g.add_argument('--prefetch-factor', type=int, default=None, help='batches loaded ahead per worker (default 2)')
    g.add_argument('--drop-last', action=B, default=False, help='drop the last incomplete batch')
    g = p.add_argument_group('model')
    g.add_argument('--arch', default='resnet50', help=f'one of {", ".join(custom_models.ARCHS)}')
    g.add_argument('--sd-prob', type=float, default=0.5, help='-sd archs: drop probability of the last block')
    g.add_argument('--n-heads', type=int, default=3, help='-heads archs: number of classifier heads')
    g.add_argument('--grad-checkpointing', action='store_true', help='recompute ResNet stage activations in '
                   'backward (less memory, ~30%% more compute)')
    g = p.add_argument_group('precision and compilation')
    g.add_argument('--amp', choices=['auto', 'off', 'fp16', 'bf16'], default='auto', help='autocast dtype; auto '
                   '= bf16 where the GPU supports it, fp16 on older GPUs, off on CPU')
    g.add_argument('--channels-last', action=B, default=None, help='NHWC memory format (default: on with CUDA)')
    g.add_argument('--tf32', action=B, default=True, help='TF32 matmuls/convolutions on Ampere and newer')
    g.add_argument('--cudnn-benchmark', action=B, default=True, help='cudnn autotuning (first steps slower)')
    g.add_argument('--compile', action=B, default=False, help='torch.compile the model')
    g.add_argument('--compile-mode', default='default', choices=['default', 'reduce-overhead', 'max-autotune',
                   'max-autotune-no-cudagraphs'], help='torch.compile mode')
    g = p.add_argument_group('optimization')
    g.add_argument('--optimizer', choices=['sgd', 'adamw'], default='sgd')
    g.add_argument('--lr', type=float, default=None, help='peak learning rate (default 0.1)')
    g.add_argument('--wd', type=float, default=0.0, help='weight decay')
    g.add_argument('--mom', type=float, default=0.9, help='SGD momentum (AdamW beta1)')
    g.add_argument('--label-smoothing', type=float, default=0.1)
    g.add_argument('--scheduler', choices=['onecycle', 'cosine', 'constant'], default='onecycle',
                   help='learning-rate schedule, stepped every batch')
    g.add_argument('--warmup-epochs', type=float, default=0.0, help='cosine: linear warm-up length, epochs')
    g.add_argument('--findlr', action='store_true', help='LR range test: geometric from 1e-8 to --lr (10 if '
                   '--lr is not given) over the run')
    g = p.add_argument_group('run')
    g.add_argument('-e', '--epochs', type=int, default=1, help='number of epochs')
    g.add_argument('--test', action='store_true', help='benchmark mode: --test-nsteps train steps, 20 val batches')
    g.add_argument('--test-nsteps', type=int, default=None, help='train steps in test mode (default 50; implies '
                   '--test)')
    g.add_argument('--seed', type=int, default=123)
    g.add_argument('--device', choices=['auto', 'cuda', 'cpu'], default='auto')
    g.add_argument('--output-dir', default=None, help='run directory (default runs/<job id or time>_<arch>_bs<b>)')
    g.add_argument('--chkpt', action='store_true', help='write checkpoint-<step>.pt at the end of each epoch and run')
    g.add_argument('--chkpt-every', type=int, default=0, help='also every N steps (implies --chkpt)')
    g.add_argument('--keep-checkpoints', type=int, default=2, help='newest checkpoints kept in the run directory')
    g.add_argument('--resume', default=None, help='checkpoint to continue from, or "auto": the newest readable '
                   'checkpoint of --output-dir if there is one (what a requeued job uses)')
    g.add_argument('--requeue', action=B, default=True, help='under SLURM, on SIGUSR2/SIGTERM: checkpoint, then '
                   '`scontrol requeue` the job')
    g.add_argument('--allow-batch-change', action='store_true', help='--resume with another global batch size '
                   '(the position in the epoch and the LR schedule are converted in images)')
    g.add_argument('--evaluate', action='store_true', help='validation only, of the --resume checkpoint, at any '
                   'world size (like torchvision\'s --test-only)')
    g = p.add_argument_group('distributed (under srun or torchrun)')
    g.add_argument('--sync-bn', action='store_true', help='SyncBatchNorm: batch statistics over all ranks (CUDA only)')
    g.add_argument('--find-unused-parameters', action='store_true', help='DDP: allow parameters without a gradient '
                   'in a step (needed by the -heads archs)')
    g.add_argument('--bucket-cap-mb', type=float, default=25.0, help='DDP gradient bucket size, MiB')
    g.add_argument('--static-graph', action='store_true', help='DDP static_graph (same graph every step)')
    g.add_argument('--gradient-as-bucket-view', action='store_true', help='DDP: gradients are views into the '
                   'buckets (saves one gradient copy of memory)')
    g.add_argument('--broadcast-buffers', action=B, default=True, help='DDP: rank 0\'s BatchNorm buffers are '
                   'broadcast before every training forward')
    g.add_argument('--dist-timeout', type=float, default=None, help='minutes a collective may wait before the job '
                   'ends with an error (default: PyTorch\'s, 10 min NCCL / 30 min gloo)')
    g.add_argument('--nccl-debug', action='store_true', help='NCCL_DEBUG=INFO, NCCL_DEBUG_SUBSYS=INIT,COLL; each '
                   'rank\'s stdout, with step markers, is also written to <output-dir>/nccl.rank<r>.log')
    g.add_argument('--dist-debug', action='store_true', help='TORCH_DISTRIBUTED_DEBUG=DETAIL')
    g = p.add_argument_group('logging and profiling')
    g.add_argument('--log-interval', type=int, default=10, help='steps between log lines')
    g.add_argument('--metric-step', type=int, default=100, help='steps between train accuracy computations (a '
                   'collective: torchmetrics gathers every rank\'s state)')
    g.add_argument('--metric-sync-log', action='store_true', help='print and record each rank\'s train metrics '
                   'before and after the sync at every --metric-step')
    g.add_argument('--wandb', choices=['off', 'offline', 'online'], default=None, help='default: offline for full '
                   'runs, off in test mode')
    g.add_argument('--prof', action='store_true', help='torch.profiler traces into <output-dir>/profiler')
    g.add_argument('--prof-wait', type=int, default=1)
    g.add_argument('--prof-warmup', type=int, default=1)
    g.add_argument('--prof-active', type=int, default=5)
    g = p.add_argument_group('benchmark')
    g.add_argument('--timing', action=B, default=True, help='per-phase timing (CUDA events on GPU)')
    g.add_argument('--sync-timing', action='store_true', help='synchronise at phase boundaries (wall-clock '
                   'splits, slower)')
    g.add_argument('--warmup-steps', type=int, default=1, help='first steps left out of the statistics')
    return p


def check_args(args):
    """Resolve defaults that depend on other flags and refuse meaningless combinations."""
    if args.test_nsteps is not None:
        args.test = True
    if args.test and args.test_nsteps is None:
        args.test_nsteps = 50
    if args.val_image_size is None:  # validate at the training resolution unless told otherwise
        args.val_image_size = args.image_size if args.image_size > 0 else 224
    if args.val_resize is None:
        args.val_resize = round(args.val_image_size * 256 / 224)
    positive = ['batch_size', 'val_batch_size', 'epochs', 'image_size', 'val_resize', 'val_image_size',
                'log_interval', 'metric_step', 'synthetic_classes', 'synthetic_train_per_class',
                'synthetic_val_per_class', 'fake_train_size', 'fake_val_size', 'fake_classes', 'prof_active']
    positive += ['test_nsteps'] if args.test else []
    positive += ['prefetch_factor'] if args.prefetch_factor is not None else []
    positive += ['lr'] if args.lr is not None else []
    for name in positive:
        if getattr(args, name) <= 0:
            raise UsageError(f'--{name.replace("_", "-")} must be positive (got {getattr(args, name)}).')
    if args.num_workers is None:
        args.num_workers = dlojz_dist.slurm_cpus_per_task() or 8
    if args.keep_checkpoints < 1:
        raise UsageError(f'--keep-checkpoints must be at least 1 (got {args.keep_checkpoints}).')
    args.chkpt = args.chkpt or args.chkpt_every > 0
    for name in ('num_workers', 'warmup_steps', 'wd', 'warmup_epochs', 'prof_wait', 'prof_warmup', 'chkpt_every'):
        if getattr(args, name) < 0:
            raise UsageError(f'--{name.replace("_", "-")} cannot be negative (got {getattr(args, name)}).')
    if args.arch not in custom_models.ARCHS:
        raise UsageError(f'unknown --arch {args.arch}; choose one of {", ".join(custom_models.ARCHS)}.')
    if not 0 <= args.sd_prob < 1 or not 0 <= args.label_smoothing < 1:
        raise UsageError('--sd-prob and --label-smoothing must be in [0, 1).')
    if args.n_heads < 2:
        raise UsageError('--n-heads must be at least 2 (head 0 for training plus at least one other).')
    if args.val_image_size > args.val_resize:
        raise UsageError(f'--val-image-size {args.val_image_size} is larger than --val-resize {args.val_resize}; '
                         f'the center crop must fit in the resized image.')
    if args.num_workers == 0 and (args.prefetch_factor is not None or args.persistent_workers):
        raise UsageError('--prefetch-factor and --persistent-workers need worker processes; drop them or set '
                         '--num-workers to 1 or more.')
    if args.findlr and args.resume:
        raise UsageError('--findlr starts from a fresh model; drop --resume.')
    if args.evaluate and not args.resume:
        raise UsageError('--evaluate validates a trained model; give its checkpoint with --resume PATH.')
    if args.evaluate and args.findlr:
        raise UsageError('--evaluate and --findlr exclude each other; drop one.')
    if args.bucket_cap_mb <= 0 or (args.dist_timeout is not None and args.dist_timeout <= 0):
        raise UsageError('--bucket-cap-mb and --dist-timeout must be positive.')
    args.findlr_upper = args.lr if args.lr is not None else 10.0
    args.lr = args.lr if args.lr is not None else 0.1
    if args.num_workers > 0:
        args.prefetch_factor = args.prefetch_factor or 2
        args.persistent_workers = True if args.persistent_workers is None else args.persistent_workers
    if args.wandb is None:
        args.wandb = 'off' if args.test else 'offline'
    return args


def resolve_device(args, dist):
    if args.device == 'cuda' and not torch.cuda.is_available():
        raise UsageError('--device cuda was requested but PyTorch sees no CUDA GPU; use --device cpu or run on a '
                         'GPU node.')
    use_cuda = args.device == 'cuda' or (args.device == 'auto' and torch.cuda.is_available())
    if use_cuda:  # bind this process to its GPU before anything allocates on the default one
        torch.cuda.set_device(dlojz_dist.cuda_device_for(dist))
    device = torch.device('cuda', torch.cuda.current_device()) if use_cuda else torch.device('cpu')
    if device.type == 'cpu':
        if args.sync_bn:
            raise UsageError('--sync-bn needs CUDA GPUs (PyTorch\'s SyncBatchNorm does not run on CPU); drop it '
                             'for CPU runs.')
        if args.amp == 'fp16':
            raise UsageError('--amp fp16 needs a CUDA GPU (CPU autocast computes in bfloat16); use --amp bf16 or '
                             '--amp off on CPU.')
        if args.pin_memory:
            raise UsageError('--pin-memory only speeds up copies to a GPU; drop it on CPU.')
        if args.compile and not (shutil.which('cc') or shutil.which('gcc')):
            raise UsageError('--compile on CPU needs a C compiler (cc/gcc) on PATH; install one or drop --compile.')
    else:
        if args.amp == 'bf16' and not torch.cuda.is_bf16_supported():
            raise UsageError(f'--amp bf16 is not supported on {torch.cuda.get_device_name(device)}; use --amp fp16.')
    if args.amp == 'auto':
        args.amp = 'off' if device.type == 'cpu' else ('bf16' if torch.cuda.is_bf16_supported() else 'fp16')
    args.pin_memory = device.type == 'cuda' if args.pin_memory is None else args.pin_memory
    args.channels_last = device.type == 'cuda' if args.channels_last is None else args.channels_last
    return device


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# ------------------------------------------------------------------------------------------------ building

def build_model(args, num_classes, device, dist):
    """-> (model to train: DDP-wrapped and/or compiled, model to evaluate, plain module for state dicts).

    Validation runs the module without its DDP wrapper: a DDP forward may broadcast buffers (a collective),
    and ranks can run different numbers of validation batches."""
    model = custom_models.build_model(args.arch, num_classes, args.sd_prob, args.n_heads)
    if args.grad_checkpointing:
        custom_models.apply_grad_checkpointing(model)
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    model = model.to(device, memory_format=memory_format)
    if dist.distributed and args.sync_bn:  # before the DDP wrap, as DDP must see the final modules
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    train_model = model
    if dist.distributed:
        ddp = nn.parallel.DistributedDataParallel
        # PyTorch >= 2.15 renamed broadcast_buffers (same meaning for the per-forward broadcast)
        buffers = 'forward_sync_buffers' if 'forward_sync_buffers' in inspect.signature(ddp).parameters else \
            'broadcast_buffers'
        train_model = ddp(model, device_ids=[device.index] if device.type == 'cuda' else None,
                          find_unused_parameters=args.find_unused_parameters, bucket_cap_mb=args.bucket_cap_mb,
                          static_graph=args.static_graph, gradient_as_bucket_view=args.gradient_as_bucket_view,
                          **{buffers: args.broadcast_buffers})
    eval_model = model
    if args.compile:  # DDP first, then compile: dynamo's DDPOptimizer keeps communication overlapped
        mode = None if args.compile_mode == 'default' else args.compile_mode
        train_model = torch.compile(train_model, mode=mode)
        eval_model = torch.compile(model, mode=mode) if dist.distributed else train_model
    return train_model, eval_model, model


def build_optimization(args, model, steps_per_epoch, total_steps):
    """model: the plain module (its parameters are the DDP/compiled model's)."""
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    lr = 1e-8 if args.findlr else args.lr
    if args.optimizer == 'sgd':
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=args.mom, weight_decay=args.wd)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(args.mom, 0.999), weight_decay=args.wd)
    if args.findlr:  # geometric sweep from 1e-8 to the upper bound over every step of the run
        mult = (args.findlr_upper / 1e-8) ** (1 / max(1, total_steps - 1))
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: mult ** s)
    elif args.scheduler == 'onecycle':
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr,
                                                        total_steps=args.epochs * steps_per_epoch)
    elif args.scheduler == 'cosine':
        warmup, total = args.warmup_epochs * steps_per_epoch, args.epochs * steps_per_epoch
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: (s + 1) / warmup if s < warmup else
                                                      0.5 * (1 + math.cos(math.pi * (s - warmup) / max(1, total - warmup))))
    else:
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    scaler = torch.amp.GradScaler('cuda', enabled=args.amp == 'fp16')
    return criterion, optimizer, scheduler, scaler


def build_profiler(args, device):
    if not args.prof:
        return nullcontext(None)
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                          if device.type == 'cuda' else [])
    return torch.profiler.profile(
        activities=activities, profile_memory=True,
        schedule=torch.profiler.schedule(wait=args.prof_wait, warmup=args.prof_warmup, active=args.prof_active, repeat=1),
        on_trace_ready=torch.profiler.tensorboard_trace_handler(os.path.join(args.output_dir, 'profiler')))


def build_wandb(args, dist):
    if args.wandb == 'off' or not dist.is_main:
        return None
    import wandb
    return wandb.init(project='dlojz', name=os.path.basename(args.output_dir), mode=args.wandb,
                      dir=args.output_dir, config=vars(args))


# ------------------------------------------------------------------------------------------------ training

@dataclass
class Run:
    args: argparse.Namespace
    dist: object
    device: torch.device
    data: object
    model: nn.Module             # what trains: DDP-wrapped and/or compiled
    eval_model: nn.Module        # what validates: without the DDP wrapper
    model_without_ddp: nn.Module  # plain module: state dicts, buffers
    criterion: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    scaler: object
    autocast: object
    chrono: Chronometer
    log: JsonlWriter
    wandb: object
    steps_per_epoch: int
    global_step: int = 0
    findlr: tuple = field(default_factory=lambda: ([], []))  # (lrs, losses) of --findlr
    stop: object = None       # dlojz_dist.StopSignal
    preempted: bool = False
    norm: tuple = ()

    def __post_init__(self):  # created once: a host->device copy per step would be a hidden stall
        self.norm = tuple(torch.tensor(v, device=self.device).view(1, 3, 1, 1) * 255 for v in (IMAGENET_MEAN, IMAGENET_STD))


class NonFiniteGuard:
    """Remembers on the device the first step whose loss was not finite; read at check points only.
    On CPU reading is free, so it is read every step; on CUDA every --log-interval steps. Distributed, the
    check is a MIN all-reduce so that every rank stops at the same step (a rank stopping alone would leave
    the others waiting in the gradient all-reduce)."""
    GOOD = 2 ** 62  # "no bad step yet"

    def __init__(self, device, first_step, every, distributed=False):
        self.first_bad = torch.full((), self.GOOD, dtype=torch.long, device=device)
        self.counter = torch.full((), first_step, dtype=torch.long, device=device)
        self.every = 1 if device.type == 'cpu' else every
        self.distributed = distributed

    def update(self, loss):
        ok = torch.isfinite(loss.detach()) | (self.first_bad < self.GOOD)
        self.first_bad = torch.where(ok, self.first_bad, self.counter)
        self.counter += 1

    def check(self, step, force=False):
        if force or step % self.every == 0:
            bad = dlojz_dist.all_reduce_(self.first_bad.clone(), 'min') if self.distributed else self.first_bad
            bad = int(bad.item())
            if bad < self.GOOD:
                raise NonFiniteLoss(bad + 1)


def to_device(images, labels, run):
    """uint8 NCHW batch -> normalised float on the device (normalising here is 4x less PCIe traffic)."""
    nb = run.args.non_blocking
    mean, std = run.norm
    images = (images.to(run.device, non_blocking=nb).float() - mean) / std
    if run.args.channels_last:
        images = images.contiguous(memory_format=torch.channels_last)
    return images, labels.to(run.device, non_blocking=nb)


def train_one_epoch(run, epoch, start_step, max_steps, prof):
    args, chrono, model = run.args, run.chrono, run.model
    model.train()
    loss_sum = torch.zeros((), device=run.device)
    top_k = min(5, len(run.data.classes))
    acc1 = MulticlassAccuracy(len(run.data.classes), top_k=1, average='micro', validate_args=False).to(run.device)
    acc5 = MulticlassAccuracy(len(run.data.classes), top_k=top_k, average='micro', validate_args=False).to(run.device)
    loss_metric = MeanMetric(nan_strategy='disable').to(run.device)
    guard = NonFiniteGuard(run.device, run.global_step, args.log_interval, run.dist.distributed)
    if args.metric_sync_log:  # the same metrics without the sync, to show what each rank sees alone
        local = dict(loss=MeanMetric(nan_strategy='disable', sync_on_compute=False).to(run.device),
                     top1=MulticlassAccuracy(len(run.data.classes), top_k=1, average='micro', validate_args=False,
                                             sync_on_compute=False).to(run.device))
    global_batch = args.batch_size * run.dist.world_size
    step = start_step
    t_log = time.perf_counter()
    bar = tqdm(total=min(run.steps_per_epoch - start_step, max_steps or run.steps_per_epoch), leave=False,
               disable=not (sys.stdout.isatty() and run.dist.is_main), desc=f'epoch {epoch + 1}')
    for images, labels in chrono.iterate(run.data.train_loader, max_steps):
        bar.update()
        if args.nccl_debug:  # the course's comm_profiler marker: tags the NCCL lines that follow
            print(f'Train step {run.global_step + 1} - rank {run.dist.rank}', flush=True)
        with chrono.phase('h2d'):
            images, labels = to_device(images, labels, run)
        with chrono.phase('forward'), run.autocast:
            output = model(images)
            loss = run.criterion(output, labels)
        guard.update(loss)
        guard.check(run.global_step)  # before backward: a non-finite loss is never applied (CPU: every step)
        with chrono.phase('backward'):
            run.scaler.scale(loss).backward()
        with chrono.phase('optimizer'):
            run.scaler.step(run.optimizer)
            run.scaler.update()
            run.optimizer.zero_grad(set_to_none=True)
        lr = run.scheduler.get_last_lr()[0]
        run.scheduler.step()
        step += 1
        run.global_step += 1
        loss_sum += loss.detach()
        if args.findlr:
            run.findlr[0].append(lr)
            run.findlr[1].append(loss.detach())
            continue
        loss_metric.update(loss.detach())
        acc1.update(output.detach(), labels)
        acc5.update(output.detach(), labels)
        if args.metric_sync_log:
            local['loss'].update(loss.detach())
            local['top1'].update(output.detach(), labels)
        if prof is not None:
            prof.step()
        if step % args.log_interval == 0 or step == run.steps_per_epoch:
            data_s, n = chrono.interval()
            now = time.perf_counter()
            step_s, t_log = (now - t_log) / n, now  # wall time per step since the last log line
            mem = torch.cuda.max_memory_allocated(run.device) if run.device.type == 'cuda' else \
                host_memory()['host_peak_rss_bytes']
            rec = dict(type='train', epoch=epoch + 1, step=step, global_step=run.global_step,
                       loss=loss_sum.item() / n, lr=lr, step_ms=step_s * 1e3, data_ms=data_s * 1e3,
                       img_s=global_batch / step_s if step_s else None, mem_bytes=mem)
            loss_sum.zero_()
            print0(f"epoch {epoch + 1}/{args.epochs} step {step}/{run.steps_per_epoch} loss {rec['loss']:.4f} "
                   f"lr {lr:.5f} | step {rec['step_ms']:.1f} ms data {rec['data_ms']:.1f} ms | "
                   f"{rec['img_s']:.1f} img/s | mem {mem / 2**30:.2f} GiB", dist=run.dist)
            run.log.write(**rec)
            if run.wandb:
                run.wandb.log({'train/loss': rec['loss'], 'train/lr': lr, 'train/img_s': rec['img_s']},
                              step=run.global_step)
        if step % args.metric_step == 0:  # every rank: compute() gathers the metric states of all ranks
            before = {k: m.compute().item() for k, m in local.items()} if args.metric_sync_log else None
            rec = dict(type='train_metrics', epoch=epoch + 1, step=step, global_step=run.global_step,
                       loss=loss_metric.compute().item(), top1=acc1.compute().item(), top5=acc5.compute().item())
            if args.metric_sync_log:
                log_metric_sync(run, step, before, {'loss': rec['loss'], 'top1': rec['top1']})
            print0(f"Train metrics at step {step}: loss {rec['loss']:.4f} top-1 {rec['top1']:.4f} "
                   f"top-5 {rec['top5']:.4f}", dist=run.dist)
            run.log.write(**rec)
        if args.chkpt_every and run.global_step % args.chkpt_every == 0 and run.dist.is_main:
            save(run, epoch, step)
        if run.stop is not None and run.stop.agreed():  # a step boundary: a consistent state to checkpoint
            run.preempted = True
            break
    bar.close()
    guard.check(run.global_step, force=True)
    chrono.finish()
    train = {'steps_run': step - start_step}
    if loss_metric.update_count:
        train.update(loss=loss_metric.compute().item(), top1=acc1.compute().item(), top5=acc5.compute().item())
    return step, train


def log_metric_sync(run, step, before, after):
    """The course's metric_compute_log lines, on every rank, and one record with all ranks on rank 0."""
    name = f"{'GPU' if run.device.type == 'cuda' else 'CPU'}{run.dist.rank}"
    for when, v in (('Before', before), ('After', after)):
        print(f"Step {step} - {when} metric compute {name}: loss: {v['loss']:.4f}, accuracy: {v['top1']:.4f}",
              flush=True)
    ranks = dlojz_dist.all_gather_object({'rank': run.dist.rank, 'before': before, 'after': after})
    run.log.write(type='metric_sync', global_step=run.global_step, step=step, ranks=ranks)


@torch.inference_mode()
def evaluate(run, epoch, max_batches=None):
    """Exact validation: each rank evaluates its own unpadded shard of the validation set and torchmetrics
    sums the states of all ranks in compute(), so every image counts once whatever the world size."""
    model, chrono = run.eval_model, run.chrono
    model.eval()
    if run.args.nccl_debug:  # comm_profiler marker: the collectives that follow belong to validation
        print(f'Validation - rank {run.dist.rank}', flush=True)
    dlojz_dist.broadcast_buffers_(run.model_without_ddp)  # rank 0's BatchNorm statistics, as in its checkpoint
    n_classes = len(run.data.classes)
    acc1 = MulticlassAccuracy(n_classes, top_k=1, average='micro', validate_args=False).to(run.device)
    acc5 = MulticlassAccuracy(n_classes, top_k=min(5, n_classes), average='micro', validate_args=False).to(run.device)
    loss_metric = MeanMetric(nan_strategy='disable').to(run.device)
    images = SumMetric().to(run.device)
    batches = 0
    with chrono.validation():
        for x, labels in itertools.islice(run.data.val_loader, max_batches):
            x, labels = to_device(x, labels, run)
            with run.autocast:
                output = model(x)
                loss = run.criterion(output, labels)
            loss_metric.update(loss, weight=labels.numel())
            acc1.update(output, labels)
            acc5.update(output, labels)
            images.update(labels.numel())
            batches += 1
        # compute() is a collective; inside the timed block so that waiting for slower ranks counts
        res = dict(type='val', epoch=epoch + 1, global_step=run.global_step, loss=loss_metric.compute().item(),
                   top1=acc1.compute().item(), top5=acc5.compute().item(), images=int(images.compute().item()),
                   batches=batches)
    chrono.val_batches = batches
    res['time_s'] = chrono.val_time
    print0(f"Validation epoch {epoch + 1}: loss {res['loss']:.4f} top-1 {res['top1']:.4f} top-5 {res['top5']:.4f} "
           f"({res['images']} images, {chrono.val_time:.1f} s)", dist=run.dist)
    run.log.write(**res)
    if run.wandb:
        run.wandb.log({'val/loss': res['loss'], 'val/top1': res['top1'], 'val/top5': res['top5']}, step=run.global_step)
    return res


# ------------------------------------------------------------------------------------------------ state

def checkpoint_state(run, epoch, step_in_epoch):
    if step_in_epoch >= run.steps_per_epoch:
        epoch, step_in_epoch = epoch + 1, 0
    return {'version': SUMMARY_VERSION, 'arch': run.args.arch, 'num_classes': len(run.data.classes),
            'model': strip_prefixes(run.model_without_ddp.state_dict()), 'optimizer': run.optimizer.state_dict(),
            'scheduler': run.scheduler.state_dict(), 'scaler': run.scaler.state_dict(), 'epoch': epoch,
            'step_in_epoch': step_in_epoch, 'global_step': run.global_step,
            'global_batch': run.args.batch_size * run.dist.world_size, 'args': vars(run.args),
            'rng': {'torch': torch.get_rng_state(), 'numpy': np.random.get_state(), 'python': random.getstate(),
                    'cuda': torch.cuda.get_rng_state_all() if run.device.type == 'cuda' else None}}


def save(run, epoch, step_in_epoch):
    """Rank 0 only: checkpoint-<global step>.pt in the run directory, keeping the newest --keep-checkpoints."""
    path = checkpoint_path(run.args.output_dir, run.global_step)
    save_checkpoint(path, checkpoint_state(run, epoch, step_in_epoch), keep=run.args.keep_checkpoints)
    return path


def restore(run, ckpt, path):
    """Load a checkpoint into the run; -> (epoch, step within epoch) to continue from."""
    args, gb = run.args, run.args.batch_size * run.dist.world_size
    if ckpt.get('arch') != args.arch or ckpt.get('num_classes') != len(run.data.classes):
        raise UsageError(f"checkpoint {path} holds {ckpt.get('arch')} with {ckpt.get('num_classes')} classes but "
                         f"this run is --arch {args.arch} with {len(run.data.classes)} classes; pass the same "
                         f"--arch and data, or another checkpoint.")
    run.model_without_ddp.load_state_dict(ckpt['model'])
    run.global_step = ckpt['global_step']
    if args.evaluate:
        return ckpt['epoch'], ckpt['step_in_epoch']
    old_gb = ckpt['global_batch']
    if old_gb != gb and not args.allow_batch_change:
        hint = f'-b {old_gb // run.dist.world_size} to keep it, ' if old_gb % run.dist.world_size == 0 else ''
        raise UsageError(f'checkpoint {path} was trained with a global batch of {old_gb} images but this run has '
                         f'{gb} (-b {args.batch_size} x {run.dist.world_size} processes); use {hint}or pass '
                         f'--allow-batch-change to continue with the new one.')
    run.optimizer.load_state_dict(ckpt['optimizer'])
    run.scaler.load_state_dict(ckpt['scaler'])
    torch.set_rng_state(ckpt['rng']['torch'])
    np.random.set_state(ckpt['rng']['numpy'])
    random.setstate(ckpt['rng']['python'])
    if ckpt['rng']['cuda'] is not None and run.device.type == 'cuda':
        torch.cuda.set_rng_state_all(ckpt['rng']['cuda'])
    if old_gb == gb:
        run.scheduler.load_state_dict(ckpt['scheduler'])
        return ckpt['epoch'], ckpt['step_in_epoch']
    # Another global batch: keep the position in images. The step restarts at the batch holding the first
    # image not yet seen; the LR schedule (built for the new batch) is advanced to the same fraction of the run.
    run.global_step = ckpt['global_step'] * old_gb // gb
    with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()": intended here
        warnings.simplefilter('ignore')
        for _ in range(run.global_step):
            run.scheduler.step()
    print0(f'Resuming with global batch {gb} instead of {old_gb}: step {run.global_step}, epoch position '
           f'{ckpt["step_in_epoch"] * old_gb // gb}', dist=run.dist)
    return ckpt['epoch'], min(ckpt['step_in_epoch'] * old_gb // gb, run.steps_per_epoch)


def rank_report(run, power):
    """This rank's timing, memory and energy; gathered from every rank at the end of a completed run."""
    st, cuda = run.chrono.stats(), run.device.type == 'cuda'
    step, data = st.get('step'), st.get('data')
    return {'rank': run.dist.rank, 'host': socket.gethostname(), 'steps': len(run.chrono.steps),
            'step_median_s': step['median'] if step else None, 'step_mean_s': step['mean'] if step else None,
            'data_mean_s': data['mean'] if data else None, 'val_time_s': run.chrono.val_time,
            'gpu_max_allocated_bytes': torch.cuda.max_memory_allocated(run.device) if cuda else None,
            'host_peak_rss_bytes': host_memory()['host_peak_rss_bytes'],
            'energy_j': power.energy_j if power else None}


def ranks_summary(ranks):
    """Straggler view: slowest and fastest rank by median step time, and the skew between them."""
    timed = [r for r in ranks if r['step_median_s']]
    if not timed:
        return {'ranks': ranks}
    slow = max(timed, key=lambda r: r['step_median_s'])
    fast = min(timed, key=lambda r: r['step_median_s'])
    return {'ranks': ranks, 'slowest_rank': slow['rank'], 'fastest_rank': fast['rank'],
            'slowest_step_median_s': slow['step_median_s'], 'fastest_step_median_s': fast['step_median_s'],
            'rank_skew': slow['step_median_s'] / fast['step_median_s'] - 1}


def communication_estimate(args, model, world_size):
    """Gradient all-reduce volume per step: 4 bytes per trainable parameter (gradients are fp32 even under
    AMP, the parameters being fp32), sent in DDP buckets: a first 1 MiB bucket, then --bucket-cap-mb ones."""
    grad_bytes = 4 * sum(p.numel() for p in model.parameters() if p.requires_grad)
    first, cap = 2 ** 20, args.bucket_cap_mb * 2 ** 20
    buckets = 1 + math.ceil(max(0, grad_bytes - first) / cap)
    return {'gradient_bytes_per_step': grad_bytes, 'bucket_cap_mb': args.bucket_cap_mb, 'buckets_estimate': buckets,
            # a ring all-reduce sends (and receives) 2 (W-1)/W of the buffer per rank
            'ring_bytes_per_rank_per_step': 2 * (world_size - 1) / world_size * grad_bytes}


def write_summary(run, status, train=None, val=None, error=None, power=None, extra=None):
    """Every rank calls it; on a completed run it gathers per-rank timings (a collective), rank 0 writes."""
    args, gb = run.args, run.args.batch_size * run.dist.world_size
    cuda = run.device.type == 'cuda'
    timing = run.chrono.summary(gb, run.steps_per_epoch, len(run.data.val_loader))
    energy = power.summary(gb * len(run.chrono.steps)) if power else None
    summary = {
        'version': SUMMARY_VERSION, 'status': status, 'error': error, 'config': vars(args),
        'provenance': provenance(run.device, run.dist),
        'world_size': run.dist.world_size, 'num_nodes': run.dist.num_nodes, 'global_batch': gb,
        'mode': 'evaluate' if args.evaluate else 'findlr' if args.findlr else 'train',
        'data': {'source': run.data.source.kind, 'root': run.data.source.root, 'reason': run.data.source.reason,
                 'classes': len(run.data.classes), 'train_images': run.data.n_train, 'val_images': run.data.n_val,
                 'batches_per_epoch': run.steps_per_epoch, 'bad_images_skipped': run.data.bad_images},
        'timing': timing,
        'memory': {**host_memory(),
                   'gpu_max_allocated_bytes': torch.cuda.max_memory_allocated(run.device) if cuda else None,
                   'gpu_max_reserved_bytes': torch.cuda.max_memory_reserved(run.device) if cuda else None},
        'energy': energy,
        'global_step': run.global_step, 'train': train, 'val': val, **(extra or {}),
    }
    if run.dist.distributed:
        summary['communication'] = communication_estimate(args, run.model_without_ddp, run.dist.world_size)
        if status == 'completed':  # after a failure other ranks may be gone: no collective then
            ranks = dlojz_dist.all_gather_object(rank_report(run, power))
            timing.update(ranks_summary(ranks))
            summary['memory']['gpu_max_allocated_bytes_any_rank'] = max(
                (r['gpu_max_allocated_bytes'] or 0 for r in ranks), default=0) if cuda else None
            if energy and all(r['energy_j'] is not None for r in ranks):
                total = sum(r['energy_j'] for r in ranks)
                energy.update(energy_j_all_ranks=total, joules_per_image_all_ranks=total / max(1, gb * len(
                    run.chrono.steps)))
    if run.dist.is_main:
        write_json(os.path.join(args.output_dir, 'summary.json'), summary)
    return summary


# ------------------------------------------------------------------------------------------------ main

class CommFailure(Exception):
    """A collective failed: another rank died or hung."""


class Preempted(Exception):
    """Stopped by SIGUSR2/SIGTERM after writing a checkpoint; `requeued` when SLURM took the job back."""

    def __init__(self, msg, requeued):
        super().__init__(msg)
        self.requeued = requeued


def find_resume_checkpoint(args, dist):
    """-> (path, state) to resume from, or (None, None). Rank 0 picks the file under --resume auto so that
    every rank loads the same one (a rank seeing a half-written file must not choose another)."""
    if not args.resume:
        return None, None
    if args.resume != 'auto':
        return args.resume, load_checkpoint(args.resume)
    warn = lambda m: print(m, file=sys.stderr, flush=True)
    found = dlojz_dist.on_ranks(lambda: load_latest_checkpoint(args.output_dir, warn), when=dist.is_main)
    path = dlojz_dist.broadcast_object(found[0] if found else None)
    if path is None:
        print0(f'--resume auto: no checkpoint in {args.output_dir}; starting from the beginning', dist=dist)
        return None, None
    print0(f'--resume auto: continuing from {path}', dist=dist)
    return path, found[1] if dist.is_main else load_checkpoint(path)  # rank 0 has already read it


def preempt(run, epoch, step, train, val):
    """Every rank got here at the same step (StopSignal.agreed). Rank 0 checkpoints while the others wait,
    the summary says 'preempted', then the SLURM job is requeued: its next start resumes with --resume auto."""
    args, dist = run.args, run.dist
    run.chrono.stop()
    path = dlojz_dist.broadcast_object(dlojz_dist.on_ranks(lambda: save(run, epoch, step), when=dist.is_main))
    why = run.stop.received or 'a signal on another rank'
    requeued, detail = False, '--no-requeue'
    if args.requeue:
        requeued, detail = dlojz_dist.on_ranks(lambda: dlojz_dist.requeue(dist, run.stop.received),
                                               when=dist.is_main) or (False, '')
    requeued = dlojz_dist.broadcast_object(requeued)
    msg = (f'stopped by {why} at step {run.global_step}; checkpoint {path} written. ' +
           ('The SLURM job was requeued and will resume from it (--resume auto).' if requeued else
            f'Not requeued ({detail}); resume with --resume {path} or --resume auto.'))
    write_summary(run, 'preempted', train, val, msg, extra={'checkpoint': path, 'requeued': requeued})
    raise Preempted(msg, requeued)


def shared_output_dir(args, dist):
    """Rank 0 chooses (a timestamp would differ between ranks) and creates the run folder; all ranks agree."""
    path = dlojz_dist.on_ranks(lambda: prepare_output_dir(args.output_dir or default_output_dir(args, dist)),
                               when=dist.is_main)
    return dlojz_dist.broadcast_object(path)


def main(args, dist=None):
    args = check_args(args)
    dist = dist or get_dist_info()
    if args.dist_debug:  # read by torch.distributed when the process group starts
        os.environ['TORCH_DISTRIBUTED_DEBUG'] = 'DETAIL'
    if args.nccl_debug:
        dlojz_dist.nccl_debug_env()
    device = resolve_device(args, dist)
    dlojz_dist.setup(dist, device, args.dist_timeout)
    args.output_dir = shared_output_dir(args, dist)
    tee = None
    if args.nccl_debug:  # before the first NCCL collective, so that the communicator's INIT lines are in it
        os.makedirs(args.output_dir, exist_ok=True)
        tee = dlojz_dist.StdoutTee(os.path.join(args.output_dir, f'nccl.rank{dist.rank}.log'))
        print(f'Train step 0 - rank {dist.rank}', flush=True)  # marker: what follows is initialisation
    try:
        return _main(args, dist, device)
    finally:
        if tee:
            tee.close()


def _main(args, dist, device):
    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = args.tf32
    seed_everything(args.seed)  # same seed on every rank: same initial weights, same augmentation streams

    data = build_data(args, dist, log=lambda m: print0(m, dist=dist), on_ranks=dlojz_dist.on_ranks)
    print0(f'Data: {data.source.kind} {data.source.root} ({data.source.reason}); {data.n_train} train / '
           f'{data.n_val} val images, {len(data.classes)} classes', dist=dist)
    model, eval_model, model_without_ddp = build_model(args, len(data.classes), device, dist)
    steps_per_epoch = len(data.train_loader)
    total_steps = min(args.test_nsteps, args.epochs * steps_per_epoch) if args.test else args.epochs * steps_per_epoch
    criterion, optimizer, scheduler, scaler = build_optimization(args, model_without_ddp, steps_per_epoch, total_steps)
    amp_dtype = {'fp16': torch.float16, 'bf16': torch.bfloat16}.get(args.amp)
    autocast = torch.autocast(device.type, dtype=amp_dtype) if amp_dtype else nullcontext()
    chrono = Chronometer(device, phases=args.timing, sync=args.sync_timing, warmup=args.warmup_steps)
    ckpt_path, ckpt = find_resume_checkpoint(args, dist)
    log = JsonlWriter(os.path.join(args.output_dir, 'metrics.jsonl'), dist.is_main,
                      append=ckpt is not None and not args.evaluate)
    run = Run(args, dist, device, data, model, eval_model, model_without_ddp, criterion, optimizer, scheduler, scaler,
              autocast, chrono, log, None, steps_per_epoch)
    start_epoch, start_step = restore(run, ckpt, ckpt_path) if ckpt is not None else (0, 0)

    gb = args.batch_size * dist.world_size
    print0(f'>>> Training on {dist.num_nodes} nodes and {dist.world_size} processes ({dist.launcher}, {device}, '
           f'{args.arch}, amp {args.amp}, channels-last {args.channels_last})', dist=dist)
    print0(f'global batch size: {gb} - mini batch size: {args.batch_size}', dist=dist)
    print0('Config: ' + ' '.join(f'{k}={v}' for k, v in sorted(vars(args).items())), dist=dist)
    if dist.is_main:
        write_json(os.path.join(args.output_dir, 'config.json'), vars(args))
    run.wandb = build_wandb(args, dist)
    power = PowerMeter(device)
    run.stop = dlojz_dist.StopSignal().install()
    train = val = None
    try:
        remaining = args.test_nsteps if args.test else None
        chrono.start()
        power.start()
        if args.evaluate:
            val = evaluate(run, max(0, start_epoch - 1) if start_step == 0 else start_epoch,
                           max_batches=20 if args.test else None)
        with build_profiler(args, device) if not args.evaluate else nullcontext(None) as prof:
            for epoch in range(start_epoch, args.epochs if not args.evaluate else start_epoch):
                first = start_step if epoch == start_epoch else 0
                data.set_epoch(epoch, first * args.batch_size)
                step, train = train_one_epoch(run, epoch, first, remaining, prof)
                if remaining is not None:
                    remaining -= step - first
                if run.preempted:
                    preempt(run, epoch, step, train, val)
                if args.chkpt and not args.findlr and dist.is_main:
                    save(run, epoch, step)
                if not args.findlr and (not args.test or remaining == 0 or epoch == args.epochs - 1):
                    val = evaluate(run, epoch, max_batches=20 if args.test else None)
                if remaining == 0:
                    break
        power.stop()
        chrono.stop()
    except Preempted:
        power.stop()
        raise
    except NonFiniteLoss as e:
        write_summary(run, 'nan', train, val, str(e), extra={'failed_step': e.step})
        raise
    except KeyboardInterrupt:
        write_summary(run, 'interrupted', train, val, 'interrupted', extra={'failed_step': run.global_step + 1})
        raise
    except torch.OutOfMemoryError:
        write_summary(run, 'oom', train, val, 'out of memory', extra={'failed_step': run.global_step + 1})
        raise UsageError(f'out of memory at step {run.global_step + 1} with batch size {args.batch_size}; lower -b, '
                         f'or use --amp bf16/--grad-checkpointing.') from None
    except DataError as e:
        write_summary(run, 'failed', train, val, loader_error_message(e), extra={'failed_step': run.global_step + 1})
        raise
    except Exception as e:
        failed = {'failed_step': run.global_step + 1}
        if args.compile and type(e).__module__.startswith(('torch._dynamo', 'torch._inductor')):
            write_summary(run, 'failed', train, val, f'torch.compile failed: {type(e).__name__}')
            raise UsageError(f'torch.compile failed ({type(e).__name__}: {str(e).splitlines()[0][:200]}); rerun '
                             f'with --no-compile or another --compile-mode.') from None
        if isinstance(e, RuntimeError) and 'find_unused_parameters' in str(e):  # DDP's reducer error
            msg = (f'--arch {args.arch} leaves some parameters without a gradient in a step (e.g. the classifier '
                   f'heads not chosen) and DDP cannot finish its gradient all-reduce; rerun with '
                   f'--find-unused-parameters.')
            write_summary(run, 'failed', train, val, msg, extra=failed)
            raise UsageError(msg) from None
        if dist.distributed and dlojz_dist.is_comm_failure(e):
            timeout = f'{args.dist_timeout:g} min' if args.dist_timeout else "PyTorch's default timeout"
            msg = (f'a collective failed on rank {dist.rank} at step {run.global_step + 1}: another rank died or '
                   f'stopped answering ({dlojz_dist.first_line(e)[:160]}); look for the first error in the other '
                   f'ranks\' output (waits are bounded by --dist-timeout, now {timeout}).')
            write_summary(run, 'failed', train, val, msg, extra=failed)
            raise CommFailure(msg) from None
        write_summary(run, 'crashed', train, val, f'{type(e).__name__}: {e}', extra=failed)
        raise
    finally:
        run.log.close()
        run.stop.restore()
    extra = {}
    if args.findlr:
        extra['findlr'] = {'lr': run.findlr[0], 'loss': [float(x) for x in torch.stack(run.findlr[1]).cpu()]
                           if run.findlr[1] else []}
    summary = write_summary(run, 'completed', train, val, power=power, extra=extra)
    if dist.is_main:
        print_final(summary, chrono, steps_per_epoch, args)
    if run.wandb:
        run.wandb.finish()
    return summary


def print_final(summary, chrono, steps_per_epoch, args):
    for line in chrono.display_lines(steps_per_epoch):
        print(line)
    t = summary['timing']
    if t.get('gpu_throughput'):
        print(f">>> Train throughput: {t['train_throughput']:.2f} images/second; GPU throughput: "
              f"{t['gpu_throughput']:.2f} images/second; epoch time estimate: {t['epoch_time_estimate_s']:.1f} s")
    if t.get('rank_skew') is not None:
        print(f">>> Step time per rank (median): fastest rank {t['fastest_rank']} {t['fastest_step_median_s'] * 1e3:.1f}"
              f" ms, slowest rank {t['slowest_rank']} {t['slowest_step_median_s'] * 1e3:.1f} ms (skew "
              f"{t['rank_skew'] * 100:.1f} %)")
    c = summary.get('communication')
    if c:
        print(f">>> Gradient all-reduce per step: {c['gradient_bytes_per_step'] / 2**20:.1f} MiB in about "
              f"{c['buckets_estimate']} buckets of <= {c['bucket_cap_mb']:g} MiB")
    e = summary['energy']
    if e and e['peak_w'] is not None:
        print(f">>> Peak Power during training: {e['peak_w']:.1f} W; energy {e['energy_j']:.1f} J "
              f"({e['joules_per_image']:.3f} J/image)")
    m = summary['memory']
    if m['gpu_max_allocated_bytes'] is not None:
        print(f">>> Max Memory Allocated {m['gpu_max_allocated_bytes']} Bytes (reserved "
              f"{m['gpu_max_reserved_bytes']} Bytes)")
    print(f">>> Host peak memory (VmHWM): {m['host_peak_rss_bytes']} Bytes")
    print(f'Run written to {args.output_dir}', flush=True)


def report_error(msg, dist):
    """Errors before the process group exists are the same on every rank: rank 0 says it once. After,
    they may be one rank's own (a bad image, an OOM, a dead peer): every rank speaks, tagged."""
    grouped = dist is not None and dist.world_size > 1 and dlojz_dist.tdist.is_initialized()
    if dist is None or dist.is_main or grouped:
        tag = f'[rank {dist.rank}] ' if grouped else ''
        print(f'dlojz: error: {tag}{msg}', file=sys.stderr, flush=True)


def cli(argv=None):
    args = get_args_parser().parse_args(argv)
    dist, code = None, 0
    try:
        dist = get_dist_info()
        main(args, dist)
    except (UsageError, DataError) as e:
        report_error(loader_error_message(e), dist)
        code = 2
    except NonFiniteLoss as e:
        report_error(str(e), dist)
        code = 3
    except CommFailure as e:
        report_error(str(e), dist)
        code = 4
    except Preempted as e:
        if dist is None or dist.is_main:
            print(f'dlojz: {e}', file=sys.stderr, flush=True)
        code = 0 if e.requeued else 5
    except KeyboardInterrupt:
        print('dlojz: interrupted', file=sys.stderr)
        code = 130
    finally:
        dlojz_dist.cleanup()
    return code


if __name__ == '__main__':
    sys.exit(cli())
