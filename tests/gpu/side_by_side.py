"""dlojz beside torchvision's reference training script on the same GPU: ResNet-50, the same batch,
the same JPEGs, images per second over 100 steps after 20 steps of warm-up, each run a process of
its own:

- torchvision's references/classification/train.py with its own options (--amp: fp16 with a
  GradScaler; NCHW; PIL decoding and float normalisation in the workers), from an untracked copy
  (--reference; never committed: tests/gpu/README.md says how to get one);
- dlojz with the reference's settings: --amp fp16 --no-channels-last --decode pil, the same workers;
- dlojz with its own best flags: the tuner's recommendation where a tune.json is given (--tune-json;
  its batch too), else --best (default: --amp bf16 --channels-last --decode gpu --compile
  --compile-mode reduce-overhead: the GPU's JPEG decoder and CUDA graphs, marked as not tuned).

Both scripts count the host time of each step, data wait included: the reference's `time` field (the
mean of the last 20 iterations, printed every --print-freq 20 iterations, so that its windows tile
the epoch), dlojz's steady_images_per_s (images / total steady time). A rate is images / time, never
a mean of rates.

The data: the synthetic JPEG dataset (ImageNet's sizes and ~110 KB files), --unique distinct images
per class, each file linked as often as an epoch of 1 + warm-up + steps batches needs (generating
57,000 JPEGs would take minutes; every file a reader opens is still a whole JPEG it decodes).

    python tests/gpu/side_by_side.py > side.md    # a GPU node; about 3 min on an H100 (estimated)
    python tests/gpu/side_by_side.py --device cpu --arch resnet18 --image-size 64 --batch 8 \\
        --steps 20 --warmup 20 --workers 2 --unique 8     # a dry run of the procedure on a CPU"""
import argparse
import datetime
import json
import math
import os
import re
import shlex
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from dlojzlib.dist import launch  # noqa: E402 - from the repository root
from dlojzlib.modes.trial import run_for_summary  # noqa: E402
CLASSES, VAL_PER_CLASS = 10, 16
WINDOW = 20  # iterations: the reference's SmoothedValue window
GOAL_IMG_S = 7000  # MLPerf Training v4.0, ResNet-50, per H100 (MXNet with DALI)
LINE = re.compile(r'Epoch: \[0\]\s+\[\s*(\d+)/(\d+)\].*?\btime: ([0-9.]+)')


def get_args(argv=None):
    cores = len(os.sched_getaffinity(0))
    p = argparse.ArgumentParser(description="dlojz beside torchvision's reference train.py; "
                                'prints a Markdown table')
    p.add_argument('--steps', type=int, default=100, help='measured steps, a multiple of 20')
    p.add_argument('--warmup', type=int, default=20, help='steps before them, a multiple of 20')
    p.add_argument('--batch', type=int, default=256, help='images per step')
    p.add_argument('--workers', type=int, default=max(1, min(16, cores - 1)),
                   help='loader worker processes')
    p.add_argument('--arch', default='resnet50')
    p.add_argument('--image-size', type=int, default=224,
                   help='training crop (validation: this, resized x 8/7)')
    p.add_argument('--device', default='cuda')
    p.add_argument('--unique', type=int, default=256, help='distinct JPEGs per class')
    tmp = os.environ.get('TMPDIR', '/tmp')
    p.add_argument('--data', default=os.path.join(tmp, 'dlojz-side-by-side'),
                   help='where the dataset is made (reused when complete)')
    p.add_argument('--reference', default=os.path.join(ROOT, '.ref', 'classification', 'train.py'),
                   help="torchvision's references/classification/train.py, with its folder's files")
    p.add_argument('--best', default='--amp bf16 --channels-last --decode gpu --compile '
                   '--compile-mode reduce-overhead',
                   help="dlojz's flags for its best row when no --tune-json is given")
    p.add_argument('--tune-json', default=None, help='a tune.json of `dlojz.py --tune` on this '
                   'GPU: its recommended command is the best row')
    p.add_argument('--out', default=None, help='folder for the logs and run folders (default '
                   'runs/side-<time>)')
    args = p.parse_args(argv)
    if args.steps % WINDOW or args.warmup % WINDOW or args.steps <= 0:
        p.error(f'--steps and --warmup must be multiples of {WINDOW} (the reference prints a mean '
                f'over {WINDOW} iterations), --steps above 0')
    if not os.path.exists(args.reference):
        p.error(f"no reference script at {args.reference}: copy torchvision's "
                f'references/classification folder there (tests/gpu/README.md)')
    args.gpu = args.device.startswith('cuda')
    return args


