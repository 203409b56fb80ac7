"""The training loader on its own, and the loader doctor.

    python dlojz.py --loader-only --num-workers 8 --test-nsteps 100   # the loader's throughput, no model
    python dlojz.py --tune-loader --arch resnet50 -b 256              # is the run loader-bound? what to set

--loader-only runs what feeds a training step (the same sampler, decode, augmentation, collation,
pinned memory, and the host-to-device copy on a GPU) and nothing else. --tune-loader measures the
compute ceiling (the same run on --fake-data: no decode) and the loader alone over a sweep of
workers x prefetch x pinned memory, each trial in its own process (its own memory peak), and says
which one bounds the run."""
import argparse
import glob
import math
import os
import sys
import time

import torch

import dlojz_chrono as chrono
from dlojzlib import SCRIPT, compat, formats, readers, tables
from dlojzlib.data.datasets import build_data
from dlojzlib.dist import launch, starting
from dlojzlib.environment import read
from dlojzlib.errors import DataError, UsageError
from dlojzlib.flags import get_args_parser
from dlojzlib.host import host_memory, provenance, usable_cores
from dlojzlib.modes.trial import run_for_summary
from dlojzlib.record.log import SUMMARY_VERSION, Console, write_json

# ------------------------------------------------------------------------------------------ host memory

def _children(pid='self'):
    pids = []
    for path in glob.glob(f'/proc/{pid}/task/*/children'):
        try:
            with open(path) as f:
                pids += [int(p) for p in f.read().split()]
        except OSError:
            continue
    return pids


def main_and_workers_memory():
    """-> (this process's VmHWM, the sum of its children's: the loader workers). Forked workers
    share the parent's pages until they write them, and each VmHWM counts those shared pages again:
    the sum is an upper bound, which is what a memory budget needs."""
    peak = lambda pid: host_memory(pid)['host_peak_rss_bytes'] or 0
    return host_memory()['host_peak_rss_bytes'], sum(map(peak, _children()))


def _cgroup_limit(proc='/proc/self/cgroup', fs='/sys/fs/cgroup'):
    """This process's cgroup memory limit in bytes (v2 memory.max, v1 memory.limit_in_bytes), or
    None."""
    try:
        with open(proc) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(':', 2)
        for name, sub in (('memory.max', ''), ('memory.limit_in_bytes', 'memory')):
            if (controllers == '' and not sub) or (sub and sub in controllers.split(',')):
                try:
                    with open(os.path.join(fs, sub, path.lstrip('/'), name)) as f:
                        value = f.read().strip()
                except OSError:
                    continue
                if value.isdigit() and int(value) < 2**60:  # 'max' or a huge v1 number: no limit
                    return int(value)
    return None


def memory_budget(environ=os.environ, cgroup=_cgroup_limit, meminfo='/proc/meminfo'):
    """Host memory one task may use, bytes: the smallest of the job's cgroup limit, Slurm's --mem
    (SLURM_MEM_PER_NODE, MiB) or --mem-per-cpu x the node's CPUs, and the available memory, divided
    by the tasks on the node (each runs its own loader)."""
    per_cpu = read('SLURM_MEM_PER_CPU', environ, 0) * read('SLURM_CPUS_ON_NODE', environ, 0)
    limits = [cgroup(), read('SLURM_MEM_PER_NODE', environ, 0) * 2**20, per_cpu * 2**20]
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith('MemAvailable:'):
                    limits.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    limits = [v for v in limits if v]
    tasks = read('SLURM_NTASKS_PER_NODE', environ, [1])[0]  # '4'; of '4(x2),3', the first node's
    return min(limits) // tasks if limits else None


# ------------------------------------------------------------------------------------------ --loader-only

