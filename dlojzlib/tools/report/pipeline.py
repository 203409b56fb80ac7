"""The pipeline view: each pipeline run's stages, what they computed and waited (their bubble, the
schedule's beside it), and the timeline of a median step of each stage (dist.stages.summary)."""
from dlojzlib.tools.report.common import md_table, plt, save_fig, slug

COLORS = {'F': '#4c72b0', 'B': '#dd8452'}


def text_timeline(p, width=60):
    """One line a stage: F and B where its chunks ran, '.' where it waited, on a shared scale."""
    span = max((s['timeline_span_s'] or 0.0 for s in p['stages']), default=0.0)
    span = span if span > 0 else 1.0
    # a column of the line, for a time inside the span (a chunk outside it is drawn at its edge)
    at = lambda t: int(min(max(t / span, 0.0), 1.0) * width)  # noqa: E731
    lines = []
    for s in p['stages']:
        row = ['.'] * width
        for kind, _, start, end in s['timeline'] or []:
            for i in range(at(start), max(at(start) + 1, at(end))):
                row[min(i, width - 1)] = kind
        lines.append(f"stage {s['stage']} |{''.join(row)}|")
    return lines


def plot_stages(run, p, out):
    fig, ax = plt().subplots(figsize=(8, 0.6 * len(p['stages']) + 1.5))
    for s in p['stages']:
        for kind, k, start, end in s['timeline'] or []:
            ax.broken_barh([(start * 1e3, (end - start) * 1e3)], (s['stage'] - 0.4, 0.8),
                           color=COLORS[kind])
            ax.text((start + end) / 2 * 1e3, s['stage'], f'{kind}{k}', ha='center', va='center',
                    fontsize=6, color='white')
    ax.set_yticks([s['stage'] for s in p['stages']])
    ax.set_yticklabels([f"stage {s['stage']}" for s in p['stages']])
    ax.invert_yaxis()
    ax.set_xlabel('ms from the start of the schedule (each stage its own clock)')
    ax.set_title(f"{run.name}: {p['schedule']}, {p['microbatches']} microbatches, bubble "
                 f"{p['measured_bubble']:.1%} measured, {p['expected_bubble']:.1%} the schedule's")
    return save_fig(fig, out, f'pipeline-{slug(run.name)}.png')


def pipeline_view(rep):
    runs = [r for r in rep.runs if (r.get('timing') or {}).get('pipeline')]
    if not runs:
        return []
    md = ['## Pipelines', '']
    for run in runs:
        p = run.get('timing')['pipeline']
        md += [f"### {run.name}", '',
               f"{p['n_stages']} stages, {p['schedule']}, {p['microbatches']} microbatches: bubble "
               f"{p['measured_bubble']:.1%} measured, {p['expected_bubble']:.1%} the schedule's; "
               f"forecast {p['forecast_span_s'] * 1e3:.1f} ms a step from the slowest stage, "
               f"measured {p['span_s'] * 1e3:.1f} ms.", '']
        md += md_table(['stage', 'compute_ms', 'wait_ms', 'bubble_pct'], [
            {'stage': s['stage'], 'compute_ms': s['compute_s'] * 1e3, 'wait_ms': s['wait_s'] * 1e3,
             'bubble_pct': s['bubble'] * 100} for s in p['stages']],
            ['stage', 'compute ms', 'waits ms', 'bubble %']) + ['']
        md += ['A median step, F forward, B backward, . waiting:', '', '```',
               *text_timeline(p), '```', '']
        md += [f'![stages of {run.name}]({plot_stages(run, p, rep.out)})', '']
    return md
