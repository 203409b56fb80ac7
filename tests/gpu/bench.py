"""The GPU benchmark for BENCHMARKS.md: ResNet-50 at batch 256, bf16 (fp16 below sm80),
channels-last, one `python dlojz.py --test-nsteps N ...` process per row, read from its
summary.json. The Markdown goes to stdout, progress to stderr:

    python tests/gpu/bench.py --quick --budget 250     # the lent node's table (issue 45)
    python tests/gpu/bench.py                          # every row
    python tests/gpu/bench.py --data-dir /path/imagenet --steps 100
    python tests/gpu/bench.py --quick --make-data      # the JPEG set alone (run.sh: first)

Rows, in the order they run (what a budget cuts comes last):
- fake data (the compute ceiling): eager, then torch.compile's reduce-overhead (CUDA graphs);
- JPEGs (synthetic ones, or --data-dir), each decode path with the loader alone
  (--loader-only, the same batches) and training, at the faster of those two modes (the one that
  completed): the GPU decoder through nvImageCodec and through torchvision's nvJPEG
  (DLOJZ_REGION_DECODE=0), then --decode fast on every usable core; the full run adds --decode pil
  and --no-decode-ahead;
- fake data in the other compile modes: default, and in the full run max-autotune-no-cudagraphs and
  max-autotune (minutes of autotuning); the full run's fp32 and NCHW eager rows close it.

The synthetic JPEGs are made before the clock starts: --unique distinct images per class (dlojz's
generator, on every usable core: 2,720 JPEGs, seconds on the node's 16 cores), each hard-linked as
often as one epoch of --steps batches needs (side_by_side.py's method and folder: the second
node command reuses the distinct images). Generating all 10,400 inside the first JPEG row took
~46 ms per image per core (a review of issue 56: F5), time the row's limit then lacked.

Columns: train img/s (images / host time over the steady steps), GPU img/s (global batch / mean GPU
time per step), device busy, bound, peak GPU memory, J/image. A loader-alone rate below what
training reached with the same loader is a defect of the measurement (issue 45: bench.py once timed
an epoch restart training never made): its cell says so and the exit code is 1. --budget S starts no
row after S seconds (those left are listed as not run); interrupted (run.sh's time limit), it prints
what finished and lists the row that was stopped. Exit code: 1 when a row failed, else 0."""
import argparse
import datetime
import json
import math
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT_S = 1800        # one run: compiling ResNet-50 can take minutes, 50 steps take seconds
MODES = ('reduce-overhead', 'default', 'max-autotune-no-cudagraphs', 'max-autotune')


def usable_cores():
    if hasattr(os, 'sched_getaffinity'):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def get_args(argv=None):
    p = argparse.ArgumentParser(description='dlojz GPU benchmark; prints Markdown tables')
    p.add_argument('--steps', type=int, default=50, help='training steps per run (--test-nsteps)')
    p.add_argument('--batch', type=int, default=256, help='images per step (-b)')
    p.add_argument('--workers', type=int, default=usable_cores(),
                   help='DataLoader worker processes (default: the usable cores)')
    p.add_argument('--out', default=None,
                   help='folder for the run directories (default runs/bench-<time>)')
    p.add_argument('--data-dir', default=None, help='ImageFolder dataset for the JPEG rows '
                   '(default: dlojz\'s built-in synthetic JPEGs)')
    p.add_argument('--quick', action='store_true', help='the rows of the lent node\'s table: '
                   'fake data eager, reduce-overhead and default; JPEGs through nvImageCodec, '
                   'torchvision and --decode fast')
    p.add_argument('--budget', type=float, default=None, help='seconds: no row starts after this '
                   '(default: no limit)')
    p.add_argument('--no-compile', dest='compile', action='store_false', help='leave the --compile '
                   'rows out (a node without a C compiler or Python\'s headers)')
    p.add_argument('--unique', type=int, default=256, help='distinct synthetic JPEGs per class '
                   '(each hard-linked as often as --steps batches need)')
    p.add_argument('--jpeg-dir', default=os.path.join(os.environ.get('TMPDIR', '/tmp'),
                                                      'dlojz-side-by-side'),
                   help='where the synthetic JPEGs are made, reused when complete '
                   "(side_by_side.py's --data: the two share the distinct images)")
    p.add_argument('--make-data', action='store_true', help='make the synthetic JPEG set of these '
                   '--steps and --batch, print its folder and stop (run.sh: before the clock)')
    return p.parse_args(argv)


