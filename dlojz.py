"""dlojz: train torchvision ResNets on ImageNet (or a built-in JPEG dataset) and measure why a run is
fast or slow.

    python dlojz.py --test-nsteps 20 --arch resnet18 --image-size 64 -b 16 --num-workers 2   # CPU demo
    python dlojz.py --test-nsteps 50 --amp bf16 --channels-last --data-dir /path/imagenet      # one GPU
    torchrun --standalone --nproc_per_node 4 dlojz.py --test-nsteps 50 --amp bf16              # 4 GPUs, DDP
    srun --ntasks-per-node=4 --gres=gpu:4 --cpus-per-task=10 python dlojz.py --num-workers 10  # SLURM, DDP
    sbatch slurm/jz-a100-8gpu.slurm --amp bf16 -b 256                      # batch job, requeued on SIGUSR2

Outputs go to --output-dir (default runs/<job id or timestamp>_<arch>_bs<b>): config.json,
metrics.jsonl, summary.json, checkpoint-<step>.pt (--chkpt), profiler traces (--prof), wandb files.

Reading order: flags -> builders -> train_step and the loops (train, LR sweep, validation) -> checkpoints
-> main. How a run ends is in dlojz_errors.py, what it writes at the end in dlojz_summary.py.
"""
import argparse
import itertools
import math
import os
import random
import re
import shutil
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn

import custom_models
import dlojz_augment
import dlojz_decode
import dlojz_dist
import dlojz_io
import dlojz_loader
import dlojz_recipe
from dlojz_chrono import Chronometer, PowerMeter, profiler
from dlojz_data import IMAGENET_MEAN, IMAGENET_STD, build_data
from dlojz_dist import get_dist_info
from dlojz_errors import (CommFailure, DlojzError, Interrupted, NonFiniteValidation, Preempted, UsageError,
                          translate)
from dlojz_metrics import Meters, NonFiniteGuard, PeakMemory
from dlojz_io import (Console, Logger, default_output_dir, host_check, intra_op_threads, prepare_output_dir,
                      remove_if_empty, run_status, trim_metrics, usable_cores, write_json)
from dlojz_state import (Progress, check_checkpoint, find_resume_checkpoint, note_validation, preempt, restore,
                         run_wall_s, save)
from dlojz_summary import final_lines, write_summary


# ------------------------------------------------------------------------------------------------ flags

class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """--help shows every default (unless the help text already says it) and keeps the examples' layout."""

    def _get_help_string(self, action):
        text = action.help or ''
        if 'default' in text or action.default is None or action.default is False or \
                action.default == argparse.SUPPRESS or not action.option_strings:
            return text
        return f'{text} (default: %(default)s)' if text else 'default: %(default)s'


EXAMPLES = """examples:
  python dlojz.py --test-nsteps 40 --arch resnet18 --image-size 64 -b 16 --num-workers 2   CPU demo
  python dlojz.py --data-dir /path/imagenet --test-nsteps 50 --amp bf16 -b 256           one GPU benchmark
  torchrun --standalone --nproc_per_node 4 dlojz.py --test-nsteps 50                     4 GPUs
  sbatch slurm/jz-a100-8gpu.slurm --amp bf16 -b 256                                      a Slurm job
  python dlojz.py --resume auto --output-dir runs/myrun                                  continue a run
"""


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one sentence and exit 2, like every other user error (no usage block)
        message = re.sub(r'^argument (\S+): ', r'\1 ', message)
        self.exit(2, f'dlojz: error: {message}; see python dlojz.py --help.\n')


def _number(cast, ok, rule):
    """An argparse type: an int or float (`cast`) for which `ok` holds; the error says `rule`."""
    def parse(text):
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {'an integer' if cast is int else 'a number'} (got {text})")
        if not ok(value):
            raise argparse.ArgumentTypeError(f'must be {rule} (got {text})')
        return value
    return parse


POSITIVE_INT = _number(int, lambda v: v > 0, 'positive')
COUNT = _number(int, lambda v: v >= 0, '0 or more')
POSITIVE = _number(float, lambda v: v > 0 and math.isfinite(v), 'positive')
NON_NEGATIVE = _number(float, lambda v: v >= 0 and math.isfinite(v), '0 or more')
FRACTION = _number(float, lambda v: 0 <= v < 1, 'in [0, 1)')


