"""The command line of dlojz.py: its flags (get_args_parser) and the checks that need nothing but
the flags (check_flags), then those that need the device, the world size or the torch version
(check_args). Torch-free on import, on purpose: `python dlojz.py` reads and checks its flags with
this module before it imports torch (seconds on a loaded node), so --help and every usage error
answer at once; check_args imports torch when called."""
import argparse
import importlib.util
import math
import os
import re
import shutil
import sys

from dlojzlib import choices
from dlojzlib.choices import native_bf16
from dlojzlib.environment import ENVIRONMENT, check_environment  # noqa: F401 (flags.ENVIRONMENT)
from dlojzlib.dist import plan, stages
from dlojzlib.errors import UsageError

# custom_models builds these (resnets from torchvision's blocks); the names live here so that the
# parser can list and check them without importing torch
RESNETS = ('resnet18', 'resnet34', 'resnet50', 'resnet101', 'resnet152')
# torchvision's, which take any image size
TORCHVISION_ARCHS = sorted(RESNETS) + sorted(f'{r}-{v}' for r in RESNETS for v in ('heads', 'sd'))
ARCHS = TORCHVISION_ARCHS + ['coatnet7']
TIMM = 'timm:'  # --arch timm:<name>: any of timm's models, by its name (custom_models.build_model)
# peak learning rate per 256 images (the linear scaling rule multiplies it by global batch / 256):
# SGD's from Goyal et al. 2017; AdamW's dlojz's earlier default; Lion's timm's default. LARS's and
# LAMB's from a 6-epoch sweep on the synthetic data (BENCHMARKS.md): values that reached 0.9+ top-1
# there; top-1 still rose at the largest values tried, so a short run cannot pick them: tune them on
# real data (--findlr).
BASE_LR = {'sgd': 0.1, 'adamw': 0.001, 'lars': 2.0, 'lamb': 0.005, 'lion': 0.0001}
ADAPTIVE = ('lars', 'lamb')  # layer-wise trust ratios: the norm/bias group is left out of them


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """--help shows every default (unless the help text already says it) and keeps the examples'
    layout."""

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


def number(cast, ok, rule):
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


POSITIVE_INT = number(int, lambda v: v > 0, 'positive')
COUNT = number(int, lambda v: v >= 0, '0 or more')
POSITIVE = number(float, lambda v: v > 0 and math.isfinite(v), 'positive')
NON_NEGATIVE = number(float, lambda v: v >= 0 and math.isfinite(v), '0 or more')
FRACTION = number(float, lambda v: 0 <= v < 1, 'in [0, 1)')
SEED = number(int, lambda v: 0 <= v < 2 ** 32,
              'from 0 to 4294967295 (what numpy\'s generators take)')


ON_OFF = argparse.BooleanOptionalAction  # --x / --no-x


def default_cache_dir(environ=os.environ):
    """$XDG_CACHE_HOME/dlojz where it is set to an absolute path (the XDG rule: a relative one is
    ignored), else ~/.cache/dlojz, as pip and torch.hub choose theirs."""
    base = environ.get('XDG_CACHE_HOME', '')
    return os.path.join(base if os.path.isabs(base) else '~/.cache', 'dlojz')


def get_args_parser(add_help=True):
    p = Parser(description='dlojz: ResNet training and benchmarking', add_help=add_help, allow_abbrev=False,
               formatter_class=HelpFormatter, epilog=EXAMPLES)
    for add_group in (data_flags, loader_flags, model_flags, precision_flags, optimization_flags,  # --help's order
                      augmentation_flags, run_flags, distributed_flags, stages.add_flags,
                      logging_flags, benchmark_flags, tuning_flags):
        add_group(p)
    return p


MAX_WORKERS_PER_CORE = 8  # loader workers per usable core beyond which --num-workers is refused


