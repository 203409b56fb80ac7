"""The scaling forecast (measure.scaling): DDP's bucket split, the ring and hierarchical all-reduce
costs, the overlap of all-reduces with the backward, the forecast rows, the probe fit, reading a
summary.json, and the gloo probe under torchrun. Expected values are computed by hand in each test
(timelines written out), never by the module itself.

python -m pytest -q tests/test_scaling.py            # the slow probe test: -m slow"""
import json
import os
import subprocess
import sys

import pytest
from hypothesis import given, settings, strategies as st

from conftest import ROOT, torchrun
from dlojzlib.dist import machines
from dlojzlib.measure import scaling as S

MiB = 2 ** 20


def test_buckets_first_one_mib_then_cap_then_rest():
    assert S.bucket_sizes(100 * MiB, 25) == [1 * MiB, 25 * MiB, 25 * MiB, 25 * MiB, 24 * MiB]
    assert S.bucket_sizes(0.5 * MiB, 25) == [0.5 * MiB]
    # ResNet-152: 60 192 808 parameters x 4 B = 240.77 MB -> 1 MiB + 9 full buckets + 4.41 MB
    sizes = S.bucket_sizes(60192808 * 4, 25)
    assert len(sizes) == 11 and sizes[-1] == pytest.approx(60192808 * 4 - MiB - 9 * 25 * MiB)


def test_ring_allreduce_hand_values():
    # 4 ranks, 1 GB at 1 GB/s, 1 ms a step: 2*3/4 s of transfer + 6 steps of latency
    assert S.ring_allreduce_s(1e9, 4, 1e9, 1e-3) == pytest.approx(1.5 + 0.006)
    assert S.ring_allreduce_s(1e9, 2, 1e9, 0) == pytest.approx(1.0)
    assert S.ring_allreduce_s(1e9, 1, 1e9, 1) == 0.0


def test_hierarchical_across_nodes():
    link = S.Link(intra_bw=100.0, intra_lat=1.0, net_bw=10.0, net_lat=2.0, ranks_per_node=4)
    # one node of 4: 2*3/4*400/100 + 6*1 = 12
    assert S.allreduce_s(400, 4, link) == pytest.approx(12.0)
    # 2 nodes of 4: inside 12, across 2*1/2*400/10 + 2*1*2 = 44
    assert S.allreduce_s(400, 8, link) == pytest.approx(56.0)
    # 3 ranks: one node of 3
    assert S.allreduce_s(300, 3, link) == pytest.approx(2 * 2 / 3 * 3 + 4)
    with pytest.raises(ValueError, match='multiple of 4'):
        S.allreduce_s(400, 6, link)
    with pytest.raises(ValueError, match='no network'):
        S.allreduce_s(400, 8, S.Link(100.0, 1.0, ranks_per_node=4))


def test_overlap_timeline_by_hand():
    comm = lambda b: float(b)  # 1 s per byte
    # buckets 1 and 3 bytes over a 4 s backward: bucket 1 ready at 1, sent 1..2; bucket 2 ready at
    # 4, sent 4..7
    assert S.exposed_comm_s([1, 3], 4.0, comm) == pytest.approx(3.0)
    # communication slower than the backward: ready at 1 and 2; sent 1..5, then 5..9 -> 7 s after
    # the backward
    assert S.exposed_comm_s([2, 2], 2.0, lambda b: 2.0 * b) == pytest.approx(7.0)
    # everything hidden but the last bucket: [1,1,1,1] bytes over 8 s, 0.5 s each -> last ready at
    # 8, ends 8.5
    assert S.exposed_comm_s([1, 1, 1, 1], 8.0, lambda b: 0.5 * b) == pytest.approx(0.5)