def get_args_parser(add_help=True):
    p = Parser(description='dlojz: ResNet training and benchmarking', add_help=add_help, allow_abbrev=False,
               formatter_class=HelpFormatter, epilog=EXAMPLES)
    B, I, N = argparse.BooleanOptionalAction, POSITIVE_INT, COUNT
    g = p.add_argument_group('data')
    g.add_argument('--data-dir', help='ImageNet in ImageFolder layout (DIR/train/<class>/*.JPEG, DIR/val/...); '
                   'default $DLOJZ_DATA_DIR, then $ALL_CCFRSCRATCH/imagenet, $DSDIR/imagenet (Jean Zay), else the built-in '
                   'synthetic dataset')
    g.add_argument('--cache-dir', default='~/.cache/dlojz', help='where the synthetic dataset is generated, once')
    g.add_argument('--synthetic-classes', type=I, default=10, help='synthetic dataset: number of classes')
    g.add_argument('--synthetic-train-per-class', type=I, default=64, help='synthetic: train images per class')
    g.add_argument('--synthetic-val-per-class', type=I, default=16, help='synthetic: val images per class')
    g.add_argument('--synthetic-seed', type=int, default=0, help='synthetic dataset content seed')
    g.add_argument('--fake-data', action='store_true', help='random uint8 batches in memory, no decoding: '
                   'the compute ceiling')
    g.add_argument('--fake-train-size', type=I, default=1281167, help='--fake-data: images per epoch')
    g.add_argument('--fake-val-size', type=I, default=50000, help='--fake-data: validation images')
    g.add_argument('--fake-classes', type=I, default=1000, help='--fake-data: number of classes')
    g.add_argument('--image-size', type=I, default=224, help='train RandomResizedCrop size, pixels')
    g.add_argument('--val-resize', type=I, default=None, help='validation: shorter side resized to, pixels '
                   '(default 256, i.e. val-image-size x 256/224)')
    g.add_argument('--val-image-size', type=I, default=None, help='validation: center crop, pixels (default '
                   '224 when --image-size is 224, else --image-size)')
    g.add_argument('--decode', choices=['auto', 'fast', 'pil', 'gpu'], default='auto', help='training decode '
                   'path (auto: fast when simplejpeg is installed, else pil): "fast" '
                   'decodes no more pixels than the crop needs (libjpeg-turbo DCT scaling via simplejpeg, uint8 '
                   'crop and resize), PIL for the files it cannot read; "pil" decodes every full image with PIL '
                   '(torchvision\'s way); "gpu" has the workers read the files and nvJPEG decode each batch on the '
                   'GPU, which crops, resizes and flips (CUDA only; the host decodes what nvJPEG refuses). Same '
                   'crops and flips every way; validation decodes on the host')
    g.add_argument('--skip-bad-images', action='store_true', help='replace undecodable files and count them '
                   'instead of stopping')
    g = p.add_argument_group('loader')
    g.add_argument('-b', '--batch-size', type=I, default=128, help='images per device; global batch = this x '
                   'world size')
    g.add_argument('--val-batch-size', type=I, default=250, help='validation images per device')
    g.add_argument('--num-workers', type=N, default=None, help='DataLoader worker processes (train and val; '
                   'default $SLURM_CPUS_PER_TASK under SLURM, else 8 or the usable cores if fewer)')
    g.add_argument('--persistent-workers', action=B, default=None, help='keep workers between epochs '
                   '(default: on when --num-workers > 0)')
    g.add_argument('--pin-memory', action=B, default=None, help='page-locked batches (default: on with CUDA)')
    g.add_argument('--non-blocking', action=B, default=True, help='asynchronous host-to-device copies')
    g.add_argument('--prefetch-factor', type=I, default=None, help='batches loaded ahead per worker (default 2)')
    g.add_argument('--drop-last', action=B, default=False, help='drop the last incomplete batch')
    g.add_argument('--loader-only', action='store_true', help='run the training loader alone (sampler, decode, '
                   'augmentation, collation, pinned memory, copy to the GPU), no model, for --test-nsteps batches '
                   '(default 50): its images/second')
    g.add_argument('--tune-loader', action='store_true', help='the loader doctor: the compute ceiling '
                   '(--fake-data) and --loader-only over workers x prefetch x pinned memory, each in its own '
                   'process; a trials table, a verdict and tune-loader.json/.csv (--test-nsteps per trial, default '
                   '30)')
    g = p.add_argument_group('model')
    g.add_argument('--arch', default='resnet50', help=f'one of {", ".join(custom_models.ARCHS)}')
    g.add_argument('--sd-prob', type=FRACTION, default=0.5, help='-sd archs: drop probability of the last block')
    g.add_argument('--n-heads', type=_number(int, lambda v: v >= 2, 'at least 2 (head 0 for training plus at '
                   'least one other)'), default=3, help='-heads archs: number of classifier heads')
    g.add_argument('--grad-checkpointing', action='store_true', help='recompute ResNet stage activations in '
                   'backward (less memory, ~30%% more compute)')
    g = p.add_argument_group('precision and compilation')
    g.add_argument('--amp', choices=['auto', 'off', 'fp16', 'bf16'], default='auto', help='autocast dtype; auto '
                   '= bf16 where the GPU supports it, fp16 on older GPUs, off on CPU')
    g.add_argument('--channels-last', action=B, default=None, help='NHWC memory format (default: on with CUDA)')
    g.add_argument('--tf32', action=B, default=True, help='TF32 matmuls/convolutions on Ampere and newer')
    g.add_argument('--cudnn-benchmark', action=B, default=True, help='cudnn autotuning (first steps slower)')
    g.add_argument('--deterministic', action='store_true', help='deterministic algorithms only (bit-exact reruns '
                   'and resumes on a GPU; slower; turns --cudnn-benchmark off)')
    g.add_argument('--compile', action=B, default=False, help='torch.compile the model')
    g.add_argument('--compile-mode', default='default', choices=['default', 'reduce-overhead', 'max-autotune',
                   'max-autotune-no-cudagraphs'], help='torch.compile mode')
    g = p.add_argument_group('optimization')
    g.add_argument('--optimizer', choices=['sgd', 'adamw', 'lars', 'lamb', 'lion'], default='sgd', help='SGD with '
                   'momentum, AdamW (torch); LARS, LAMB (layer-wise trust ratios, for large global batches) or Lion '
                   '(timm)')
    g.add_argument('--lr', type=POSITIVE, default=None, help='peak learning rate; overrides --base-lr (with '
                   '--findlr: the upper end of the sweep, default 10)')
    g.add_argument('--base-lr', type=POSITIVE, default=None, help='peak learning rate per 256 images, scaled by '
                   'the global batch (linear scaling rule); default ' + ', '.join(
                       f'{v:g} for {k}' for k, v in dlojz_recipe.BASE_LR.items()))
    g.add_argument('--wd', type=NON_NEGATIVE, default=0.0, help='weight decay (adamw, lion: decoupled)')
    g.add_argument('--wd-norm-bias', action=B, default=None, help='weight decay on BatchNorm weights and biases '
                   'too (default: yes, except for lars and lamb, which also leave them out of their adaptation)')
    g.add_argument('--mom', type=FRACTION, default=0.9, help='momentum of SGD and LARS (beta1 of AdamW, LAMB, Lion)')
    g.add_argument('--accum-steps', type=I, default=1, help='micro-batches of -b images per optimizer step, their '
                   'gradients added up (DDP all-reduces once, during the last): global batch = -b x processes x N, '
                   'and one GPU sees the batches N GPUs would')
    g.add_argument('--label-smoothing', type=FRACTION, default=0.1, help='cross-entropy label smoothing')
    g.add_argument('--scheduler', choices=['onecycle', 'cosine', 'poly', 'constant'], default='onecycle',
                   help='learning-rate schedule, stepped every optimizer step (onecycle warms up over its first '
                   '30%%; poly: (1 - progress)^--poly-power, as MLPerf\'s LARS runs)')
    g.add_argument('--warmup-epochs', type=NON_NEGATIVE, default=0.0, help='cosine, poly, constant: linear '
                   'warm-up length, epochs')
    g.add_argument('--poly-power', type=POSITIVE, default=2.0, help='poly schedule exponent')
    g.add_argument('--ema-decay', type=FRACTION, default=None, help='keep an exponential moving average of the '
                   'weights with this decay per optimizer step (e.g. 0.9998), validated beside the raw model, saved '
                   'and resumed (default: none)')
    g.add_argument('--ema-warmup', action=B, default=True, help='EMA decay min(decay, (1 + n) / (10 + n)) after n '
                   'steps, so that the average forgets the initial weights')
    g.add_argument('--findlr', action='store_true', help='LR range test: geometric from 1e-8 to --lr over the '
                   'run, stopped when the loss diverges')
    g = p.add_argument_group('augmentation')
    g.add_argument('--randaugment', default=None, metavar='N,M', help='RandAugment in the workers: N operations '
                   'per image at magnitude M (0-30), e.g. 2,9 (torchvision v2 on uint8)')
    g.add_argument('--trivialaugment', action='store_true', help='TrivialAugmentWide in the workers')
    g.add_argument('--random-erasing', type=FRACTION, default=0.0, help='probability of erasing a random '
                   'rectangle of each image, in the workers')
    g.add_argument('--mixup', type=NON_NEGATIVE, default=0.0, help='mixup on the device: Beta(alpha, alpha) '
                   'weight alpha (e.g. 0.2; 0: off); soft targets, label smoothing applies on top')
    g.add_argument('--cutmix', type=NON_NEGATIVE, default=0.0, help='cutmix on the device: Beta(alpha, alpha) '
                   'alpha (e.g. 1.0; 0: off); with --mixup, one of the two per batch')
    g.add_argument('--res-start', type=I, default=None, help='progressive resizing: training resolution at epoch '
                   '0, pixels, growing linearly to --image-size at --res-end-epoch (multiples of 8)')
    g.add_argument('--res-end-epoch', type=NON_NEGATIVE, default=None, help='progressive resizing: epoch where '
                   '--image-size is reached (default: the last epoch)')
    g = p.add_argument_group('run')
    g.add_argument('-e', '--epochs', type=I, default=1, help='number of epochs')
    g.add_argument('--test', action='store_true', help='benchmark mode: --test-nsteps train steps, 20 val batches')
    g.add_argument('--test-nsteps', type=I, default=None, help='train steps in test mode (default 50; implies '
                   '--test)')
    g.add_argument('--seed', type=int, default=123, help='weights, data order and augmentation (same on every rank)')
    g.add_argument('--device', choices=['auto', 'cuda', 'cpu'], default='auto')
    g.add_argument('--output-dir', default=None, help='run directory (default runs/<run name>, else '
                   'runs/<job id or time>_<arch>_bs<b>); one that holds another run is refused unless --resume '
                   'continues it or --overwrite replaces it')
    g.add_argument('--run-name', default=None, help='run directory runs/<NAME>, independent of the job id: a '
                   'resubmitted job with --resume auto continues it; when its run is over (completed, NaN, '
                   'OOM), runs/<NAME>.2, .3, ... (the slurm/ scripts pass one: $DLOJZ_RUN, or the job name and '
                   'a checksum of the flags)')
    g.add_argument('--overwrite', action='store_true', help='delete the run files (config, metrics, summary, '
                   'checkpoints) of a non-empty --output-dir first')
    g.add_argument('--val-every', type=I, default=1, help='validate every N epochs (and after the last)')
    g.add_argument('--target-top1', type=FRACTION, default=None, help='time to accuracy: record the wall time, '
                   'epoch and images seen when validation top-1 (a fraction, e.g. 0.759) first reaches this, for '
                   'the raw weights and the EMA')
    g.add_argument('--chkpt', action='store_true', help='write checkpoint-<step>.pt at the end of each epoch and run, '
                   'and best.pt when validation top-1 improves')
    g.add_argument('--chkpt-every', type=N, default=0, help='also every N steps (implies --chkpt)')
    g.add_argument('--keep-checkpoints', type=I, default=2, help='newest checkpoints kept in the run directory')
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
    g.add_argument('--bucket-cap-mb', type=POSITIVE, default=25.0, help='DDP gradient bucket size, MiB')
    g.add_argument('--static-graph', action='store_true', help='DDP static_graph (same graph every step)')
    g.add_argument('--gradient-as-bucket-view', action='store_true', help='DDP: gradients are views into the '
                   'buckets (saves one gradient copy of memory)')
    g.add_argument('--broadcast-buffers', action=B, default=True, help='DDP: rank 0\'s BatchNorm buffers are '
                   'broadcast before every training forward')
    g.add_argument('--dist-timeout', type=POSITIVE, default=None, help='minutes a collective may wait before the '
                   'job ends with an error (default: PyTorch\'s, 10 min NCCL / 30 min gloo)')
    g.add_argument('--nccl-debug', action='store_true', help='NCCL_DEBUG=INFO, NCCL_DEBUG_SUBSYS=INIT,COLL; each '
                   'rank\'s stdout, with step markers, is also written to <output-dir>/nccl.rank<r>.log')
    g.add_argument('--dist-debug', action='store_true', help='TORCH_DISTRIBUTED_DEBUG=DETAIL')
    g.add_argument('--share-gpu', action='store_true', help='allow several tasks per GPU (on by itself when an '
                   'NVIDIA MPS daemon runs; without MPS they take turns on the GPU)')
    g = p.add_argument_group('logging and profiling')
    g.add_argument('--log-interval', type=I, default=10, help='steps between log lines')
    g.add_argument('--metric-step', type=I, default=100, help='steps between train accuracy computations (one '
                   'all-reduce of every rank\'s sums)')
    g.add_argument('--metric-sync-log', action='store_true', help='print and record each rank\'s train metrics '
                   'before and after the sync at every --metric-step')
    g.add_argument('--wandb', choices=['off', 'offline', 'online'], default=None, help='default: offline for full '
                   'runs, off in test mode')
    g.add_argument('--prof', action='store_true', help='torch.profiler traces into <output-dir>/profiler')
    g.add_argument('--prof-wait', type=N, default=1, help='--prof: steps before the profiler starts')
    g.add_argument('--prof-warmup', type=N, default=1, help='--prof: profiled steps thrown away (its own warm-up)')
    g.add_argument('--prof-active', type=I, default=5, help='--prof: steps recorded in the trace')
    g = p.add_argument_group('benchmark')
    g.add_argument('--timing', action=B, default=True, help='per-phase timing (CUDA events on GPU)')
    g.add_argument('--sync-timing', action='store_true', help='synchronise at phase boundaries (wall-clock '
                   'splits, slower)')
    g.add_argument('--warmup-steps', type=N, default=1, help='first steps left out of the statistics')
    return p


