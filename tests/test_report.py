"""tools.report: the report reads real run directories and its numbers are the runs' own.

Run directories come from real tiny CPU runs of dlojz.py made once per session (a DataLoader trial,
a batch-size sweep, world sizes 1 and 2 with checkpoints and --metric-sync-log, --findlr, a NaN run
and a run killed mid-checkpoint); NCCL logs, which need GPUs, are written here in NCCL's own line
format with hand-counted bytes. Expected values come from the summaries, numpy or torchvision, never
from tools.report itself. The time-to-accuracy figure keeps runs with one validation visible.

    python -m pytest -q tests/test_report.py
"""
import json
import math
import os
import re
import shutil
import statistics

import numpy as np
import pytest
import torch
import torchvision

from conftest import run_cli, run_main, torchrun, TINY
from dlojzlib.tools import report
from dlojzlib.tools.report import common, metric_sync, race, scaling
from dlojzlib.tools.report.batchnorm import bn_view
from dlojzlib.tools.report.communication import comm_view, parse_nccl
from dlojzlib.tools.report.lr_finder import lr_plot_ylim, lr_suggestion
from dlojzlib.tools.report.runs import collect_runs
from dlojzlib.tools.report.sweep import fit_line, sweeps

STEPS = ['--test-nsteps', '6', '--log-interval', '2']


@pytest.fixture(scope='module')
def runs(tmp_path_factory, cache_dir):
    """name -> run directory, made by dlojz itself."""
    root = tmp_path_factory.mktemp('runs')
    d = {}

    def make(name, *flags):
        d[name] = root / name
        run_main(d[name], cache_dir, *STEPS, *flags)

    # a small DataLoader trial (pinned memory is refused on CPU, so workers and persistence vary)
    make('w0', '--num-workers', '0')
    make('w0b', '--num-workers', '0')  # a repeat: the report gives medians per configuration
    make('w1', '--num-workers', '1')
    make('w2', '--num-workers', '2')
    make('w2np', '--num-workers', '2', '--no-persistent-workers')  # persistent is the default with workers
    for b in (4, 6, 10):  # not a doubling series; own processes, so that each peak RSS is its own
        d[f'b{b}'] = root / 'sweep' / f'b{b}'
        p = run_cli(*TINY, '--cache-dir', cache_dir, '--output-dir', d[f'b{b}'], '--test-nsteps', '4', '-b', b,
                    '--lr', '0.01')
        assert p.returncode == 0, p.stderr[-2000:]
    # world sizes 1 and 2; --nccl-debug writes the logs (markers only: gloo prints no NCCL lines)
    sync = ['--chkpt', '--metric-sync-log', '--metric-step', '2', '--nccl-debug']
    d['ws1'] = root / 'ws1'
    p = run_cli(*TINY, '--cache-dir', cache_dir, '--output-dir', d['ws1'], *STEPS, *sync)
    assert p.returncode == 0, p.stderr[-3000:]
    d['ws2'] = root / 'ws2'
    p = torchrun(2, *TINY, '--cache-dir', cache_dir, '--output-dir', d['ws2'], *STEPS, *sync)
    assert p.returncode == 0, p.stderr[-3000:]
    make('findlr', '--findlr', '--test-nsteps', '12')
    make('notiming', '--no-timing')
    make('evaluate', '--evaluate', '--resume', sorted(d['ws1'].glob('checkpoint-*.pt'))[-1])
    d['nan'] = root / 'nan'
    p = run_cli(*TINY, '--cache-dir', cache_dir, '--output-dir', d['nan'], *STEPS, '--lr', '1e4')
    assert p.returncode == 3, p.stderr[-2000:]
    d['nan_stderr'] = p.stderr
    d['crash'] = root / 'crash'  # killed while writing its second checkpoint: no summary.json
    p = run_cli(*TINY, '--cache-dir', cache_dir, '--output-dir', d['crash'], *STEPS, '--chkpt-every', '2',
                env={'DLOJZ_FAULT': 'kill-in-checkpoint:2'})
    assert p.returncode == -9, p.stderr[-2000:]
    return d


def summary(path):
    with open(os.path.join(path, 'summary.json')) as f:
        return json.load(f)


def make_report(tmp_path, *paths, args=()):
    out = tmp_path / 'report'
    code = report.cli([str(p) for p in paths] + ['--out', str(out)] + list(args))
    if code == 0:  # no section of a report on dlojz's own runs may fail
        assert '## Problems' not in (out / 'report.md').read_text()
    return code, out


def read_csv(path):
    import csv
    with open(path) as f:
        return list(csv.DictReader(f))