def measure(loader, steps, warmup, device, non_blocking=True, set_epoch=lambda epoch: None,
            clock=time.perf_counter, synchronize=None):
    """Draw `steps` batches (across epochs when one is too short), as a training loop would with a
    model that takes no time. -> dict: images per second over the batches after `warmup`, the wait
    for each batch, the first batch's (worker start-up included), host memory. On a GPU each batch
    is taken onto the device as the step takes it (copied; with --decode gpu decoded, cropped and
    resized there), and the device is synchronised where the steady window starts and where it
    ends (`synchronize`, default torch.cuda.synchronize: every stream of the device, the decoder's
    included), so that the window holds the device work of its own batches, all of it."""
    cuda = device.type == 'cuda'
    sync = synchronize or ((lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None))
    waits, images = [], []
    epoch, before = 0, 0  # before: the batches drawn before this epoch
    set_epoch(epoch)
    it = iter(loader)
    t = t0 = clock()
    t_steady = None
    while len(waits) < steps:
        try:
            x, y = next(it)
        except StopIteration:
            if len(waits) == before:  # a whole epoch without a batch: so would the next ones be
                raise no_batch(epoch)
            epoch, before = epoch + 1, len(waits)
            set_epoch(epoch)
            it = iter(loader)
            continue
        if cuda:
            x, y = x.to(device, non_blocking=non_blocking), y.to(device, non_blocking=non_blocking)
        now = clock()
        waits.append(now - t)
        images.append(len(y))
        t = now
        if len(waits) == warmup:
            sync()  # the warm-up's device work stays out of the window
            t_steady = t = clock()
    sync()
    end = clock()
    main_mem, workers_mem = main_and_workers_memory()  # before the iterator (and its workers) goes
    del it
    steady_images = sum(images[warmup:])
    elapsed = end - (t_steady if t_steady is not None else t0)
    return {'images_per_second': steady_images / elapsed if elapsed > 0 else None,
            'steps': len(waits), 'warmup_steps': warmup, 'images': sum(images), 'epochs_started': epoch + 1,
            'first_batch_s': waits[0], 'wait_mean_s': sum(waits[warmup:]) / max(1, len(waits) - warmup),
            'total_s': end - t0, 'host_peak_main_bytes': main_mem, 'host_peak_workers_bytes': workers_mem}


def no_batch(epoch):
    """Why a loader gave no batch in a whole epoch: a stop signal ended its start (the training
    loader of a lone process, data.workers: the stop is the command's, dist.starting), or it has
    none to give."""
    stop = launch.stop_received()
    if stop:
        return starting.Stopped(stop)
    return DataError(f'the loader gave no batch in epoch {epoch + 1}: nothing to time; check that '
                     f'the training set holds a batch (-b) of images.')


def loader_warmup(warmup_steps, num_workers, prefetch_factor):
    """The batches --loader-only leaves out of its rate: --warmup-steps, or all that the workers
    load at once when they start (measured by review: 16 workers read 2.7x their true throughput
    when their first batches were counted), whichever is more; prefetch 2 where not given (torch's
    DataLoader default)."""
    prefetch = (prefetch_factor or 2) if num_workers > 0 else 0
    return max(warmup_steps, num_workers * prefetch)