def pick_device(choice, dist, share=False):
    if choice == 'cuda' and not torch.cuda.is_available():
        raise UsageError('--device cuda was requested but PyTorch sees no CUDA GPU; use --device cpu or run on a '
                         'GPU node.')
    if choice == 'cpu' or not torch.cuda.is_available():
        return torch.device('cpu')
    torch.cuda.set_device(dlojz_dist.cuda_device_for(dist, share))  # before anything allocates on the default GPU
    return torch.device('cuda', torch.cuda.current_device())


def check_args(args, device, world_size=1, capability=None):
    """Refuse flag combinations that mean nothing and resolve the defaults that depend on other flags, on
    the device or on the world size. The parser has already checked each value's type and range.
    capability: the GPU's (major, minor) compute capability (default: asked from CUDA)."""
    if args.test_nsteps is not None:
        args.test = True
    elif args.test:
        args.test_nsteps = 50
    if args.val_image_size is None:  # validate at the training resolution unless told otherwise
        args.val_image_size = args.image_size
    if args.val_resize is None:
        args.val_resize = round(args.val_image_size * 256 / 224)
    if args.num_workers is None:
        args.num_workers = dlojz_dist.slurm_cpus_per_task() or min(8, usable_cores())
    args.chkpt = args.chkpt or args.chkpt_every > 0
    if args.randaugment:
        try:
            dlojz_augment.parse_randaugment(args.randaugment)
        except ValueError as e:
            raise UsageError(str(e)) from None
    if args.decode == 'auto':  # a cluster module may lack simplejpeg: the run still goes, the summary says how
        args.decode = 'fast' if dlojz_decode.simplejpeg is not None else 'pil'
    loader_mode = args.loader_only or args.tune_loader  # no model: the loader alone
    if loader_mode and args.resume == 'auto':
        args.resume = None  # the slurm/ scripts pass --resume auto to every run; nothing to resume here
    args.cudnn_benchmark = args.cudnn_benchmark and not args.deterministic
    mode = '--loader-only' if args.loader_only else '--tune-loader'
    refusals = [
        (args.arch not in custom_models.ARCHS, f'unknown --arch {args.arch}; choose one of '
                                               f'{", ".join(custom_models.ARCHS)}.'),
        (args.val_image_size > args.val_resize, f'--val-image-size {args.val_image_size} is larger than '
         f'--val-resize {args.val_resize}; the center crop must fit in the resized image.'),
        (args.num_workers == 0 and (args.prefetch_factor is not None or args.persistent_workers),
         '--prefetch-factor and --persistent-workers need worker processes; drop them or set --num-workers to 1 '
         'or more.'),
        (args.run_name is not None and args.output_dir is not None, '--run-name and --output-dir both name the '
         'run folder; give one.'),
        (args.run_name is not None and (not args.run_name.strip('.') or '/' in args.run_name),
         f'--run-name {args.run_name!r} is not a folder name; use letters, digits, "-", "_" or "." without "/".'),
        (args.loader_only and args.tune_loader, '--loader-only and --tune-loader exclude each other; drop one.'),
        (args.tune_loader and args.test_nsteps is not None and args.test_nsteps < 3, f'--tune-loader needs at '
         f'least 3 batches per trial (--test-nsteps {args.test_nsteps}); give 3 or more (default 30).'),
        (loader_mode and (args.fake_data or args.evaluate or args.findlr or args.resume),
         f'{mode} measures the data loader of a new run; drop --fake-data, --evaluate, --findlr and --resume.'),
        (loader_mode and world_size > 1, f'{mode} measures one process\'s loader; run '
         f'it as a single process (no torchrun, one task).'),
        (args.findlr and args.resume, '--findlr starts from a fresh model; drop --resume.'),
        (args.decode == 'gpu' and (bool(dlojz_augment.worker_ops(args)) or args.res_start is not None),
         '--decode gpu decodes after the workers, where --randaugment, --trivialaugment, --random-erasing and '
         '--res-start act; use --decode fast with them.'),
        (args.res_start is not None and args.res_start > args.image_size, f'--res-start {args.res_start} is larger '
         f'than --image-size {args.image_size}; progressive resizing grows the resolution up to --image-size.'),
        (args.res_start is not None and args.fake_data, '--res-start resizes decoded images and --fake-data has '
         'none; drop one.'),
        (args.wd_norm_bias and args.optimizer in dlojz_recipe.ADAPTIVE, f'--optimizer {args.optimizer} leaves '
         f'BatchNorm weights and biases out of weight decay and of its adaptation, as published; drop '
         f'--wd-norm-bias.'),
        (args.evaluate and not args.resume, '--evaluate validates a trained model; give its checkpoint with '
                                            '--resume PATH.'),
        (args.evaluate and args.findlr, '--evaluate and --findlr exclude each other; drop one.'),
        # measured on CPU: torch 2.5-2.8 (inductor and aot_eager) and 2.4 (aot_eager) update BatchNorm's running
        # statistics again in the compiled recompute; 2.9 and later once
        (args.compile and args.grad_checkpointing and torch.__version__ < '2.9', f'--compile with '
         f'--grad-checkpointing needs torch 2.9 or later (torch {torch.__version__} updates the BatchNorm '
         f'statistics of recomputed stages twice); drop one of the two or upgrade torch.'),
        (args.static_graph and args.accum_steps > 1, '--static-graph does not work with the no_sync() of '
         '--accum-steps (DDP asserts, pytorch/pytorch#143580); drop one of the two.'),
        (args.compile and args.res_start is not None, '--compile makes one graph per image size and runs eager '
         'after 8 of them, while --res-start changes the size every few epochs; drop one of the two.'),
        (args.static_graph and args.arch.endswith('-heads'), f'--static-graph needs the same parameters used at '
         f'every step, but {args.arch} uses a different head from step to step; drop --static-graph.'),
    ]
    cpu = device.type == 'cpu'
    if cpu:
        refusals += [
            (args.sync_bn, '--sync-bn needs CUDA GPUs (PyTorch\'s SyncBatchNorm does not run on CPU); drop it for '
                           'CPU runs.'),
            (args.amp == 'fp16', '--amp fp16 needs a CUDA GPU (CPU autocast computes in bfloat16); use --amp bf16 '
                                 'or --amp off on CPU.'),
            (args.pin_memory, '--pin-memory only speeds up copies to a GPU; drop it on CPU.'),
            (args.decode == 'gpu', '--decode gpu decodes with nvJPEG on a CUDA GPU and this run is on CPU; use '
                                   '--decode fast (or auto).'),
            (args.compile and not (shutil.which('cc') or shutil.which('gcc')),
             '--compile on CPU needs a C compiler (cc/gcc) on PATH; install one or drop --compile.')]
    else:
        # cuDNN runs bf16 convolutions natively from sm80 (Ampere) on; torch.cuda.is_bf16_supported() also
        # counts emulation, which on a V100 (sm70) sends every convolution down a slow path.
        major, minor = capability or torch.cuda.get_device_capability(device)
        bf16 = (major, minor) >= (8, 0)
        refusals.append((args.amp == 'bf16' and not bf16, f'--amp bf16 needs a GPU of compute capability 8.0 or '
                         f'more (A100, H100); this one is {major}.{minor} (V100: 7.0) and would emulate it slowly; '
                         f'use --amp fp16.'))
        args.amp = ('bf16' if bf16 else 'fp16') if args.amp == 'auto' else args.amp
    for refused, sentence in refusals:
        if refused:
            raise UsageError(sentence)
    args.amp = 'off' if args.amp == 'auto' else args.amp
    args.pin_memory = not cpu if args.pin_memory is None else args.pin_memory
    args.channels_last = not cpu if args.channels_last is None else args.channels_last
    if args.num_workers > 0:
        args.prefetch_factor = args.prefetch_factor or 2
        args.persistent_workers = True if args.persistent_workers is None else args.persistent_workers
    args.base_lr = args.base_lr or dlojz_recipe.BASE_LR[args.optimizer]
    if args.res_start is not None and args.res_end_epoch is None:
        args.res_end_epoch = max(0, args.epochs - 1)
    if args.wd_norm_bias is None:
        args.wd_norm_bias = args.optimizer not in dlojz_recipe.ADAPTIVE
    if args.lr is None:  # Goyal et al. 2017: the learning rate grows with the global batch
        args.lr = 10.0 if args.findlr else args.base_lr * args.batch_size * world_size * args.accum_steps / 256
    if args.wandb is None:
        args.wandb = 'off' if args.test else 'offline'
    return args


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
    train_model = dlojz_dist.wrap_ddp(model, device, args) if dist.distributed else model
    eval_model = model
    if args.compile:  # DDP first, then compile: dynamo's DDPOptimizer keeps communication overlapped
        # Static shapes: an epoch's smaller last batch gets its own graph (compiled once, outside the
        # statistics), instead of turning every later step into a slower dynamic-shape graph.
        kw = dict(mode=None if args.compile_mode == 'default' else args.compile_mode, dynamic=False)
        train_model = torch.compile(train_model, **kw)
        eval_model = torch.compile(model, **kw) if dist.distributed else train_model
    return train_model, eval_model, model


