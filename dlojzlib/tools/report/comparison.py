"""The comparison view: one row per run (or per configuration), the course's DataLoader-trials
table."""
import json
import os
import statistics

from dlojzlib import tables
from dlojzlib.tools.report.common import (COLORS, DERIVED_KEYS, HIGHER_IS_BETTER, METRICS,
                                          PATH_KEYS, fmt, guarded, md_table, numbers, plt, save_fig,
                                          shown)
from dlojzlib.tools.report.runs import ReportError


HELP_COLUMNS = ('load_ms: mean data wait + host-to-device copy per step; compute_ms: mean compute '
                'per step, the copy left out (GPU: device time of the step\'s work; CPU: step '
                'without the data wait), so that load_ms + compute_ms is the mean step; step_ms: '
                'median step; train_img_s = images / total time of the steady steps; gpu_img_s = '
                'global batch / device work per step (clean spans, docs/chronometer.md); busy_pct: '
                'device busy time / step time over the steady steps and data_pct: data wait / step '
                'time (both summed over the ranks when every rank was measured); bound: compute, '
                'loader, host, communication or straggler; host_mem_gib: peak RSS (VmHWM) of rank '
                '0; gpu_mem_gib: max allocated (any rank); j_per_img: GPU energy per image (all '
                'ranks); top1: last validation.')


def differing_keys(runs):
    """Config keys (and world size) whose values are not the same in every run."""
    keys = sorted(set().union(*(r.config for r in runs)) - PATH_KEYS - DERIVED_KEYS)
    diff = [k for k in keys if len({json.dumps(r.config.get(k), sort_keys=True,
                                               default=str) for r in runs}) > 1]
    if len({r.world_size for r in runs}) > 1:
        diff.append('world_size')
    return diff


def comparison(runs, sort='train_img_s'):
    """-> (columns, rows): one row per run; the flags that differ, then the measured figures; best
    first."""
    flags = differing_keys(runs)
    rows = []
    for r in runs:
        row = {'run': r.name, 'status': r.status}
        row.update({k: r.world_size if k == 'world_size' else r.config.get(k) for k in flags})
        row.update(numbers(r))
        rows.append(row)
    columns = ['run', 'status'] + flags + METRICS
    if sort not in columns:
        raise ReportError(f'--sort {sort} is not a column of this comparison; choose one of '
                          f'{", ".join(columns)}.')
    return columns, sort_rows(rows, sort)


def sort_rows(rows, col):
    """Best first; rows without the value go last, in input order."""
    present = [row for row in rows if row.get(col) is not None]
    key = lambda row: (0, row[col]) if isinstance(row[col], (int, float)) else (1, str(row[col]))
    present.sort(key=key, reverse=col in HIGHER_IS_BETTER)
    return present + [row for row in rows if row.get(col) is None]


def by_config(columns, rows, sort):
    """Repeated runs of one configuration (same values of the differing flags) -> one row of medians
    over the completed runs, or None when no configuration was repeated."""
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
    # both means per step (sums over the steady steps / their number): a bar is the mean step
    ax.barh(y, load, color=COLORS['data'], label='loading (data wait + copy), mean per step')
    ax.barh(y, [r['compute_ms'] or 0 for r in rows], left=load, color=COLORS['forward'],
            label='compute (the copy left out), mean per step')
    for yi, r, l in zip(y, rows, load):
        ax.text(l + (r['compute_ms'] or 0), yi, f"  {fmt(r['train_img_s'])} img/s", va='center',
                fontsize=8)
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
    md = ['## Comparison', '',
          f'Sorted by `{rep.sort}`, best first; also in [comparison.csv](comparison.csv). Flags '
          f'shown are those that differ between the runs. {HELP_COLUMNS}', '']
    md += md_table(shown(columns, rows), rows) + ['']
    rep.per_config = by_config(columns, rows, rep.sort)
    if rep.per_config:
        md += ['Per configuration, median of the completed runs (the machine is noisy: compare '
               'these):', '']
        md += md_table(shown(*rep.per_config), rep.per_config[1]) + ['']
        tables.write_csv(os.path.join(rep.out, 'comparison-by-config.csv'), *rep.per_config)
    png = guarded('comparison figure',
                  lambda: plot_comparison(*(rep.per_config or (columns, rows)), rep.out),
                  rep.problems)
    return md + ([f'![comparison]({png})', ''] if isinstance(png, str) else [])
