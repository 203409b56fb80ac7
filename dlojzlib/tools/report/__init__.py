"""dlojz report: the course's analysis tools, headless — run dashboards (controle_technique), step
timelines (turbo_profiler), run comparisons (the DataLoader-trials table), batch-size sweeps
(GPU_underthehood), scaling, NCCL communication (comm_profiler), BatchNorm view, metric sync log,
LR finder and config diff.

It reads what dlojz.py writes in a run directory — summary.json, config.json, metrics.jsonl,
checkpoint-*.pt, nccl.rank<r>.log — never stdout, and writes <out>/report.md with PNG figures and
comparison.csv next to it; the comparison table is also printed.

    python dlojz_report.py runs/*                          # every section that applies to these runs
    python dlojz_report.py runs/* --sort load_ms --out trials
    python dlojz_report.py diff runs/a runs/b              # configuration differences of two runs

The file reads top-down: loading run directories, what the views share (numbers, tables, figures), then
one block per view — its computation, its figure and its Markdown together — and VIEWS, the list the
report is built from: each view is a function of the Report (runs, output folder, options) returning its
Markdown lines.
"""
import argparse
import datetime
import json
import math
import os
import re
import statistics
import sys
from dataclasses import dataclass, field

from dlojz_chrono import PHASES
from dlojzlib import tables
from dlojzlib.errors import UsageError
from dlojzlib.measure.scaling import collective_waits
from dlojzlib.recipe import FINDLR_MIN_STEPS, centered_mean, diverged_at, suggest_lr
from dlojzlib.record.checkpoint import list_checkpoints, load_checkpoint, strip_prefixes
from dlojzlib.record.log import SUMMARY_VERSION

# Config keys that name places, not what was measured: they always differ between runs.
PATH_KEYS = {'output_dir', 'cache_dir', 'resume'}
DERIVED_KEYS = {'findlr_upper'}  # written by dlojz before --lr held the sweep's upper end: follows lr
COLORS = {'data': '#d62728', 'h2d': '#ff7f0e', 'forward': '#1f77b4', 'backward': '#2ca02c',
          'optimizer': '#9467bd', 'other': '#7f7f7f'}
GiB = 2 ** 30


class ReportError(Exception):
    """A user error: one sentence saying what is wrong and what to do."""


def scaled(v, factor):
    """v * factor (a unit change: s -> ms, bytes -> GiB), None stays None."""
    return v * factor if v is not None else None


def dig(d, *keys):
    """d[k1][k2]... or None when a level is missing or not a dict (older or partial summaries)."""
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


# ------------------------------------------------------------------------------------ run directories

@dataclass
class RunDir:
    path: str
    name: str
    summary: dict = None      # None: no readable summary.json (crashed, killed, still running)
    config: dict = field(default_factory=dict)
    records: list = field(default_factory=list)
    notes: list = field(default_factory=list)  # what was missing or unreadable, said in the report

    @property
    def status(self):
        return (self.summary or {}).get('status') or 'incomplete'

    def get(self, *keys):
        return dig(self.summary, *keys)

    @property
    def world_size(self):
        return self.get('world_size') or 1

    @property
    def batch_size(self):
        return self.config.get('batch_size')


def read_json(path):
    """-> (object, problem): problem is a short phrase when the file is absent or unreadable."""
    if not os.path.exists(path):
        return None, None
    try:
        with open(path) as f:
            return json.load(f), None
    except (OSError, ValueError) as e:
        return None, f'{os.path.basename(path)} is unreadable ({type(e).__name__}: {str(e)[:80]})'


def load_run(path):
    run = RunDir(os.path.abspath(path), os.path.basename(os.path.normpath(path)))
    run.summary, problem = read_json(os.path.join(path, 'summary.json'))
    if problem:
        run.notes.append(problem)
    if run.summary is not None and not isinstance(run.summary, dict):
        run.summary = None
        run.notes.append('summary.json does not hold a JSON object')
    config, problem = read_json(os.path.join(path, 'config.json'))
    if problem:
        run.notes.append(problem)
    run.config = dict(dig(run.summary, 'config') or config or {})
    version = dig(run.summary, 'version')
    if run.summary is not None and isinstance(version, int) and version > SUMMARY_VERSION:
        run.notes.append(f'summary.json is version {version}, newer than this report ({SUMMARY_VERSION}): '
                         f'fields it does not know are ignored')
    bad, metrics = 0, os.path.join(path, 'metrics.jsonl')
    try:
        with open(metrics) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:  # a line cut by a crash
                    bad += 1
                    continue
                if isinstance(rec, dict):
                    run.records.append(rec)
    except OSError as e:
        if os.path.exists(metrics):  # absent is normal before the first log line; unreadable is said
            run.notes.append(f'metrics.jsonl is unreadable ({e.strerror})')
    if bad:
        run.notes.append(f'{bad} unreadable line(s) in metrics.jsonl (cut by a crash?)')
    run.records, repeated = latest_records(run.records)
    if repeated:
        run.notes.append(f'{repeated} record(s) of metrics.jsonl were logged again by a resumed run (written '
                         f'before dlojz trimmed them on resume): each step is counted once, from the resumed run')
    return run


def latest_records(records):
    """A run resumed by a dlojz older than the trimming of metrics.jsonl (record.rundir.trim_metrics) logged the
    steps after its checkpoint twice: keep the last record of each (type, global step), in order.
    -> (records, number dropped)."""
    last = {}
    for i, r in enumerate(records):
        if isinstance(r.get('global_step'), int):
            last[(r.get('type'), r['global_step'])] = i
    kept = [r for i, r in enumerate(records)
            if not isinstance(r.get('global_step'), int) or last[(r.get('type'), r['global_step'])] == i]
    return kept, len(records) - len(kept)


def is_run_dir(path):
    return any(os.path.isfile(os.path.join(path, f)) for f in ('summary.json', 'config.json', 'metrics.jsonl'))


def collect_runs(paths):
    """Run directories among paths; a folder that is not a run but holds runs (e.g. runs/) is expanded.
    -> (runs, skipped paths)."""
    found, skipped = [], []
    for p in paths:
        if not os.path.exists(p):
            raise ReportError(f'{p} does not exist; pass run directories written by dlojz.py (--output-dir).')
        if is_run_dir(p):
            found.append(p)
        elif os.path.isdir(p) and (subs := sorted(os.path.join(p, d) for d in os.listdir(p)
                                                  if is_run_dir(os.path.join(p, d)))):
            found.extend(subs)
        else:
            skipped.append(p)
    if not found:
        raise ReportError(f'no dlojz run directory among {" ".join(paths)}; pass folders written by dlojz.py '
                          f'--output-dir (they hold summary.json, config.json, metrics.jsonl).')
    runs = [load_run(p) for p in dict.fromkeys(os.path.abspath(p) for p in found)]
    names = [r.name for r in runs]
    for r in runs:  # two runs named alike in different folders: name them by parent/name
        if names.count(r.name) > 1:
            r.name = os.path.join(os.path.basename(os.path.dirname(r.path)), r.name)
    return runs, skipped


# -------------------------------------------------------------------------------- shared by the views

def last_record(run, kind):
    recs = [r for r in run.records if r.get('type') == kind]
    return recs[-1] if recs else None


def verdict(run):
    """One line: completed, or what stopped the run and at which step (from the run's recorded status)."""
    if run.summary is None or run.status == 'running':  # dlojz writes 'running' as each attempt starts
        last = last_record(run, 'train')
        ckpts = list_checkpoints(run.path)
        why = 'no summary.json' if run.summary is None else "summary.json still says 'running'"
        return (f'incomplete: {why}, the run crashed, was killed or is still running; last logged '
                f"step {last.get('global_step') if last else 'none'}; newest checkpoint "
                f"{os.path.basename(ckpts[-1]) if ckpts else 'none'}")
    status, step, error = run.status, run.get('failed_step'), run.get('error')
    if status == 'completed':
        mode = run.get('mode')
        return 'completed' + (f' ({mode} run)' if mode and mode != 'train' else '')
    what = {'nan': 'NaN loss', 'oom': 'out of memory', 'failed': 'failed', 'crashed': 'crashed',
            'interrupted': 'interrupted', 'preempted': 'preempted'}.get(status, status)
    where = f' at step {step}' if step is not None else ''
    if status == 'oom' and run.batch_size:
        where += f' with batch {run.batch_size} per process'
    return f'{what}{where}' + (f': {error}' if error and error != status and status != 'oom' else '')