def test_forecast_rows_by_hand():
    # step 1 s, backward 0.5 s, 32 images, 2 buckets of 1 MiB (cap 1 MiB), 2 ranks at 1 MiB/s, no
    # latency: each all-reduce moves 2*1/2*1 MiB / 1 MiB/s = 1 s. Ready at 0.25 and 0.5: sent
    # 0.25..1.25, 1.25..2.25
    link = S.Link(intra_bw=MiB, intra_lat=0.0)
    rows = S.forecast(1.0, 0.5, 32, 2 * MiB, link, gpus=(1, 2), bucket_cap_mb=1)
    assert rows[0] == {'gpus': 1, 'nodes': 1, 'comm_s': 0.0, 'exposed_s': 0.0, 'straggler_s': 0.0,
                       'step_s': 1.0, 'images_per_s': 32.0, 'efficiency': 1.0, 'comm_pts': 0.0,
                       'straggler_pts': 0.0, 'slowed_s': 0.0, 'slowed_pts': 0.0}
    two = rows[1]
    assert two['comm_s'] == pytest.approx(2.0) and two['exposed_s'] == pytest.approx(1.75)
    assert two['step_s'] == pytest.approx(2.75)
    assert two['images_per_s'] == pytest.approx(64 / 2.75) and two['efficiency'] == pytest.approx(1 / 2.75)
    with pytest.raises(ValueError, match='inside the step'):
        S.forecast(1.0, 1.5, 32, MiB, link)


def test_expected_max_by_hand():
    # two equally likely values 1 and 3: the max of 2 draws is 1 only if both are 1 (1/4): 1/4 + 3 *
    # 3/4
    assert S.expected_max([3.0, 1.0], 2) == pytest.approx(2.5)
    assert S.expected_max([3.0, 1.0], 1) == pytest.approx(2.0)  # one draw: the mean
    assert S.expected_max([1.0, 2.0, 3.0, 4.0], 3) == pytest.approx(
        (1 * 1 + 2 * (8 - 1) + 3 * (27 - 8) + 4 * (64 - 27)) / 64)
    assert S.expected_max([0.5] * 7, 32) == pytest.approx(0.5)  # no spread, no straggler


def test_stragglers_are_added_from_the_measured_steps():
    # steps of 1 s and 3 s alike (mean 2 s), no communication: at 2 ranks a step waits for the
    # slower of two: 2.5 s, 0.5 s of straggler; 20 % of the step, efficiency 2 / 2.5
    link = S.Link(intra_bw=1e30, intra_lat=0.0)
    [one, two] = S.forecast(2.0, 1.0, 8, 4.0, link, gpus=(1, 2), step_samples=[1.0, 3.0])
    assert one['straggler_s'] == pytest.approx(0.0)
    assert two['straggler_s'] == pytest.approx(0.5) and two['step_s'] == pytest.approx(2.5)
    assert two['straggler_pts'] == pytest.approx(20.0) and two['efficiency'] == pytest.approx(0.8)


def test_a100_profile_resnet152_by_hand():
    """The course's case (reference/course.md §7.1) on the A100 profile, computed by hand: 4 GPUs in
    one node at 300 GB/s and 3.4 us a step; 11 buckets."""
    link = S.machine_link('a100')
    assert link.ranks_per_node == 8 and link.intra_bw == 300e9
    grad = 60192808 * 4
    rows = S.forecast(512 / 1165.5, 512 / 1165.5 * 2 / 3, 512, grad, link, gpus=(4, 32))
    assert rows[0]['comm_s'] == pytest.approx(1.5 * grad / 300e9 + 11 * 6 * 3.4e-6)
    # 4 nodes of 8: inside 2*7/8*G/300e9 + 14*3.4us; across 2*3/4*G/100e9 + 6*9.6us (per bucket)
    inside = 2 * 7 / 8 * grad / 300e9 + 11 * 14 * 3.4e-6
    across = 1.5 * grad / 100e9 + 11 * 6 * 9.6e-6
    assert rows[1]['nodes'] == 4 and rows[1]['comm_s'] == pytest.approx(inside + across)


def test_every_gpu_machine_has_an_interconnect():
    for name, m in machines.MACHINES.items():
        if m['gpus_per_node']:
            ic = m['interconnect']
            assert ic['intra_bw'] > (ic['net_bw'] or 0) >= 0 and ic['intra_lat'] > 0
            assert ic['net_bw'] or ic['net'] == 'not confirmed'  # no figure rather than a guess