def loader_only(args, dist, device, say):
    """--loader-only: measure the training loader, print its line, write summary.json (mode
    'loader')."""
    data = build_data(args, dist, log=say, device=device)  # its batches as the training loop takes them
    say(f'Data: {data.source.kind} {data.source.root} ({data.source.reason}); {data.n_train} train images, '
        f'{len(data.classes)} classes')
    # The batches a training run of the same flags reads: --test-nsteps steps of --accum-steps
    # batches each, within its -e epochs (from epoch 0, across an epoch's end where training crosses
    # it), the first `warmup` left out of the rate. Drawing more (an epoch restart training never
    # makes) measured another loader.
    per_epoch, accum = len(data.train_steps), data.accum  # optimizer steps per epoch
    warmup = loader_warmup(args.warmup_steps, args.num_workers, args.prefetch_factor)
    steps = min(args.test_nsteps or 50, args.epochs * per_epoch) * accum
    if warmup >= steps:
        asked = args.test_nsteps or 50
        per = f'{per_epoch} steps of {accum} batches' if accum > 1 else f'{per_epoch}'
        raise UsageError(f'--loader-only reads the {steps} batches a training run of these flags '
                         f'reads ({args.epochs} epoch(s) of {per}, --test-nsteps {asked}) and '
                         f'leaves its first {warmup} out of the rate: nothing would be timed; give '
                         f'more epochs (-e) or images, or fewer --num-workers.')
    write_json(os.path.join(args.output_dir, 'config.json'), vars(args))
    say(f'>>> Loader only: {steps} batches of {args.batch_size}, the first {warmup} left out of '
        f'the rate, {args.num_workers} workers, prefetch {args.prefetch_factor}, pin memory '
        f'{args.pin_memory}, '
        + (f'DALI ({args.num_workers or 1} threads)' if args.loader == 'dali' else f'decode {args.decode}')
        + f', on {device}')
    m = measure(data.train_batches, steps, warmup, device, args.non_blocking, data.set_epoch)
    workers = args.num_workers
    loader = {**m, 'num_workers': workers, 'prefetch_factor': args.prefetch_factor, 'pin_memory': args.pin_memory,
              'persistent_workers': args.persistent_workers, 'batch_size': args.batch_size, 'decode': args.decode,
              'image_size': args.image_size, 'device': str(device),
              'images_per_second_per_worker': m['images_per_second'] / max(1, workers)
              if m['images_per_second'] else None}
    per = f'{loader["images_per_second_per_worker"]:.1f} per worker' if workers else 'in the main process'
    say(f'>>> Loader throughput: {m["images_per_second"]:.1f} images/second ({per})')
    say(f'>>> Loader wait per batch: {m["wait_mean_s"]:.4f} s; first batch {m["first_batch_s"]:.4f} s')
    peak = (m['host_peak_main_bytes'] or 0) + (m['host_peak_workers_bytes'] or 0)
    say(f'>>> Host peak memory (VmHWM, main + workers): {peak / 2**30:.2f} GiB')
    summary = {'version': SUMMARY_VERSION, 'status': 'completed', 'error': None, 'mode': 'loader',
               'config': vars(args), 'provenance': provenance(device, dist), 'world_size': dist.world_size,
               'data': {'source': data.source.kind, 'root': data.source.root, 'reason': data.source.reason,
                        'classes': len(data.classes), 'train_images': data.n_train,
                        'batches_per_epoch': len(data.train_loader), 'bad_images_skipped': data.bad_images,
                        'shard_file_opens': data.file_opens, 'gpu_decode': data.gpu_decode,
                        'fast_decode': data.fast_decode, 'handover': data.handover, 'dali': data.dali,
                        'staging': data.staging},
               'loader': loader}
    write_json(os.path.join(args.output_dir, 'summary.json'), summary)
    return summary


# ------------------------------------------------------------------------------------------ --tune-loader

# flags the doctor sets itself in each trial
_TRIAL_FLAGS = ('tune_loader', 'loader_only', 'output_dir', 'run_name', 'num_workers', 'prefetch_factor',
                'pin_memory', 'persistent_workers', 'test', 'test_nsteps', 'overwrite', 'resume', 'fake_data',
                'decode', 'loader')


def to_argv(parser, values):
    """The command-line flags that give `values` (a dict of raw, unresolved flag values) with
    `parser`: those that differ from their defaults, leaving out `_TRIAL_FLAGS`."""
    argv = []
    for action in compat.parser_actions(parser):
        if not action.option_strings or action.dest in _TRIAL_FLAGS or action.dest not in values:
            continue
        value = values[action.dest]
        if value == action.default:
            continue
        flag = max(action.option_strings, key=len)  # the long form
        if isinstance(action, argparse.BooleanOptionalAction):  # its strings: --x, then --no-x
            argv.append(action.option_strings[0 if value else 1])
        elif isinstance(action, argparse._StoreTrueAction):
            argv.append(flag)
        else:
            argv += [flag, str(value)]
    return argv


def sweep(usable, cuda, max_workers=16, decode='fast', dali=False):
    """The trials: workers 0, 1, 2, 4, ... up to the usable cores (and the usable cores), prefetch 2
    and 4 with workers, pinned memory on and off on a GPU (it only matters for the copy to one);
    with the most workers, the other host decode path too, and nvJPEG on a GPU; with `dali`
    (installed), --loader dali with as many threads (its 'decode' is 'dali' in the table)."""
    top = min(usable, max_workers)
    workers = sorted({0, top} | {2 ** k for k in range(0, 8) if 2 ** k <= top})
    others = [d for d in ('fast', 'pil', 'gpu') if d != decode and (d != 'gpu' or cuda)]
    others = others if decode != 'gpu' else others[:1]  # from the GPU path, the fast host path is the other one
    trials = []
    for w in workers:
        for d in ([decode, *others] if w == top else [decode]):
            for p in ([None] if w == 0 else [2, 4]):
                for pin in ([False, True] if cuda else [None]):  # None: the flag is not given (refused on CPU)
                    trials.append({'num_workers': w, 'prefetch_factor': p, 'pin_memory': pin, 'decode': d})
    if dali:
        trials.append({'num_workers': top, 'prefetch_factor': None, 'pin_memory': None, 'decode': 'dali'})
    return trials