def check_figures(out):
    """Every figure the report links exists and is a non-trivial PNG."""
    text = (out / 'report.md').read_text()
    names = re.findall(r'!\[[^\]]*\]\(([^)]+\.png)\)', text)
    for n in names:
        data = (out / n).read_bytes()
        assert data[:8] == b'\x89PNG\r\n\x1a\n' and len(data) > 5000, n
    return names


@pytest.mark.slow
def test_dataloader_trial_table_matches_summaries(runs, tmp_path, capsys):
    trial = [runs[n] for n in ('w0', 'w1', 'w2', 'w2np', 'w0b')]
    code, out = make_report(tmp_path, *trial)
    assert code == 0
    rows = read_csv(out / 'comparison.csv')
    flags = [c for c in rows[0] if c not in common.METRICS and c not in ('run', 'status')]
    # only what differs, as resolved by dlojz (prefetch 2 with workers, none without); paths never
    assert flags == ['num_workers', 'persistent_workers', 'prefetch_factor']
    by_run = {r['run']: r for r in rows}
    for name in ('w0', 'w1', 'w2', 'w2np'):
        s, row = summary(runs[name]), by_run[name]
        per, warm = s['timing']['per_step'], s['timing']['warmup_steps']
        load = statistics.fmean(d + h for d, h in zip(per['data'][warm:], per['h2d'][warm:]))
        assert float(row['load_ms']) == pytest.approx(load * 1e3, rel=1e-9)
        # both means (the figure stacks them): together the mean step, the copy counted once
        compute = statistics.fmean(c - h for c, h in zip(per['compute'][warm:], per['h2d'][warm:]))
        assert float(row['compute_ms']) == pytest.approx(compute * 1e3, rel=1e-9)
        mean_step = statistics.fmean(per['step'][warm:]) * 1e3
        both = float(row['load_ms']) + float(row['compute_ms'])
        assert both == pytest.approx(mean_step, rel=0.01)
        assert float(row['step_ms']) == pytest.approx(statistics.median(per['step'][warm:]) * 1e3, rel=1e-9)
        steady = per['step'][warm:]  # a rate is a sum: images of the steady steps / their time
        assert float(row['train_img_s']) == pytest.approx(8 * len(steady) / sum(steady), rel=1e-9)
        assert float(row['host_mem_gib']) == s['memory']['host_peak_rss_bytes'] / 2 ** 30
        assert float(row['top1']) == s['val']['top1']
        assert row['num_workers'] == str(s['config']['num_workers'])
    img_s = [float(r['train_img_s']) for r in rows]
    assert img_s == sorted(img_s, reverse=True)  # default sort: train throughput, best first
    per_config = {(r['num_workers'], r['persistent_workers']): r for r in read_csv(out / 'comparison-by-config.csv')}
    assert len(per_config) == 4 and per_config[('0', '')]['runs'] == '2' and per_config[('1', 'True')]['runs'] == '1'
    repeats = [summary(runs[n])['timing']['train_throughput'] for n in ('w0', 'w0b')]
    assert float(per_config[('0', '')]['train_img_s']) == pytest.approx(sum(repeats) / 2, rel=1e-12)
    printed = capsys.readouterr().out
    assert 'num_workers' in printed and f"{float(rows[0]['train_img_s']):.1f}" in printed
    assert (out / 'comparison.png').exists() and 'timeline-w0.png' in check_figures(out)
    assert '## Problems' not in (out / 'report.md').read_text()


@pytest.mark.slow
def test_sort_column_and_bad_column(runs, tmp_path, capsys):
    code, out = make_report(tmp_path, runs['w0'], runs['w2'], args=['--sort', 'load_ms'])
    rows = read_csv(out / 'comparison.csv')
    assert code == 0 and [float(r['load_ms']) for r in rows] == sorted(float(r['load_ms']) for r in rows)
    code, _ = make_report(tmp_path, runs['w0'], runs['w2'], args=['--sort', 'speed'])
    err = capsys.readouterr().err
    assert code == 2 and '--sort speed is not a column' in err and 'Traceback' not in err


def test_fit_recovers_a_known_line_from_non_doubling_batch_sizes():
    batches = [3, 7, 12, 20, 33]
    fixed, per_image = 1.75e9, 2.5e7
    a, b = fit_line(batches, [fixed + per_image * x for x in batches])
    assert a == pytest.approx(fixed, rel=1e-9) and b == pytest.approx(per_image, rel=1e-9)
    # the course's two-point formula M = m2 - (b2/b1)(m2 - m1) is only right for b2 = 2 b1; here it
    # is not
    m1, m2 = fixed + per_image * 7, fixed + per_image * 12
    assert abs((m2 - 12 / 7 * (m2 - m1)) - fixed) > 1e7
    assert fit_line([4, 4], [1.0, 2.0]) is None


