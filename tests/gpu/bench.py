"""The GPU benchmark matrix for BENCHMARKS.md: ResNet-50 training in fp32 and in the GPU's low precision
(--amp auto: bf16 from sm80, fp16 below) x channels-last on/off x torch.compile on/off x in-memory fake data
(the compute ceiling) / decoded JPEGs (the built-in synthetic dataset, or --data-dir). Each configuration is
one `python dlojz.py --test-nsteps N ...` process; the table is read from its summary.json. The Markdown goes
to stdout, progress to stderr:

    python tests/gpu/bench.py | tee tests/gpu/last-bench.md     # 16 configurations
    python tests/gpu/bench.py --quick                            # 2: low precision, channels-last
    python tests/gpu/bench.py --data-dir /path/imagenet --steps 100 --batch 256

A second table compares the host's decode paths (--decode fast and pil; --quick: fast) on the
machine's cores with nvJPEG (--decode gpu), same workers, same JPEGs: the training loader alone
(--loader-only) and training. --budget S starts no row after S seconds (the rows left are listed as
not run). The exit code is 1 when any run failed, in either table.
"""
import argparse
import datetime
import itertools
import json
import math
import os
import shlex
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SYNTHETIC_CLASSES = 10  # dlojz's --synthetic-classes default
TIMEOUT_S = 1800        # one configuration: compiling ResNet-50 can take minutes, 50 steps take seconds


def get_args(argv=None):
    p = argparse.ArgumentParser(description='dlojz GPU benchmark matrix; prints a Markdown table')
    p.add_argument('--steps', type=int, default=50, help='training steps per configuration (--test-nsteps)')
    p.add_argument('--batch', type=int, default=128, help='images per step (-b)')
    p.add_argument('--workers', type=int, default=min(8, os.cpu_count() or 1), help='DataLoader worker processes '
                   '(default min(8, CPU count))')
    p.add_argument('--out', default=None, help='folder for the run directories (default runs/bench-<time>)')
    p.add_argument('--data-dir', default=None, help='ImageFolder dataset for the JPEG rows (default: dlojz\'s '
                   'built-in synthetic JPEGs)')
    p.add_argument('--quick', action='store_true', help='2 configurations (low precision, '
                   'channels-last, fake data, eager and compiled) and 2 decode rows (fast, gpu)')
    p.add_argument('--budget', type=float, default=None, help='seconds: no row starts after this '
                   '(default: no limit)')
    p.add_argument('--no-compile', dest='compile', action='store_false', help='leave the --compile '
                   'rows out (a node without a C compiler or Python\'s headers)')
    return p.parse_args(argv)


def matrix(quick, compile_=True):
    """(--amp, channels-last, compile, data) of every row."""
    rows = [('auto', True, False, 'fake'), ('auto', True, True, 'fake')] if quick else \
        list(itertools.product(('off', 'auto'), (True, False), (False, True), ('fake', 'jpeg')))
    return [r for r in rows if compile_ or not r[2]]