def trial_argv(trial):
    if trial['decode'] == 'dali':
        return ['--num-workers', str(trial['num_workers']), '--loader', 'dali']
    argv = ['--num-workers', str(trial['num_workers']), '--decode', trial['decode']]
    if trial['pin_memory'] is not None:
        argv.append('--pin-memory' if trial['pin_memory'] else '--no-pin-memory')
    if trial['prefetch_factor']:
        argv += ['--prefetch-factor', str(trial['prefetch_factor'])]
    return argv


# What the doctor reads of a trial's summary.json (formats.SUMMARY, declared once): a loader
# trial's measure, and the ceiling run's throughput
LOADER_TRIAL_SUMMARY = readers.require(formats.SUMMARY, *(f'loader.{k}' for k in (
    'images_per_second', 'images_per_second_per_worker', 'wait_mean_s', 'first_batch_s')),
    'loader', 'data', 'data.classes')
CEILING_SUMMARY = readers.require(formats.SUMMARY, 'timing', 'timing.train_throughput')


def _run(cmd, out, shape):
    """One trial in its own process -> its summary.json (of `shape`), or a UsageError that says
    what failed."""
    summary, code, tail = run_for_summary(cmd, out)
    if code != 0 or summary is None or summary.get('status') != 'completed':
        raise UsageError(f'a --tune-loader trial failed (exit {code}: {tail}); its command: '
                         f'{" ".join(cmd[1:])}')
    try:
        return shape.check(summary, '')
    except readers.Wrong as e:
        raise UsageError(f'a --tune-loader trial\'s {os.path.join(out, "summary.json")} {e}, not '
                         f'what this dlojz writes; run --tune-loader again with this dlojz.py '
                         f'(its command: {" ".join(cmd[1:])}).') from None


def verdict(trials, ceiling_ips, budget):
    """The best trial within the memory budget against the compute ceiling (images per second). A
    training run fed at the loader's rate L by a model that takes C would wait for data 1 - L/C of
    each step (the workers load while it computes) and compute L/C of it: the verdict is the
    largest of those shares (dlojz_chrono.verdict), the word the run's own '>>> Bound by' line
    would give."""
    fits = [t for t in trials if budget is None or t['host_peak_bytes'] <= budget]
    best = max(fits or trials, key=lambda t: t['images_per_second'])
    per_worker = max((t['images_per_second_per_worker'] for t in trials if t['num_workers'] > 0), default=None)
    v = {'best': best, 'ceiling_images_per_second': ceiling_ips, 'within_budget': bool(fits),
         'loader_over_ceiling': best['images_per_second'] / ceiling_ips,
         'workers_for_ceiling': math.ceil(ceiling_ips / per_worker) if per_worker else None}
    step = 1 / min(best['images_per_second'], ceiling_ips)  # seconds per image, both at work
    v['data_wait_share'] = 1 - 1 / ceiling_ips / step
    v['bound'] = chrono.verdict(step, 1 / ceiling_ips, step - 1 / ceiling_ips)
    return v


def verdict_lines(v):
    b, ratio = v['best'], v['loader_over_ceiling']
    flags = ' '.join(trial_argv(b))
    lines = [f">>> Compute ceiling (--fake-data): {v['ceiling_images_per_second']:.1f} images/second",
             f">>> Best loader setting measured: {flags}: {b['images_per_second']:.1f} images/second"
             + ('' if v['within_budget'] else ' (no setting fitted the memory budget: the fastest is shown)')]
    need = v['workers_for_ceiling']
    feed = f'; at the best rate per worker, about {need} workers (cores) would feed it' if need \
        else ''
    share = v['data_wait_share']
    wait = f"data wait {share:.0%} of each step, compute {1 - share:.0%}"
    if v['bound'] == 'loader':
        lines.append(f">>> Verdict: loader-bound ({wait}): the model could take {1 / ratio:.2f}x "
                     f"what the best setting feeds{feed}.")
    elif ratio < 1:  # the model still waits, less than it computes
        lines.append(f">>> Verdict: compute-bound ({wait}): use {flags}; the model could take "
                     f"{1 / ratio:.2f}x what it feeds{feed}.")
    else:
        lines.append(f'>>> Verdict: compute-bound: the best setting feeds {ratio:.2f}x what the model takes; '
                     f'use {flags}.')
    return lines