def numbers(run):
    """The figures the comparison, sweep and scaling views share, None where the run did not record them."""
    t, m, e = run.get('timing') or {}, run.get('memory') or {}, run.get('energy') or {}
    st = t.get('stats') or {}
    load = None
    if dig(st, 'data', 'mean') is not None:  # mean of data + h2d = the '>>> Loading performance' avg
        load = st['data']['mean'] + (dig(st, 'h2d', 'mean') or 0.0)
    return {
        'load_ms': scaled(load, 1e3), 'compute_ms': scaled(dig(st, 'compute', 'median'), 1e3),
        'step_ms': scaled(dig(st, 'step', 'median'), 1e3),
        'train_img_s': t.get('train_throughput'), 'gpu_img_s': t.get('gpu_throughput'),
        # a verdict over all ranks comes with its shares over all ranks (rank 0's alone could read 'compute,
        # busy 100 %' beside 'loader (all ranks)'), as the run's '>>> Bound by' line gives them
        'busy_pct': scaled(t.get('device_busy_all_ranks' if t.get('bound_all_ranks') else 'device_busy'), 100),
        'data_pct': scaled(t.get('data_share_all_ranks' if t.get('bound_all_ranks') else 'data_share'), 100),
        'bound': t.get('bound'),
        'host_mem_gib': scaled(m.get('host_peak_rss_bytes'), 1 / GiB),
        'gpu_mem_gib': scaled(m.get('gpu_max_allocated_bytes_any_rank') or m.get('gpu_max_allocated_bytes'), 1 / GiB),
        'j_per_img': e.get('joules_per_image_all_ranks') or e.get('joules_per_image'),
        'top1': dig(run.summary, 'val', 'top1'),
    }


METRICS = ['load_ms', 'compute_ms', 'step_ms', 'train_img_s', 'gpu_img_s', 'busy_pct', 'data_pct', 'bound',
           'host_mem_gib', 'gpu_mem_gib', 'j_per_img', 'top1']


HIGHER_IS_BETTER = {'train_img_s', 'gpu_img_s', 'top1'}  # sorted best first: these descending, others ascending


FORMATS = {'comm_pts': '.1f', 'straggler_pts': '.1f', 'rest_pts': '.1f', 'step_ms': '.1f',
           'top1': '.4f', 'top1_before': '.4f', 'top1_after': '.4f', 'loss_before': '.4f', 'loss_after': '.4f',
           'speedup': '.2f', 'efficiency': '.1%', 'j_per_img': '.3f', 'host_mem_gib': '.2f', 'gpu_mem_gib': '.2f',
           'mem_gib': '.3f', 'max_diff': '.3g'}


MEASURED = ('_ms', '_img_s', '_w', '_pct', '_step')  # column suffixes of timings, rates and averages


def fmt(v, col=''):
    """A cell: measured figures rounded for reading, flag values as given (0.1 stays 0.1)."""
    if v is None:
        return '—'
    if isinstance(v, bool):
        return 'on' if v else 'off'
    if isinstance(v, float):
        if col in FORMATS:
            return format(v, FORMATS[col])
        if col.endswith(MEASURED) or not col:
            return f'{v:.1f}' if abs(v) >= 10 else f'{v:.2f}' if abs(v) >= 0.01 else f'{v:.3g}'
        return f'{v:g}'
    if isinstance(v, int) and col in ('bytes', 'calls'):
        return f'{v:,}'
    return str(v)


def md_table(columns, rows, headers=None):
    return tables.markdown(headers or columns, [[fmt(row.get(c), c) for c in columns] for row in rows])