@pytest.mark.slow
def test_batch_size_sweep_from_real_runs(runs, tmp_path):
    oom = tmp_path / 'b16'  # what dlojz writes on CUDA out of memory (a CPU run cannot be made to OOM here)
    shutil.copytree(runs['b10'], oom)
    s = summary(oom)
    s.update(status='oom', error='out of memory', failed_step=1, timing={}, val=None)
    s['config']['batch_size'] = 16
    (oom / 'summary.json').write_text(json.dumps(s))
    found = sweeps(collect_runs([runs['b4'], runs['b6'], runs['b10'], oom])[0])
    assert len(found) == 1
    rows = found[0]['rows']
    assert [r['batch'] for r in rows] == [4, 6, 10, 16] and rows[-1]['status'] == 'oom'
    mems = [summary(runs[f'b{b}'])['memory']['host_peak_rss_bytes'] for b in (4, 6, 10)]
    assert [r['mem_bytes'] for r in rows[:3]] == mems
    slope, intercept = np.polyfit([4, 6, 10], mems, 1)  # the OOM run is left out of the fit
    assert found[0]['fit'] == pytest.approx((intercept, slope), rel=1e-6, abs=1e-3)
    code, out = make_report(tmp_path, runs['b4'], runs['b6'], runs['b10'], oom)
    text = (out / 'report.md').read_text()
    assert code == 0 and '## Batch-size sweep' in text and 'sweep-1.png' in check_figures(out)
    assert 'out of memory at step 1 with batch 16 per process' in text


@pytest.mark.slow
def test_sweep_of_gpu_runs_uses_gpu_memory_and_the_gpu_size(runs, tmp_path):
    """The GPU fields as dlojz writes them on CUDA, put into real CPU run directories (no GPU here)."""
    dirs = []
    for b in (4, 6, 10):
        d = tmp_path / f'gpu-b{b}'
        shutil.copytree(runs[f'b{b}'], d)
        s = summary(d)
        s['memory'].update(gpu_max_allocated_bytes=3_000_000_000 + 90_000_000 * b, gpu_max_reserved_bytes=4e9)
        s['provenance'].update(device='cuda', device_name='NVIDIA A100-SXM4-80GB', gpu_total_memory_bytes=85_100_000_000)
        s['energy'] = {'available': True, 'peak_w': 300.0, 'mean_w': 250.0, 'energy_j': 10.0 * b,
                       'joules_per_image': 0.5}
        (d / 'summary.json').write_text(json.dumps(s))
        dirs.append(d)
    [sw] = sweeps(collect_runs(dirs)[0])
    assert sw['memory'] == 'GPU max allocated' and sw['device_memory_bytes'] == 85_100_000_000
    assert sw['fit'] == pytest.approx((3e9, 9e7), rel=1e-9)
    assert [r['mean_w'] for r in sw['rows']] == [250.0] * 3
    code, out = make_report(tmp_path, *dirs)
    text = (out / 'report.md').read_text()
    assert code == 0 and 'memory = 2.794 GiB' in text and '85.83 MiB per image' in text  # 3e9 B, 9e7 B
    assert read_csv(out / 'comparison.csv')[0]['j_per_img'] == '0.5' and 'peak 300.0 W, mean 250.0 W' in text


def scaling_pair(runs, tmp_path, step2, img_s2):
    """Hand-made sums in real run folders. One process: 100 ms a step of 8 images (80 img/s), 95 ms
    of work, 5 of data wait. Two ranks at `step2` s a step: each 103 ms of work, 6 of data wait, 10
    of transfer; rank 0 also waits 5 ms for rank 1 (busy = work + the waits in collectives), and is
    the typical rank whose view is the job's (issue 57: the one of two that waited)."""
    one, two = tmp_path / 'one', tmp_path / 'two'
    shutil.copytree(runs['ws1'], one)
    shutil.copytree(runs['ws2'], two)
    s1, s2 = summary(one), summary(two)
    totals = {'wall_s': 1.0, 'steady_steps': 10, 'busy_s': 0.95, 'data_s': 0.05,
              'collective_s': 0.0}
    s1['timing'].update(train_throughput=80.0, totals={**s1['timing']['totals'], **totals})
    s2['timing'].update(train_throughput=img_s2, comm_measured='all-reduce hook', bound_job=True,
                        typical_ranks=[0])
    for r in s2['timing']['ranks']:
        late = 0.05 if r['rank'] == 0 else 0.0
        r.update(wall_s=10 * step2, steady_steps=10, data_s=0.06, comm_s=0.1, late_s=late,
                 busy_s=1.03 + 0.1 + late)
    (one / 'summary.json').write_text(json.dumps(s1))
    (two / 'summary.json').write_text(json.dumps(s2))
    [sc] = scaling.scalings(collect_runs([one, two])[0])
    return sc, one, two