def test_fit_recovers_a_ring():
    # 3 ranks at 2e8 B/s and 50 us a step: t = 4/3 b / 2e8 + 4 * 50e-6, written out
    points = [(b, 4 / 3 * b / 2e8 + 4 * 50e-6) for b in (2 ** 16, 2 ** 20, 2 ** 22)]
    bw, lat = S.fit_ring(points, 3)
    assert bw == pytest.approx(2e8) and lat == pytest.approx(50e-6)
    # noise that would make the latency negative: refit through the origin
    bw, lat = S.fit_ring([(1e6, 0.0009), (2e6, 0.0021)], 2)
    assert lat == 0.0 and bw == pytest.approx((1e12 + 4e12) / (0.0009e6 + 0.0042e6))


def summary(world_size=1, **timing):
    return {'world_size': world_size, 'global_batch': 8, 'config': {'bucket_cap_mb': 25.0},
            'communication': {'gradient_bytes_per_step': 4000},
            'timing': {'steady_images_per_s': 80.0, 'stats': {'backward': {'mean': 0.05}}, **timing}}


def test_inputs_from_summary():
    x = S.inputs_from_summary(summary())
    assert x == {'step_s': 0.1, 'backward_s': 0.05, 'batch_per_device': 8, 'grad_bytes': 4000,
                 'bucket_cap_mb': 25.0, 'step_samples': None, 'work_s': None}
    # the steady steps: after the warm-up, full batches only (an epoch's last batch of 3 is left
    # out)
    per = {'step': [9.0, 0.1, 0.12, 0.05, 0.11], 'images': [8, 8, 8, 3, 8]}
    x = S.inputs_from_summary(summary(per_step=per, warmup_steps=1))
    assert x['step_samples'] == [0.1, 0.12, 0.11]
    with pytest.raises(ValueError, match='one-device run'):
        S.inputs_from_summary(summary(world_size=2))
    with pytest.raises(ValueError, match='phase timing'):
        S.inputs_from_summary(summary(stats={}))


def test_the_forecast_sends_what_the_shard_mode_sends():
    """A reference run under --shard full (ZeRO-3) writes traffic_factor 1.5: the forecast sends
    1.5 x its gradients per step; a summary without the factor (before --shard) sends them once."""
    plain, zero3 = summary(), summary()
    # ResNet-50's 98 MiB, where bandwidth rules
    plain['communication'] = {'gradient_bytes_per_step': 10 ** 8}
    zero3['communication'] = {'gradient_bytes_per_step': 10 ** 8, 'traffic_factor': 1.5}
    assert S.inputs_from_summary(zero3)['grad_bytes'] == 1.5e8
    link = S.Link(1e9, 1e-5)
    plain, zero3 = (S.forecast(**S.inputs_from_summary(s), link=link, gpus=(2,))[0]
                    for s in (plain, zero3))
    assert zero3['comm_s'] / plain['comm_s'] == pytest.approx(1.5, rel=0.02)


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.floats(allow_nan=True),
                 st.text(max_size=5), st.lists(st.integers(), max_size=2)))
def test_a_traffic_factor_is_a_number_from_1_to_2_or_one_sentence(value):
    try:
        f = S.traffic_factor({'traffic_factor': value})
    except ValueError as e:
        assert 'traffic_factor' in str(e) and '\n' not in str(e)
        return
    assert isinstance(f, float) and 1 <= f <= 2 and not isinstance(value, bool)


def test_measured_from_summary():
    ranks = [{'rank': 0, 'steady_steps': 10, 'comm_s': 0.2, 'late_s': 0.5},
             {'rank': 1, 'steady_steps': 10, 'comm_s': 0.2, 'late_s': 0.0}]
    m = S.measured_from_summary({'world_size': 2, 'timing': {'steady_images_per_s': 50.0, 'ranks': ranks,
                                                             'comm_measured': 'all-reduce hook'}})
    assert m == {'gpus': 2, 'images_per_s': 50.0, 'exposed_s': pytest.approx(0.02),
                 'late_s': pytest.approx(0.05), 'work_s': None}
    m = S.measured_from_summary({'world_size': 2, 'timing': {'steady_images_per_s': 50.0}})
    assert m['exposed_s'] is None and m['late_s'] is None


