"""--prof under DDP (issue 20, defect 9): only rank 0 profiles, but every rank waits for rank 0's slowed
steps in the gradient all-reduce, so every rank must leave the same steps out of its statistics. Two CPU
ranks (gloo) under torchrun, the tiny config; each rank's count comes from summary.json's per-rank reports.

Run: python -m pytest -q tests/test_prof_ddp.py   (marked slow: two processes start torch)
"""
import json
import os

import pytest

from conftest import TINY, torchrun


@pytest.mark.slow
def test_every_rank_leaves_out_the_profiled_steps(tmp_path, cache_dir):
    out = tmp_path / 'run'
    # 6 steps: 1 warm-up; the profiler waits 1 step, then 1 warm-up + 2 active steps: steps 1, 2, 3 excluded
    p = torchrun(2, *TINY, '--cache-dir', cache_dir, '--output-dir', out, '--test-nsteps', '6', '--prof',
                 '--prof-active', '2')
    assert p.returncode == 0, p.stderr[-2000:]
    with open(os.path.join(out, 'summary.json')) as f:
        timing = json.load(f)['timing']
    ranks = {r['rank']: r for r in timing['ranks']}
    assert set(ranks) == {0, 1}
    assert [ranks[r]['profiled_steps'] for r in (0, 1)] == [3, 3]
    assert [ranks[r]['steady_steps'] for r in (0, 1)] == [6 - 1 - 3] * 2
    assert os.listdir(out / 'profiler')  # rank 0 still wrote its trace
