"""The run dashboards (the course's controle_technique) and step timelines (turbo_profiler)."""
from dlojz_chrono import PHASES
from dlojzlib.record.summary import job_key, share_text, straggler_text, whose
from dlojzlib.tools.report.common import (COLORS, GiB, fmt, gib, guarded, hms, last_record,
                                          md_table, numbers, plt, save_fig, scaled, slug, verdict)
from dlojzlib.tools.report.runs import dig


def bound_cell(n, t):
    """The run's verdict and what each share of its steady steps went to, as its '>>> Bound by' line
    gives them; a summary from before the shares (issue 39): device busy and the waits."""
    if not n['bound']:
        why = (t.get('unmeasured') or {}).get('bound')
        return f'not measured: {why}' if why else '—'
    every = f' ({whose(t)})' if whose(t) else ''
    late = (f" ({straggler_text(t)})"
            if n['bound'] == 'straggler' and t.get('straggler_rank') is not None else '')
    split = share_text(t)
    if split:
        return f"{n['bound']}{every}: {split} of the steady steps{late}"
    comm = fmt(scaled(t.get('comm_share'), 100))
    waits = (f", exposed communication {comm} %, waiting for a late "
             f"rank {fmt(scaled(t.get('straggler_share'), 100))} "
             f"%" if job_key(t, 'bound') else '')
    return (f"{n['bound']}{every}: device busy {fmt(n['busy_pct'])} % of the steady steps, data "
            f"wait {fmt(n['data_pct'])} %{waits}{late}")


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
    why = t.get('unmeasured') or {}  # what the run's '>>>' lines said instead of a figure
    rows = [
        ('Train throughput', f"not measured: {why['train_throughput']}"
         if n['train_img_s'] is None and 'train_throughput' in why else
         f"{fmt(n['train_img_s'])} img/s (images / total time of the steady steps)"),
        ('GPU throughput', f"{fmt(n['gpu_img_s'])} img/s (global batch / device work per step, {t.get('clock')} clock, "
                           f"from {t.get('gpu_step_source') or '?'} spans)"),
        ('Bound by', bound_cell(n, t)),
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
         f"not measured: {e.get('why_unavailable') or 'no NVIDIA GPU or NVML'}"),
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
        skew = f"{t['rank_skew'] * 100:.1f}"
        rows.append(('Stragglers', f"slowest rank {t.get('slowest_rank')} is {skew} % slower than "
                                   f"rank {t.get('fastest_rank')} (median step)"))
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
    # each series as long as the steps' (a summary edited by hand may hold fewer or more)
    bars = {ph: (list(per[ph]) + [None] * n)[:n] for ph in PHASES if per.get(ph)}
    names = {}
    if set(bars) <= {'data'}:  # --no-timing: only the data wait and the step were timed
        data = bars.get('data') or [0.0] * n
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
    """controle_technique and turbo_profiler, one section per run (one odd run does not stop the
    others)."""
    md = ['## Runs', '']
    for r in rep.runs:
        md += guarded(f'dashboard of {r.name}', lambda r=r: dashboard(r, rep.out), rep.problems)
    return md