@pytest.mark.slow
def test_scaling_splits_the_lost_efficiency_as_measured(runs, tmp_path):
    """Two ranks at 125 ms (128 img/s): by hand, efficiency 128 / 80 / 2 = 80 %; of the 20 points
    lost, 10 / 125 = 8.0 are communication, the job's wait for the late rank (the typical rank's)
    5 / 125 = 4.0, the work grown by 8 ms 6.4, the data wait grown by 1 ms 0.8, and the rest 0.8:
    the typical rank's host time, 125 - 103 - 6 - 10 - 5 = 1 ms, where the one process had none.
    Before issue 57 the terms were means over the ranks: the wait 2.0, the rest 2.8."""
    sc, one, two = scaling_pair(runs, tmp_path, 0.125, 128.0)
    row = sc['rows'][1]
    assert row['efficiency'] == pytest.approx(0.8) and row['step_ms'] == pytest.approx(125.0)
    assert [row[c] for c in scaling.COLUMNS] == pytest.approx([8.0, 4.0, 6.4, 0.8, 0.8])
    assert sc['rows'][0]['comm_pts'] == 0.0  # one process waits for no one
    code, out = make_report(tmp_path / 'rep', one, two)
    text = (out / 'report.md').read_text()
    assert code == 0
    assert '| straggler_pts | compute_slowed_pts | loader_slowed_pts | rest_pts |' in text


@pytest.mark.slow
def test_a_loss_the_measured_terms_cannot_explain_is_a_large_rest(runs, tmp_path):
    """The same sums, but the two ranks' steps take 200 ms (80 img/s: efficiency 50 %) while nothing
    they measured grew more than above: the 50 points lost are 10 / 200 = 5.0 communication, 2.5
    straggler, 4.0 compute slowed, 0.5 loader slowed, and a rest of 38.0 points, shown as such.
    Before issue 39 the compute slowed and the loader were in the rest as well; a split that made
    its terms add up (scaled to the loss) would hide it."""
    sc, _, _ = scaling_pair(runs, tmp_path, 0.200, 80.0)
    row = sc['rows'][1]
    assert row['efficiency'] == pytest.approx(0.5)
    assert [row[c] for c in scaling.COLUMNS] == pytest.approx([5.0, 2.5, 4.0, 0.5, 38.0])


@pytest.mark.slow
def test_scaling_from_world_sizes_1_and_2(runs, tmp_path):
    code, out = make_report(tmp_path, runs['ws1'], runs['ws2'])
    t1 = summary(runs['ws1'])['timing']['train_throughput']
    t2 = summary(runs['ws2'])['timing']['train_throughput']
    [s] = scaling.scalings(collect_runs([runs['ws1'], runs['ws2']])[0])
    assert [r['world_size'] for r in s['rows']] == [1, 2] and [r['global_batch'] for r in s['rows']] == [8, 16]
    assert s['rows'][1]['efficiency'] == pytest.approx(t2 / t1 / 2)
    two = s['rows'][1]  # the ranks measured their waits and their work: each term is there
    assert None not in [two[c] for c in scaling.COLUMNS], two
    text = (out / 'report.md').read_text()
    assert code == 0 and '## Scaling' in text and 'scaling-1.png' in check_figures(out)
    assert '## Diff' in text and '| run | world_size | 1 | 2 |' in text
    for r in summary(runs['ws2'])['timing']['ranks']:  # the per-rank table of the dashboard
        assert f"| {r['rank']} | {r['host']} | {r['step_median_s'] * 1e3:.1f} |" in text