def build_wandb(args, dist):
    if args.wandb == 'off' or not dist.is_main:
        return None
    import wandb  # seconds to import: only when asked for
    return wandb.init(project='dlojz', name=os.path.basename(args.output_dir), mode=args.wandb,
                      dir=args.output_dir, config=vars(args))


def console_lines(args, steps_per_epoch):
    """How each record type reads on the console; metrics.jsonl and wandb get the record itself."""
    return {
        'train': lambda r: (f"epoch {r['epoch']}/{args.epochs} step {r['step']}/{steps_per_epoch} loss {r['loss']:.4f} "
                            f"lr {r['lr']:.5f} | step {r['step_ms']:.1f} ms data {r['data_ms']:.1f} ms | "
                            f"{r['img_s']:.1f} img/s | mem {r['mem_bytes'] / 2**30:.2f} GiB"),
        'train_metrics': lambda r: (f"Train metrics at step {r['step']}: loss {r['loss']:.4f} top-1 {r['top1']:.4f} "
                                    f"top-5 {r['top5']:.4f}"),
        'val': lambda r: (f"Validation epoch {r['epoch']}: loss {r['loss']:.4f} top-1 {r['top1']:.4f} top-5 "
                          f"{r['top5']:.4f} ({r['images']} images, {r['time_s']:.1f} s)"),
        'val_ema': lambda r: (f"Validation (EMA) epoch {r['epoch']}: loss {r['loss']:.4f} top-1 {r['top1']:.4f} "
                              f"top-5 {r['top5']:.4f}"),
        'findlr': lambda r: (f"LR sweep step {r['global_step']}: lr {r['lr']:.3g} loss {r['loss']:.4f} (smoothed "
                             f"{r['smoothed']:.4f})"),
    }