def trials_table(trials):
    """The course's DataLoader-trials table, one row per trial."""
    headers = ['workers', 'pin', 'prefetch', 'decode', 'img/s', 'img/s per worker', 'load s', 'first s',
               'host mem GiB']
    cells = [[t['num_workers'], '-' if t['pin_memory'] is None else 'T' if t['pin_memory'] else 'F',  # '-': CPU
              t['prefetch_factor'] or '-', t['decode'], f"{t['images_per_second']:.1f}",
              f"{t['images_per_second_per_worker']:.1f}", f"{t['wait_mean_s']:.4f}", f"{t['first_batch_s']:.3f}",
              f"{t['host_peak_bytes'] / 2**30:.2f}"] for t in trials]
    return tables.markdown(headers, cells)


def tune_loader(args, raw, parser, dist, device, say, python=sys.executable, script=None):
    """--tune-loader: the trials, then the ceiling, each a dlojz process; tune-loader.json/.csv in
    --output-dir; -> the result dict. raw: the flags as parsed, before defaults were resolved."""
    script = script or SCRIPT
    base = to_argv(parser, raw) + (['--overwrite'] if args.overwrite else [])  # its trials' folders too
    steps = args.test_nsteps or 30
    from dlojzlib.data import dali
    trials = sweep(usable_cores(), device.type == 'cuda', decode=args.decode, dali=dali.dali() is not None)
    budget = memory_budget()
    say(f'Loader doctor: {len(trials)} loader trials of {steps} batches, then the compute ceiling on --fake-data; '
        f'host memory budget ' + (f'{budget / 2**30:.1f} GiB' if budget else 'unknown'))
    results = []
    for i, trial in enumerate(trials, 1):
        out = os.path.join(args.output_dir, f"loader-w{trial['num_workers']}-p{trial['prefetch_factor'] or 0}"
                                            f"-pin{int(bool(trial['pin_memory']))}-{trial['decode']}")
        # `steps` timed after the trial's own warm-up, counted as the trial counts it (a DALI trial
        # gives no prefetch); as many epochs as batches, so that a small dataset's trial crosses
        # epochs instead of running out (the trials compare with each other)
        drawn = str(steps + loader_warmup(args.warmup_steps, trial['num_workers'],
                                          trial['prefetch_factor']))
        s = _run([python, script, *base, '--loader-only', '--test-nsteps', drawn, '--epochs', drawn,
                  *trial_argv(trial), '--output-dir', out], out, LOADER_TRIAL_SUMMARY)
        m = s['loader']
        row = {**trial, 'images_per_second': m['images_per_second'],
               'images_per_second_per_worker': m['images_per_second_per_worker'], 'wait_mean_s': m['wait_mean_s'],
               'first_batch_s': m['first_batch_s'],
               'host_peak_bytes': (m['host_peak_main_bytes'] or 0) + (m['host_peak_workers_bytes'] or 0),
               'classes': s['data']['classes'], 'dir': out}
        results.append(row)
        say(f"trial {i}/{len(trials)}: {' '.join(trial_argv(trial))}: {row['images_per_second']:.1f} images/second")
    out = os.path.join(args.output_dir, 'ceiling')
    s = _run([python, script, *base, '--fake-data', '--fake-classes', str(results[0]['classes']), '--test-nsteps',
              str(steps), '--output-dir', out], out, CEILING_SUMMARY)
    t = s['timing']
    ceiling = t.get('gpu_throughput') or t['train_throughput']  # the device's clock on a GPU
    v = verdict(results, ceiling, budget)
    result = {'version': SUMMARY_VERSION, 'steps_per_trial': steps, 'device': str(device),
              'usable_cores': usable_cores(), 'host_memory_budget_bytes': budget, 'trials': results,
              'ceiling': {'images_per_second': ceiling, 'dir': out, 'clock': t.get('clock')}, 'verdict': v}
    write_json(os.path.join(args.output_dir, 'tune-loader.json'), result)
    write_json(os.path.join(args.output_dir, 'summary.json'), {
        'version': SUMMARY_VERSION, 'status': 'completed', 'error': None, 'mode': 'tune-loader',
        'config': vars(args), 'provenance': provenance(device, dist), 'tune_loader': result})
    tables.write_csv(os.path.join(args.output_dir, 'tune-loader.csv'), [k for k in results[0] if k != 'dir'],
                     results)
    for line in trials_table(results) + verdict_lines(v):
        say(line)
    return result


