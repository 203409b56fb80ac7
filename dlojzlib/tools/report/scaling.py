"""The scaling view: runs of one configuration at several world sizes, their step split in measured
terms."""
import statistics

from dlojzlib.measure.scaling import collective_waits
from dlojzlib.tools.report.common import group_runs, label, md_table, numbers, plt, save_fig
from dlojzlib.tools.report.runs import dig


def step_terms(run):
    """A run's mean steady step (s, mean over its ranks) and its ranks' waits per step in
    collectives (measure.scaling.collective_waits: the transfer, the wait for a late rank); None
    where not measured."""
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
    """Same config at several world sizes -> img/s vs processes and efficiency vs linear scaling.
    The LR may differ: by default dlojz scales it with the global batch (linear scaling rule).

    Each world size's lost efficiency (1 - efficiency, in points) is split, from the runs' measured
    sums, into: exposed communication (comm_pts), waiting for a late rank (straggler_pts), and the
    rest (rest_pts: compute slowed by communication kernels or threads sharing the device or the
    cores, DDP's copies, noise), each term = its seconds per step above the smallest world size's /
    the step at that world size; the terms add up to the loss because the rest is what the measured
    terms leave of it."""
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
        # the smallest world size is the reference: what it already waited (a launcher's world of
        # one still all-reduces with itself) is not a loss of the larger ones
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
    lines = []
    for i, s in enumerate(scalings(rep.runs), 1):
        lines += [f'### {s["label"]}', '']
        lines += md_table(['world_size', 'runs', 'global_batch', 'train_img_s', 'speedup', 'efficiency', 'step_ms',
                           'comm_pts', 'straggler_pts', 'rest_pts'],
                          s['rows']) + ['', f'![scaling]({plot_scaling(s, i, rep.out)})', '']
    return ['## Scaling', '', 'Median train img/s of the runs at each world size; efficiency = speedup / '
            '(processes / smallest processes). The lost points (100 - efficiency %) split as measured by the '
            'ranks: exposed communication (comm_pts), waiting for a late rank (straggler_pts) and the rest '
            '(rest_pts: compute slowed by communication sharing the device or the cores, copies, noise); '
            'each is its seconds per step / the step (step_ms).', ''] + lines if lines else []