@pytest.mark.slow
def test_a_verdict_over_all_ranks_shows_the_shares_over_all_ranks(runs, tmp_path):
    """Rank 0 busy 99 % while the job (its typical rank) waited for data 60 % of the time: the
    dashboard's 'Bound by' row gives the job's shares beside the job's verdict, largest first, as
    the run's own line does, and the comparison the job's busy and data shares (hand-set numbers
    in a real 2-rank run folder). A summary from before issue 57 (every rank's sums) keeps its
    all-ranks figures; one from before the shares keeps its busy and data figures."""
    two = tmp_path / 'two'
    shutil.copytree(runs['ws2'], two)
    s = summary(two)
    assert s['timing'].get('bound_job')  # a 2-rank run measures every rank
    shares = {'loader': 0.6, 'compute': 0.4, 'communication': 0.0, 'straggler': 0.0, 'host': 0.0}
    s['timing'].update(device_busy=0.99, data_share=0.01, device_busy_job=0.4,
                       data_share_job=0.6, bound='loader', comm_share=0.0,
                       straggler_share=0.0, shares_job=shares, typical_ranks=[1])
    (two / 'summary.json').write_text(json.dumps(s))
    code, out = make_report(tmp_path / 'rep', two)
    text = (out / 'report.md').read_text()
    assert code == 0 and ('loader (as rank 1 saw the job): data wait 60%, compute 40%, exposed '
                          'communication 0%, waiting for a late rank 0%, host 0% of the steady '
                          'steps') in text, text
    [row] = read_csv(out / 'comparison.csv')
    assert (float(row['busy_pct']), float(row['data_pct'])) == pytest.approx((40.0, 60.0))
    t = s['timing']
    for key in ('bound', 'shares', 'device_busy', 'data_share'):  # as issue 39 to 56 wrote them
        t[f'{key}_all_ranks'] = t.pop(f'{key}_job')
    (two / 'summary.json').write_text(json.dumps(s))
    code, out = make_report(tmp_path / 'rep-57', two)
    assert code == 0 and ('loader (all ranks): data wait 60%, compute 40%, exposed communication '
                          '0%') in (out / 'report.md').read_text()
    [row] = read_csv(out / 'comparison.csv')
    assert (float(row['busy_pct']), float(row['data_pct'])) == pytest.approx((40.0, 60.0))
    del s['timing']['shares_all_ranks']
    (two / 'summary.json').write_text(json.dumps(s))
    code, out = make_report(tmp_path / 'rep-old', two)
    assert code == 0 and re.search(r'loader \(all ranks\): device busy 40(\.0+)? % of the steady '
                                   r'steps, data wait 60(\.0+)? %', (out / 'report.md').read_text())


@pytest.mark.slow
def test_batchnorm_view_covers_every_batchnorm(runs):
    bn = bn_view(collect_runs([runs['ws1'], runs['ws2']])[0])
    for name in ('ws1', 'ws2'):  # reference: torchvision's own modules, loaded with the checkpoint
        model = torchvision.models.resnet18(num_classes=4)
        ckpt = torch.load(sorted(runs[name].glob('checkpoint-*.pt'))[-1], map_location='cpu', weights_only=False)
        model.load_state_dict(ckpt['model'])
        modules = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.BatchNorm2d)}
        assert bn['layers'] == list(modules) and 'layer2.0.downsample.1' in bn['layers'] and len(modules) == 20
        for layer, m in modules.items():
            got = bn['runs'][name][layer]
            assert got['running_mean'] == pytest.approx(m.running_mean.mean().item(), abs=1e-7)
            assert got['running_var'] == pytest.approx(m.running_var.mean().item(), rel=1e-6)
            assert got['weight'] == pytest.approx(m.weight.mean().item(), abs=1e-7)
    assert bn['runs']['ws1'] != bn['runs']['ws2']


@pytest.mark.slow
def test_metric_sync_log_from_two_ranks(runs, tmp_path):
    rows = metric_sync.metric_sync_rows(collect_runs([runs['ws2']])[0][0])
    logged = {r['global_step']: r for r in map(json.loads, (runs['ws2'] / 'metrics.jsonl').read_text().splitlines())
              if r['type'] == 'train_metrics'}
    assert sorted({r['step'] for r in rows}) == [2, 4, 6] and sorted({r['rank'] for r in rows}) == [0, 1]
    for step in (2, 4, 6):
        at = [r for r in rows if r['step'] == step]
        assert {r['loss_after'] for r in at} == {logged[step]['loss']}  # synced: what rank 0 logged
        assert len({r['loss_before'] for r in at}) == 2  # each rank saw only its own batches
        assert statistics.fmean(r['loss_before'] for r in at) == pytest.approx(logged[step]['loss'], rel=1e-5)
    code, out = make_report(tmp_path, runs['ws2'])
    assert 'every rank holds the same values: yes (3 syncs)' in (out / 'report.md').read_text()


