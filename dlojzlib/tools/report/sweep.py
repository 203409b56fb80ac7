"""The batch-size sweep view (the course's GPU_underthehood): throughput and memory against the
batch."""
from dlojzlib.tools.report.common import (GiB, group_runs, label, md_table, numbers, plt, save_fig,
                                          scaled)


def fit_line(xs, ys):
    """Least-squares y = a + b·x -> (a, b). The course's formula assumed doubling batch sizes; this
    takes any."""
    n = len(xs)
    if n < 2 or len(set(xs)) < 2:
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def sweeps(runs):
    """Batch-size sweeps: same config but the batch size (and the LR, often scaled with it), same
    world size."""
    out = []
    for g in group_runs(runs, {'batch_size', 'lr'}):
        g = [r for r in g if r.batch_size is not None]  # a config without it is no point of a sweep
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
        rows.append({'run': r.name, 'batch': r.batch_size, 'status': r.status,
                     'mem_bytes': r.get('memory', key),
                     'gpu_img_s': n['gpu_img_s'], 'train_img_s': n['train_img_s'],
                     'mean_w': r.get('energy', 'mean_w')})
    ok = [row for row in rows if row['status'] == 'completed' and row['mem_bytes'] is not None]
    fit = fit_line([row['batch'] for row in ok], [row['mem_bytes'] for row in ok])
    total = next((t for r in runs if (t := r.get('provenance', 'gpu_total_memory_bytes'))), None)
    return {'label': label(runs[0]), 'world_size': runs[0].world_size,
            'memory': 'GPU max allocated' if gpu else
            'host peak RSS (CPU run: model, activations and the process itself)', 'rows': rows,
            'fit': fit,
            'device_memory_bytes': total, 'device': runs[0].get('provenance', 'device_name')}


def plot_sweep(s, i, out):
    p = plt()
    fig, (a1, a2) = p.subplots(1, 2, figsize=(11, 4))
    xs = [r['batch'] for r in s['rows']]  # a numeric axis: the fit is a straight line over any batch sizes
    width = 0.6 * min((b - a for a, b in zip(xs, xs[1:])), default=1)
    mem = [(r['mem_bytes'] or 0) / GiB for r in s['rows']]
    a1.bar(xs, mem, width=width,
           color=['#d62728' if r['status'] == 'oom' else '#1f77b4' for r in s['rows']])
    for x, m, r in zip(xs, mem, s['rows']):
        if r['status'] == 'oom':
            a1.annotate('OOM', (x, m), ha='center', va='bottom', color='#d62728', fontweight='bold')
    if s['fit']:
        a, b = s['fit']
        a1.plot([0, max(xs)], [a / GiB, (a + b * max(xs)) / GiB], 'k--', lw=1,
                label=f'fit: {a / GiB:.3f} GiB + {b / 2**20:.2f} MiB/image')
    if s['device_memory_bytes']:
        a1.axhline(s['device_memory_bytes'] / GiB, color='#d62728', ls=':',
                   label=f"{s['device']} memory")
    a1.set_xticks(xs)
    a1.set_xlabel('batch size per process')
    a1.set_ylabel(f"GiB, {s['memory'].split(' (')[0]}")
    a1.legend(fontsize=7, loc='lower right')
    ok = [(x, r) for x, r in zip(xs, s['rows']) if r['gpu_img_s']]
    a2.plot([x for x, _ in ok], [r['gpu_img_s'] for _, r in ok], 'g-o',
            label='GPU throughput (compute)')
    a2.plot([x for x, _ in ok], [r['train_img_s'] for _, r in ok], 'g--o', label='train throughput')
    a2.set_xticks(xs)
    a2.set_xlabel('batch size per process')
    a2.set_ylabel('images/s')
    a2.legend(fontsize=7)
    fig.suptitle(s['label'], fontsize=9)
    return save_fig(fig, out, f'sweep-{i}.png')


def sweep_view(rep):
    """GPU_underthehood: memory and throughput vs batch size."""
    lines = []
    for i, s in enumerate(sweeps(rep.runs), 1):
        lines += [f'### {s["label"]}, {s["world_size"]} process(es)', '', f'Memory: {s["memory"]}.',
                  '']
        lines += md_table(['run', 'batch', 'status', 'mem_gib', 'gpu_img_s', 'train_img_s',
                           'mean_w'],
                          [{**row, 'mem_gib': scaled(row['mem_bytes'], 1 / GiB)}
                           for row in s['rows']]) + ['']
        if s['fit']:
            a, b = s['fit']
            lines += [f'Least-squares line over the '
                      f'{sum(r["status"] == "completed" for r in s["rows"])} completed runs: '
                      f'memory = {a / GiB:.3f} GiB (fixed: model, gradients, optimizer state, '
                      f'workspace) + {b / 2**20:.2f} MiB per image.', '']
        lines += [f'![batch-size sweep]({plot_sweep(s, i, rep.out)})', '']
    return ['## Batch-size sweep', ''] + lines if lines else []