def data_flags(p):
    g = p.add_argument_group('data')
    g.add_argument('--data-dir', help='ImageNet in ImageFolder layout (DIR/train/<class>/*.JPEG, DIR/val/...); '
                   'default $DLOJZ_DATA_DIR, then $ALL_CCFRSCRATCH/imagenet, $DSDIR/imagenet (Jean Zay), else the built-in '
                   'synthetic dataset')
    g.add_argument('--stage-dir', help='copy the shards (dlojz_data.py prepare) to this folder on the node\'s local '
                   'disk, once per node, and read them there, e.g. $SLURM_TMPDIR; other data are read in place')
    g.add_argument('--cache-dir', default=default_cache_dir(), help='where the synthetic dataset '
                   'is generated, once, and the index of each data folder is kept for the next '
                   'job; default $XDG_CACHE_HOME/dlojz, else ~/.cache/dlojz')
    g.add_argument('--rescan-data', action='store_true', help='list the data folder again rather '
                   'than reuse the kept index of its unchanged class folders')
    g.add_argument('--synthetic-classes', type=POSITIVE_INT, default=10, help='synthetic dataset: number of classes')
    g.add_argument('--synthetic-train-per-class', type=POSITIVE_INT, default=64, help='synthetic: train images per class')
    g.add_argument('--synthetic-val-per-class', type=POSITIVE_INT, default=16, help='synthetic: val images per class')
    g.add_argument('--synthetic-seed', type=SEED, default=0, help='synthetic dataset content seed')
    g.add_argument('--fake-data', action='store_true', help='random uint8 batches in memory, no decoding: '
                   'the compute ceiling')
    g.add_argument('--fake-train-size', type=POSITIVE_INT, default=1281167, help='--fake-data: images per epoch')
    g.add_argument('--fake-val-size', type=POSITIVE_INT, default=50000, help='--fake-data: validation images')
    g.add_argument('--fake-classes', type=POSITIVE_INT, default=1000, help='--fake-data: number of classes')
    g.add_argument('--image-size', type=POSITIVE_INT, default=224, help='train RandomResizedCrop size, pixels')
    g.add_argument('--val-resize', type=POSITIVE_INT, default=None, help='validation: shorter side resized to, pixels '
                   '(default 256, i.e. val-image-size x 256/224)')
    g.add_argument('--val-image-size', type=POSITIVE_INT, default=None, help='validation: center crop, pixels (default '
                   '224 when --image-size is 224, else --image-size)')
    g.add_argument('--decode', choices=['auto', 'fast', 'pil', 'gpu'], default='auto', help='training decode '
                   'path (auto: fast when simplejpeg is installed, else pil): "fast" '
                   'decodes no more pixels than the crop needs (libjpeg-turbo DCT scaling via simplejpeg, uint8 '
                   'crop and resize), PIL for the files it cannot read; "pil" decodes every full image with PIL '
                   '(torchvision\'s way); "gpu" has the workers read the files and the GPU decode each batch '
                   '(nvImageCodec: the crops only, on the hardware JPEG decoder where the GPU has one; else '
                   'torchvision\'s nvJPEG, whole images), crop, resize and flip it (CUDA only; the host decodes '
                   'what nvJPEG refuses). Same crops and flips every way; validation decodes on the host')
    g.add_argument('--loader', choices=['native', 'dali'], default='native', help='"native": PyTorch\'s '
                   'DataLoader and its workers, decoding with --decode; "dali": NVIDIA DALI decodes, crops, resizes '
                   'and flips (its CPU pipeline with --num-workers threads, or its GPU decoder on a GPU), the same '
                   'crops, order and shares (pip install nvidia-dali-cuda120 or -cuda130)')
    g.add_argument('--decode-ahead', action=ON_OFF, default=True, help='--decode gpu: decode the next batch on a '
                   'thread and side streams while the step before it trains (--no-decode-ahead: decode each '
                   'batch at the start of its step, to compare)')
    g.add_argument('--skip-bad-images', action='store_true', help='replace undecodable files and count them '
                   'instead of stopping')


def loader_flags(p):
    g = p.add_argument_group('loader')
    g.add_argument('-b', '--batch-size', type=POSITIVE_INT, default=128, help='images per device; global batch = this x '
                   'world size')
    g.add_argument('--val-batch-size', type=POSITIVE_INT, default=250, help='validation images per device')
    g.add_argument('--num-workers', type=COUNT, default=None, help='DataLoader worker processes (train and val; '
                   'default $SLURM_CPUS_PER_TASK under SLURM, else 8 or the usable cores if fewer)')
    g.add_argument('--persistent-workers', action=ON_OFF, default=None, help='keep workers between epochs '
                   '(default: on when --num-workers > 0)')
    g.add_argument('--pin-memory', action=ON_OFF, default=None, help='page-locked batches (default: on with CUDA)')
    g.add_argument('--non-blocking', action=ON_OFF, default=True, help='asynchronous host-to-device copies')
    g.add_argument('--prefetch-factor', type=POSITIVE_INT, default=None, help='batches loaded ahead per worker (default 2)')
    g.add_argument('--drop-last', action=ON_OFF, default=False, help='drop the last incomplete batch')
    g.add_argument('--loader-only', action='store_true', help='run the training loader alone (sampler, decode, '
                   'augmentation, collation, pinned memory, copy to the GPU), no model: the --test-nsteps batches '
                   '(default 50) a training run of as many steps reads; its images/second after the batches the '
                   'workers load at once when they start')
    g.add_argument('--tune-loader', action='store_true', help='the loader doctor: the compute ceiling '
                   '(--fake-data) and --loader-only over workers x prefetch x pinned memory, each in its own '
                   'process; a trials table, a verdict and tune-loader.json/.csv (--test-nsteps per trial, default '
                   '30)')