@pytest.mark.slow
def test_lr_finder_view_uses_dlojz_rule_and_clips_spikes(runs, tmp_path):
    """The report's suggestion is the one in summary.json (recipe.suggest_lr, tested on known curves
    in test_findlr.py); the plot's loss axis follows the smoothed curve, so a raw spike is clipped,
    not scaled to."""
    lrs = [10 ** (-6 + i * 0.03) for i in range(200)]  # 1e-6 .. 1e-0.03
    losses = [0.1 * (math.log10(lr) + 3) ** 2 + 1 for lr in lrs]  # minimum at lr = 1e-3, at most 1.9
    losses[150] = 60.0  # one spike that the EMA of the stopping rule absorbs
    sm, cut, suggested, _ = lr_suggestion(lrs, losses)
    assert cut == 200 and lrs[0] <= suggested <= 1e-3
    lo, hi = lr_plot_ylim(losses[:cut], sm)
    assert lo <= 1.0 and max(sm) < hi < 60 / 2
    code, out = make_report(tmp_path, runs['findlr'])
    s = summary(runs['findlr'])
    text = (out / 'report.md').read_text()
    assert code == 0 and f"{len(s['findlr']['lr'])} steps from lr 1e-08" in text and 'lrfind-findlr.png' in \
        check_figures(out)
    shown = s['findlr']['suggested_lr']
    assert (f'suggested lr {shown:.3g}' if shown else 'no suggestion') in text
    assert 'fewer than 100 steps' in text  # the fixture's sweep has 12
    assert f"The sweep ended: {s['findlr']['stopped']}." in text



@pytest.mark.slow
def test_failed_and_crashed_runs_get_a_verdict(runs, tmp_path, capsys):
    step = int(re.search(r'at step (\d+)', runs['nan_stderr']).group(1))  # what dlojz told the user
    broken = tmp_path / 'broken'  # a summary cut in the middle of writing (not dlojz's atomic write: a copy)
    shutil.copytree(runs['w0'], broken)
    (broken / 'summary.json').write_text((runs['w0'] / 'summary.json').read_text()[:500])
    empty = tmp_path / 'empty'
    empty.mkdir()
    code, out = make_report(tmp_path, runs['nan'], runs['crash'], broken, empty)
    printed = capsys.readouterr()
    assert code == 0 and 'Traceback' not in printed.err
    assert f'nan: NaN loss at step {step}' in printed.out
    last = [json.loads(l) for l in (runs['crash'] / 'metrics.jsonl').read_text().splitlines()][-1]['global_step']
    # killed while writing a checkpoint: its summary is the 'running' one written when the attempt
    # started
    assert "crash: incomplete: summary.json still says 'running'" in printed.out
    assert f'last logged step {last}' in printed.out
    assert 'newest checkpoint checkpoint-00000002.pt' in printed.out  # the second one died half-written
    text = (out / 'report.md').read_text()
    assert 'summary.json is unreadable' in text and f'skipped {empty}' in printed.out
    assert '## Problems' not in text


@pytest.mark.slow
def test_every_kind_of_run_reports_cleanly(runs, tmp_path):
    code, out = make_report(tmp_path, runs['notiming'], runs['evaluate'], runs['ws1'], runs['ws2'])
    text = (out / 'report.md').read_text()
    assert code == 0 and '**completed (evaluate run)**' in text
    assert {'timeline-notiming.png', 'timeline-ws1.png'} <= set(check_figures(out))
    assert 'no NCCL collective line: the run used gloo' in text  # --nccl-debug on CPU: markers only
    assert os.path.getsize(runs['ws2'] / 'nccl.rank1.log') > 0


@pytest.mark.slow
def test_older_and_newer_summaries(runs, tmp_path):
    old = tmp_path / 'old'
    shutil.copytree(runs['w1'], old)
    s = summary(old)
    for key in ('version', 'num_nodes', 'mode', 'energy', 'provenance'):
        s.pop(key)
    s['timing'].pop('per_step')
    (old / 'summary.json').write_text(json.dumps(s))
    new = tmp_path / 'new'
    shutil.copytree(runs['w2'], new)
    s = summary(new)
    s.update(version=99, future_section={'x': 1})
    s['timing']['future_key'] = [1, 2]
    (new / 'summary.json').write_text(json.dumps(s))
    code, out = make_report(tmp_path, old, new)
    text = (out / 'report.md').read_text()
    assert code == 0 and '## Problems' not in text and 'version 99, newer than this report' in text
    assert float(read_csv(out / 'comparison.csv')[0]['train_img_s']) > 0


@pytest.mark.slow
def test_diff_and_usage_errors(runs, tmp_path, capsys):
    assert report.cli(['diff', str(runs['w0']), str(runs['w2np'])]) == 0
    out = capsys.readouterr().out
    assert re.search(r'config\s+num_workers\s+0\s+2', out) and 'persistent_workers' in out
    assert 'output_dir' not in out
    assert report.cli(['diff', str(runs['w0'])]) == 2
    assert report.cli([str(tmp_path / 'nowhere')]) == 2
    err = capsys.readouterr().err
    assert 'does not exist' in err and 'Traceback' not in err