@dataclass(kw_only=True)
class Run:
    """What a run is built from; none of it changes while the loops run (their state is a Progress)."""
    args: argparse.Namespace
    dist: dlojz_dist.DistInfo
    device: torch.device
    data: object                  # dlojz_data.Data: loaders, classes, counts
    model: nn.Module              # what trains: DDP-wrapped and/or compiled
    eval_model: nn.Module         # what validates: without the DDP wrapper
    model_without_ddp: nn.Module  # plain module: state dicts, buffers
    criterion: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    scaler: torch.amp.GradScaler
    autocast: object              # torch.autocast, or nullcontext with --amp off
    norm: tuple                   # ImageNet mean and std x 255 on the device, (1, 3, 1, 1): made once
    chrono: Chronometer
    power: PowerMeter             # NVML energy: whole run, and steady training windows for J/image
    memory: PeakMemory            # peak memory, reset after the warm-up steps
    guard: NonFiniteGuard
    stop: dlojz_dist.StopSignal
    log: Logger
    global_batch: int
    host: dict                    # cores, load, threads, workers (dlojz_io.host_check)
    steps_per_epoch: int
    total_steps: int              # of this invocation's schedule: --findlr's sweep length
    mix: object = None            # dlojz_augment.Mix: --mixup / --cutmix on the device (identity when off)
    ema: object = None            # dlojz_recipe.EMA with --ema-decay
    started: float = 0.0          # time.time() when the run was built: time to accuracy counts from here


def build_run(args, dist, device, say):
    """-> (run, where it starts). The checkpoint is checked against the run before any log is opened."""
    data = build_data(args, dist, log=say, on_ranks=dlojz_dist.on_ranks)
    say(f'Data: {data.source.kind} {data.source.root} ({data.source.reason}); {data.n_train} train / '
        f'{data.n_val} val images, {len(data.classes)} classes')
    model, eval_model, plain = build_model(args, len(data.classes), device, dist)
    steps_per_epoch = len(data.train_steps)
    total_steps = args.epochs * steps_per_epoch
    if args.test and args.test_nsteps > total_steps:
        say(f'Note: --test-nsteps {args.test_nsteps} is more than {args.epochs} epoch(s) of {steps_per_epoch} steps '
            f'hold: running {total_steps} steps; raise -e to run more.')
    total_steps = min(args.test_nsteps, total_steps) if args.test else total_steps
    if len(data.classes) == 1:
        say(f'Warning: the data has a single class ({data.classes[0]}): every prediction is right, loss and '
            f'accuracy say nothing; check --data-dir.')
    criterion, optimizer, scheduler, scaler = dlojz_recipe.build_optimization(args, plain, steps_per_epoch,
                                                                                    total_steps, device)
    global_batch = args.batch_size * dist.world_size * args.accum_steps
    ckpt_path, ckpt = find_resume_checkpoint(args, dist, say)
    if ckpt is not None:
        check_checkpoint(args, ckpt, ckpt_path, len(data.classes), global_batch, dist.world_size)
    resumed = ckpt is not None and not args.evaluate
    metrics = os.path.join(args.output_dir, 'metrics.jsonl')
    dropped = None
    if resumed and dist.is_main and os.path.samefile(os.path.dirname(os.path.abspath(ckpt_path)), args.output_dir):
        # the steps logged after the checkpoint are run again: their records are written again, not repeated
        dropped = trim_metrics(metrics, ckpt.get('metrics_bytes'), ckpt['global_step'])
    amp_dtype = {'fp16': torch.float16, 'bf16': torch.bfloat16}.get(args.amp)
    chrono = Chronometer(device, phases=args.timing, sync=args.sync_timing, warmup=args.warmup_steps)
    power, memory = PowerMeter(device), PeakMemory(device)
    chrono.on_steady += [memory.reset, power.window_start]  # once the warm-up steps are over
    run = Run(args=args, dist=dist, device=device, data=data, model=model, eval_model=eval_model,
              model_without_ddp=plain, criterion=criterion, optimizer=optimizer, scheduler=scheduler, scaler=scaler,
              autocast=torch.autocast(device.type, dtype=amp_dtype) if amp_dtype else nullcontext(),
              norm=tuple(torch.tensor(v, device=device).view(1, 3, 1, 1) * 255 for v in (IMAGENET_MEAN, IMAGENET_STD)),
              chrono=chrono, power=power, memory=memory,
              # a non-finite loss is looked for every step on CPU (free) and every --log-interval steps on a
              # GPU (a sync); the LR sweep reads its loss every step anyway and stops on its own
              guard=NonFiniteGuard(device, 0 if args.findlr else 1 if device.type == 'cpu' else args.log_interval,
                                   dist.distributed),
              stop=dlojz_dist.StopSignal(),
              log=Logger(metrics, say, append=resumed, lines=console_lines(args, steps_per_epoch),
                         wandb=build_wandb(args, dist)),
              global_batch=global_batch, host=host_check(args.num_workers, device.type == 'cpu'),
              steps_per_epoch=steps_per_epoch, total_steps=total_steps,
              mix=dlojz_augment.Mix(args.mixup, args.cutmix, len(data.classes), args.seed),
              ema=dlojz_recipe.EMA(plain, args.ema_decay, args.ema_warmup) if args.ema_decay else None,
              started=time.time())
    if resumed:  # where this attempt starts, and what it replaced of the one before
        run.log.log(type='resume', global_step=ckpt['global_step'], checkpoint=ckpt_path, dropped_records=dropped)
    return run, restore(run, ckpt) if ckpt is not None else Progress()


# ------------------------------------------------------------------------------------------------ training

def to_device(images, labels, run):
    """uint8 NCHW batch -> normalised float on the device (normalising here is 4x less PCIe traffic)."""
    nb = run.args.non_blocking
    mean, std = run.norm
    x = images.to(run.device, non_blocking=nb)
    labels = labels.to(run.device, non_blocking=nb)
    for i, j in getattr(images, 'replaced', ()):  # --decode gpu --skip-bad-images: sample j took bad i's place
        labels[i] = labels[j]
    if run.args.channels_last:  # reorder the uint8 batch (1 byte per value), not a float copy of it
        x = x.contiguous(memory_format=torch.channels_last)
    return (x.float() - mean) / std, labels