@dataclass
class Row:
    """One line of a table: its name, the flags that make it, and what its runs gave."""
    name: str
    label: str
    flags: list
    env: dict = field(default_factory=dict)
    loader: bool = False  # a JPEG row: the loader alone too
    cells: list = None    # the table's cells once it ran
    failed: bool = False
    mode: str = None      # fake-data rows: the compile mode ('eager' for none)
    provenance: dict = None


def fake_rows(opts):
    modes = ['eager', *(MODES[:2] if opts.quick else MODES)] if opts.compile else ['eager']
    rows = [Row(f'fake_{m}', f'fake data, {m if m == "eager" else "compile " + m}',
                ['--fake-data', *compile_flags(m)], mode=m) for m in modes]
    if not opts.quick:
        rows += [Row('fake_fp32', 'fake data, eager, fp32 (TF32)', ['--fake-data', '--amp', 'off'],
                     mode='eager'),
                 Row('fake_nchw', 'fake data, eager, NCHW', ['--fake-data', '--no-channels-last'],
                     mode='eager')]
    return rows


def compile_flags(mode):
    if mode in (None, 'eager'):
        return []
    return ['--compile'] + ([] if mode == 'default' else ['--compile-mode', mode])


def decode_rows(opts):
    """(name, label, flags, env) of each decode path, the GPU's first."""
    rows = [('gpu_nvimgcodec', '--decode gpu, nvImageCodec', ['--decode', 'gpu'], {}),
            ('gpu_torchvision', "--decode gpu, torchvision's nvJPEG", ['--decode', 'gpu'],
             {'DLOJZ_REGION_DECODE': '0'}),
            ('fast', f'--decode fast, {opts.workers} workers', ['--decode', 'fast'], {})]
    if not opts.quick:
        rows += [('pil', '--decode pil', ['--decode', 'pil'], {}),
                 ('gpu_no_ahead', '--decode gpu --no-decode-ahead',
                  ['--decode', 'gpu', '--no-decode-ahead'], {})]
    return rows


class Budget:
    """--budget: whether a row may still start."""

    def __init__(self, seconds, clock=time.monotonic):
        self.seconds, self.clock, self.t0, self.left_out = seconds, clock, clock(), []

    def allows(self, name):
        if self.seconds is None or self.clock() - self.t0 < self.seconds:
            return True
        self.left_out.append(name)
        return False