# ------------------------------------------------------------------------------------------------- NCCL

def resnet18_params():
    return sum(p.numel() for p in torchvision.models.resnet18(num_classes=4).parameters())


def coll(rank, op, opcount, count, dtype, comm, nranks=2):
    return (f'node1:{4100 + rank}:{4200 + rank} [{rank}] NCCL INFO {op}: opCount {opcount:x} sendbuff 0x7f2a1c000000 '
            f'recvbuff 0x7f2a1c000000 count {count} datatype {dtype} op 0 root 0 comm {comm} [nranks={nranks}] '
            f'stream 0x55d0c8a1e0f0')


def nccl_log(rank, steps=3):
    """One rank's --nccl-debug log, as dlojz's tee writes it: markers, NCCL INIT and COLL lines,
    noise."""
    comm = f'0x55d0c8{rank}0a0b0'
    n = resnet18_params()
    buckets = [n - 2_000_000 - 262_144, 2_000_000, 262_144]  # DDP buckets: sizes add up to the parameters
    lines = ['Train step 0 - rank %d' % rank,
             f'node1:{4100 + rank}:{4100 + rank} [{rank}] NCCL INFO Bootstrap : Using eth0:10.0.0.1<0>',
             f'node1:{4100 + rank}:{4300 + rank} [{rank}] NCCL INFO comm {comm} rank {rank} nranks 2 cudaDev {rank} '
             f'nvmlDev {rank} busId 1000 commId 0x6b1d2c3e4f - Init COMPLETE']
    ops = [('Broadcast', n, 7), ('Broadcast', 20, 4)]  # initial weights fp32; BN counters int64
    lines += [coll(rank, op, i, c, t, comm) for i, (op, c, t) in enumerate(ops)]
    k = len(ops)
    for s in range(1, steps + 1):
        lines.append(f'Train step {s} - rank {rank}')
        lines.append('epoch 1/1 step %d/12 loss 1.2 lr 0.1 | step 10.0 ms' % s)  # dlojz's own print
        for c in buckets:
            lines.append(coll(rank, 'AllReduce', k, c, 7, comm))
            k += 1
        lines.append(coll(rank, 'AllReduce', k, 1000, 9, comm))  # a bf16 op
        k += 1
        if s == 2:  # a metric sync as torchmetrics does it: all-gathers of one fp32 and one int64
            lines += [coll(rank, 'AllGather', k, 3, 7, comm), coll(rank, 'AllGather', k + 1, 1, 4, comm)]
            k += 2
    lines.append(f'Validation - rank {rank}')
    lines += [coll(rank, 'AllReduce', k, 5, 6, comm), coll(rank, 'AllGather', k + 1, 7, 1, comm),
              coll(rank, 'Broadcast', k + 2, 4, 42, comm)]  # float16, uint8, and a datatype NCCL may add later
    return lines


def test_nccl_bytes_from_count_and_datatype(tmp_path):
    n = resnet18_params()
    ops = parse_nccl(nccl_log(1), file_rank=1)
    assert {o['rank'] for o in ops} == {1}
    by = lambda phase, op: sum(o['bytes'] for o in ops if o['phase'] == phase and o['op'] == op)
    assert by('init', 'Broadcast') == 4 * n + 8 * 20
    for s in (1, 2, 3):
        assert by(f'step {s}', 'AllReduce') == 4 * n + 2 * 1000
    assert by('step 2', 'AllGather') == 3 * 4 + 1 * 8 and by('step 1', 'AllGather') == 0
    assert by('valid', 'AllReduce') == 5 * 2 and by('valid', 'AllGather') == 7
    assert [o['bytes'] for o in ops if o['dtype'] == 'type 42'] == [None]

    run_dir = tmp_path / 'ddp'  # a run directory around the logs, summary from a real-looking estimate
    run_dir.mkdir()
    for r in (0, 1):
        (run_dir / f'nccl.rank{r}.log').write_text('\n'.join(nccl_log(r)) + '\n')
    (run_dir / 'summary.json').write_text(json.dumps({'version': 1, 'status': 'completed', 'world_size': 2,
                                                      'config': {'batch_size': 8},
                                                      'communication': {'gradient_bytes_per_step': 4 * n}}))
    c = comm_view(collect_runs([run_dir])[0][0])
    assert c['ranks'] == [0, 1] and c['consistent'] and c['steps'] == [1, 2, 3]
    assert c['table'][('train', 'AllReduce')] == {'calls': 12, 'bytes': 3 * (4 * n + 2000)}
    assert c['table'][('train', 'AllGather')] == {'calls': 2, 'bytes': 20}
    assert c['allreduce_per_step'] == 4 * n + 2000 and c['unknown_dtypes'] == ['type 42']
    code, out = make_report(tmp_path, run_dir)
    text = (out / 'report.md').read_text()
    assert code == 0 and '## Communication (NCCL)' in text and 'All ranks issued the same collectives' in text
    assert 'comm-ddp.png' in check_figures(out)