def train_step(run, images, labels):
    """One optimisation step, as every mode runs it, over a batch or (--accum-steps) lists of micro-batches
    whose gradients add up: each micro-batch's loss is divided by their number, so the step follows the mean
    over all its images, as N ranks' all-reduce would; DDP syncs only during the last backward (no_sync
    before). -> (mean loss, output, labels): detached, on the device."""
    micro = list(zip(images, labels)) if isinstance(images, list) else [(images, labels)]
    n = len(micro)
    losses, outputs, targets = [], [], []
    for k, (x, y) in enumerate(micro):
        with run.model.no_sync() if k < n - 1 and run.dist.distributed else nullcontext():
            with run.chrono.phase('h2d'):
                x, y = to_device(x, y, run)
                # soft targets with --mixup/--cutmix, drawn for (optimizer step, virtual rank); the meters keep y
                x, target = run.mix(x, y, run.scheduler.last_epoch, run.dist.rank * n + k)
            with run.chrono.phase('forward'), run.autocast:
                output = run.model(x)
                loss = run.criterion(output, target)
            # copies with several micro-batches: CUDA graphs (--compile-mode reduce-overhead) reuse outputs
            losses.append(loss.detach() if n == 1 else loss.detach().clone())
            if k == n - 1:  # before the last backward: a non-finite loss it reads is never applied
                run.guard.observe(loss if n == 1 else torch.stack(losses).sum())
            with run.chrono.phase('backward'):
                run.scaler.scale(loss / n if n > 1 else loss).backward()
        outputs.append(output.detach() if n == 1 else output.detach().clone())
        targets.append(y)
    with run.chrono.phase('optimizer'):
        run.scaler.step(run.optimizer)
        run.scaler.update()
        run.optimizer.zero_grad(set_to_none=True)
    run.scheduler.step()
    if run.ema is not None:
        run.ema.update(run.model_without_ddp)
    if n == 1:
        return losses[0], outputs[0], targets[0]
    return torch.stack(losses).mean(), torch.cat(outputs), torch.cat(targets)


def train(run, progress, prof=None):
    """Epochs from where progress stands: train, then close the epoch (validation, best.pt, checkpoint). With
    --test, --test-nsteps steps in all, a resumed run's earlier steps included, then a short validation. A stop
    signal ends it through preempt(): during training at the next step boundary (a stop during an epoch's
    last step leaves a checkpoint that owes the epoch's validation, which the resumed run runs first); during
    the closing of an epoch, once it is done."""
    args = run.args
    while progress.epoch < args.epochs:
        if not progress.end_due:
            left = args.test_nsteps - progress.global_step if args.test else None
            if left is not None and left <= 0:  # resumed from the end of a --test-nsteps run
                break
            first = progress.step
            run.data.set_epoch(progress.epoch, first * args.batch_size)
            if train_one_epoch(run, progress, left, prof):  # it sets end_due when the epoch or --test-nsteps ends
                preempt(run, progress)
        close_epoch(run, progress)
        over = progress.epoch >= args.epochs or (args.test and progress.global_step >= args.test_nsteps)
        if not over and stop_now(run):  # a signal during the validation
            preempt(run, progress)
        if args.chkpt:  # after the validation: it holds the best top-1 and time to accuracy so far
            save(run, progress)


def close_epoch(run, progress):
    """The end of an epoch or of --test-nsteps: validation when due (every --val-every epochs, after the last
    and at the end of --test-nsteps), then the position moves to the next epoch, then best.pt (which so holds
    a closed epoch)."""
    args = run.args
    epoch_end = progress.step == run.steps_per_epoch  # else --test-nsteps ended mid-epoch (this run's or the last)
    last = (epoch_end and progress.epoch == args.epochs - 1) or (args.test and progress.global_step >= args.test_nsteps)
    if last or (epoch_end and not args.test and (progress.epoch + 1) % args.val_every == 0):
        progress.val = evaluate(run, progress.epoch, progress, 20 if args.test else None)
        if run.ema is not None:
            progress.val_ema = evaluate(run, progress.epoch, progress, 20 if args.test else None, ema=True)
        validated = True
    else:
        validated = False
    if epoch_end:
        progress.epoch, progress.step = progress.epoch + 1, 0
    progress.end_due = False
    if validated:
        note_validation(run, progress)


def stop_now(run):
    """Whether a stop signal reached any rank: agreed() starts the agreement, settle() waits for it (blocking:
    between epochs only; alone, agreed() answers a step later)."""
    return run.stop.agreed() or run.stop.settle()


def train_one_epoch(run, progress, max_steps=None, prof=None):
    """Train from progress.step to the end of the epoch, or for max_steps steps; -> True when a stop signal
    ended it early. Each step: step -> meters -> log line -> checkpoint -> stop check."""
    args, first = run.args, progress.step
    run.model.train()
    run.guard.reset(progress.global_step)
    meters = Meters(len(run.data.classes), run.device)
    window = torch.zeros((), device=run.device)  # loss summed since the last log line, read there only
    t_log, stopped = time.perf_counter(), False
    images_before = run.chrono.images_after_warmup
    if len(run.chrono.steps) >= run.chrono.warmup:  # past the warm-up (a later epoch): this epoch's steps count for J/image
        run.power.window_start()
    bar = run.log.bar(min(run.steps_per_epoch - first, max_steps or run.steps_per_epoch), f'epoch {progress.epoch + 1}')
    for images, labels in run.chrono.iterate(run.data.train_steps, max_steps):
        if args.nccl_debug:  # the course's comm_profiler marker: tags the NCCL lines that follow
            print(f'Train step {progress.global_step + 1} - rank {run.dist.rank}', flush=True)
        lr = run.optimizer.param_groups[0]['lr']
        loss, output, labels = train_step(run, images, labels)
        progress.advance(labels.shape[0] * run.dist.world_size)  # every rank's batch has this size
        # the epoch's (or --test-nsteps') last step: a checkpoint from here on owes the closing validation
        progress.end_due = progress.step == run.steps_per_epoch or progress.step - first == max_steps
        window += loss
        meters.update(loss, output, labels)
        bar.update()
        if prof is not None:  # the profiled steps, and the one that writes the trace, are slower: not counted
            if args.prof_wait <= prof.step_num < args.prof_wait + args.prof_warmup + args.prof_active:
                run.chrono.exclude_current()
            prof.step()
        if progress.step % args.log_interval == 0 or progress.step == run.steps_per_epoch:
            t_log = log_train(run, progress, lr, window, t_log)
        if progress.step % args.metric_step == 0:
            log_train_metrics(run, progress, meters)
        if args.chkpt_every and progress.global_step % args.chkpt_every == 0:
            run.guard.check()  # every rank, before rank 0 saves: never checkpoint weights a NaN reached
            save(run, progress)
        dlojz_io.slow_step()
        dlojz_io.signal_fault('step', progress.global_step)
        if run.stop.agreed():  # a step boundary: a consistent state to checkpoint
            stopped = True
            break
    stopped = run.stop.settle() or stopped  # a signal during the last step: stop at the end of the epoch
    bar.close()
    run.guard.check()
    run.chrono.finish()
    run.power.window_stop(run.chrono.images_after_warmup - images_before)
    progress.train = {'steps_run': progress.step - first, **meters.compute()}
    return stopped


