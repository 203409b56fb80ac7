"""The scaling view: runs of one configuration at several world sizes, their step split in measured
terms."""
import statistics

from dlojzlib.measure.scaling import step_split
from dlojzlib.tools.report.common import group_runs, label, md_table, numbers, plt, save_fig


# the measured terms of a lost efficiency: (step_split's key, the column, the figure's legend)
TERMS = (('comm', 'comm_pts', 'exposed communication'),
         ('late', 'straggler_pts', 'waiting for a late rank'),
         ('work', 'compute_slowed_pts', 'compute slowed'),
         ('data', 'loader_slowed_pts', 'loader slowed'))
COLUMNS = ['comm_pts', 'straggler_pts', 'compute_slowed_pts', 'loader_slowed_pts', 'rest_pts']


def scalings(runs):
    """Same config at several world sizes -> img/s vs processes and efficiency vs linear scaling.
    The LR may differ: by default dlojz scales it with the global batch (linear scaling rule).

    Each world size's lost efficiency (1 - efficiency, in points) is split, from the runs' measured
    sums (measure.scaling.step_split: seconds per step, as the job's typical rank saw it), into:
    exposed communication (comm_pts), waiting for a late rank (straggler_pts), the device's own
    work per step grown (compute_slowed_pts: communication kernels or threads sharing the device or
    the cores) and the data wait grown (loader_slowed_pts), each = its seconds per step above the
    smallest world size's / the step at that world size (medians over the runs). What they leave of
    the loss is rest_pts, shown, never spread over them: the host's own time grown (launches,
    Python), and the difference between the throughput and the steps (noise between runs). A term
    the runs did not measure is None, and its part stays in the rest."""
    out = []
    for g in group_runs(runs, {'lr'}):
        by_ws = {}
        for r in g:
            img_s = numbers(r)['train_img_s']
            if r.status == 'completed' and img_s:
                split = step_split(r.get('timing') or {})
                by_ws.setdefault(r.world_size, []).append((img_s, split))
        if len(by_ws) < 2:
            continue
        base_ws = min(by_ws)
        base = statistics.median(i for i, _ in by_ws[base_ws])
        # the smallest world size is the reference: what it already waited (a launcher's world of
        # one still all-reduces with itself) is not a loss of the larger ones
        base_split = medians(by_ws[base_ws])
        rows = []
        for ws, v in sorted(by_ws.items()):
            img_s = statistics.median(i for i, _ in v)
            batch = g[0].batch_size
            row = {'world_size': ws, 'runs': len(v),
                   'global_batch': ws * batch if batch is not None else None,
                   'train_img_s': img_s,
                   'speedup': img_s / base, 'efficiency': img_s / base / (ws / base_ws),
                   'step_ms': None, **dict.fromkeys(COLUMNS)}
            split = medians(v)
            if split.get('step') and base_split.get('step'):
                row['step_ms'] = split['step'] * 1e3
                for key, column, _ in TERMS:
                    if split.get(key) is not None and base_split.get(key) is not None:
                        row[column] = 100 * (split[key] - base_split[key]) / split['step']
                if row['comm_pts'] is not None:
                    named = sum(row[c] or 0.0 for c in COLUMNS[:-1])
                    row['rest_pts'] = 100 * (1 - row['efficiency']) - named
            rows.append(row)
        out.append({'label': label(g[0]) + f', {g[0].batch_size} images per process', 'rows': rows})
    return out


def medians(runs):
    """{key: median over the runs that measured it} of their step splits ((img/s, split) pairs)."""
    splits = [s for _, s in runs if s]
    keys = {k for s in splits for k, v in s.items() if v is not None}
    return {k: statistics.median(s[k] for s in splits if s.get(k) is not None) for k in keys}


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
        colours = ('tab:red', 'tab:orange', 'tab:purple', 'tab:green', 'tab:gray')
        legends = [name for _, _, name in TERMS] + ['rest (host, noise)']
        for key, name, colour in zip(COLUMNS, legends, colours):
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
    lines = []
    for i, s in enumerate(scalings(rep.runs), 1):
        lines += [f'### {s["label"]}', '']
        lines += md_table(['world_size', 'runs', 'global_batch', 'train_img_s', 'speedup',
                           'efficiency', 'step_ms',
                           *COLUMNS],
                          s['rows']) + ['', f'![scaling]({plot_scaling(s, i, rep.out)})', '']
    return ['## Scaling', '', 'Median train img/s of the runs at each world size; efficiency = '
            'speedup / (processes / smallest processes). The lost points (100 - efficiency %) '
            'split as measured by the ranks, each term its seconds per step above the smallest '
            'world size\'s / the step (step_ms): exposed communication (comm_pts), waiting for a '
            'late rank (straggler_pts), the device\'s own work grown (compute_slowed_pts: '
            'communication sharing the device or the cores), the data wait grown '
            '(loader_slowed_pts), and what they leave unexplained (rest_pts: the host\'s time, '
            'noise between runs), shown as it is.', ''] + \
        lines if lines else []