def make_dataset(args):
    """-> the ImageFolder root (train/, val/), its epoch holding every measured step: the
    reference's epoch has no step limit."""
    per_class = math.ceil((args.warmup + args.steps + 1) * args.batch / CLASSES) + 1
    return linked_dataset(args.data, args.unique, per_class)


def linked_dataset(data, unique, per_class, val_per_class=VAL_PER_CLASS, log=None):
    """-> the ImageFolder root (train/, val/) of CLASSES classes under `data`: `unique` synthetic
    JPEGs per class, generated once on every usable core, each hard-linked as often as per_class
    files need (val_per_class distinct ones for validation). The distinct JPEGs are kept apart
    (unique-...), so that another count of links (bench.py's, this script's) reuses them."""
    from dlojzlib.data.synthetic import ensure_synthetic_dataset
    root = os.path.join(data, f'c{CLASSES}-u{unique}-n{per_class}-v{val_per_class}')
    marker = os.path.join(root, 'COMPLETE')
    if os.path.exists(marker):
        return root
    source = os.path.join(data, f'unique-c{CLASSES}-u{unique}-v{val_per_class}')
    ensure_synthetic_dataset(source, CLASSES, unique, val_per_class, seed=0,
                             workers=len(os.sched_getaffinity(0)), log=log or say)
    for split, n in (('train', per_class), ('val', val_per_class)):
        for name in sorted(os.listdir(os.path.join(source, split))):
            files = sorted(os.listdir(os.path.join(source, split, name)))
            folder = os.path.join(root, split, name)
            os.makedirs(folder, exist_ok=True)
            for i in range(n):
                file = files[i % len(files)]
                dst = os.path.join(folder, f'{i:06d}-{file}')
                if not os.path.exists(dst):
                    os.link(os.path.join(source, split, name, file), dst)
    open(marker, 'w').close()
    return root


def say(text):
    print(text, file=sys.stderr, flush=True)


def reference_rate(log_text, batch, warmup, steps):
    """Images per second over iterations warmup+1 .. warmup+steps from the reference's log: each
    line printed at iteration i holds the mean time of iterations i-19..i; the windows ending at
    warmup+20, +40, ... tile the measured steps. -> (img/s, how many windows were found)."""
    means = {int(i): float(t) for i, _, t in LINE.findall(log_text)}
    ends = range(warmup + WINDOW, warmup + steps + 1, WINDOW)
    found = [means[i] for i in ends if i in means]
    if len(found) != len(ends):
        return None, len(found)
    return batch * steps / (WINDOW * sum(found)), len(found)