def log_train(run, progress, lr, window, t_last):
    """The periodic training record; -> the time it was taken (wall time per step is measured between
    records, so it includes everything the loop does)."""
    data_s, n = run.chrono.interval()
    now = time.perf_counter()
    step_s = (now - t_last) / n
    mem = run.memory.peak()
    run.log.log(type='train', epoch=progress.epoch + 1, step=progress.step, global_step=progress.global_step,
                loss=window.item() / n, lr=lr, step_ms=step_s * 1e3, data_ms=data_s * 1e3,
                img_s=run.global_batch / step_s if step_s else None, mem_bytes=mem)
    window.zero_()
    return now


def log_train_metrics(run, progress, meters):
    """Every rank: compute() adds up the meters of all ranks. With --metric-sync-log, each rank's own values
    before the sync are printed and recorded too (the course's metric_compute_log)."""
    before = meters.compute(sync=False) if run.args.metric_sync_log else None
    after = meters.compute()
    run.log.log(type='train_metrics', epoch=progress.epoch + 1, step=progress.step,
                global_step=progress.global_step, **after)
    if before is None:
        return
    name = f"{'GPU' if run.device.type == 'cuda' else 'CPU'}{run.dist.rank}"
    for when, v in (('Before', before), ('After', after)):
        print(f"Step {progress.step} - {when} metric compute {name}: loss: {v['loss']:.4f}, accuracy: "
              f"{v['top1']:.4f}", flush=True)
    ranks = dlojz_dist.all_gather_object({'rank': run.dist.rank, 'before': before, 'after': after})
    run.log.log(type='metric_sync', global_step=progress.global_step, step=progress.step, ranks=ranks)


def find_lr(run, progress, beta=0.98, explode=4.0):
    """LR range test (Smith 2017): the LR grows geometrically from 1e-8 to --lr over the run's steps. The
    sweep ends at the first non-finite loss or once the smoothed loss (EMA `beta`, bias-corrected) passes
    `explode` x its minimum, as LR finders do. -> the curve up to there: {'lr', 'loss', 'steps', 'stopped'}.
    It reads the rank-mean loss every step (a sync per step: this is a measurement, not training)."""
    run.model.train()
    lrs, losses, why, avg, best = [], [], 'end of the sweep', 0.0, math.inf
    curve = lambda: {'lr': lrs, 'loss': losses, 'steps': len(lrs), 'stopped': why}

    def batches():  # the sweep crosses epoch boundaries
        for epoch in range(run.args.epochs):
            run.data.set_epoch(epoch)
            yield from run.data.train_steps
    for images, labels in run.chrono.iterate(batches(), run.total_steps):
        lr = run.optimizer.param_groups[0]['lr']
        loss = train_step(run, images, labels)[0]
        loss = dlojz_dist.all_reduce_(loss.float().clone()).item() / run.dist.world_size
        progress.advance()
        if not math.isfinite(loss):
            why = f'non-finite loss at lr {lr:.3g}'
            break
        avg = beta * avg + (1 - beta) * loss
        smoothed = avg / (1 - beta ** (len(lrs) + 1))
        best = min(best, smoothed)
        lrs.append(lr)
        losses.append(loss)
        if len(lrs) % run.args.log_interval == 0:
            run.log.log(type='findlr', global_step=progress.global_step, lr=lr, loss=loss, smoothed=smoothed)
        if smoothed > explode * best:
            why = f'smoothed loss {smoothed:.3g} passed {explode:g}x its minimum {best:.3g} at lr {lr:.3g}'
            break
        if run.stop.agreed():
            run.chrono.finish()
            run.stop.settle()
            raise Preempted(f'the LR sweep was stopped by {run.stop.received or "a signal on another rank"} at '
                            f'step {progress.global_step}; its curve so far is in summary.json; run it again to '
                            f'sweep further.', findlr=curve())
    run.stop.settle()  # the sweep ended: a signal during its last step changes nothing
    run.chrono.finish()
    run.log.print(f'LR sweep: {len(lrs)} steps, lr {lrs[0] if lrs else 1e-8:.3g} to {lrs[-1] if lrs else 1e-8:.3g}; '
                  f'stopped: {why}')
    return curve()


@torch.inference_mode()
def evaluate(run, epoch, progress, max_batches=None, ema=False):
    """Exact validation: each rank evaluates its own unpadded shard of the validation set and the meters of
    all ranks are added up, so every image counts once whatever the world size. ema: the EMA weights."""
    model, chrono = run.ema.module if ema else run.eval_model, run.chrono
    model.eval()
    if run.args.nccl_debug:  # comm_profiler marker: the collectives that follow belong to validation
        print(f'Validation - rank {run.dist.rank}', flush=True)
    # rank 0's BatchNorm statistics, as in its checkpoint
    dlojz_dist.broadcast_buffers_(run.ema.module if ema else run.model_without_ddp)
    meters, batches, raw_time = Meters(len(run.data.classes), run.device), 0, chrono.val_time
    with chrono.validation():
        for x, labels in itertools.islice(run.data.val_loader, max_batches):
            x, labels = to_device(x, labels, run)
            with run.autocast:
                output = model(x)
                loss = run.criterion(output, labels)
            meters.update(loss, output, labels)
            batches += 1
            dlojz_io.signal_fault('val')
        # compute() is a collective; inside the timed block so that waiting for slower ranks counts
        res = dict(type='val_ema' if ema else 'val', epoch=epoch + 1, global_step=progress.global_step,
                   **meters.compute(), batches=batches, train_images=progress.images, wall_s=run_wall_s(run))
    res['time_s'] = chrono.val_time
    if ema:  # the summary's validation time and batches stay the raw model's
        chrono.val_time = raw_time
    else:
        chrono.val_batches = batches
    run.log.log(**res)
    if not math.isfinite(res.get('loss', 0.0)):  # on every rank: the loss is the all-reduced one
        raise NonFiniteValidation(epoch + 1, progress.global_step)
    return res


# ------------------------------------------------------------------------------------------------ main

def main(args, dist=None):
    """Validate the flags, join the process group, choose the run folder, then run (see _main)."""
    dist = dist or get_dist_info()
    if args.deterministic:  # cuBLAS reads it when its first handle is made: before any GPU matmul
        os.environ.setdefault('CUBLAS_WORKSPACE_CONFIG', ':4096:8')
    share = args.share_gpu or dlojz_dist.mps_active()
    device = pick_device(args.device, dist, share)
    raw = dict(vars(args))  # the flags as given: --tune-loader passes them on to its trials
    args = check_args(args, device, dist.world_size)
    threads = intra_op_threads(args.num_workers, device.type == 'cpu', dist.local_world_size)
    if threads:  # before the first parallel op: OpenMP sizes its pool then
        torch.set_num_threads(threads)
    if args.dist_debug:  # read by torch.distributed when the process group starts
        os.environ['TORCH_DISTRIBUTED_DEBUG'] = 'DETAIL'
    if args.nccl_debug:
        dlojz_dist.nccl_debug_env()
    dlojz_dist.setup(dist, device, args.dist_timeout, share)
    # Rank 0 chooses the folder (a timestamp would differ between ranks), takes it (one run per folder at a
    # time: the lock comes before anything in it is read or deleted) and prepares it; all ranks agree.
    lock, tee = dlojz_io.FolderLock(), None

    def take_folder():
        path = lock.acquire(args.output_dir or default_output_dir(args, dist), dist.job_id).folder
        try:
            return prepare_output_dir(path, continues=bool(args.resume) and not args.evaluate,
                                      overwrite=args.overwrite)
        except BaseException:
            lock.release()
            raise
    args.output_dir = dlojz_dist.broadcast_object(dlojz_dist.on_ranks(take_folder, when=dist.is_main))
    try:
        if dist.is_main and args.run_name and os.path.basename(args.output_dir) != args.run_name:
            first = os.path.join('runs', args.run_name)
            why = f'a finished run ({run_status(first)})' if run_status(first) else 'the run of another live job'
            print(f'{first} holds {why}; this run goes to {args.output_dir}', flush=True)
        if dist.is_main and args.run_name and dist.job_id:  # who writes here: a duplicate job goes elsewhere
            write_json(os.path.join(args.output_dir, dlojz_io.OWNER), {'job_id': dist.job_id})
        if args.nccl_debug:  # before the first NCCL collective, so that the communicator's INIT lines are in it
            os.makedirs(args.output_dir, exist_ok=True)  # node-local folders: ranks on other nodes create their own
            tee = dlojz_dist.StdoutTee(os.path.join(args.output_dir, f'nccl.rank{dist.rank}.log'))
            print(f'Train step 0 - rank {dist.rank}', flush=True)  # marker: what follows is initialisation
        if args.loader_only or args.tune_loader:
            return loader_mode(args, raw, dist, device)
        return _main(args, dist, device)
    except BaseException:
        lock.release()
        if dist.is_main:  # an error before anything was written (bad data, a refused checkpoint): no empty folder
            remove_if_empty(args.output_dir)
        raise
    finally:
        lock.release()
        if tee:
            tee.close()