def test_the_step_split_is_the_typical_ranks_as_the_verdict_is():
    """Issue 57: one slow rank among three (the others wait 0.2 s a step for it, its own work is
    0.3 s, theirs 0.1 s). The job's split is a typical rank's, as its verdict: work 0.1, late 0.2
    per step. A summary written before issue 57 (no typical_ranks) keeps the mean over the ranks:
    work (0.3 + 2 x 0.1) / 3, late 2 x 0.2 / 3."""
    def rank(r, late):
        return {'rank': r, 'steady_steps': 10, 'wall_s': 3.1, 'data_s': 0.0, 'comm_s': 0.1,
                'late_s': late * 10, 'busy_s': 3.1}
    ranks = [rank(0, 0.2), rank(1, 0.0), rank(2, 0.2)]  # busy 0.31 a step, all of it
    t = {'ranks': ranks, 'comm_measured': 'all-reduce hook', 'bound_job': True,
         'typical_ranks': [2]}
    split = S.step_split(t)
    assert split['late'] == pytest.approx(0.2) and split['work'] == pytest.approx(0.1)
    assert S.collective_waits(t) == (pytest.approx(0.01), pytest.approx(0.2))
    old = {'ranks': ranks, 'comm_measured': 'all-reduce hook', 'bound_all_ranks': True}
    assert S.step_split(old)['late'] == pytest.approx(0.4 / 3)
    assert S.step_split(old)['work'] == pytest.approx(0.5 / 3)


def test_cli_error_is_one_sentence(tmp_path):
    path = tmp_path / 'summary.json'
    path.write_text(json.dumps(summary(world_size=2)))
    r = subprocess.run([sys.executable, os.path.join(ROOT, 'dlojz_scaling.py'), '--summary', str(path),
                        '--machine', 'a100'], capture_output=True, text=True)
    assert r.returncode == 2 and 'Traceback' not in r.stderr
    assert r.stderr.startswith('dlojz_scaling: error: the forecast starts from a one-device run')
    path.write_text(json.dumps(summary()))
    r = subprocess.run([sys.executable, os.path.join(ROOT, 'dlojz_scaling.py'), '--summary', str(path),
                        '--machine', 'a100', '--gpus', '1,8,16'], capture_output=True, text=True)
    assert r.returncode == 0 and len(r.stdout.splitlines()) == 6
    assert r.stdout.splitlines()[1].startswith('compute slowed: none')
    two = tmp_path / 'two.json'
    two.write_text(json.dumps({'world_size': 2, 'global_batch': 16,
                               'timing': {'steady_images_per_s': 150.0}}))
    r = subprocess.run([sys.executable, os.path.join(ROOT, 'dlojz_scaling.py'), '--summary', str(path),
                        '--machine', 'a100', '--gpus', '1,8', '--measured', str(two)], capture_output=True, text=True)
    # the source line, the head, 1, 2 (measured) and 8 GPUs
    assert r.returncode == 0 and len(r.stdout.splitlines()) == 6, r.stderr
    assert 'measured' in r.stdout.splitlines()[2] and '150.0' in r.stdout.splitlines()[4]


def test_slowdown_by_hand():
    """CPU ranks of 1 thread on 2 cores: 2 ranks have a core each, 3 share 2 (each 1.5x as long), 4
    take twice as long. A 2-rank run measured 20 % more work per step on 2 cores: at 3 ranks
    1.2 x 1.5 - 1 = 0.8. GPUs measured 5 % at 2 ranks: 5 % at 8."""
    cores, words = S.slowdown(threads=1, cores=2)
    assert [cores(n) for n in (1, 2, 3, 4)] == pytest.approx([0.0, 0.0, 0.5, 1.0])
    assert '2 cores' in words
    both, words = S.slowdown(threads=1, cores=2, measured=(2, 0.2))
    assert [both(n) for n in (1, 2, 3)] == pytest.approx([0.0, 0.2, 0.8])
    assert 'measured at 2 ranks' in words
    gpu, words = S.slowdown(measured=(2, 0.05))
    assert [gpu(n) for n in (1, 2, 8)] == pytest.approx([0.0, 0.05, 0.05]) and 'cores' not in words
    none, words = S.slowdown()
    assert none(8) == 0.0 and words.startswith('none')