def test_nccl_interleaved_ranks_in_one_log():
    """The course's setting: every rank in one stdout; ranks come from the Init COMPLETE comm map."""
    a, b = nccl_log(0, steps=2), nccl_log(1, steps=2)
    mixed = [line for pair in zip(a, b) for line in pair] + a[len(b):] + b[len(a):]
    ops = parse_nccl(mixed)
    for rank in (0, 1):
        mine = [o for o in ops if o['rank'] == rank]
        assert [o['phase'] for o in mine] == [o['phase'] for o in parse_nccl(nccl_log(rank, steps=2), rank)]
    assert sum(o['bytes'] or 0 for o in ops if o['phase'] == 'step 2' and o['op'] == 'AllGather') == 2 * 20


def test_ranks_that_differ_are_flagged(tmp_path):
    run_dir = tmp_path / 'skew'
    run_dir.mkdir()
    (run_dir / 'nccl.rank0.log').write_text('\n'.join(nccl_log(0, steps=3)))
    (run_dir / 'nccl.rank1.log').write_text('\n'.join(nccl_log(1, steps=2)))
    (run_dir / 'config.json').write_text('{"batch_size": 8}')
    c = comm_view(collect_runs([run_dir])[0][0])
    assert not c['consistent']
    code, out = make_report(tmp_path, run_dir)
    text = (out / 'report.md').read_text()
    assert code == 0 and '**Ranks differ**' in text and 'incomplete: no summary.json' in text


@pytest.mark.slow
def test_time_to_accuracy_view(tmp_path, cache_dir):
    """Two 3-epoch runs with a target, one with an EMA: the table's epochs and images are the first
    validation records at or above the target in each run's own metrics.jsonl; the figure is drawn.
    """
    target = 0.4
    for name, extra in (('plain', []), ('ema', ['--ema-decay', '0.8'])):
        run_main(tmp_path / name, cache_dir, '-e', '3', '--target-top1', target, *extra)
    code, out = make_report(tmp_path, tmp_path / 'plain', tmp_path / 'ema')
    assert code == 0 and 'time-to-accuracy.png' in check_figures(out)
    rows = {r['run']: r for r in read_csv(out / 'time-to-accuracy.csv')}
    for name in ('plain', 'ema'):
        recs = [json.loads(line) for line in open(tmp_path / name / 'metrics.jsonl')]
        for kind, col in (('val', 'raw'), ('val_ema', 'ema')):
            hit = next((r for r in recs if r['type'] == kind and r['top1'] >= target), None)
            if hit is None:
                assert rows[name][f'{col}_epoch'] == '', (name, kind)
            else:
                assert int(rows[name][f'{col}_epoch']) == hit['epoch'], (name, kind)
                assert int(rows[name][f'{col}_images']) == hit['global_step'] * 8
    assert rows['ema']['ema_epoch'] != ''  # the EMA's validations are there to be read


def test_time_to_accuracy_shows_runs_with_one_validation(tmp_path, monkeypatch):
    """Two --test runs, one validation each: each is a visible point with its top-1 beside it, the
    axes from 0 (it was a dot of 3 points in an otherwise empty corner)."""
    from types import SimpleNamespace
    figs = []
    monkeypatch.setattr(race, 'save_fig', lambda fig, out, name: figs.append(fig) or name)
    runs = [SimpleNamespace(name=f'run{i}', records=[{'type': 'val', 'wall_s': 30.0 + i, 'train_images': 800,
                                                      'top1': 0.25 + 0.5 * i}]) for i in range(2)]
    race.plot_race(runs, [0.7], str(tmp_path))
    [fig] = figs
    for ax in fig.axes:
        assert ax.get_xlim()[0] == 0 and ax.get_ylim()[0] == 0
        points = [line for line in ax.get_lines() if line.get_marker() == 'o']
        assert len(points) == 2 and all(line.get_markersize() >= 6 for line in points)
        assert sorted(t.get_text() for t in ax.texts) == ['0.250', '0.750']