def loader_mode(args, raw, dist, device):
    """--loader-only and --tune-loader (dlojz_loader): no model is built."""
    say = Console(dist.is_main)
    write_json(os.path.join(args.output_dir, 'config.json'), vars(args))
    if args.loader_only:
        return dlojz_loader.loader_only(args, dist, device, say)
    return dlojz_loader.tune_loader(args, raw, get_args_parser(), dist, device, say)


def _main(args, dist, device):
    """Build the run, run its mode (train, LR sweep or evaluation), and end every way it can end with a
    summary.json that says how (dlojz_errors), the power meter stopped and the logs closed."""
    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    torch.use_deterministic_algorithms(args.deterministic)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = args.tf32
    seed_everything(args.seed)  # same seed on every rank: same initial weights, same augmentation streams
    run, progress = build_run(args, dist, device, Console(dist.is_main))
    print_header(run)
    if dist.is_main:
        write_json(os.path.join(args.output_dir, 'config.json'), vars(args))
    power, extra, code = run.power, {}, 1
    run.stop.install()
    try:
        run.chrono.start()
        power.start()
        if args.evaluate:  # an end-of-epoch checkpoint is the start of the next epoch
            epoch = progress.epoch - 1 if progress.step == 0 else progress.epoch
            progress.val = evaluate(run, max(0, epoch), progress, 20 if args.test else None)
            if run.ema is not None:
                progress.val_ema = evaluate(run, max(0, epoch), progress, 20 if args.test else None, ema=True)
        elif args.findlr:
            extra['findlr'] = find_lr(run, progress)
        else:
            # rank 0 only: one trace tells the story, and every rank's export would stall its own step
            run.chrono.labels = args.prof and dist.is_main
            with profiler(device, os.path.join(args.output_dir, 'profiler'), args.prof_wait, args.prof_warmup,
                          args.prof_active) if run.chrono.labels else nullcontext() as prof:
                train(run, progress, prof)
        run.chrono.stop()
        power.stop()
        summary = write_summary(run, progress, 'completed', extra=extra)
        for line in final_lines(summary, run.chrono, run.steps_per_epoch):
            run.log.print(line)
        code = 0
        return summary
    except BaseException as e:
        err = translate(e, args, dist.rank, dist.distributed, progress.global_step + 1)
        power.stop()  # not chrono.stop(): its GPU synchronise may raise again after a CUDA error
        status, msg = (err.status, str(err)) if err else ('crashed', f'{type(e).__name__}: {e}')
        write_summary(run, progress, status, msg,
                      extra=err.extra if err else {'failed_step': progress.global_step + 1})
        code = err.exit_code if err else 1
        if err is None:
            raise
        raise err from None
    finally:
        run.stop.restore()
        run.log.close(code)


def print_header(run):
    args, dist, say = run.args, run.dist, run.log.print
    nodes, procs = dist.num_nodes, dist.world_size
    # ends with the process count, which the course's tools read as split()[-2]
    say(f">>> Training on {nodes} node{'s' * (nodes > 1)} and {procs} process{'es' * (procs > 1)}")
    say(f'{dist.launcher} launch on {run.device}: {args.arch}, amp {args.amp}, channels-last {args.channels_last}')
    say(f'global batch size: {run.global_batch} - mini batch size: {args.batch_size}' +
        (f' ({args.accum_steps} micro-batches per step)' if args.accum_steps > 1 else ''))
    if args.findlr:
        say(f'learning rate: sweep from 1e-08 to {args.lr:g} over {run.total_steps} steps')
    else:
        rule = '--lr' if args.lr != args.base_lr * run.global_batch / 256 else \
            f'--base-lr {args.base_lr:g} per 256 images x global batch {run.global_batch}'
        say(f'learning rate: {args.lr:.6g} ({rule}; {args.scheduler} schedule)')
    # the flags that differ from their defaults; config.json holds them all
    defaults = vars(get_args_parser().parse_args([]))
    changed = [f'{k}={v}' for k, v in sorted(vars(args).items()) if k not in defaults or defaults[k] != v]
    say('Config (differs from the defaults; all of it in config.json): ' + ' '.join(changed))
    for warning in run.host['warnings']:
        say(f'Warning: {warning}')


def report_error(e, dist):
    """Errors before the process group exists are the same on every rank: rank 0 says it once. After,
    they may be one rank's own (a bad image, an OOM, a dead peer): every rank speaks, tagged."""
    grouped = dist is not None and dist.world_size > 1 and dlojz_dist.tdist.is_initialized()
    if e.label is None:  # preempted, interrupted: not an error of the user's, rank 0 says it
        if dist is None or dist.is_main:
            print(f'dlojz: {e}', file=sys.stderr, flush=True)
    elif dist is None or dist.is_main or grouped:
        print(f"dlojz: {e.label}: {f'[rank {dist.rank}] ' if grouped else ''}{e}", file=sys.stderr, flush=True)


def cli(argv=None):
    """python dlojz.py FLAGS -> exit code (dlojz_errors lists them)."""
    dist, peer_failed = None, False
    try:
        args = get_args_parser().parse_args(argv)
        dist = get_dist_info()
        main(args, dist)
        return 0
    except SystemExit as e:  # argparse: --help (0) or a bad flag (2, its sentence already printed)
        return e.code
    except KeyboardInterrupt:  # before the run existed (afterwards _main turns it into Interrupted)
        e = Interrupted('interrupted')
        report_error(e, dist)
        return e.exit_code
    except DlojzError as e:
        report_error(e, dist)
        peer_failed = isinstance(e, CommFailure)
        return e.exit_code
    finally:
        dlojz_dist.cleanup(peer_failed)


if __name__ == '__main__':
    code = cli()
    if dlojz_dist.abandoned:  # a dead peer's NCCL group: no teardown, no destructor that could wait for it
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