def model_flags(p):
    g = p.add_argument_group('model')
    g.add_argument('--arch', default='resnet50', help=f'one of {", ".join(ARCHS)}, or '
                   f'{TIMM}<name>: a model of timm (e.g. {TIMM}vit_base_patch16_224, '
                   f'{TIMM}coatnet_2_rw_224, {TIMM}maxvit_base_tf_224)')
    g.add_argument('--sd-prob', type=FRACTION, default=0.5, help='-sd archs: drop probability of the last block')
    heads = number(int, lambda v: v >= 2, 'at least 2 (head 0 for training plus another)')
    g.add_argument('--n-heads', type=heads, default=3, help='-heads archs: classifier heads')
    g.add_argument('--grad-checkpointing', action='store_true', help='recompute activations in the '
                   'backward (ResNet stages; timm\'s own blocks; less memory, ~30%% more compute)')


def precision_flags(p):
    g = p.add_argument_group('precision and compilation')
    g.add_argument('--amp', choices=['auto', 'off', 'fp16', 'bf16'], default='auto', help='autocast dtype; auto '
                   '= bf16 where the GPU supports it, fp16 on older GPUs, off on CPU')
    g.add_argument('--channels-last', action=ON_OFF, default=None, help='NHWC memory format (default: on with CUDA)')
    g.add_argument('--tf32', action=ON_OFF, default=True, help='TF32 matmuls/convolutions on Ampere and newer')
    g.add_argument('--cudnn-benchmark', action=ON_OFF, default=True, help='cudnn autotuning (first steps slower)')
    g.add_argument('--deterministic', action='store_true', help='deterministic algorithms only (bit-exact reruns '
                   'and resumes on a GPU; slower; turns --cudnn-benchmark off)')
    g.add_argument('--compile', action=ON_OFF, default=False, help='torch.compile the model')
    g.add_argument('--compile-mode', default='default', choices=['default', 'reduce-overhead', 'max-autotune',
                   'max-autotune-no-cudagraphs'], help='torch.compile mode: reduce-overhead and max-autotune '
                   'replay the step\'s kernels as CUDA graphs (one process per run; the host\'s launch time off '
                   'the step), max-autotune tunes its kernels first (minutes)')