def common_flags(opts):
    # warm-up: worker start-up, cudnn autotuning, compilation and graph capture stay out of the
    # statistics
    return ['--test-nsteps', opts.steps, '--arch', 'resnet50', '-b', opts.batch,
            '--num-workers', opts.workers, '--amp', 'auto', '--channels-last',
            '--warmup-steps', max(3, opts.steps // 5), '--wandb', 'off']


def side_by_side():
    """side_by_side.py, which makes the synthetic JPEG sets (imported when needed: it imports
    parts of dlojz)."""
    if __package__:  # imported as tests/gpu's module (the CPU tests)
        from . import side_by_side as module
    else:  # run as a script: tests/gpu is sys.path[0]
        import side_by_side as module
    return module


def per_class(opts):
    """Training images per class of the synthetic set: one epoch holds every step (an epoch
    boundary would restart the loader's prefetching inside the timing)."""
    return max(64, math.ceil(opts.steps * opts.batch / side_by_side().CLASSES))


def jpeg_set(opts):
    """-> the folder of the synthetic JPEGs for --steps batches, made unless complete (seconds of
    generation on every usable core, then hard links)."""
    return side_by_side().linked_dataset(opts.jpeg_dir, opts.unique, per_class(opts),
                                         log=lambda s: print(s, file=sys.stderr, flush=True))


def run_one(flags, out_dir, env=None):
    """-> (summary or None, why it failed or None); dlojz's output in <out_dir>.log."""
    cmd = [sys.executable, os.path.join(ROOT, 'dlojz.py'), *map(str, flags),
           '--output-dir', out_dir]
    with open(f'{out_dir}.log', 'w') as log:
        try:
            code = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                  timeout=TIMEOUT_S, env={**os.environ, **(env or {})}).returncode
        except subprocess.TimeoutExpired:
            return None, f'no result after {TIMEOUT_S} s'
    try:
        with open(os.path.join(out_dir, 'summary.json')) as f:
            summary = json.load(f)
    except (OSError, ValueError):
        summary = None
    if code == 0 and summary and summary['status'] == 'completed':
        return summary, None
    with open(f'{out_dir}.log') as f:
        lines = [line.strip() for line in f if line.strip()]
    said = [line for line in lines if line.startswith('dlojz:')] or lines or ['no output']
    print(f'--- the last lines of {out_dir}.log:', *lines[-25:], sep='\n', file=sys.stderr,
          flush=True)
    return summary, f'exit {code}: {said[-1][:200]}'


def failed(why):
    return f"failed ({why or 'no result'})".replace('|', '/')


def num(v, fmt):
    return '–' if v is None else format(v, fmt)


def train_cells(summary, why, steps):
    """train img/s, GPU img/s, device busy %, bound, peak GPU memory GiB, J/image."""
    if why:
        return [failed(why)] + [''] * 5
    t, m, e = summary['timing'], summary['memory'], summary['energy']
    # a small --data-dir ends with its epoch
    note = f" ({t['steps']} steps)" if t['steps'] < steps else ''
    peak = m['gpu_max_allocated_bytes']
    gib = peak / 2 ** 30 if peak is not None else None
    busy = t['device_busy'] * 100 if t.get('device_busy') is not None else None
    return [num(t.get('train_throughput'), '.1f') + note, num(t.get('gpu_throughput'), '.1f'),
            num(busy, '.0f'), t.get('bound', '–'), num(gib, '.2f'),
            num(e['joules_per_image'], '.3f')]


def loader_cell(loader, trained):
    """The loader-alone cell, and whether it is a defect: below the training rate it fed."""
    ips = (loader or {}).get('images_per_second')
    rate = ((trained or {}).get('timing') or {}).get('train_throughput')
    if not ips:
        return '–', False
    if rate and ips < rate:
        return f'{ips:.1f} (below training: a measurement defect)', True
    return f'{ips:.1f}', False


def run_row(i, row, opts, out, flags):
    """-> the row, its cells filled, after its runs (the loader alone first, for a JPEG row)."""
    t0 = time.perf_counter()
    print(f'[{i}] {row.name} ...', file=sys.stderr, flush=True)
    loader = why_loader = None
    if row.loader:  # the same batches, nothing compiled
        alone = [f for f in flags if f != '--compile']
        if '--compile-mode' in alone:
            del alone[alone.index('--compile-mode'):alone.index('--compile-mode') + 2]
        folder = os.path.join(out, f'loader_{row.name}')
        loader, why_loader = run_one([*alone, '--loader-only'], folder, row.env)
    summary, why = run_one(flags, os.path.join(out, row.name), row.env)
    row.cells = train_cells(summary, why, opts.steps)
    row.failed = bool(why)
    if row.loader:
        cell, defect = loader_cell((loader or {}).get('loader'), summary) if not why_loader \
            else (failed(why_loader), True)
        row.cells.insert(0, cell)
        row.failed |= defect
        decoder = ((summary or {}).get('data') or {}).get('gpu_decode') or {}
        if decoder.get('decoder'):
            row.label += f" ({decoder['decoder']})"
    row.provenance = (summary or {}).get('provenance')
    seconds = time.perf_counter() - t0
    print(f'[{i}] {row.name}: {why or "completed"} ({seconds:.0f} s)', file=sys.stderr, flush=True)
    return row


def shown(path):
    """A path as the reader would type it from the repository root."""
    path = os.path.abspath(path)
    return os.path.relpath(path, ROOT) if path.startswith(ROOT + os.sep) else path


def header(prov, opts, argv, out, jpeg_mode, jpegs):
    gpu = 'unknown GPU'
    if prov:
        total = prov.get('gpu_total_memory_bytes')
        mem = f"{total / 2 ** 30:.0f} GiB, " if total else ''
        # '9.0' -> 'sm_90 (compute capability 9.0)', as nvcc names it
        cc = prov.get('compute_capability')
        arch = (f"sm_{cc.replace('.', '')} (compute capability {cc})" if cc
                else 'compute capability ?')
        gpu = f"{prov['device_name']} ({mem}{arch}), driver {prov.get('driver')}"
    versions = (f"torch {prov['torch']} (CUDA {prov['cuda']}, cuDNN {prov['cudnn']})" if prov else
                f'torch {torch.__version__}')
    command = shlex.join(['python', shown(sys.argv[0]), *argv])
    dlojz = shlex.join(['python', 'dlojz.py', *map(str, common_flags(opts))])
    host, sha = (prov['host'], prov['dlojz_sha']) if prov else ('?', '?')
    mode = ' '.join(compile_flags(jpeg_mode)) or 'eager'
    data = f'`--data-dir {opts.data_dir}`' if opts.data_dir else \
        (f'the synthetic JPEGs ({opts.unique} distinct per class, hard-linked to '
         f'{per_class(opts)} per class, made before the clock: {jpegs})')
    return [f"## {datetime.date.today().isoformat()} — {gpu}, {versions}, host {host}", '',
            f"`{command}` (dlojz {sha}): each row is `{dlojz} ROW FLAGS` (`--amp auto`: bf16 "
            f"from sm80); the JPEG rows train with `{mode}` (the faster of eager and "
            f"reduce-overhead on fake data) and read {data} with {opts.workers} workers. "
            f"Throughputs are sums over the steady steps (after the warm-up): train = their images "
            f"/ their host time, GPU = global batch / mean GPU time per step (CUDA events); device "
            f"busy = GPU time / host time; memory = max allocated after warm-up; J/image = NVML "
            f"energy over the steady steps / their images; loader alone = `--loader-only` on the "
            f"same batches. Run folders: {out}.", '']


def tables(fake, jpeg):
    lines = ['| fake data | train img/s | GPU img/s | device busy % | bound | peak GPU memory GiB '
             '| J/image |', '|---|---:|---:|---:|---|---:|---:|']
    lines += [f"| {r.label} | {' | '.join(r.cells)} |" for r in fake if r.cells]
    if any(r.cells for r in jpeg):
        lines += ['', '| JPEG | loader alone img/s | train img/s | GPU img/s | device busy % '
                      '| bound | peak GPU memory GiB | J/image |',
                  '|---|---:|---:|---:|---:|---|---:|---:|']
        lines += [f"| {r.label} | {' | '.join(r.cells)} |" for r in jpeg if r.cells]
    return lines


def fastest_mode(fake):
    """The compile mode of the fastest completed fake-data row (train img/s), eager if none."""
    done = [r for r in fake if r.cells and not r.failed]
    best = max(done, key=lambda r: float(r.cells[0].split()[0]), default=None)
    return best.mode if best else 'eager'


def main(argv=None):
    """Fake data eager and with CUDA graphs, JPEG rows at the faster of the two, then the other
    rows; interrupted (Ctrl-C, run.sh's time limit), it prints the tables of what finished and
    names the row that was running."""
    argv = sys.argv[1:] if argv is None else argv
    opts = get_args(argv)
    if opts.make_data:
        print(opts.data_dir or jpeg_set(opts))
        return 0
    if not torch.cuda.is_available():
        sys.exit('bench.py: PyTorch sees no CUDA GPU (torch.cuda.is_available() is False); run it '
                 'on a GPU node.')
    stamp = datetime.datetime.now().strftime('%Y%m%d-%H%M%S')
    out = opts.out or os.path.join(ROOT, 'runs', f'bench-{stamp}')
    os.makedirs(out, exist_ok=True)
    jpegs = opts.data_dir or jpeg_set(opts)  # before the clock: the rows time training, not this
    budget, base = Budget(opts.budget), [*common_flags(opts)]
    fake, jpeg, stopped, n = fake_rows(opts), [], None, 0
    # the ceiling and the CUDA graphs first, then the JPEG rows (issue 45's goals), then the rest
    extra = [r for r in fake
             if r.mode not in ('eager', 'reduce-overhead') or r.name in ('fake_fp32', 'fake_nchw')]
    fake = [r for r in fake if r not in extra]
    jpeg_mode = 'eager'
    try:
        for row in fake:
            if budget.allows(row.name):
                stopped, n = row.name, n + 1
                run_row(n, row, opts, out, [*base, *row.flags])
        jpeg_mode = fastest_mode(fake)
        for name, label, flags, env in decode_rows(opts):
            row_flags = ['--data-dir', jpegs, *flags, *compile_flags(jpeg_mode)]
            row = Row(name, label, row_flags, env, loader=True)
            jpeg.append(row)
            if budget.allows(row.name):
                stopped, n = row.name, n + 1
                run_row(n, row, opts, out, [*base, *row.flags])
        for row in extra:
            fake.append(row)
            if budget.allows(row.name):
                stopped, n = row.name, n + 1
                run_row(n, row, opts, out, [*base, *row.flags])
        stopped = None
    except KeyboardInterrupt:
        print(f'bench.py: interrupted during {stopped}; the tables hold the rows that finished.',
              file=sys.stderr)
    prov = next((r.provenance for r in fake + jpeg if getattr(r, 'provenance', None)), None)
    lines = header(prov, opts, argv, shown(out), jpeg_mode, shown(jpegs)) + tables(fake, jpeg)
    if stopped:
        lines += ['', f'Stopped by its time limit while it ran: {stopped}.']
    if budget.left_out:
        lines += ['', f"Not run (--budget {opts.budget:g} s spent): {', '.join(budget.left_out)}."]
    print('\n'.join(lines))
    failures = [r.name for r in fake + jpeg if r.failed]
    if failures:
        print(f'bench.py: {len(failures)} row(s) failed ({", ".join(failures)}); their cells say '
              f'why, their logs are in {shown(out)}.', file=sys.stderr)
    return 1 if failures else 0


if __name__ == '__main__':
    sys.exit(main())