def test_forecast_with_slowed_compute_by_hand():
    """The by-hand case above (step 1 s, backward 0.5 s, two 1 MiB buckets at 1 s each), with 0.9 s
    of work per step slowed by half at 2 ranks: 0.45 s more work, the backward 0.75 s, so buckets
    ready at 0.375 and 0.75, sent 0.375..1.375, 1.375..2.375: exposed 1.625 s; step 1 + 0.45 + 1.625
    = 3.075 s."""
    link = S.Link(intra_bw=MiB, intra_lat=0.0)
    rows = S.forecast(1.0, 0.5, 32, 2 * MiB, link, gpus=(1, 2), bucket_cap_mb=1, work_s=0.9,
                      slowed=lambda n: 0.5 if n > 1 else 0.0)
    assert rows[0]['step_s'] == 1.0 and rows[0]['slowed_pts'] == 0.0
    two = rows[1]
    assert (two['slowed_s'], two['exposed_s'], two['step_s']) == pytest.approx((0.45, 1.625, 3.075))
    assert two['slowed_pts'] == pytest.approx(100 * 0.45 / 3.075)
    assert two['efficiency'] == pytest.approx(1 / 3.075)


def test_cli_takes_the_slowdown_from_a_run_at_two_ranks(tmp_path):
    """The one device works 90 ms of its 100 ms steps; two ranks, 108 ms each (20 % more): the
    forecast says where its compute slowed term comes from and prints it beside the measured one."""
    one = summary(totals={'steady_steps': 10, 'wall_s': 1.0, 'busy_s': 0.9, 'data_s': 0.1})
    one['provenance'], one['host'] = {'device': 'cuda'}, {'usable_cores': 16, 'torch_threads': 4}
    ranks = [{'rank': k, 'steady_steps': 10, 'wall_s': 1.3, 'data_s': 0.1, 'busy_s': 1.08 + 0.1,
              'comm_s': 0.1, 'late_s': 0.0} for k in (0, 1)]
    two = {'status': 'completed', 'world_size': 2, 'global_batch': 16,
           'config': {'bucket_cap_mb': 25.0},
           'timing': {'steady_images_per_s': 123.0, 'ranks': ranks,
                      'comm_measured': 'all-reduce hook'}}
    paths = [tmp_path / 'one.json', tmp_path / 'two.json']
    for path, s in zip(paths, (one, two)):
        path.write_text(json.dumps(s))
    def run(*extra):
        return subprocess.run([sys.executable, os.path.join(ROOT, 'dlojz_scaling.py'), '--summary',
                               str(paths[0]), '--machine', 'a100', '--gpus', '1,2', *extra],
                              capture_output=True, text=True)
    r = run('--slowed-from', str(paths[1]), '--measured', str(paths[1]))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[1] == 'compute slowed: measured at 2 ranks (+20.0% work per step)'
    # the work grown, ms: the model's and the measured
    assert lines[4].split()[5] == '18.00' and lines[4].split()[-1] == '18.00'
    r = run('--slowed-from', str(paths[0]))
    assert r.returncode == 2
    assert r.stderr.startswith('dlojz_scaling: error: --slowed-from needs a run at 2')
    r = run('--cores', '-1')
    assert r.returncode == 2 and 'Traceback' not in r.stderr


@pytest.mark.slow
def test_gloo_probe_under_torchrun(tmp_path):
    """The probe at 2 ranks: a point per size, times that grow with the size, and a fit that gives
    back the measured times within a factor of 2 at the largest size (a ring is what gloo's
    all-reduce does there)."""
    out = tmp_path / 'probe.json'
    r = torchrun(2, '--probe', out, script=os.path.join(ROOT, 'dlojz_scaling.py'), timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    probe = json.loads(out.read_text())
    assert probe['world_size'] == 2 and [b for b, _ in probe['points']] == [2 ** 16, 2 ** 20, 2 ** 22, 2 ** 24]
    times = [t for _, t in probe['points']]
    assert all(t > 0 for t in times) and times[-1] > times[0]
    b, t = probe['points'][-1]
    assert S.ring_allreduce_s(b, 2, probe['bandwidth'], probe['latency']) == pytest.approx(t, rel=1.0)