def text_table(columns, rows):
    cells = [columns] + [[fmt(row.get(c), c) for c in columns] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    return ['  '.join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in cells]


def shown(columns, rows):
    """Drop measured columns that no run has (e.g. GPU memory and energy on CPU runs) from the display."""
    return [c for c in columns if c not in METRICS or any(row.get(c) is not None for row in rows)]


def hms(seconds):
    if seconds is None:
        return '—'
    return f'{seconds:.1f} s' if seconds < 60 else str(datetime.timedelta(seconds=round(seconds)))


def gib(b):
    return f'{b / GiB:.2f} GiB' if b is not None else '—'


def plt():
    import matplotlib
    matplotlib.use('Agg')  # headless: login nodes have no display
    import matplotlib.pyplot
    return matplotlib.pyplot


def save_fig(fig, out, name):
    fig.tight_layout()
    fig.savefig(os.path.join(out, name), dpi=100)
    plt().close(fig)
    return name


def slug(name):
    return re.sub(r'[^A-Za-z0-9._-]+', '_', name).strip('_') or 'run'


def group_runs(runs, ignore):
    """Runs whose config is equal apart from `ignore` (and paths), in first-seen order."""
    groups = {}
    for r in runs:
        if not r.config:
            continue
        key = json.dumps({k: v for k, v in r.config.items() if k not in PATH_KEYS | set(ignore)}, sort_keys=True,
                         default=str)
        groups.setdefault(key, []).append(r)
    return list(groups.values())


def label(run):
    c = run.config
    return (f"{c.get('arch')} {c.get('image_size')} px, amp {c.get('amp')}, channels-last "
            f"{'on' if c.get('channels_last') else 'off'}, {c.get('optimizer')}")


# ----------------------------------------------------------------------------------- view: comparison

HELP_COLUMNS = ('load_ms: mean data wait + host-to-device copy per step; compute_ms: median compute per step (GPU: '
                'device time of the step\'s work; CPU: step without the data wait); step_ms: median step; '
                'train_img_s = images / total time of the steady steps; gpu_img_s = global batch / device work per '
                'step (clean spans, docs/chronometer.md); busy_pct: device busy time / step time over the steady '
                'steps and data_pct: data wait / step time (both summed over the ranks when every rank was '
                'measured); bound: compute, loader, host, '
                'communication or straggler; host_mem_gib: peak RSS (VmHWM) of rank 0; gpu_mem_gib: max allocated '
                '(any rank); j_per_img: GPU energy per image (all ranks); top1: last validation.')


def differing_keys(runs):
    """Config keys (and world size) whose values are not the same in every run."""
    keys = sorted(set().union(*(r.config for r in runs)) - PATH_KEYS - DERIVED_KEYS)
    diff = [k for k in keys if len({json.dumps(r.config.get(k), sort_keys=True, default=str) for r in runs}) > 1]
    if len({r.world_size for r in runs}) > 1:
        diff.append('world_size')
    return diff


def comparison(runs, sort='train_img_s'):
    """-> (columns, rows): one row per run; the flags that differ, then the measured figures; best first."""
    flags = differing_keys(runs)
    rows = []
    for r in runs:
        row = {'run': r.name, 'status': r.status}
        row.update({k: r.world_size if k == 'world_size' else r.config.get(k) for k in flags})
        row.update(numbers(r))
        rows.append(row)
    columns = ['run', 'status'] + flags + METRICS
    if sort not in columns:
        raise ReportError(f'--sort {sort} is not a column of this comparison; choose one of {", ".join(columns)}.')
    return columns, sort_rows(rows, sort)


def sort_rows(rows, col):
    """Best first; rows without the value go last, in input order."""
    present = [row for row in rows if row.get(col) is not None]
    key = lambda row: (0, row[col]) if isinstance(row[col], (int, float)) else (1, str(row[col]))
    present.sort(key=key, reverse=col in HIGHER_IS_BETTER)
    return present + [row for row in rows if row.get(col) is None]


def by_config(columns, rows, sort):
    """Repeated runs of one configuration (same values of the differing flags) -> one row of medians over
    the completed runs, or None when no configuration was repeated."""
    flags = [c for c in columns if c not in METRICS and c not in ('run', 'status')]
    groups = {}
    for row in rows:
        if row['status'] == 'completed':
            groups.setdefault(tuple(json.dumps(row[f], default=str) for f in flags), []).append(row)
    if all(len(g) < 2 for g in groups.values()):
        return None
    out = []
    for g in groups.values():
        med = {m: (statistics.mode if isinstance(v[0], str) else statistics.median)(v)  # a verdict: the most common
               if (v := [row[m] for row in g if row[m] is not None]) else None
               for m in METRICS}
        out.append({'runs': len(g), **{f: g[0][f] for f in flags}, **med})
    return ['runs'] + flags + METRICS, sort_rows(out, sort if sort not in ('run', 'status') else 'train_img_s')


def plot_comparison(columns, rows, out):
    """DataLoader trials at a glance: loading vs compute per step, labelled with train img/s."""
    rows = [r for r in rows if r['step_ms'] is not None]
    if not rows:
        return None
    p = plt()
    flags = [c for c in columns if c not in METRICS and c not in ('run', 'status', 'runs')]
    name = lambda r: r['run'] if 'run' in r else f"median of {r['runs']} run{'s' * (r['runs'] > 1)}"
    labels = [name(r) + ('\n' + ', '.join(f'{k}={fmt(r[k], k)}' for k in flags[:3]) if flags else '') for r in rows]
    fig, ax = p.subplots(figsize=(8, 1 + 0.55 * len(rows)))
    y = range(len(rows))[::-1]
    load = [r['load_ms'] or 0 for r in rows]
    ax.barh(y, load, color=COLORS['data'], label='loading (data wait + copy), mean')
    ax.barh(y, [r['compute_ms'] or 0 for r in rows], left=load, color=COLORS['forward'], label='compute, median')
    for yi, r, l in zip(y, rows, load):
        ax.text(l + (r['compute_ms'] or 0), yi, f"  {fmt(r['train_img_s'])} img/s", va='center', fontsize=8)
    ax.set_yticks(list(y), labels, fontsize=7)
    ax.set_xlabel('ms per step')
    ax.set_xlim(0, max(l + (r['compute_ms'] or 0) for r, l in zip(rows, load)) * 1.3)
    ax.set_title('Runs: where a step goes', pad=22)
    ax.legend(fontsize=7, ncol=2, loc='lower center', bbox_to_anchor=(0.5, 1.0), frameon=False)
    return save_fig(fig, out, 'comparison.png')


def comparison_view(rep):
    """The DataLoader-trials table: one row per run, medians per configuration when runs repeat one."""
    columns, rows = comparison(rep.runs, rep.sort)
    rep.table = columns, rows
    tables.write_csv(os.path.join(rep.out, 'comparison.csv'), columns, rows)
    md = ['## Comparison', '', f'Sorted by `{rep.sort}`, best first; also in [comparison.csv](comparison.csv). '
          f'Flags shown are those that differ between the runs. {HELP_COLUMNS}', '']
    md += md_table(shown(columns, rows), rows) + ['']
    rep.per_config = by_config(columns, rows, rep.sort)
    if rep.per_config:
        md += ['Per configuration, median of the completed runs (the machine is noisy: compare these):', '']
        md += md_table(shown(*rep.per_config), rep.per_config[1]) + ['']
        tables.write_csv(os.path.join(rep.out, 'comparison-by-config.csv'), *rep.per_config)
    png = guarded('comparison figure', lambda: plot_comparison(*(rep.per_config or (columns, rows)), rep.out),
                  rep.problems)
    return md + ([f'![comparison]({png})', ''] if isinstance(png, str) else [])


# ----------------------------------------------------------------- view: run dashboards and timelines

def dashboard(run, out):
    """controle_technique: one section per run."""
    md = [f'### {run.name}', '', f'**{verdict(run)}**', '']
    md += [f'*Note: {n}.*' for n in run.notes] + ([''] if run.notes else [])
    c, t, n = run.config, run.get('timing') or {}, numbers(run)
    if run.summary is None:
        last = last_record(run, 'train')
        if last:
            md += [f"Last log line: step {last.get('global_step')}, loss {fmt(last.get('loss'))}, "
                   f"{fmt(last.get('img_s'))} img/s, step {fmt(last.get('step_ms'))} ms.", '']
        return md
    pv = run.get('provenance') or {}
    first = (t.get('first_steps') or [None])[0] or {}
    e, m = run.get('energy') or {}, run.get('memory') or {}
    rows = [
        ('Train throughput', f"{fmt(n['train_img_s'])} img/s (images / total time of the steady steps)"),
        ('GPU throughput', f"{fmt(n['gpu_img_s'])} img/s (global batch / device work per step, {t.get('clock')} clock, "
                           f"from {t.get('gpu_step_source') or '?'} spans)"),
        ('Bound by', f"{n['bound']}{' (all ranks)' if t.get('bound_all_ranks') else ''}: device busy "
                     f"{fmt(n['busy_pct'])} % of the steady steps, data wait {fmt(n['data_pct'])} %"
                     + (f", exposed communication {fmt(scaled(t['comm_share'], 100))} %, waiting for a late rank "
                        f"{fmt(scaled(t.get('straggler_share'), 100))} %" if t.get('bound_all_ranks') else '')
                     + (f" (rank {t['straggler_rank']}, bound by {t['straggler_bound']})"
                        if n['bound'] == 'straggler' and t.get('straggler_rank') is not None else '')
                     if n['bound'] else '—'),
        ('Epoch time estimate', f"{hms(t.get('epoch_time_estimate_s'))} ({dig(run.summary, 'data', 'batches_per_epoch')}"
                                f" batches)"),
        ('Full validation estimate', hms(t.get('full_val_time_estimate_s'))),
        ('First step', f"{fmt(first.get('step', 0) * 1e3)} ms, of which loading "
                       f"{fmt((first.get('data') or 0) * 1e3 + (first.get('h2d') or 0) * 1e3)} ms (median step "
                       f"{fmt(n['step_ms'])} ms)" if first else '—'),
        ('Memory', f"GPU max allocated {gib(m.get('gpu_max_allocated_bytes'))}, reserved "
                   f"{gib(m.get('gpu_max_reserved_bytes'))} of {gib(pv.get('gpu_total_memory_bytes'))}; host peak "
                   f"{gib(m.get('host_peak_rss_bytes'))}"),
        ('Power, energy', f"peak {fmt(e.get('peak_w'))} W, mean {fmt(e.get('mean_w'))} W, "
                          f"{fmt(n['j_per_img'], 'j_per_img')} J/image" if e.get('available') else
         'not measured (no NVIDIA GPU or NVML)'),
        ('Processes', f"{run.world_size} on {run.get('num_nodes') or 1} node(s), global batch "
                      f"{run.get('global_batch')} ({c.get('batch_size')} per process)"),
        ('Optimizer', f"{c.get('optimizer')} lr {c.get('lr')} momentum {c.get('mom')} weight decay {c.get('wd')}, "
                      f"label smoothing {c.get('label_smoothing')}"),
        ('Scheduler', f"{c.get('scheduler')}, warm-up {c.get('warmup_epochs')} epochs"),
        ('Precision', f"amp {c.get('amp')}, channels-last {fmt(c.get('channels_last'))}, compile "
                      f"{fmt(c.get('compile'))}"),
        ('Loader', f"workers {c.get('num_workers')}, pin {fmt(c.get('pin_memory'))}, persistent "
                   f"{fmt(c.get('persistent_workers'))}, prefetch {fmt(c.get('prefetch_factor'))}, drop_last "
                   f"{fmt(c.get('drop_last'))}"),
        ('Validation', f"top-1 {fmt(dig(run.summary, 'val', 'top1'), 'top1')}, top-5 "
                       f"{fmt(dig(run.summary, 'val', 'top5'), 'top1')}, loss {fmt(dig(run.summary, 'val', 'loss'))} "
                       f"on {dig(run.summary, 'val', 'images')} images" if run.get('val') else 'none recorded'),
        ('Machine', f"{pv.get('device_name')} ({pv.get('device')}), torch {pv.get('torch')}, host {pv.get('host')}, "
                    f"SLURM job {pv.get('slurm_job_id') or '—'}, dlojz {str(pv.get('dlojz_sha') or '—')[:10]}"),
    ]
    if t.get('rank_skew') is not None:
        rows.append(('Stragglers', f"slowest rank {t['slowest_rank']} is {t['rank_skew'] * 100:.1f} % slower than "
                                   f"rank {t['fastest_rank']} (median step)"))
    md += ['| | |', '|---|---|'] + [f'| {k} | {v} |' for k, v in rows] + ['']
    st, share = t.get('stats') or {}, t.get('phase_share') or {}
    phase_rows = [{'phase': ph, 'median_ms': st[ph]['median'] * 1e3, 'mean_ms': st[ph]['mean'] * 1e3,
                   'std_ms': st[ph]['std'] * 1e3, 'p90_ms': st[ph]['p90'] * 1e3,
                   'share_pct': share[ph] * 100 if ph in share else None}
                  for ph in PHASES + ('step',) if isinstance(st.get(ph), dict) and st[ph].get('median') is not None]
    if phase_rows:
        md += [f"Step split over {dig(st, 'step', 'n')} steps after {t.get('warmup_steps')} warm-up step(s), "
               f"{t.get('clock')} clock; phase sum error {fmt(t.get('phase_sum_error'))}:", '']
        md += md_table(['phase', 'median_ms', 'mean_ms', 'std_ms', 'p90_ms', 'share_pct'], phase_rows,
                       ['phase', 'median ms', 'mean ms', 'std ms', 'p90 ms', 'share of steps %']) + ['']
    ranks = [r for r in t.get('ranks') or [] if isinstance(r, dict)]
    if ranks:  # stragglers and per-GPU memory (the course's pipe_memory)
        md += ['Per rank:', '']
        md += md_table(['rank', 'host', 'step_ms', 'data_ms', 'host_mem_gib', 'gpu_mem_gib', 'energy_j'], [{
            'rank': r.get('rank'), 'host': r.get('host'),
            'step_ms': scaled(r.get('step_median_s'), 1e3), 'data_ms': scaled(r.get('data_mean_s'), 1e3),
            'host_mem_gib': scaled(r.get('host_peak_rss_bytes'), 1 / GiB),
            'gpu_mem_gib': scaled(r.get('gpu_max_allocated_bytes'), 1 / GiB),
            'energy_j': r.get('energy_j')} for r in ranks],
            ['rank', 'host', 'median step ms', 'mean data wait ms', 'host peak GiB', 'GPU max allocated GiB',
             'energy J']) + ['']
    png = plot_timeline(run, out)
    if png:
        md += [f'![timeline of {run.name}]({png})', '']
    return md


def plot_timeline(run, out):
    """turbo_profiler: per-step stacked phases; a loader-bound run shows tall red (data) bars."""
    per = run.get('timing', 'per_step') or {}
    if not per.get('step'):
        return None
    p = plt()
    n, step = len(per['step']), per['step']
    fig, ax = p.subplots(figsize=(max(6, min(16, 0.25 * n + 4)), 3.5))
    bars, names = {ph: per[ph] for ph in PHASES if per.get(ph)}, {}
    if set(bars) <= {'data'}:  # --no-timing: only the data wait and the step were timed
        data = per.get('data') or [0.0] * n
        bars = {'data': data, 'other': [s - (d or 0) for s, d in zip(step, data)]}
        names = {'other': 'rest of the step (--no-timing)'}
    bottom = [0.0] * n
    for ph, values in bars.items():
        vals = [max(0.0, v or 0.0) * 1e3 for v in values]  # 'other' < 0 on GPU when the wait overlapped work
        ax.bar(range(1, n + 1), vals, bottom=bottom, color=COLORS[ph], label=names.get(ph, ph), width=0.85)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.plot(range(1, n + 1), [s * 1e3 for s in step], 'k.', ms=4, label='step (wall)')
    warm = run.get('timing', 'warmup_steps') or 0
    if warm:
        ax.axvspan(0.5, warm + 0.5, color='0.9', zorder=0, label='warm-up (excluded)')
    ax.set_xlabel('training step')
    ax.set_ylabel('ms')
    ax.set_title(f'{run.name}: time per step by phase ({run.get("timing", "clock") or "?"} clock)')
    ax.legend(fontsize=7, ncol=4, loc='upper right')
    return save_fig(fig, out, f'timeline-{slug(run.name)}.png')


def dashboards_view(rep):
    """controle_technique and turbo_profiler, one section per run (one odd run does not stop the others)."""
    md = ['## Runs', '']
    for r in rep.runs:
        md += guarded(f'dashboard of {r.name}', lambda r=r: dashboard(r, rep.out), rep.problems)
    return md


# ----------------------------------------------------------------------------- view: batch-size sweep

def fit_line(xs, ys):
    """Least-squares y = a + b·x -> (a, b). The course's formula assumed doubling batch sizes; this takes any."""
    n = len(xs)
    if n < 2 or len(set(xs)) < 2:
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def sweeps(runs):
    """Batch-size sweeps: same config but the batch size (and the LR, often scaled with it), same world size."""
    out = []
    for g in group_runs(runs, {'batch_size', 'lr'}):
        for ws in sorted({r.world_size for r in g}):
            s = sorted((r for r in g if r.world_size == ws), key=lambda r: r.batch_size)
            if len({r.batch_size for r in s}) >= 2:
                out.append(sweep(s))
    return out


def sweep(runs):
    gpu = any(r.get('memory', 'gpu_max_allocated_bytes') is not None for r in runs)
    key = 'gpu_max_allocated_bytes' if gpu else 'host_peak_rss_bytes'
    rows = []
    for r in runs:
        n = numbers(r)
        rows.append({'run': r.name, 'batch': r.batch_size, 'status': r.status, 'mem_bytes': r.get('memory', key),
                     'gpu_img_s': n['gpu_img_s'], 'train_img_s': n['train_img_s'], 'mean_w': r.get('energy', 'mean_w')})
    ok = [row for row in rows if row['status'] == 'completed' and row['mem_bytes'] is not None]
    fit = fit_line([row['batch'] for row in ok], [row['mem_bytes'] for row in ok])
    total = next((t for r in runs if (t := r.get('provenance', 'gpu_total_memory_bytes'))), None)
    return {'label': label(runs[0]), 'world_size': runs[0].world_size, 'memory': 'GPU max allocated' if gpu else
            'host peak RSS (CPU run: model, activations and the process itself)', 'rows': rows, 'fit': fit,
            'device_memory_bytes': total, 'device': runs[0].get('provenance', 'device_name')}


def plot_sweep(s, i, out):
    p = plt()
    fig, (a1, a2) = p.subplots(1, 2, figsize=(11, 4))
    xs = [r['batch'] for r in s['rows']]  # a numeric axis: the fit is a straight line over any batch sizes
    width = 0.6 * min((b - a for a, b in zip(xs, xs[1:])), default=1)
    mem = [(r['mem_bytes'] or 0) / GiB for r in s['rows']]
    a1.bar(xs, mem, width=width, color=['#d62728' if r['status'] == 'oom' else '#1f77b4' for r in s['rows']])
    for x, m, r in zip(xs, mem, s['rows']):
        if r['status'] == 'oom':
            a1.annotate('OOM', (x, m), ha='center', va='bottom', color='#d62728', fontweight='bold')
    if s['fit']:
        a, b = s['fit']
        a1.plot([0, max(xs)], [a / GiB, (a + b * max(xs)) / GiB], 'k--', lw=1,
                label=f'fit: {a / GiB:.3f} GiB + {b / 2**20:.2f} MiB/image')
    if s['device_memory_bytes']:
        a1.axhline(s['device_memory_bytes'] / GiB, color='#d62728', ls=':', label=f"{s['device']} memory")
    a1.set_xticks(xs)
    a1.set_xlabel('batch size per process')
    a1.set_ylabel(f"GiB, {s['memory'].split(' (')[0]}")
    a1.legend(fontsize=7, loc='lower right')
    ok = [(x, r) for x, r in zip(xs, s['rows']) if r['gpu_img_s']]
    a2.plot([x for x, _ in ok], [r['gpu_img_s'] for _, r in ok], 'g-o', label='GPU throughput (compute)')
    a2.plot([x for x, _ in ok], [r['train_img_s'] for _, r in ok], 'g--o', label='train throughput')
    a2.set_xticks(xs)
    a2.set_xlabel('batch size per process')
    a2.set_ylabel('images/s')
    a2.legend(fontsize=7)
    fig.suptitle(s['label'], fontsize=9)
    return save_fig(fig, out, f'sweep-{i}.png')


def sweep_view(rep):
    """GPU_underthehood: memory and throughput vs batch size."""
    runs, out = rep.runs, rep.out
    lines = []
    for i, s in enumerate(sweeps(runs), 1):
        lines += [f'### {s["label"]}, {s["world_size"]} process(es)', '', f'Memory: {s["memory"]}.', '']
        lines += md_table(['run', 'batch', 'status', 'mem_gib', 'gpu_img_s', 'train_img_s', 'mean_w'],
                          [{**row, 'mem_gib': scaled(row['mem_bytes'], 1 / GiB)}
                           for row in s['rows']]) + ['']
        if s['fit']:
            a, b = s['fit']
            lines += [f'Least-squares line over the {sum(r["status"] == "completed" for r in s["rows"])} '
                      f'completed runs: memory = {a / GiB:.3f} GiB (fixed: model, gradients, optimizer state, '
                      f'workspace) + {b / 2**20:.2f} MiB per image.', '']
        lines += [f'![batch-size sweep]({plot_sweep(s, i, out)})', '']
    return ['## Batch-size sweep', ''] + lines if lines else []


# -------------------------------------------------------------------------------------- view: scaling

def step_terms(run):
    """A run's mean steady step (s, mean over its ranks) and its ranks' waits per step in collectives
    (measure.scaling.collective_waits: the transfer, the wait for a late rank); None where not measured."""
    t = run.get('timing') or {}
    ranks = [r for r in t.get('ranks') or [] if r.get('steady_steps')]
    if ranks:
        step = statistics.fmean(r['wall_s'] / r['steady_steps'] for r in ranks)
    elif dig(t, 'totals', 'steady_steps'):
        step = t['totals']['wall_s'] / t['totals']['steady_steps']
    else:
        return None, None, None
    if not ranks:  # one process: nothing to wait for
        return step, 0.0, 0.0
    return (step, *collective_waits(t))


def scalings(runs):
    """Same config at several world sizes -> img/s vs processes and efficiency vs linear scaling. The LR may
    differ: by default dlojz scales it with the global batch (linear scaling rule).

    Each world size's lost efficiency (1 - efficiency, in points) is split, from the runs' measured sums,
    into: exposed communication (comm_pts), waiting for a late rank (straggler_pts), and the rest (rest_pts:
    compute slowed by communication kernels or threads sharing the device or the cores, DDP's copies, noise),
    each term = its seconds per step above the smallest world size's / the step at that world size; the
    terms add up to the loss because the rest is what the measured terms leave of it."""
    out = []
    for g in group_runs(runs, {'lr'}):
        by_ws = {}
        for r in g:
            img_s = numbers(r)['train_img_s']
            if r.status == 'completed' and img_s:
                by_ws.setdefault(r.world_size, []).append((img_s, step_terms(r)))
        if len(by_ws) < 2:
            continue
        base_ws = min(by_ws)
        base = statistics.median(i for i, _ in by_ws[base_ws])
        base_terms = [t for _, t in by_ws[base_ws] if t[0] and t[1] is not None]
        # the smallest world size is the reference: what it already waited (a launcher's world of one still
        # all-reduces with itself) is not a loss of the larger ones
        base_step, base_comm, base_late = (statistics.median(t[k] for t in base_terms) for k in range(3)) \
            if base_terms else (None, 0.0, 0.0)
        rows = []
        for ws, v in sorted(by_ws.items()):
            img_s = statistics.median(i for i, _ in v)
            row = {'world_size': ws, 'runs': len(v), 'global_batch': ws * g[0].batch_size, 'train_img_s': img_s,
                   'speedup': img_s / base, 'efficiency': img_s / base / (ws / base_ws),
                   'step_ms': None, 'comm_pts': None, 'straggler_pts': None, 'rest_pts': None}
            terms = [t for _, t in v if t[0] and t[1] is not None]
            if terms and base_step:
                step, comm, late = (statistics.median(t[k] for t in terms) for k in range(3))
                loss = 100 * (1 - row['efficiency'])
                row.update(step_ms=step * 1e3, comm_pts=100 * (comm - base_comm) / step,
                           straggler_pts=100 * (late - base_late) / step)
                row['rest_pts'] = loss - row['comm_pts'] - row['straggler_pts']
            rows.append(row)
        out.append({'label': label(g[0]) + f', {g[0].batch_size} images per process', 'rows': rows})
    return out


def plot_scaling(s, i, out):
    p = plt()
    fig, (a1, a2) = p.subplots(1, 2, figsize=(10, 3.5))
    ws = [r['world_size'] for r in s['rows']]
    a1.plot(ws, [r['train_img_s'] for r in s['rows']], 'b-o', label='measured')
    base = s['rows'][0]
    a1.plot(ws, [base['train_img_s'] * w / base['world_size'] for w in ws], 'k:', label='linear')
    a1.set_xlabel('processes (GPUs)')
    a1.set_ylabel('train images/s')
    a1.legend(fontsize=7)
    x = [str(w) for w in ws]
    eff = [r['efficiency'] * 100 for r in s['rows']]
    a2.bar(x, eff, label='efficiency')
    if any(r['comm_pts'] is not None for r in s['rows']):  # the lost points, stacked on top, as measured
        bottom = list(eff)
        for key, name, colour in (('comm_pts', 'exposed communication', 'tab:red'),
                                  ('straggler_pts', 'waiting for a late rank', 'tab:orange'),
                                  ('rest_pts', 'rest (compute slowed, noise)', 'tab:gray')):
            h = [max(0.0, r[key] or 0.0) for r in s['rows']]
            a2.bar(x, h, bottom=bottom, label=name, color=colour)
            bottom = [b + v for b, v in zip(bottom, h)]
        a2.legend(fontsize=7)
    a2.axhline(100, color='k', ls=':')
    a2.set_xlabel('processes (GPUs)')
    a2.set_ylabel('efficiency vs linear (%)')
    fig.suptitle(s['label'], fontsize=9)
    return save_fig(fig, out, f'scaling-{i}.png')


def scaling_view(rep):
    """img/s and efficiency vs world size."""
    runs, out = rep.runs, rep.out
    lines = []
    for i, s in enumerate(scalings(runs), 1):
        lines += [f'### {s["label"]}', '']
        lines += md_table(['world_size', 'runs', 'global_batch', 'train_img_s', 'speedup', 'efficiency', 'step_ms',
                           'comm_pts', 'straggler_pts', 'rest_pts'],
                          s['rows']) + ['', f'![scaling]({plot_scaling(s, i, out)})', '']
    return ['## Scaling', '', 'Median train img/s of the runs at each world size; efficiency = speedup / '
            '(processes / smallest processes). The lost points (100 - efficiency %) split as measured by the '
            'ranks: exposed communication (comm_pts), waiting for a late rank (straggler_pts) and the rest '
            '(rest_pts: compute slowed by communication sharing the device or the cores, copies, noise); '
            'each is its seconds per step / the step (step_ms).', ''] + lines if lines else []


# --------------------------------------------------------------------------- view: NCCL communication

# ncclDataType_t (nccl.h): value -> (name, bytes per element).
NCCL_DTYPES = {0: ('int8', 1), 1: ('uint8', 1), 2: ('int32', 4), 3: ('uint32', 4), 4: ('int64', 8), 5: ('uint64', 8),
               6: ('float16', 2), 7: ('float32', 4), 8: ('float64', 8), 9: ('bfloat16', 2), 10: ('float8e4m3', 1),
               11: ('float8e5m2', 1)}


# "host:pid:tid [0] NCCL INFO AllReduce: opCount 1b sendbuff 0x.. recvbuff 0x.. count 237184 datatype 7 op 0
#  root 0 comm 0x7f0c741162f0 [nranks=2] stream 0x.."  (NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=COLL)
COLL_RE = re.compile(r'\[(\d+)\] NCCL INFO (\w+): opCount (\w+) .*?\bcount (\d+) datatype (\d+)(?:.*?\bcomm (\S+))?'
                     r'(?:.*?\[nranks=(\d+)\])?')


# "host:pid:tid [0] NCCL INFO comm 0x55d6 rank 3 nranks 4 cudaDev 0 busId 7000 commId 0x.. - Init COMPLETE"
INIT_RE = re.compile(r'NCCL INFO comm (\S+) rank (\d+) nranks (\d+).*Init COMPLETE')


# dlojz's markers (--nccl-debug): "Train step k - rank r" before step k (0: initialisation), "Validation - rank r".
MARK_RE = re.compile(r'(?:Train step (\d+)|(Validation)) - rank (\d+)\s*$')


def parse_nccl(lines, file_rank=None):
    """NCCL collective lines -> list of ops, each tagged with the phase ('init', 'step k', 'valid') its rank
    was in. The rank of an op is its communicator's global rank (Init COMPLETE lines), else file_rank."""
    comm_rank, phase, ops = {}, {}, []
    for line in lines:
        if (m := MARK_RE.search(line)):
            step, valid, rank = m.groups()
            phase[int(rank)] = 'valid' if valid else 'init' if step == '0' else f'step {int(step)}'
        elif (m := INIT_RE.search(line)):
            comm_rank[m.group(1)] = int(m.group(2))
        elif (m := COLL_RE.search(line)):
            local, op, opcount, count, dtype, comm, nranks = m.groups()
            rank = comm_rank.get(comm, file_rank if file_rank is not None else int(local))
            name, size = NCCL_DTYPES.get(int(dtype), (f'type {dtype}', None))
            ops.append({'rank': rank, 'phase': phase.get(rank, 'init'), 'op': op, 'opcount': int(opcount, 16),
                        'count': int(count), 'dtype': name,
                        # bytes handed to NCCL per rank (an AllGather receives nranks times this)
                        'bytes': int(count) * size if size else None,
                        'nranks': int(nranks) if nranks else None})
    return ops


PHASE_ORDER = {'init': 0, 'train': 1, 'valid': 2}


def phase_kind(phase):
    return 'train' if phase.startswith('step') else phase


def comm_view(run, max_steps=10):
    """The run's nccl.rank<r>.log files -> tables of collectives by phase and type, or None without logs."""
    logs = sorted((int(m.group(1)), os.path.join(run.path, n)) for n in os.listdir(run.path)
                  if (m := re.fullmatch(r'nccl\.rank(\d+)\.log', n)))
    if not logs:
        return None
    ops = []
    for rank, path in logs:
        with open(path, errors='replace') as f:
            ops.extend(parse_nccl(f, rank))
    if not ops:
        return {'ops': [], 'logs': len(logs)}
    ranks = sorted({o['rank'] for o in ops})
    r0 = [o for o in ops if o['rank'] == ranks[0]]
    steps = sorted({int(o['phase'].split()[1]) for o in r0 if o['phase'].startswith('step')})
    table = {}
    for o in r0:
        row = table.setdefault((phase_kind(o['phase']), o['op']), {'calls': 0, 'bytes': 0})
        row['calls'] += 1
        row['bytes'] += o['bytes'] or 0
    per_rank = {r: (sum(1 for o in ops if o['rank'] == r), sum(o['bytes'] or 0 for o in ops if o['rank'] == r))
                for r in ranks}
    allreduce = dict.fromkeys(steps, 0)  # one pass: a --nccl-debug log of a long run has many ops
    for o in r0:
        if o['op'] == 'AllReduce' and o['phase'].startswith('step'):
            allreduce[int(o['phase'].split()[1])] += o['bytes'] or 0
    return {'ops': ops, 'logs': len(logs), 'ranks': ranks, 'steps': steps, 'table': table, 'per_rank': per_rank,
            'consistent': len(set(per_rank.values())) == 1, 'shown_steps': steps[:max_steps],
            'allreduce_per_step': statistics.median(allreduce.values()) if allreduce else None,
            'estimate': run.get('communication', 'gradient_bytes_per_step'),
            'unknown_dtypes': sorted({o['dtype'] for o in ops if o['bytes'] is None})}


ZOOM_BYTES = 64 * 1024  # below this an op is "small": metric syncs, BN buffer broadcasts, NaN guards


def plot_comm(run, c, out):
    p = plt()
    r0 = [o for o in c['ops'] if o['rank'] == c['ranks'][0]]
    phases = ['init'] + [f'step {s}' for s in c['shown_steps']] + ['valid']
    types = sorted({o['op'] for o in r0})
    cmap = p.get_cmap('tab10')
    fig, (a1, a2) = p.subplots(2, 1, figsize=(12, 6.5))
    bottom = [0.0] * len(phases)
    for j, t in enumerate(types):
        vals = [sum(o['bytes'] or 0 for o in r0 if o['phase'] == ph and o['op'] == t) for ph in phases]
        a1.bar(phases, vals, bottom=bottom, color=cmap(j % 10), label=t)
        bottom = [b + v for b, v in zip(bottom, vals)]
    a1.set_yscale('symlog', linthresh=1)
    a1.set_ylim(bottom=0)
    a1.set_ylabel(f'bytes (rank {c["ranks"][0]})')
    a1.set_title(f'{run.name}: NCCL collectives per phase, total {sum(o["bytes"] or 0 for o in r0):,} bytes')
    a1.legend(fontsize=7)
    a1.tick_params(axis='x', labelsize=7, rotation=45)
    small = [o for o in sorted(r0, key=lambda o: o['opcount']) if (o['bytes'] or 0) < ZOOM_BYTES and
             (o['phase'] in phases)]
    a2.bar(range(len(small)), [o['bytes'] or 0 for o in small], color=[cmap(types.index(o['op']) % 10) for o in small])
    a2.set_xticks(range(len(small)), [o['phase'] for o in small], fontsize=6, rotation=90)
    a2.set_yscale('symlog', linthresh=1)  # 4-byte metric syncs next to kilobyte buffers
    a2.set_ylim(bottom=0)
    a2.set_ylabel('bytes')
    a2.set_title(f'zoom: the {len(small)} ops under {ZOOM_BYTES // 1024} KiB, in order (colour = type)')
    return save_fig(fig, out, f'comm-{slug(run.name)}.png')


def communication_view(rep):
    """comm_profiler: NCCL collectives from the nccl.rank<r>.log files."""
    runs, out, comm_steps = rep.runs, rep.out, rep.comm_steps
    lines = []
    for r in runs:
        c = comm_view(r, comm_steps)
        if c is None:
            continue
        lines += [f'### {r.name}', '']
        if not c['ops']:
            lines += [f"{c['logs']} nccl.rank*.log file(s) but no NCCL collective line: the run used gloo "
                      f"(CPU), or NCCL_DEBUG=INFO with NCCL_DEBUG_SUBSYS=COLL was not in effect.", '']
            continue
        ranks, n_steps = c['ranks'], len(c['steps'])
        table = [{'phase': k, 'op': op, 'calls': v['calls'], 'bytes': v['bytes'],
                  'calls_per_step': v['calls'] / n_steps if k == 'train' and n_steps else None,
                  'bytes_per_step': v['bytes'] / n_steps if k == 'train' and n_steps else None}
                 for (k, op), v in sorted(c['table'].items(), key=lambda kv: (PHASE_ORDER.get(kv[0][0], 3), kv[0][1]))]
        lines += [f"Rank {ranks[0]}, {n_steps} training steps; bytes = count × datatype size as handed to NCCL "
                  f"(an AllGather receives nranks times this).", '']
        lines += md_table(['phase', 'op', 'calls', 'bytes', 'calls_per_step', 'bytes_per_step'], table) + ['']
        per_rank = ', '.join(f'rank {k} {n} ops / {b:,} B' for k, (n, b) in c['per_rank'].items())
        lines += [('All ranks issued the same collectives: ' if c['consistent'] else
                   '**Ranks differ** (a rank running other collectives hangs the job): ') + per_rank, '']
        if c['allreduce_per_step'] is not None and c['estimate']:
            lines += [f"Gradient AllReduce per step: {c['allreduce_per_step']:,.0f} B measured (median) vs "
                      f"{c['estimate']:,} B expected (4 B per trainable parameter).", '']
        if c['unknown_dtypes']:
            lines += [f"Unknown NCCL datatypes, bytes not counted: {', '.join(c['unknown_dtypes'])}.", '']
        lines += [f'![communication]({plot_comm(r, c, out)})', '']
    return ['## Communication (NCCL)', ''] + lines if lines else []


# ------------------------------------------------------------------------------------ view: BatchNorm

BN_STATS = ('running_mean', 'running_var', 'weight', 'bias')


def bn_layers(state_dict):
    """Every BatchNorm layer (one with a running_mean: downsample.1 included, which the course's 'bn' name
    filter missed) -> {layer: {stat: mean of the tensor}}, in state-dict order."""
    out = {}
    for k in state_dict:
        if k.endswith('.running_mean'):
            layer = k[:-len('.running_mean')]
            out[layer] = {s: float(state_dict[f'{layer}.{s}'].float().mean()) for s in BN_STATS
                          if f'{layer}.{s}' in state_dict}
    return out


def checkpoint_weights(path):
    """A dlojz checkpoint (dict with 'model') or a bare state dict (the course's) -> state dict, unprefixed.
    Checkpoints are unpickled in full: read only your own."""
    state = load_checkpoint(path)
    sd = state.get('model', state) if isinstance(state, dict) else {}
    return strip_prefixes(sd)


def bn_view(runs):
    """-> {'layers': [...], 'runs': {name: {layer: stats}}, 'checkpoints': {name: path}} or None."""
    per_run, paths, notes = {}, {}, []
    for r in runs:
        ckpts = list_checkpoints(r.path)
        if not ckpts:
            continue
        try:
            per_run[r.name] = bn_layers(checkpoint_weights(ckpts[-1]))
            paths[r.name] = os.path.basename(ckpts[-1])
        except UsageError as e:
            notes.append(f'{r.name}: {e}')
    if not per_run:
        return None if not notes else {'layers': [], 'runs': {}, 'checkpoints': {}, 'notes': notes}
    layers = list(dict.fromkeys(l for v in per_run.values() for l in v))
    return {'layers': layers, 'runs': per_run, 'checkpoints': paths, 'notes': notes}


def plot_bn(bn, out):
    p = plt()
    fig, axes = p.subplots(2, 2, figsize=(13, 7))
    x = range(len(bn['layers']))
    for ax, stat in zip(axes.flat, BN_STATS):
        for name, layers in bn['runs'].items():
            ax.plot(x, [layers.get(l, {}).get(stat, float('nan')) for l in bn['layers']], '-o', ms=3, label=name)
        ax.set_title(f'mean of {stat}')
        ax.set_xticks(list(x), bn['layers'], rotation=90, fontsize=5)
    axes.flat[0].legend(fontsize=7)
    return save_fig(fig, out, 'batchnorm.png')


def batchnorm_view(rep):
    """BatchNorm_view: the newest checkpoint of each run."""
    runs, out = rep.runs, rep.out
    bn = bn_view(runs)
    if bn is None:
        return []
    lines = ['## BatchNorm view', '']
    lines += [f'*{n}*' for n in bn['notes']]
    if not bn['runs']:
        return lines + ['']
    lines += [f"Mean of each BatchNorm tensor, {len(bn['layers'])} layers (downsample included), from "
              + ', '.join(f'{k}: {v}' for k, v in bn['checkpoints'].items()) + '.', '']
    if len(bn['runs']) > 1:
        rows_bn = []
        for stat in BN_STATS:
            spread = [(max(v[l][stat] for v in bn['runs'].values() if l in v and stat in v[l]) -
                       min(v[l][stat] for v in bn['runs'].values() if l in v and stat in v[l]), l)
                      for l in bn['layers'] if all(l in v and stat in v[l] for v in bn['runs'].values())]
            d, layer = max(spread) if spread else (None, None)
            rows_bn.append({'stat': stat, 'max_diff': d, 'layer': layer})
        lines += md_table(['stat', 'max_diff', 'layer'], rows_bn, ['statistic', 'largest difference between '
                          'runs', 'at layer']) + ['']
    tables.write_csv(os.path.join(out, 'batchnorm.csv'), ['run', 'layer'] + list(BN_STATS),
                     [[name, l] + [v.get(s) for s in BN_STATS] for name, layers in bn['runs'].items()
                      for l, v in layers.items()])
    return lines + ['Per layer values: [batchnorm.csv](batchnorm.csv).', '', f'![BatchNorm]({plot_bn(bn, out)})',
                    '']


# ------------------------------------------------------------------------------ view: metric sync log

def metric_sync_rows(run):
    rows = []
    for rec in run.records:
        if rec.get('type') != 'metric_sync':
            continue
        for r in rec.get('ranks') or []:
            before, after = r.get('before') or {}, r.get('after') or {}
            rows.append({'step': rec.get('global_step'), 'rank': r.get('rank'),
                         'loss_before': before.get('loss'), 'loss_after': after.get('loss'),
                         'top1_before': before.get('top1'), 'top1_after': after.get('top1')})
    return rows


def metric_sync_view(rep):
    """metric_compute_log: per-rank values before and after the sync."""
    runs = rep.runs
    lines = []
    for r in runs:
        rows_s = metric_sync_rows(r)
        if rows_s:
            steps = {}
            for row in rows_s:
                steps.setdefault(row['step'], set()).add((row['loss_after'], row['top1_after']))
            agree = all(len(v) == 1 for v in steps.values())
            lines += [f'### {r.name}', '', f"After compute() every rank holds the same values: "
                      f"{'yes' if agree else '**no**'} ({len(steps)} syncs).", '']
            lines += md_table(['step', 'rank', 'loss_before', 'loss_after', 'top1_before', 'top1_after'],
                              rows_s) + ['']
    return ['## Metric sync log', '', 'Per-rank training metrics before (local) and after (synced) '
            'the meters\' compute(), from `--metric-sync-log`.', ''] + lines if lines else []


# ------------------------------------------------------------------------------------ view: LR finder

def lr_suggestion(lrs, losses):
    """-> (smoothed curve, cut, suggested lr or None, why): dlojz's own rule (recipe.suggest_lr, the
    steepest descent of the smoothed loss), so the report says what the console and summary.json said. The
    curve is cut where the sweep counts as diverged; `smoothed` is the centered mean the suggestion follows."""
    cut = diverged_at(losses)
    suggested, why = suggest_lr(lrs, losses)
    return centered_mean(losses[:cut], max(1, cut // 20)), cut, suggested, why


def lr_plot_ylim(losses, smoothed):
    """The loss axis of the LR finder plot: the smoothed curve with a margin; raw spikes above it are clipped
    (one loss of 120 squashed the descent into a flat line)."""
    lo = min([v for v in losses if math.isfinite(v)] + list(smoothed))
    hi = max(smoothed)
    margin = 0.15 * (hi - lo) or 0.1 * abs(hi) or 1.0
    return lo - margin / 3, hi + margin


def plot_lr(run, lrs, losses, sm, cut, suggested, out):
    p = plt()
    fig, ax = p.subplots(figsize=(7, 3.5))
    ax.plot(lrs[:cut], losses[:cut], color='#9ecae1', lw=1, label='loss')
    ax.plot(lrs[:cut], sm, color='navy', label='smoothed (centered mean)')
    if suggested:
        ax.axvline(suggested, color='#d62728', ls='--', label=f'suggested lr {suggested:.3g} (steepest descent)')
    ax.set_ylim(*lr_plot_ylim(losses[:cut], sm))
    ax.set_xscale('log')
    ax.set_xlabel('learning rate')
    ax.set_ylabel('training loss')
    ax.set_title(f'{run.name}: LR range test')
    ax.legend(fontsize=7)
    return save_fig(fig, out, f'lrfind-{slug(run.name)}.png')


def lr_finder_view(rep):
    """lrfind_plot: smoothed loss vs LR and a suggestion."""
    runs, out = rep.runs, rep.out
    lines = []
    for r in runs:
        fl = r.get('findlr')
        if not fl or not fl.get('lr'):
            continue
        lrs, losses = fl['lr'], [v if v is not None else float('nan') for v in fl['loss']]
        sm, cut, suggested, why = lr_suggestion(lrs, losses)
        lines += [f'### {r.name}', '', f"{len(lrs)} steps from lr {lrs[0]:.3g} to {lrs[-1]:.3g}; " +
                  (f"**suggested lr {suggested:.3g}** ({why})." if suggested else f"no suggestion: {why}."), '']
        if len(lrs) < FINDLR_MIN_STEPS:
            lines += [f'A sweep of fewer than {FINDLR_MIN_STEPS} steps places the suggestion coarsely; sweep '
                      f'longer (--test-nsteps).', '']
        if fl.get('stopped'):  # dlojz stops a sweep when the loss diverges
            lines += [f"The sweep ended: {fl['stopped']}.", '']
        if cut:
            lines += [f'![LR finder]({plot_lr(r, lrs, losses, sm, cut, suggested, out)})', '']
    return ['## LR finder', ''] + lines if lines else []


# ------------------------------------------------------------------------------- view: loader doctor

def plot_doctor(run, tune, out):
    """One bar per loader trial (images/second), the compute ceiling as a line: bars short of it are
    settings that would leave the model waiting."""
    trials, ceiling = tune['trials'], tune['ceiling']['images_per_second']
    p = plt()
    fig, ax = p.subplots(figsize=(8, 1.2 + 0.4 * len(trials)))
    y = range(len(trials))[::-1]
    ips = [t['images_per_second'] for t in trials]
    colors = [COLORS['data'] if v < ceiling else COLORS['forward'] for v in ips]
    ax.barh(y, ips, color=colors)
    ax.axvline(ceiling, color='black', linestyle='--', label=f'compute ceiling (--fake-data) {ceiling:.0f} img/s')
    labels = [f"{t['num_workers']} workers, prefetch {t['prefetch_factor'] or '-'}, {t['decode']}"
              + ('' if t['pin_memory'] is None else f", pin {'on' if t['pin_memory'] else 'off'}") for t in trials]
    ax.set_yticks(list(y), labels, fontsize=7)
    ax.set_xlabel('loader images/second (red: below the ceiling)')
    ax.set_title(f'Loader doctor: {run.name}', pad=22)
    ax.legend(fontsize=7, loc='lower center', bbox_to_anchor=(0.5, 1.0), frameon=False)
    return save_fig(fig, out, f'doctor-{slug(run.name)}.png')


def doctor_view(rep):
    """The loader doctor's trials (--tune-loader): the course's DataLoader-trials table and a figure."""
    lines = []
    for r in rep.runs:
        tune = r.get('tune_loader')
        if not tune or not tune.get('trials'):
            continue
        v = tune['verdict']
        rows = [{'workers': t['num_workers'], 'pin': t['pin_memory'], 'prefetch': t['prefetch_factor'],
                 'decode': t['decode'], 'img_s': t['images_per_second'],
                 'img_s_per_worker': t['images_per_second_per_worker'], 'load_s': t['wait_mean_s'],
                 'first_s': t['first_batch_s'], 'host_mem_gib': t['host_peak_bytes'] / 2**30}
                for t in tune['trials']]
        lines += [f'### {r.name}', '', f"Compute ceiling {v['ceiling_images_per_second']:.1f} img/s; best loader "
                  f"setting {v['best']['images_per_second']:.1f} img/s: **{v['bound']}-bound**.", '']
        lines += md_table(list(rows[0]), rows) + ['', f'![loader doctor]({plot_doctor(r, tune, rep.out)})', '']
    return ['## Loader doctor', ''] + lines if lines else []


# ----------------------------------------------------------------------------------- view: tuning (--tune)

def plot_tune(run, trials, out):
    """Throughput and memory against the batch per device, one line per configuration (precision,
    channels-last, compile): where a line flattens, a larger batch buys nothing."""
    p = plt()
    fig, (a1, a2) = p.subplots(1, 2, figsize=(11, 4))
    configs = {}
    for t in trials:
        if t['status'] == 'completed':
            key = f"{t['amp']}, {'NHWC' if t['channels_last'] else 'NCHW'}, {'compiled' if t['compile'] else 'eager'}"
            configs.setdefault(key, []).append(t)
    for i, (key, ts) in enumerate(sorted(configs.items())):
        ts = sorted(ts, key=lambda t: t['batch'])
        b = [t['batch'] for t in ts]
        a1.plot(b, [t['images_per_s'] for t in ts], 'o-', color=f'C{i % 10}', label=key)
        a2.plot(b, [(t['memory_bytes'] or 0) / GiB for t in ts], 'o-', color=f'C{i % 10}', label=key)
    for ax, label in ((a1, 'images/second'), (a2, 'memory peak, GiB')):
        ax.set_xscale('log', base=2)
        ax.set_xlabel('batch per device')
        ax.set_ylabel(label)
    a1.legend(fontsize=7)
    fig.suptitle(f'Tuning: {run.name}')
    return save_fig(fig, out, f'tune-{slug(run.name)}.png')


def tune_view(rep):
    """The tuner's trials (--tune): its table, the recommended command, the scaling forecast, a figure."""
    lines = []
    for r in rep.runs:
        tune = r.get('tune')
        if not tune or not tune.get('trials'):
            continue
        rows = [{'batch': t['batch'], 'amp': t['amp'], 'channels_last': t['channels_last'], 'compile': t['compile'],
                 'img_s': t['images_per_s'], 'step_ms': t['step_ms'],
                 'memory_gib': (t['memory_bytes'] or 0) / GiB if t['memory_bytes'] is not None else None,
                 'bound': t['bound'], 'status': t['status']} for t in tune['trials']]
        lines += [f'### {r.name}', ''] + md_table(list(rows[0]), rows) + ['']
        rec = tune.get('recommended')
        if rec:
            lines += [f"Recommended ({rec['images_per_s']:.1f} img/s): `{rec['command']}`; {rec['lr_rule']}.", '']
        if tune.get('skipped'):
            lines += [f"Skipped for the time budget: {', '.join(tune['skipped'])}.", '']
        if tune.get('forecast'):
            lines += ['Scaling forecast (docs/scaling.md: an upper bound):', '']
            lines += md_table(['gpus', 'nodes', 'images_per_s', 'efficiency'], tune['forecast']) + ['']
        lines += [f"![tuning]({plot_tune(r, tune['trials'], rep.out)})", '']
    return ['## Tuning', ''] + lines if lines else []


# ------------------------------------------------------------------------------ view: time to accuracy

def accuracy_curve(run, kind):
    """[(wall s, images seen, top-1)] of the run's validations ('val' raw, 'val_ema' EMA) that carry them."""
    return [(r['wall_s'], r['train_images'], r['top1']) for r in run.records
            if r.get('type') == kind and r.get('wall_s') is not None and r.get('train_images') is not None]


def plot_race(runs, targets, out):
    """The race's figure: validation top-1 against wall time and against images seen, one colour per run,
    the EMA dashed, the --target-top1 lines dotted. A run with one validation (a --test run) is one point: it
    gets a large marker and its top-1 written beside it, and both axes start at 0, so it does not vanish in a
    corner of an empty figure."""
    p = plt()
    fig, axes = p.subplots(1, 2, figsize=(11, 4), sharey=True)
    longest = max(w for r in runs for w, _, _ in accuracy_curve(r, 'val'))
    unit, unit_name = (60, 'minutes') if longest > 600 else (1, 's')
    for i, r in enumerate(runs):
        color = f'C{i % 10}'
        for kind, style in (('val', '-'), ('val_ema', '--')):
            pts = accuracy_curve(r, kind)
            if not pts:
                continue
            name = r.name + (' (EMA)' if kind == 'val_ema' else '')
            size = 7 if len(pts) <= 3 else 3  # few validations: the markers are the figure
            for ax, xs in ((axes[0], [w / unit for w, _, _ in pts]), (axes[1], [n for _, n, _ in pts])):
                ax.plot(xs, [t for _, _, t in pts], style, color=color, marker='o', markersize=size,
                        label=name if ax is axes[0] else None)
                if len(pts) == 1:
                    ax.annotate(f'{pts[0][2]:.3f}', (xs[0], pts[0][2]), textcoords='offset points', xytext=(6, 4),
                                fontsize=7, color=color)
    for ax, xlabel in zip(axes, (f'wall time since the start, {unit_name}', 'training images seen')):
        for t in targets:
            ax.axhline(t, color='grey', linestyle=':', linewidth=1)
        ax.set_xlim(left=0)
        ax.set_ylim(bottom=0)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel('validation top-1')
    axes[0].legend(fontsize=7)
    fig.suptitle('Time to accuracy')
    return save_fig(fig, out, 'time-to-accuracy.png')


def race_view(rep):
    """Validation top-1 against wall time and images seen for every run that validated, and when each
    reached its --target-top1 (summary.json['time_to_accuracy'])."""
    runs = [r for r in rep.runs if accuracy_curve(r, 'val')]
    if not runs:
        return []
    rows, targets = [], set()
    for r in runs:
        tta = dig(r.summary, 'time_to_accuracy') or {}
        if tta.get('target_top1') is not None:
            targets.add(tta['target_top1'])
        row = {'run': r.name, 'target_top1': tta.get('target_top1'),
               'best_top1': max(t for *_, t in accuracy_curve(r, 'val'))}
        for kind in ('raw', 'ema'):
            hit = tta.get(kind) or {}
            row[f'{kind}_wall_s'], row[f'{kind}_epoch'], row[f'{kind}_images'] = (
                hit.get('wall_s'), hit.get('epoch'), hit.get('train_images'))
        rows.append(row)
    tables.write_csv(os.path.join(rep.out, 'time-to-accuracy.csv'), list(rows[0]), rows)
    return ['## Time to accuracy', '', 'When validation top-1 first reached `--target-top1` (raw weights and EMA; '
            'empty: not reached or no target).', ''] + md_table(list(rows[0]), rows) + [
        '', f'![time to accuracy]({plot_race(runs, sorted(targets), rep.out)})', '']


# ----------------------------------------------------------------------------------------- view: diff

def config_diff(a, b):
    """-> [(section, key, value in a, value in b)] for config and provenance entries that differ."""
    out = []
    for section, da, db in (('config', a.config, b.config),
                            ('provenance', a.get('provenance') or {}, b.get('provenance') or {})):
        for k in sorted(set(da) | set(db)):
            if k in ('output_dir', 'time') or da.get(k) == db.get(k):
                continue
            out.append((section, k, da.get(k, '—'), db.get(k, '—')))
    if a.world_size != b.world_size:
        out.append(('run', 'world_size', a.world_size, b.world_size))
    return out


def diff_view(rep):
    if len(rep.runs) != 2:
        return []
    a, b = rep.runs
    return ['## Diff', '', f'`{a.name}` vs `{b.name}`:', ''] + md_table(
        ['section', 'key', 'a', 'b'], [dict(zip(('section', 'key', 'a', 'b'), d)) for d in config_diff(a, b)],
        ['', 'key', a.name, b.name]) + ['']


# ----------------------------------------------------------------------------------------- the report

@dataclass
class Report:
    """What every view is given: the runs, where to write and the options. A view returns its Markdown
    lines ([] when it does not apply) and may leave results here for the command line (the table)."""
    runs: list
    out: str
    sort: str = 'train_img_s'
    comm_steps: int = 10
    skipped: tuple = ()
    problems: list = field(default_factory=list)
    table: tuple = None       # comparison (columns, rows), printed by main
    per_config: tuple = None  # medians per repeated configuration, or None


VIEWS = [('comparison', comparison_view), ('run dashboards', dashboards_view), ('batch-size sweep', sweep_view),
         ('scaling', scaling_view), ('communication', communication_view), ('BatchNorm view', batchnorm_view),
         ('metric sync log', metric_sync_view), ('LR finder', lr_finder_view), ('loader doctor', doctor_view), ('tuning', tune_view),
         ('time to accuracy', race_view), ('diff', diff_view)]


def guarded(title, build, problems):
    """A part that fails on odd input becomes a sentence in the report, never a traceback. A user error
    (ReportError: a bad --sort) still stops the command."""
    try:
        return build()
    except ReportError:
        raise
    except Exception as e:  # noqa: BLE001 - a report of many runs must survive one bad run
        problems.append(f'{title}: {type(e).__name__}: {e}')
        return [f'*{title} could not be built: {type(e).__name__}: {e}*', '']


def build_report(rep):
    """Write rep.out/report.md with its figures and CSV files, one view after the other; -> rep."""
    os.makedirs(rep.out, exist_ok=True)
    md = ['# dlojz report', '',
          f'{len(rep.runs)} run(s), generated {datetime.datetime.now():%Y-%m-%d %H:%M} by `dlojz_report.py`.', '']
    md += [f'*Skipped (not a dlojz run directory): {p}*' for p in rep.skipped] + ([''] if rep.skipped else [])
    for title, view in VIEWS:
        md += guarded(title, lambda view=view: view(rep), rep.problems)
    if rep.problems:
        md += ['## Problems', ''] + [f'- {p}' for p in rep.problems] + ['']
    with open(os.path.join(rep.out, 'report.md'), 'w') as f:
        f.write('\n'.join(md))
    return rep


# --------------------------------------------------------------------------------------- command line

def get_args_parser():
    p = argparse.ArgumentParser(description='Report on dlojz run directories: Markdown + PNG figures + CSV.',
                                epilog='python dlojz_report.py diff RUN_A RUN_B prints their configuration '
                                       'differences.')
    p.add_argument('runs', nargs='+', help='run directories written by dlojz.py (--output-dir), or folders '
                                           'holding them (e.g. runs/)')
    p.add_argument('--out', default='report', help='folder for report.md, comparison.csv and the figures '
                                                   '(default: ./report)')
    p.add_argument('--sort', default='train_img_s', help='comparison column to sort by, best first (throughputs and '
                                                         'top1 descending, times and memory ascending); default '
                                                         'train_img_s')
    p.add_argument('--comm-steps', type=int, default=10, help='training steps shown in the communication figure')
    return p


def diff_main(argv):
    p = argparse.ArgumentParser(prog='dlojz_report.py diff', description='Configuration differences of two runs.')
    p.add_argument('a')
    p.add_argument('b')
    args = p.parse_args(argv)
    runs, _ = collect_runs([args.a, args.b])
    if len(runs) != 2:
        raise ReportError(f'diff compares two run directories, got {len(runs)}; pass exactly two.')
    diff = config_diff(*runs)
    print('\n'.join(text_table(['section', 'key', runs[0].name, runs[1].name],
                               [dict(zip(('section', 'key', runs[0].name, runs[1].name), d)) for d in diff]))
          if diff else 'same configuration and provenance')


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ['diff'] and not is_run_dir('diff'):
        return diff_main(argv[1:])
    args = get_args_parser().parse_args(argv)
    runs, skipped = collect_runs(args.runs)
    try:  # a folder that cannot be created or written, or --out naming a file
        rep = build_report(Report(runs, args.out, args.sort, args.comm_steps, skipped))
    except OSError as e:
        raise ReportError(f'cannot write the report into {args.out} ({e.strerror or e}); pass a writable --out.')
    if rep.table:
        print('\n'.join(text_table(shown(*rep.table), rep.table[1])))
    if rep.per_config:
        print('\nMedian per configuration:')
        print('\n'.join(text_table(shown(*rep.per_config), rep.per_config[1])))
    for r in runs:
        if r.status != 'completed':
            print(f'{r.name}: {verdict(r)}')
    for p in skipped:
        print(f'skipped {p}: not a dlojz run directory')
    for p in rep.problems:
        print(f'problem: {p}', file=sys.stderr)
    print(f'Report written to {os.path.join(args.out, "report.md")}')


def cli(argv=None):
    try:
        main(argv)
    except ReportError as e:
        print(f'dlojz_report: error: {e}', file=sys.stderr)
        return 2
    except SystemExit as e:  # argparse's usage errors (already printed) and --help, as a return code
        return e.code
    return 0


if __name__ == '__main__':
    sys.exit(cli())