def optimization_flags(p):
    g = p.add_argument_group('optimization')
    g.add_argument('--optimizer', choices=['sgd', 'adamw', 'lars', 'lamb', 'lion'], default='sgd', help='SGD with '
                   'momentum, AdamW (torch); LARS, LAMB (layer-wise trust ratios, for large global batches) or Lion '
                   '(timm)')
    g.add_argument('--lr', type=POSITIVE, default=None, help='peak learning rate; overrides --base-lr (with '
                   '--findlr: the upper end of the sweep, default 10)')
    g.add_argument('--base-lr', type=POSITIVE, default=None, help='peak learning rate per 256 images, scaled by '
                   'the global batch (linear scaling rule); default ' + ', '.join(
                       f'{v:g} for {k}' for k, v in BASE_LR.items()))
    g.add_argument('--wd', type=NON_NEGATIVE, default=0.0, help='weight decay (adamw, lion: decoupled)')
    g.add_argument('--wd-norm-bias', action=ON_OFF, default=None, help='weight decay on BatchNorm weights and biases '
                   'too (default: yes, except for lars and lamb, which also leave them out of their adaptation)')
    g.add_argument('--mom', type=FRACTION, default=0.9, help='momentum of SGD and LARS (beta1 of AdamW, LAMB, '
                   'Lion); not used by onecycle, which cycles it from 0.95 to 0.85 and back')
    g.add_argument('--accum-steps', type=POSITIVE_INT, default=1, help='micro-batches of -b images per optimizer step, their '
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
    g.add_argument('--ema-warmup', action=ON_OFF, default=True, help='EMA decay min(decay, (1 + n) / (10 + n)) after n '
                   'steps, so that the average forgets the initial weights')
    g.add_argument('--findlr', action='store_true', help='LR range test: geometric from 1e-8 to --lr over the '
                   'run, stopped when the loss diverges')


def augmentation_flags(p):
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
    g.add_argument('--res-start', type=POSITIVE_INT, default=None, help='progressive resizing: training resolution at epoch '
                   '0, pixels, growing linearly to --image-size at --res-end-epoch (multiples of 8)')
    g.add_argument('--res-end-epoch', type=NON_NEGATIVE, default=None, help='progressive resizing: epoch where '
                   '--image-size is reached (default: the last epoch)')


def run_flags(p):
    g = p.add_argument_group('run')
    g.add_argument('-e', '--epochs', type=POSITIVE_INT, default=1, help='number of epochs')
    g.add_argument('--test', action='store_true', help='benchmark mode: --test-nsteps train steps, 20 val batches')
    g.add_argument('--test-nsteps', type=POSITIVE_INT, default=None, help='train steps in test mode (default 50; implies '
                   '--test)')
    g.add_argument('--seed', type=SEED, default=123, help='weights, data order and augmentation '
                   '(same on every rank)')
    g.add_argument('--device', choices=['auto', 'cuda', 'cpu'], default='auto', help='where the model runs (auto: '
                   'the CUDA GPU of this process when PyTorch sees one, else the CPU)')
    g.add_argument('--output-dir', default=None, help='run directory (default runs/<run name>, else '
                   'runs/<job id or time>_<arch>_bs<b>); one that holds another run is refused unless --resume '
                   'continues it or --overwrite replaces it')
    g.add_argument('--run-name', default=None, help='run directory runs/<NAME>, independent of the job id: a '
                   'resubmitted job with --resume auto continues it (a completed one says so and stays as it '
                   'is); when its run ended in NaN or OOM, runs/<NAME>.2, .3, ... (the slurm/ scripts pass one: '
                   '$DLOJZ_RUN, or the job name and a checksum of the flags)')
    g.add_argument('--overwrite', action='store_true', help='delete the run files (config, metrics, summary, '
                   'checkpoints) of a non-empty --output-dir first')
    g.add_argument('--val-every', type=POSITIVE_INT, default=1, help='validate every N epochs (and after the last)')
    g.add_argument('--target-top1', type=FRACTION, default=None, help='time to accuracy: record the wall time, '
                   'epoch and images seen when validation top-1 (a fraction, e.g. 0.759) first reaches this, for '
                   'the raw weights and the EMA')
    g.add_argument('--chkpt', action='store_true', help='write checkpoint-<step>.pt at the end of each epoch and run, '
                   'and best.pt when validation top-1 improves (.dcp folders under --shard '
                   'gradients, full)')
    g.add_argument('--chkpt-every', type=COUNT, default=0, help='also every N steps (implies --chkpt)')
    g.add_argument('--keep-checkpoints', type=POSITIVE_INT, default=2, help='newest checkpoints kept in the run directory')
    g.add_argument('--resume', default=None, help='checkpoint to continue from, or "auto": the newest readable '
                   'checkpoint of --output-dir if there is one (what a requeued job uses)')
    g.add_argument('--requeue', action=ON_OFF, default=True, help='under SLURM, on SIGUSR2/SIGTERM: checkpoint, then '
                   '`scontrol requeue` the job')
    g.add_argument('--allow-batch-change', action='store_true', help='--resume with another global batch size '
                   '(the position in the epoch and the LR schedule are converted in images)')
    g.add_argument('--evaluate', action='store_true', help='validation only, of the --resume checkpoint, at any '
                   'world size (like torchvision\'s --test-only)')


def distributed_flags(p):
    g = p.add_argument_group('distributed (under srun or torchrun)')
    g.add_argument('--sync-bn', action='store_true', help='SyncBatchNorm: batch statistics over all ranks (CUDA only)')
    g.add_argument('--find-unused-parameters', action='store_true', help='DDP: allow parameters without a gradient '
                   'in a step (needed by the -heads archs)')
    g.add_argument('--bucket-cap-mb', type=POSITIVE, default=25.0, help='DDP gradient bucket size, MiB')
    g.add_argument('--static-graph', action='store_true', help='DDP static_graph (same graph every step)')
    g.add_argument('--gradient-as-bucket-view', action='store_true', help='DDP: gradients are views into the '
                   'buckets (saves one gradient copy of memory)')
    g.add_argument('--broadcast-buffers', action=ON_OFF, default=True, help='DDP: rank 0\'s BatchNorm buffers are '
                   'broadcast before every training forward')
    g.add_argument('--dist-timeout', type=POSITIVE, default=None, help='minutes a collective may wait before the '
                   'job ends with an error (default: PyTorch\'s, 10 min NCCL / 30 min gloo)')
    g.add_argument('--nccl-debug', action='store_true', help='NCCL_DEBUG=INFO, NCCL_DEBUG_SUBSYS=INIT,COLL; each '
                   'rank\'s stdout, with step markers, is also written to <output-dir>/nccl.rank<r>.log')
    g.add_argument('--dist-debug', action='store_true', help='TORCH_DISTRIBUTED_DEBUG=DETAIL')
    g.add_argument('--shard', choices=plan.MODES, default='none', help='what each rank keeps a '
                   'slice of: none (DDP), optimizer (its state: ZeRO-1), gradients (and the '
                   'gradients: ZeRO-2, FSDP2), full (and the parameters: ZeRO-3); docs/sharding.md')
    g.add_argument('--cpu-offload', action='store_true', help='--shard gradients or full: keep the '
                   'shards in host memory (FSDP2\'s CPUOffloadPolicy; the optimizer steps on the '
                   'CPU)')
    g.add_argument('--share-gpu', action='store_true', help='allow several tasks per GPU (on by itself when an '
                   'NVIDIA MPS daemon runs; without MPS they take turns on the GPU)')


def logging_flags(p):
    g = p.add_argument_group('logging and profiling')
    g.add_argument('--log-interval', type=POSITIVE_INT, default=10, help='steps between log lines')
    g.add_argument('--metric-step', type=POSITIVE_INT, default=100, help='steps between train accuracy computations (one '
                   'all-reduce of every rank\'s sums)')
    g.add_argument('--metric-sync-log', action='store_true', help='print and record each rank\'s train metrics '
                   'before and after the sync at every --metric-step')
    g.add_argument('--wandb', choices=['off', 'offline', 'online'], default=None, help='default: offline for full '
                   'runs (off where the wandb package is not installed), off in test mode')
    g.add_argument('--prof', action='store_true', help='torch.profiler traces into <output-dir>/profiler')
    g.add_argument('--prof-wait', type=COUNT, default=1, help='--prof: steps before the profiler starts')
    g.add_argument('--prof-warmup', type=COUNT, default=1, help='--prof: profiled steps thrown away (its own warm-up)')
    g.add_argument('--prof-active', type=POSITIVE_INT, default=5, help='--prof: steps recorded in the trace')


def benchmark_flags(p):
    g = p.add_argument_group('benchmark')
    g.add_argument('--timing', action=ON_OFF, default=True, help='per-phase timing (CUDA events on GPU)')
    g.add_argument('--sync-timing', action='store_true', help='synchronise at phase boundaries (wall-clock '
                   'splits, slower)')
    g.add_argument('--warmup-steps', type=COUNT, default=1, help='first steps left out of the statistics')


def tuning_flags(p):
    g = p.add_argument_group('tuning (--tune)')
    g.add_argument('--tune', action='store_true', help='measured trials over batch size, precision, channels-last '
                   'and compile, each in its own process; prints a recommended command line and a scaling forecast; '
                   'writes tune.json/.csv into --output-dir')
    g.add_argument('--tune-budget', type=POSITIVE, default=30.0, metavar='MIN', help='--tune: '
                   'minutes for the whole sweep (resumed parts included); trials that would not '
                   'fit are skipped and listed')
    g.add_argument('--tune-steps', type=POSITIVE_INT, default=20, help='--tune: steady training '
                   'steps per trial (after 3 warm-up steps)')
    g.add_argument('--tune-memory-gib', type=POSITIVE, default=None, help='--tune: largest memory '
                   'peak a batch may reach, GiB (GPU memory on a GPU, host peak on CPU); default: '
                   'until out of memory (GPU) or --tune-max-batch')
    g.add_argument('--tune-max-batch', type=POSITIVE_INT, default=1024, help='--tune: largest '
                   'batch per device tried')
    g.add_argument('--tune-machine', default=None, help='--tune: machine profile of dlojz_slurm.py (a100, h100, v100, '
                   'generic) for the scaling forecast; default: a100 on a GPU, none on CPU')


def parse_randaugment(text):
    """'N,M' -> (N operations per image, magnitude M of 0-30), as torchvision's RandAugment takes
    them."""
    try:
        n, m = (int(v) for v in text.split(','))
    except ValueError:
        raise ValueError(f'--randaugment takes N,M (operations per image, magnitude 0-30), e.g. 2,9; got {text!r}') from None
    if n < 1 or not 0 <= m <= 30:
        raise ValueError(f'--randaugment {text}: N must be 1 or more and M within 0-30 (e.g. 2,9)')
    return n, m


def check_flags(args):
    """Refuse flag combinations that mean nothing whatever the machine, and resolve the defaults
    that depend only on other flags (idempotent: check_args calls it again). -> args; raises
    UsageError."""
    check_environment()
    if args.test_nsteps is not None:
        args.test = True
    elif args.test:
        args.test_nsteps = 50
    if args.val_image_size is None:  # validate at the training resolution unless told otherwise
        args.val_image_size = args.image_size
    if args.val_resize is None:
        args.val_resize = round(args.val_image_size * 256 / 224)
    args.chkpt = args.chkpt or args.chkpt_every > 0
    if args.randaugment:
        try:
            parse_randaugment(args.randaugment)
        except ValueError as e:
            raise UsageError(str(e)) from None
    loader_mode = args.loader_only or args.tune_loader  # no model: the loader alone
    if loader_mode and args.resume == 'auto':
        args.resume = None  # the slurm/ scripts pass --resume auto to every run; nothing to resume here
    args.cudnn_benchmark = args.cudnn_benchmark and not args.deterministic
    mode = '--loader-only' if args.loader_only else '--tune-loader'
    worker_ops = args.randaugment or args.trivialaugment or args.random_erasing  # data.augment.worker_ops
    smallest = min(args.image_size, args.res_start or args.image_size)  # px (--res-start's start)
    refusals = [
        (args.stage_dir is not None and not args.stage_dir.strip(), '--stage-dir is empty (what '
         '"$SLURM_TMPDIR" gives where the variable is unset); give a folder on the node\'s local '
         'disk, or leave --stage-dir out.'),
        (args.arch not in ARCHS
         and not (args.arch.startswith(TIMM) and args.arch[len(TIMM):].strip()),
         f'unknown --arch {args.arch}; choose one of {", ".join(ARCHS)}, or {TIMM}<a timm model\'s '
         f'name>.'),
        (args.arch not in TORCHVISION_ARCHS
         and (args.val_image_size != args.image_size or args.res_start),
         f'--arch {args.arch} is built for one image size (its position tables), and '
         f'--val-image-size or --res-start asks for another; drop them, or give '
         f'--val-image-size {args.image_size}.'),
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
        (args.tune and (loader_mode or args.findlr or args.evaluate), '--tune runs its own trials; it excludes '
         '--loader-only, --tune-loader (it reuses a finished loader doctor in its --output-dir), --findlr and '
         '--evaluate; drop one.'),
        (args.tune_loader and args.test_nsteps is not None and args.test_nsteps < 3, f'--tune-loader needs at '
         f'least 3 batches per trial (--test-nsteps {args.test_nsteps}); give 3 or more (default 30).'),
        (loader_mode and (args.fake_data or args.evaluate or args.findlr or args.resume),
         f'{mode} measures the data loader of a new run; drop --fake-data, --evaluate, --findlr and --resume.'),
        (args.findlr and args.resume, '--findlr starts from a fresh model; drop --resume.'),
        (args.findlr and (args.lr or 1.0) <= 1e-8, f'--findlr sweeps the learning rate up from '
         f'1e-8 to --lr, and --lr {args.lr} is not above it; give a larger --lr (default 10), or '
         f'leave it out.'),
        (args.overwrite and args.resume, '--overwrite starts the run folder afresh and --resume continues it; drop '
         'one (the slurm/ scripts pass --resume auto: give the new run another --run-name or --output-dir).'),
        (args.decode == 'gpu' and (worker_ops or args.res_start is not None),
         '--decode gpu decodes after the workers, where --randaugment, --trivialaugment, --random-erasing and '
         '--res-start act; use --decode fast with them.'),
        (args.loader == 'dali' and (args.decode == 'gpu' or worker_ops or args.res_start is not None
                                    or args.skip_bad_images or args.fake_data),
         '--loader dali decodes, crops and flips by itself: it excludes --decode gpu, --randaugment, '
         '--trivialaugment, --random-erasing, --res-start, --skip-bad-images and --fake-data; drop them or use '
         '--loader native.'),
        (args.res_start is not None and args.res_start > args.image_size, f'--res-start {args.res_start} is larger '
         f'than --image-size {args.image_size}; progressive resizing grows the resolution up to --image-size.'),
        (args.res_start is not None and args.fake_data, '--res-start resizes decoded images and --fake-data has '
         'none; drop one.'),
        (args.wd_norm_bias and args.optimizer in ADAPTIVE, f'--optimizer {args.optimizer} leaves '
         f'BatchNorm weights and biases out of weight decay and of its adaptation, as published; drop '
         f'--wd-norm-bias.'),
        (args.evaluate and not args.resume, '--evaluate validates a trained model; give its checkpoint with '
                                            '--resume PATH.'),
        (args.evaluate and args.findlr, '--evaluate and --findlr exclude each other; drop one.'),
        (args.static_graph and args.accum_steps > 1, '--static-graph does not work with the no_sync() of '
         '--accum-steps (DDP asserts, pytorch/pytorch#143580); drop one of the two.'),
        (args.compile and args.res_start is not None, '--compile makes one graph per image size and runs eager '
         'after 8 of them, while --res-start changes the size every few epochs; drop one of the two.'),
        (args.static_graph and args.arch.endswith('-heads'), f'--static-graph needs the same parameters used at '
         f'every step, but {args.arch} uses a different head from step to step; drop --static-graph.'),
        # a ResNet's last feature map is the image / 32, rounded up: at 32 px or less 1 x 1, where
        # BatchNorm has a single value per channel to normalise in a batch of one (it raises)
        (args.batch_size == 1 and smallest <= 32 and not (loader_mode or args.evaluate),
         f'-b 1 at {smallest} px leaves BatchNorm one value per channel in the last block (a 1 x 1 '
         f'feature map); give -b 2 or more, or an image size above 32.'),
    ]
    for refused, sentence in refusals:
        if refused:
            raise UsageError(sentence)
    return args


def timm_refusal(name):
    """(refused, sentence) for --arch timm:<name>: a name timm does not know (importing timm takes
    seconds)."""
    import timm
    return (not timm.is_model(name), f'timm has no model {name!r} (timm {timm.__version__}); '
            f'python -c "import timm; print(timm.list_models(\'*vit*\'))" lists its names.')


def check_args(args, device, world_size=1, capability=None, job_id=None, backend=None,
               choice=None):
    """Refuse flag combinations that mean nothing and resolve the defaults that depend on other
    flags, on the device or on the world size. The parser has already checked each value's type and
    range. capability: the GPU's (major, minor) compute capability (default: asked from CUDA).
    job_id: SLURM's, which names the default run folder (a requeued job keeps it). backend: the
    process group's (dist.launch.process_group_backend). choice: the device's choices.Choices
    (default: choices.of the device, DLOJZ_AS_IF_CUDA read), which resolve the device's defaults.
    Imports torch and the data modules when called, not when this module is imported."""
    import torch

    from dlojzlib.data import decode
    from dlojzlib.dist import launch
    from dlojzlib.host import usable_cores
    args = check_flags(args)  # those that need only the flags (`python dlojz.py` ran it already)
    if args.num_workers is None:
        args.num_workers = launch.slurm_cpus_per_task() or min(8, usable_cores())
    if args.decode == 'auto':  # a cluster module may lack simplejpeg: the run still goes, the summary says how
        args.decode = 'fast' if decode.simplejpeg is not None else 'pil'
    mode = '--loader-only' if args.loader_only else '--tune-loader'
    cores = usable_cores()
    if args.loader == 'dali':
        from dlojzlib.data import dali
        if dali.dali() is None:
            raise UsageError(dali.INSTALL)
    refusals = [
        # measured: 1000 workers on 2 cores took minutes to start, and a stop signal then waited for
        # them
        (args.num_workers > MAX_WORKERS_PER_CORE * cores, f'--num-workers {args.num_workers} is more than '
         f'{MAX_WORKERS_PER_CORE} workers per usable core ({cores} here); so many processes take minutes to start '
         f'and slow the node down: use at most {MAX_WORKERS_PER_CORE * cores} (a few per core is usually best; '
         f'--tune-loader measures it).'),
        (args.resume == 'auto' and not (args.output_dir or args.run_name or job_id), '--resume auto continues the '
         'run of --output-dir or --run-name (or, in a SLURM job, the job\'s own folder), and none was given: this '
         'run would start afresh in a new folder; name the run folder with --output-dir or --run-name.'),
        ((args.loader_only or args.tune_loader) and world_size > 1, f'{mode} measures one process\'s loader; run '
         f'it as a single process (no torchrun, one task).'),
        # measured on CPU: torch 2.5-2.8 (inductor and aot_eager) and 2.4 (aot_eager) update
        # BatchNorm's running statistics again in the compiled recompute; 2.9 and later once
        (args.compile and args.grad_checkpointing and torch.__version__ < '2.9', f'--compile with '
         f'--grad-checkpointing needs torch 2.9 or later (torch {torch.__version__} updates the BatchNorm '
         f'statistics of recomputed stages twice); drop one of the two or upgrade torch.'),
        # CUDA graphs and DDP, in torch's own trackers: BatchNorm's running statistics, updated under
        # DDP, make inductor skip its graphs (pytorch/pytorch#139207, open), and max-autotune under
        # DDP fails from 2.5 (#140395, open)
        (args.compile and args.compile_mode in ('reduce-overhead', 'max-autotune') and world_size > 1,
         f'--compile-mode {args.compile_mode} captures CUDA graphs, which DDP defeats for these models '
         f'(torch skips them where BatchNorm updates its statistics under DDP, pytorch/pytorch#139207, '
         f'and max-autotune under DDP fails from torch 2.5, #140395); with several processes use '
         f'--compile-mode default or max-autotune-no-cudagraphs.'),
    ]
    version = tuple(int(v) for v in re.findall(r'\d+', torch.__version__)[:2])
    refusals += plan.refusals(args, device.type, world_size, version, backend)
    refusals += stages.refusals(args, world_size, version, backend, device.type)
    if args.arch.startswith(TIMM):
        refusals.append(timm_refusal(args.arch[len(TIMM):]))
    choice = choice or choices.of(device, capability)
    cpu = device.type == 'cpu'  # what the device itself must run: the seam changes none of it
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
        major, minor = choice.capability
        refusals.append((args.amp == 'bf16' and not native_bf16((major, minor)),
                         f'--amp bf16 needs a GPU of compute capability 8.0 or more (A100, '
                         f'H100); this one is {major}.{minor} (V100: 7.0) and would emulate it '
                         f'slowly; use --amp fp16.'))
        # gloo (ranks sharing a GPU) all-reduces and broadcasts CUDA tensors, but SyncBatchNorm
        # all-gathers them
        refusals.append((args.sync_bn and backend == 'gloo' and world_size > 1, '--sync-bn all-gathers BatchNorm '
                         'statistics on the GPU, which the gloo group of ranks sharing a GPU cannot do; drop '
                         '--sync-bn, or give each task a GPU of its own.'))
    for refused, sentence in refusals:
        if refused:
            raise UsageError(sentence)
    if args.amp == 'auto':  # FSDP2's slices and a pipeline's stages refuse fp16's loss scale
        piped = args.pipeline_stages > 1 or args.microbatches > 1
        args.amp = choice.amp(half_refused=args.shard in plan.FSDP_MODES or piped)
    args.pin_memory = not cpu if args.pin_memory is None else args.pin_memory  # pinned: CUDA's
    if args.channels_last is None:  # FSDP2 slices contiguous parameters only (dist.plan refuses it)
        args.channels_last = choice.channels_last(sharded=args.shard in plan.FSDP_MODES)
    if args.num_workers > 0:
        args.prefetch_factor = args.prefetch_factor or 2
        args.persistent_workers = True if args.persistent_workers is None else args.persistent_workers
    args.base_lr = args.base_lr or BASE_LR[args.optimizer]
    if args.res_start is not None and args.res_end_epoch is None:
        args.res_end_epoch = max(0, args.epochs - 1)
    if args.wd_norm_bias is None:
        args.wd_norm_bias = args.optimizer not in ADAPTIVE
    if args.lr is None:  # Goyal et al. 2017: the learning rate grows with the global batch
        gb = args.batch_size * world_size // args.pipeline_stages * args.accum_steps  # global batch
        args.lr = 10.0 if args.findlr else args.base_lr * gb / 256
    # wandb is optional where a cluster module lacks it: a full run then logs to metrics.jsonl only
    # (config.json says 'off'); asked for by name, its absence is refused before any work
    wandb = importlib.util.find_spec('wandb') is not None
    if args.wandb in ('offline', 'online') and not wandb:
        raise UsageError(f'--wandb {args.wandb} needs the wandb package, which this Python does not '
                         f'have; pip install wandb, or pass --wandb off.')
    if args.wandb is None:
        args.wandb = 'offline' if wandb and not args.test else 'off'
    return args


def parse_or_exit(argv=None):
    """`python dlojz.py`'s first step, before torch is imported: --help (exit 0), a bad flag (exit
    2, the parser's sentence) or a refused combination (exit 2, errors.UsageError's line) end here.
    -> args."""
    args = get_args_parser().parse_args(argv)
    try:
        return check_flags(args)
    except UsageError as e:
        print(f'dlojz: {e.label}: {e}', file=sys.stderr, flush=True)
        raise SystemExit(e.exit_code) from None