def reference_row(args, data, out):
    size = args.image_size
    cmd = [sys.executable, args.reference, '--data-path', data, '--model', args.arch,
           '--batch-size', str(args.batch), '--epochs', '1', '--workers', str(args.workers),
           '--print-freq', str(WINDOW), '--output-dir', '', '--device', args.device,
           '--train-crop-size', str(size), '--val-crop-size', str(size),
           '--val-resize-size', str(size * 8 // 7), *(['--amp'] if args.gpu else [])]
    say(f'$ {shlex.join(cmd)}')
    log = os.path.join(out, 'reference.log')
    with open(log, 'w') as f:
        code = subprocess.run(cmd, cwd=os.path.dirname(args.reference), stdout=f,
                              stderr=subprocess.STDOUT).returncode
    with open(log) as f:
        rate, windows = reference_rate(f.read(), args.batch, args.warmup, args.steps)
    why = None if code == 0 and rate else \
        f'exit {code}, {windows} of {args.steps // WINDOW} windows in its log'
    return {'run': "torchvision's reference train.py",
            'flags': f"{'--amp, ' * args.gpu}NCHW, PIL, {args.workers} workers",
            'precision': 'fp16 (GradScaler)' if args.gpu else 'fp32', 'img_s': rate, 'bound': '',
            'why': why}


def dlojz_row(args, data, out, name, flags, label):
    run_dir = os.path.join(out, name)
    size = args.image_size
    cmd = [sys.executable, os.path.join(ROOT, 'dlojz.py'), '--data-dir', data, '--arch', args.arch,
           '-b', str(args.batch), '--num-workers', str(args.workers), '--image-size', str(size),
           '--val-image-size', str(size), '--val-resize', str(size * 8 // 7),
           '--device', args.device, *flags, '--test-nsteps', str(args.warmup + args.steps),
           '--warmup-steps', str(args.warmup), '-e', '100', '--output-dir', run_dir]
    say(f'$ {shlex.join(cmd)}')
    summary, code, last_line = run_for_summary(cmd, run_dir)
    summary = summary or {}
    t = summary.get('timing') or {}
    rate = t.get('steady_images_per_s')
    completed = code == 0 and summary.get('status') == 'completed' and rate
    amp = (summary.get('config') or {}).get('amp', '?')
    return {'run': label, 'flags': ' '.join(flags), 'precision': 'fp32' if amp == 'off' else amp,
            'img_s': rate, 'bound': t.get('bound', ''),
            'why': None if completed else f'exit {code}: {last_line}'}


def best_flags(args):
    """-> (flags, where they come from) of dlojz's best row: a tuner's precision, layout, compile
    and batch."""
    if not args.tune_json:
        return shlex.split(args.best), 'not tuned: --best'
    with open(args.tune_json) as f:
        command = json.load(f)['recommended']['command']
    flags = shlex.split(command)[2:]  # after `python dlojz.py`
    keep, skip = [], {'--data-dir', '--arch', '--output-dir', '--num-workers'}
    it = iter(flags)
    for flag in it:
        if flag in skip:
            next(it, None)
        else:
            keep.append(flag)
    return keep, f'the tuner\'s recommendation ({os.path.basename(args.tune_json)})'


def table(rows, args, host):
    ref = rows[0]['img_s']
    command = shlex.join(['python', 'tests/gpu/side_by_side.py', *sys.argv[1:]])
    day = datetime.date.today().isoformat()
    lines = [f"## {day} — dlojz beside torchvision's reference, {host}",
             '', f"`{command}`: {args.arch}, {args.batch} images per step, {args.workers} loader "
             f"workers, the synthetic JPEGs ({args.unique} distinct per class, linked); images / "
             f"host time over {args.steps} steps after {args.warmup}. Goal: 1.5x the reference and "
             f"{GOAL_IMG_S} img/s per H100 (MLPerf v4.0).", '',
             '| run | flags | precision | img/s | x reference | of 7000 | bound |',
             '|---|---|---|---:|---:|---:|---|']
    for r in rows:
        head = f"| {r['run']} | `{r['flags']}` | {r['precision']} |"
        if r['why']:
            lines.append(f"{head} failed ({r['why']}) | | | |")
            continue
        x = f"{r['img_s'] / ref:.2f}" if ref else '–'
        goal = f"{r['img_s'] / GOAL_IMG_S:.0%}"
        lines.append(f"{head} {r['img_s']:.0f} | {x} | {goal} | {r['bound']} |")
    return lines


def main(argv=None):
    args = get_args(argv)
    import torch
    if args.gpu and not torch.cuda.is_available():
        sys.exit('side_by_side.py: PyTorch sees no CUDA GPU; run it on a GPU node, or pass '
                 '--device cpu for a dry run.')
    stamp = datetime.datetime.now().strftime('%Y%m%d-%H%M%S')
    out = args.out or os.path.join(ROOT, 'runs', f'side-{stamp}')
    os.makedirs(out, exist_ok=True)
    # each run alone, inside a job too (the reference reads SLURM_PROCID as a distributed launch)
    for name in launch.launch_variables():
        del os.environ[name]
    t0 = time.perf_counter()
    data = make_dataset(args)
    say(f'dataset {data} ready after {time.perf_counter() - t0:.0f} s')
    best, source = best_flags(args)
    as_reference = ['--amp', 'fp16' if args.gpu else 'off', '--no-channels-last', '--decode', 'pil']
    if not args.gpu:  # the GPU's decoder and CUDA graphs do not run on a CPU: the dry run's
        best = [f for f in best if f not in ('--compile', '--compile-mode', 'reduce-overhead')]
        best = ['fast' if f == 'gpu' else f for f in best]
    runs = [lambda: reference_row(args, data, out),
            lambda: dlojz_row(args, data, out, 'dlojz-reference-flags', as_reference,
                              "dlojz, the reference's settings"),
            lambda: dlojz_row(args, data, out, 'dlojz-best', best, f'dlojz, {source}')]
    rows, stopped = [], None
    try:
        for k, run in enumerate(runs):
            stopped = k
            rows.append(run())
            say(f"row {k + 1}: {rows[-1]['run']}: {rows[-1]['img_s'] or rows[-1]['why']}")
        stopped = None
    except KeyboardInterrupt:  # run.sh's time limit: the rows that finished still make a table
        say(f'side_by_side.py: interrupted during row {stopped + 1}; the table holds the rows '
            f'before it.')
    host = torch.cuda.get_device_name() if args.gpu else f'{args.device} ({os.uname().nodename})'
    lines = (table(rows, args, f'{host}, torch {torch.__version__}') if rows
             else ['No row finished.'])
    if stopped is not None:
        lines += ['', f'Stopped by its time limit during row {stopped + 1} of {len(runs)}.']
    print('\n'.join(lines))
    return 1 if any(r['why'] for r in rows) else 0


if __name__ == '__main__':
    sys.exit(main())