def loader_mode(args, raw, dist, device):
    """--loader-only and --tune-loader as dlojz.py runs them, in the run folder it has taken: no
    model is built."""
    say = Console(dist.is_main)
    if args.loader_only:  # it writes config.json once it has a window to time
        result = loader_only(args, dist, device, say)
    else:
        write_json(os.path.join(args.output_dir, 'config.json'), vars(args))
        result = tune_loader(args, raw, get_args_parser(), dist, device, say)
    say(f'Run written to {args.output_dir}')
    return result


# ------------------------------------------------------------------------------- decode benchmark

def classic_loader(root, size, batch_size, workers):
    """The classic torchvision pipeline: ImageFolder + PIL + RandomResizedCrop + flip + ToTensor +
    Normalize."""
    import torchvision
    from torchvision import transforms as T
    tf = T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.ToTensor(),
                    T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    ds = torchvision.datasets.ImageFolder(os.path.join(root, 'train'), tf)
    return torch.utils.data.DataLoader(ds, batch_size=batch_size, shuffle=True, num_workers=workers,
                                       persistent_workers=False)


def compare_decode(root, size=224, batch_size=64, steps=20, warmup=2, repeats=5, workers=1, shards=None):
    """Images per second of the classic pipeline and of dlojz's training loader (--decode pil and
    fast; and fast from `shards`, a prepared copy of root), `workers` workers each (1: per core),
    alternated `repeats` times -> {name: [img/s per repeat]}."""
    from dlojzlib.data.datasets import DataLoader, EpochSampler, FastTrainTransform, ImageFolderDataset, ShardDataset, \
        TrainTransform, scan_imagefolder
    from dlojzlib.data.shards import load_index
    _, train, _ = scan_imagefolder(root)
    datasets = {'dlojz-pil': lambda: ImageFolderDataset(train, TrainTransform(size), seed=0),
                'dlojz-fast': lambda: ImageFolderDataset(train, FastTrainTransform(size), seed=0)}
    if shards:
        datasets['dlojz-fast-shards'] = lambda: ShardDataset(shards, *load_index(shards)[1]['train'],
                                                             FastTrainTransform(size), seed=0)
    loaders = {'classic': lambda: classic_loader(root, size, batch_size, workers)}
    for name, make_ds in datasets.items():
        def make(make_ds=make_ds):
            ds = make_ds()
            return DataLoader(ds, batch_size=batch_size, sampler=EpochSampler(ds, 0),
                              num_workers=workers)
        loaders[name] = make
    results = {k: [] for k in loaders}
    for _ in range(repeats):
        for name, make in loaders.items():
            results[name].append(measure(make(), steps + warmup, warmup, torch.device('cpu'))['images_per_second'])
    return results


def compare_main(argv=None):
    """`python dlojz_loader.py ROOT`: the classic loader against dlojz's decode paths, per worker."""
    import statistics
    p = argparse.ArgumentParser(description='The classic torchvision loader against dlojz\'s decode paths, '
                                            'per worker (one worker each by default: per core).')
    p.add_argument('root', help='ImageFolder root (train/<class>/...), e.g. the synthetic dataset')
    p.add_argument('--image-size', type=int, default=224)
    p.add_argument('-b', '--batch-size', type=int, default=64)
    p.add_argument('--steps', type=int, default=20)
    p.add_argument('--repeats', type=int, default=5)
    p.add_argument('--workers', type=int, default=1)
    p.add_argument('--shards', default=None, help='a `dlojz_data.py prepare` copy of root, measured too')
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    res = compare_decode(a.root, a.image_size, a.batch_size, a.steps, repeats=a.repeats, workers=a.workers,
                         shards=a.shards)
    base = statistics.median(res['classic'])
    for name, v in res.items():
        m = statistics.median(v)
        print(f'{name:10s} median {m:7.1f} img/s ({" ".join(f"{x:.0f}" for x in v)}): {m / base:.2f}x classic')


if __name__ == '__main__':
    compare_main()
