"""--findlr, the LR range test: a geometric sweep from 1e-8 to --lr that ends cleanly when the loss
diverges (status completed, exit 0, the curve up to there in summary.json), and a SIGUSR2 during the
sweep stops it within a step with the curve kept. The stopping rule is re-derived here from the
recorded losses (EMA 0.98, bias-corrected; 4x the running minimum), not taken from dlojz.

The suggestion (recipe.suggest_lr, steepest descent of the smoothed loss): on a loss with a known
steepest point (a tanh in log10(lr), inflection at 1e-3) it lands on that point; on any curve, noisy, short,
flat or diverging, it is one of the swept LRs or None, never outside [start, end] (the old minimum/10 rule
suggested 1e-9 for a sweep from 1e-8). It is printed and stored in summary.json; a sweep shorter than 100
steps is warned about.

Run: python -m pytest -q tests/test_findlr.py
"""
import json
import math
import os
import signal
import subprocess
import sys
import time

import random

import pytest

from conftest import DLOJZ, ROOT, TINY, run_main
import dlojz
from dlojzlib.recipe import FINDLR_MIN_STEPS, suggest_lr


def smoothed(losses, beta=0.98):
    avg, out = 0.0, []
    for i, loss in enumerate(losses, 1):
        avg = beta * avg + (1 - beta) * loss
        out.append(avg / (1 - beta ** i))
    return out


def sweep(out, cache_dir, *flags):
    """cli() in-process: -> (exit code, summary.json as written, metrics records)."""
    code = dlojz.cli([*TINY, '--cache-dir', cache_dir, '--output-dir', str(out), '--findlr', *map(str, flags)])
    recs = [json.loads(line) for line in open(out / 'metrics.jsonl')]
    return code, json.load(open(out / 'summary.json')), recs


def test_sweep_geometric_without_divergence(tmp_path, cache_dir, capsys):
    code, s, recs = sweep(tmp_path, cache_dir, '--test-nsteps', '6', '--lr', '1e-3')
    out = capsys.readouterr().out
    assert 'Warning: an LR sweep of 6 steps multiplies the LR by' in out and f'{FINDLR_MIN_STEPS} steps or more' in out
    c = s['findlr']
    assert (code, s['status'], s['mode'], c['steps'], c['stopped']) == (0, 'completed', 'findlr', 6, 'end of the sweep')
    assert c['lr'][0] == pytest.approx(1e-8) and c['lr'][-1] == pytest.approx(1e-3)
    ratios = [b / a for a, b in zip(c['lr'], c['lr'][1:])]
    assert max(ratios) == pytest.approx(min(ratios)) == pytest.approx((1e-3 / 1e-8) ** (1 / 5))
    assert s['val'] is None and not any(r['type'] == 'val' for r in recs)  # a sweep does not validate


def test_diverging_sweep_ends_completed_with_its_curve(tmp_path, cache_dir, capsys):
    """The default upper end (10) is where an LR range test normally ends: in divergence."""
    steps = 40
    code, s, _ = sweep(tmp_path, cache_dir, '--test-nsteps', steps, '-e', '4')
    c = s['findlr']
    out = capsys.readouterr().out
    if c['suggested_lr'] is None:
        assert f"LR sweep: no suggestion ({c['suggestion']})" in out
    else:  # printed and stored; one of the swept LRs before the divergence
        assert f"LR sweep: suggested --lr {c['suggested_lr']:.3g} ({c['suggestion']})" in out
        assert c['suggested_lr'] in c['lr'][:-1] and c['suggestion'].startswith('steepest descent')
    assert (code, s['status'], s['error']) == (0, 'completed', None)
    assert 2 <= c['steps'] < steps and c['stopped'] != 'end of the sweep', c['stopped']
    assert len(c['lr']) == len(c['loss']) == c['steps']
    assert all(math.isfinite(x) for x in c['loss'])
    sm = smoothed(c['loss'])
    best = [min(sm[:i + 1]) for i in range(len(sm))]
    assert all(v <= 4 * b for v, b in zip(sm[:-1], best[:-1]))  # it did not run past a divergence
    if 'passed' in c['stopped']:
        assert sm[-1] > 4 * best[-1]
    else:  # the next step's loss was not finite
        assert c['stopped'].startswith('non-finite loss')
    # the sweep's steps are the run's steps: lr k is 1e-8 x (10 / 1e-8)^(k / (steps - 1))
    mult = (10 / 1e-8) ** (1 / (steps - 1))
    assert c['lr'] == pytest.approx([1e-8 * mult ** k for k in range(c['steps'])], rel=1e-6)