def decodes(quick):
    """The --decode settings of the second table: the host's paths, then nvJPEG."""
    return ['fast', 'gpu'] if quick else ['fast', 'pil', 'gpu', 'gpu --no-decode-ahead']


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
    # warm-up: worker start-up, cudnn autotuning and compilation stay out of the statistics
    return ['--test-nsteps', opts.steps, '--arch', 'resnet50', '-b', opts.batch, '--num-workers', opts.workers,
            '--warmup-steps', max(1, opts.steps // 10)]


def row_flags(cfg, opts):
    amp, nhwc, comp, data = cfg
    flags = ['--amp', amp, '--channels-last' if nhwc else '--no-channels-last'] + (['--compile'] if comp else [])
    if data == 'fake':
        return flags + ['--fake-data']
    if opts.data_dir:
        return flags + ['--data-dir', opts.data_dir]
    # One epoch holds every step: an epoch boundary would restart the loader's prefetching inside the timing.
    # The first JPEG row generates these images (~110 KB each) into dlojz's --cache-dir, once.
    return flags + ['--synthetic-train-per-class', max(64, math.ceil(opts.steps * opts.batch / SYNTHETIC_CLASSES))]


def run_one(flags, out_dir):
    """-> (summary or None, why it failed or None); dlojz's output in <out_dir>.log."""
    cmd = [sys.executable, os.path.join(ROOT, 'dlojz.py'), *map(str, flags), '--output-dir', out_dir]
    with open(f'{out_dir}.log', 'w') as log:
        try:
            code = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=TIMEOUT_S).returncode
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


def loader_rows(opts, out, budget, rows):
    """Each --decode of decodes(): the loader alone (--loader-only) and a training run (same flags),
    a Markdown row each appended to `rows` as it ends (an interrupt keeps those) -> how many runs
    failed. The training run shows what the loader figure cannot: nvJPEG's decode sharing the GPU
    with the step, and the host waiting for it."""
    failures = 0
    for decode in decodes(opts.quick):
        if not budget.allows(f'--decode {decode}'):
            continue
        flags = [*common_flags(opts), *row_flags(('auto', True, False, 'jpeg'), opts), '--decode', *decode.split()]
        decode_dir = decode.replace(' --', '_').replace('-', '_')
        summary, why = run_one([*flags, '--loader-only'], os.path.join(out, f'loader_{decode_dir}'))
        ips = ((summary or {}).get('loader') or {}).get('images_per_second')
        failures += bool(why or not ips)
        cell = f'{ips:.1f}' if ips and not why else failed(why)
        print(f'loader {decode}: {why or "completed"}', file=sys.stderr, flush=True)
        summary, why = run_one(flags, os.path.join(out, f'train_{decode_dir}'))
        t = (summary or {}).get('timing') or {}
        failures += bool(why or not t.get('train_throughput'))
        rate = t.get('train_throughput')
        train = f'{rate:.1f}' if rate and not why else failed(why)
        rows.append(f"| {decode} | {opts.workers} | {cell} | {train} | {t.get('bound', '–')} |")
        print(f'train {decode}: {why or "completed"}', file=sys.stderr, flush=True)
    return failures


def decode_table(opts, rows):
    if not rows:
        return []
    return ['', f'Decoding on the host (`--decode fast`, `pil`) or with nvJPEG (`--decode gpu`): '
            f'the training loader alone (`--loader-only`) and training (low precision, '
            f'channels-last, eager), {opts.batch} images per batch, {opts.steps} batches:', '',
            '| decode | workers | loader alone img/s | training img/s | bound |',
            '|---|---:|---:|---:|---|', *rows]


def label(cfg, summary, opts):
    amp, nhwc, comp, data = cfg
    precision = 'fp32' if amp == 'off' else summary['config']['amp'] if summary else 'bf16/fp16'
    source = 'fake data' if data == 'fake' else 'JPEG --data-dir' if opts.data_dir else 'synthetic JPEG'
    return ' / '.join([precision, 'channels-last' if nhwc else 'NCHW', 'compile' if comp else 'eager', source])


def cells(summary, why, steps):
    if why:
        return [failed(why)] + [''] * 5
    t, m, e = summary['timing'], summary['memory'], summary['energy']
    note = f" ({t['steps']} steps)" if t['steps'] < steps else ''  # a small --data-dir ends with its epoch
    num = lambda v, fmt: '–' if v is None else format(v, fmt)
    gib = m['gpu_max_allocated_bytes'] / 2 ** 30 if m['gpu_max_allocated_bytes'] is not None else None
    return [num(t.get('train_throughput'), '.1f') + note, num(t.get('gpu_throughput'), '.1f'), t.get('bound', '–'),
            num(t['device_busy'] * 100 if t.get('device_busy') is not None else None, '.0f'), num(gib, '.2f'),
            num(e['joules_per_image'], '.3f')]


def shown(path):
    """A path as the reader would type it from the repository root."""
    path = os.path.abspath(path)
    return os.path.relpath(path, ROOT) if path.startswith(ROOT + os.sep) else path


def header(prov, opts, argv, out):
    gpu = 'unknown GPU'
    if prov:
        mem = f"{prov['gpu_total_memory_bytes'] / 2 ** 30:.0f} GiB, " if prov.get('gpu_total_memory_bytes') else ''
        cc = prov.get('compute_capability')  # '9.0' -> 'sm_90 (compute capability 9.0)', as nvcc names it
        arch = f"sm_{cc.replace('.', '')} (compute capability {cc})" if cc else 'compute capability ?'
        gpu = f"{prov['device_name']} ({mem}{arch}), driver {prov.get('driver')}"
    versions = (f"torch {prov['torch']} (CUDA {prov['cuda']}, cuDNN {prov['cudnn']})" if prov else
                f'torch {torch.__version__}')
    command = shlex.join(['python', shown(sys.argv[0]), *argv])
    dlojz = shlex.join(['python', 'dlojz.py', *map(str, common_flags(opts))])
    return [f"## {datetime.date.today().isoformat()} — {gpu}, {versions}, host {prov['host'] if prov else '?'}", '',
            f"`{command}` (dlojz {prov['dlojz_sha'] if prov else '?'}): each row is `{dlojz} ROW FLAGS`, where "
            f"precision is `--amp off` (fp32, TF32 on) or `--amp auto`, the layout `--channels-last` or "
            f"`--no-channels-last`, `--compile` or not, and the data `--fake-data` or JPEGs decoded by "
            f"{opts.workers} workers. Throughputs are sums over the steady steps (after the "
            f"warm-up): train = their images / their host time, GPU = global batch / mean GPU time "
            f"per step (CUDA events); device busy = GPU time / host time; memory = max allocated "
            f"after warm-up; J/image = NVML energy over the steady steps / their images. Run "
            f"folders: {out}.", '']


def matrix_row(i, cfg, opts, out):
    """-> (its table cells, whether it failed, its provenance)."""
    name = row_name(cfg)
    t0 = time.perf_counter()
    print(f'[{i}] {name} ...', file=sys.stderr, flush=True)
    summary, why = run_one([*common_flags(opts), *row_flags(cfg, opts)], os.path.join(out, name))
    seconds = time.perf_counter() - t0
    print(f'[{i}] {name}: {why or "completed"} ({seconds:.0f} s)', file=sys.stderr, flush=True)
    row = [label(cfg, summary, opts), *cells(summary, why, opts.steps)]
    return row, bool(why), (summary or {}).get('provenance')


def row_name(cfg):
    return '_'.join(['fp32' if cfg[0] == 'off' else 'amp', 'nhwc' if cfg[1] else 'nchw',
                     'compile' if cfg[2] else 'eager', cfg[3]])


def main(argv=None):
    """The eager rows, the decode rows, then the compiled rows (minutes of inductor each: what
    --budget cuts first); the tables keep the matrix's order. Interrupted (Ctrl-C, run.sh's stage
    timeout), it prints the tables of what finished."""
    argv = sys.argv[1:] if argv is None else argv
    opts = get_args(argv)
    if not torch.cuda.is_available():
        sys.exit('bench.py: PyTorch sees no CUDA GPU (torch.cuda.is_available() is False); run it on a GPU node.')
    out = opts.out or os.path.join(ROOT, 'runs', 'bench-' + datetime.datetime.now().strftime('%Y%m%d-%H%M%S'))
    os.makedirs(out, exist_ok=True)
    configs, budget = matrix(opts.quick, opts.compile), Budget(opts.budget)
    done, prov, failures, decode_rows = {}, None, 0, []
    try:
        for cfg in [c for c in configs if not c[2]]:
            if budget.allows(row_name(cfg)):
                done[cfg], failed_row, found = matrix_row(len(done) + 1, cfg, opts, out)
                failures, prov = failures + failed_row, prov or found
        failures += loader_rows(opts, out, budget, decode_rows)
        for cfg in [c for c in configs if c[2]]:
            if budget.allows(row_name(cfg)):
                done[cfg], failed_row, found = matrix_row(len(done) + 1, cfg, opts, out)
                failures, prov = failures + failed_row, prov or found
    except KeyboardInterrupt:
        print('bench.py: interrupted; the tables hold the runs that finished.', file=sys.stderr)
        failures += 1
    lines = header(prov, opts, argv, shown(out))
    lines += ['| config | train img/s | GPU img/s | bound | device busy % | peak GPU memory GiB | J/image |',
              '|---|---:|---:|---|---:|---:|---:|']
    lines += ['| ' + ' | '.join(done[cfg]) + ' |' for cfg in configs if cfg in done]
    lines += decode_table(opts, decode_rows)
    if budget.left_out:
        lines += ['', f"Not run (--budget {opts.budget:g} s spent): {', '.join(budget.left_out)}."]
    print('\n'.join(lines))
    if failures:
        print(f'bench.py: {failures} run(s) failed or were interrupted; their cells say why, their '
              f'logs are in {shown(out)}.', file=sys.stderr)
    return 1 if failures else 0


if __name__ == '__main__':
    sys.exit(main())