@pytest.mark.slow  # 4 s; the fast tier stops runs by signal in test_preempt.py
def test_usr2_stops_a_sweep_within_a_step(tmp_path, cache_dir):
    out = tmp_path / 'run'
    run_main(tmp_path / 'warm', cache_dir, '--test-nsteps', '1')  # the dataset exists before the timed part
    cmd = [sys.executable, DLOJZ, *TINY, '--cache-dir', cache_dir, '--output-dir', str(out), '--findlr',
           '--lr', '1e-3', '--test-nsteps', '2000', '-e', '200', '--log-interval', '1']
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    metrics, seen = out / 'metrics.jsonl', 0
    deadline = time.time() + 120
    while seen < 3:
        assert time.time() < deadline and p.poll() is None, p.communicate()[1][-2000:]
        time.sleep(0.02)
        seen = len(open(metrics).readlines()) if os.path.exists(metrics) else 0
    p.send_signal(signal.SIGUSR2)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 5, err[-2000:]
    assert 'the LR sweep was stopped by SIGUSR2' in err and 'Traceback' not in err
    s = json.load(open(out / 'summary.json'))
    assert s['status'] == 'preempted' and s['requeued'] is False
    # seen steps were logged before the signal; the step under way when it came ends, then the sweep stops
    assert seen <= s['findlr']['steps'] <= seen + 2, (seen, s['findlr']['steps'])
    assert len(s['findlr']['loss']) == s['findlr']['steps'] == s['global_step']


def geometric(start, end, n):
    return [start * (end / start) ** (k / (n - 1)) for k in range(n)]


def known_curve(lrs, noise=0.0, seed=0):
    """2 - tanh((log10 lr + 3) / 0.5): falls fastest at lr = 1e-3 (the tanh's inflection), flat near 1 beyond;
    from lr 0.3 on, the loss grows exponentially (divergence)."""
    rng = random.Random(seed)
    out = []
    for lr in lrs:
        x = math.log10(lr)
        out.append(2 - math.tanh((x + 3) / 0.5) + max(0.0, math.exp(3 * (x + 0.5)) - 1) + rng.gauss(0, noise))
    return out


def test_suggestion_is_the_steepest_point_of_a_known_curve():
    lrs = geometric(1e-8, 10, 200)  # 0.045 decade per step
    suggested, why = suggest_lr(lrs, known_curve(lrs))
    assert abs(math.log10(suggested) + 3) <= 9 / 199 + 1e-9, suggested  # the grid point next to 1e-3
    assert why.startswith('steepest descent of the smoothed loss')
    noisy = known_curve(lrs, noise=0.05, seed=1)  # per-batch noise: the smoothing keeps it near
    assert abs(math.log10(suggest_lr(lrs, noisy)[0]) + 3) <= 0.3


def test_suggestion_lies_in_the_sweep_whatever_the_curve():
    rng = random.Random(0)
    for trial in range(300):
        n = rng.randrange(1, 150)
        start, end = 10 ** rng.uniform(-9, -3), 10 ** rng.uniform(-2, 1)
        lrs = geometric(start, end, max(n, 2))[:n]
        losses = [rng.choice([rng.uniform(0, 10), 2.3 - 0.01 * k, 2.3])  # noise, descent, flat
                  for k in range(n)]
        if rng.random() < 0.2:
            losses[rng.randrange(n)] = rng.choice([float('nan'), float('inf'), 1e4])
        suggested, why = suggest_lr(lrs, losses)
        assert suggested is None or lrs[0] <= suggested <= lrs[-1], (trial, suggested, lrs[0], lrs[-1])
        assert suggested is not None or why
    # a curve lowest at its first LR: minimum / 10 was below the sweep; steepest descent has none to give
    lrs = geometric(1e-8, 10, 120)
    assert suggest_lr(lrs, [1.0 + k / 100 for k in range(120)])[0] is None
