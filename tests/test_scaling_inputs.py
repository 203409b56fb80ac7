"""What the scaling forecast reads (measure.forecast_inputs, issue 49): each file (--summary,
--slowed-from, --measured, --link, --pipeline) read through dlojzlib.readers, and the forecast
refusing what cannot be one: a --slowed-from run of other flags, not completed, or of no more
ranks; a negative term or an efficiency above 100 % (a busy node, noise) named a measurement
problem, not printed. The runs are fabricated summary.json files whose numbers are chosen by hand
(the cause outside the code); any bytes and any JSON at each flag's path give a table or one
sentence, within a second.

python -m pytest -q tests/test_scaling_inputs.py          # a real 1- and 2-rank pair: -m slow"""
import contextlib
import io
import json
import os
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import ROOT, TINY, torchrun
from dlojzlib.measure import forecast_inputs as F, scaling as S
from strategies import DELETE, json_values, paths_of, replaced

SCRIPT = os.path.join(ROOT, 'dlojz_scaling.py')
CONFIG = {'arch': 'resnet18', 'batch_size': 8, 'image_size': 32, 'amp': 'off',
          'channels_last': False, 'compile': False, 'bucket_cap_mb': 25.0, 'shard': 'none',
          'lr': 0.1, 'output_dir': 'runs/one', 'test_nsteps': 50}


def one_rank(work=0.125, **config):
    """A completed one-rank run: 4 steady steps of 0.25 s, `work` s of them the device's own work
    (busy, no collective), 32 img/s at a batch of 8."""
    return {'status': 'completed', 'world_size': 1, 'global_batch': 8,
            'config': {**CONFIG, **config}, 'provenance': {'device': 'cuda'},
            'host': {'usable_cores': 16, 'torch_threads': 4},
            'communication': {'gradient_bytes_per_step': 4000, 'traffic_factor': 1.0},
            'timing': {'steady_images_per_s': 32.0, 'stats': {'backward': {'mean': 0.0625}},
                       'totals': {'steady_steps': 4, 'wall_s': 1.0, 'busy_s': 4 * work,
                                  'data_s': 0.125, 'collective_s': 0.0}}}


def more_ranks(work=0.125, ranks=2, status='completed', **config):
    """A run of `ranks` ranks whose every rank worked `work` s a step (its busy time less its
    0.125 s a step waiting in the all-reduce), over 4 steady steps."""
    per_rank = [{'rank': k, 'steady_steps': 4, 'wall_s': 1.5, 'data_s': 0.125,
                 'busy_s': 4 * work + 0.5, 'comm_s': 0.5, 'late_s': 0.0} for k in range(ranks)]
    return {'status': status, 'world_size': ranks, 'global_batch': 8 * ranks,
            'config': {**CONFIG, 'lr': 0.1 * ranks, 'output_dir': f'runs/{ranks}', **config},
            'timing': {'steady_images_per_s': 40.0 * ranks, 'ranks': per_rank,
                       'comm_measured': 'all-reduce hook'}}


PROBE = {'world_size': 2, 'backend': 'gloo', 'points': [[65536, 0.001]], 'bandwidth': 1e9,
         'latency': 1e-5}


def write(tmp_path, name, value):
    path = tmp_path / name
    path.write_bytes(value if isinstance(value, bytes) else json.dumps(value).encode())
    return str(path)


def forecast(*argv):
    """dlojz_scaling.py in this process -> (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = S.main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


def refused(code, out, err, *words):
    assert code == 2 and out == '', (code, out, err)
    assert err.startswith('dlojz_scaling: error: ') and err.count('\n') == 1, err
    for w in words:
        assert w in err, (w, err)
    return err


def pair(tmp_path, one, other, *extra):
    return forecast('--summary', write(tmp_path, 'one.json', one), '--machine', 'a100',
                    '--gpus', '1,2', '--slowed-from', write(tmp_path, 'other.json', other), *extra)


# --------------------------------------------------------------- --slowed-from: what a forecast is

def test_less_work_at_two_ranks_is_a_measurement_problem_not_187_percent(tmp_path):
    """The issue's case: runs measured on a busy node (here the one-device run, slowed by a
    neighbour) give the 2-rank run 73 % less work per step than the one device; the forecast
    printed that as an efficiency of 187 % at 2 GPUs, exit 0."""
    err = refused(*pair(tmp_path, one_rank(work=0.125), more_ranks(work=0.03375)),
                  '--slowed-from', 'other.json', 'measurement problem', '-73.0%',
                  'compute slowed', 'idle node')
    assert 'at 2 GPUs' in err and 'efficiency' in err


def test_no_work_grown_at_two_ranks_is_a_forecast_of_a_term_of_zero(tmp_path):
    """The margin: the same work at 2 ranks as on the one device (0.125 s both, exactly) is a
    compute slowed term of exactly 0, and a forecast."""
    code, out, err = pair(tmp_path, one_rank(), more_ranks())
    assert code == 0, err
    lines = out.splitlines()
    assert lines[1] == 'compute slowed: measured at 2 ranks (+0.0% work per step)'
    assert lines[4].split()[5] == '0.00'  # slowed ms at 2 GPUs


def test_an_efficiency_of_exactly_100_percent_is_a_forecast_and_above_is_not():
    row = {'gpus': 2, 'slowed_s': 0.0, 'straggler_s': 0.0, 'exposed_s': 0.0, 'step_s': 0.25,
           'efficiency': 1.0}
    assert F.measurement_problem([row], 'none') is None
    for bad in ({'efficiency': 1.0 + 1e-12}, {'slowed_s': -1e-9}, {'exposed_s': -1e-9}):
        sentence = F.measurement_problem([{**row, **bad}], 'measured at 2 ranks')
        assert 'measurement problem' in sentence and 'at 2 GPUs' in sentence
        assert '\n' not in sentence and sentence.endswith('.')


def test_work_that_grew_less_than_the_shared_cores_predict_is_a_measurement_problem(tmp_path):
    """3 CPU ranks on 2 cores take 1.5 x as long each; a run at 3 ranks that measured only 30 %
    more work makes the term at 2 ranks (a core each) 1.3 / 1.5 - 1 = -13.3 %."""
    one = one_rank(work=0.125)
    one['provenance'], one['host'] = {'device': 'cpu'}, {'usable_cores': 2, 'torch_threads': 1}
    refused(*pair(tmp_path, one, more_ranks(work=0.1625, ranks=3), '--gpus', '1,2,3'),
            'measurement problem', 'at 2 GPUs', '--slowed-from')


def test_a_one_device_run_that_measured_no_work_is_refused(tmp_path):
    """Busy no longer than its waits in collectives: the work per step is 0, and the slowed
    fraction work(2) / work(1) a division by zero (a ZeroDivisionError's traceback)."""
    one = one_rank()
    one['timing']['totals'].update(busy_s=0.5, collective_s=0.5)
    refused(*pair(tmp_path, one, more_ranks()), '--summary', 'one.json', 'no work')


@pytest.mark.parametrize('status', ['crashed', 'running', 'preempted'])
def test_a_slowed_from_run_that_did_not_complete_is_refused(tmp_path, status):
    refused(*pair(tmp_path, one_rank(), more_ranks(status=status)),
            '--slowed-from', 'other.json', repr(status), 'completed')


def test_a_slowed_from_run_of_other_flags_is_refused_naming_them(tmp_path):
    """The issue's -b 64 --arch resnet152: another work per step altogether. The learning rate,
    the output folder and the world size differ between any two such runs: not refused."""
    refused(*pair(tmp_path, one_rank(), more_ranks(batch_size=64, arch='resnet152')),
            '--slowed-from', 'other.json', '-b 64', '--arch resnet152', 'same flags')
    refused(*pair(tmp_path, one_rank(), more_ranks(amp='bf16')), '--amp bf16')
    unrecorded = more_ranks()
    del unrecorded['config']
    refused(*pair(tmp_path, one_rank(), unrecorded), '--slowed-from', 'config')


def test_a_slowed_from_run_at_one_rank_is_refused(tmp_path):
    refused(*pair(tmp_path, one_rank(), one_rank()), '--slowed-from needs a run at 2')


# ------------------------------------------------------------------------ the files themselves

def test_a_probe_of_one_rank_is_one_sentence(tmp_path):
    """A --probe at world size 1 writes no fit (bandwidth null): a TypeError's traceback."""
    one = write(tmp_path, 'one.json', one_rank())
    for probe in ({**PROBE, 'world_size': 1, 'bandwidth': None, 'latency': None},
                  {**PROBE, 'bandwidth': 0}, {**PROBE, 'latency': -1.0}):
        refused(*forecast('--summary', one, '--link', write(tmp_path, 'probe.json', probe)),
                '--link', 'probe.json', '--probe')


def test_a_bucket_cap_of_zero_is_one_sentence(tmp_path):
    """config.bucket_cap_mb 0 made bucket_sizes loop for ever past the first 1 MiB bucket (no
    bucket ever full)."""
    one = one_rank(bucket_cap_mb=0)
    one['communication']['gradient_bytes_per_step'] = 4 * 2 ** 20
    one = write(tmp_path, 'one.json', one)
    r = subprocess.run([sys.executable, SCRIPT, '--summary', one, '--machine', 'a100'],
                       capture_output=True, text=True, timeout=30)
    refused(r.returncode, r.stdout, r.stderr, 'config.bucket_cap_mb')


@pytest.mark.parametrize('flag', ['--summary', '--slowed-from', '--measured', '--link',
                                  '--pipeline'])
@pytest.mark.parametrize('kind', ['fifo', 'folder'])
def test_a_special_file_is_refused_without_blocking(tmp_path, flag, kind):
    """open() of a FIFO waits for a writer: the forecast hung for ever (a FIFO's case runs in a
    process of its own, whose wait a timeout ends)."""
    path = str(tmp_path / 'special')
    os.mkfifo(path) if kind == 'fifo' else os.mkdir(path)
    one = write(tmp_path, 'one.json', one_rank())
    argv = {'--summary': ['--summary', path, '--machine', 'a100'],
            '--link': ['--summary', one, '--link', path],
            '--pipeline': ['--pipeline', path]}.get(flag, ['--summary', one, '--machine', 'a100',
                                                           flag, path])
    if kind == 'folder':
        refused(*forecast(*argv), flag, path, 'folder')
        return
    r = subprocess.run([sys.executable, SCRIPT, *argv], capture_output=True, text=True,
                       timeout=30)
    refused(r.returncode, r.stdout, r.stderr, flag, path, 'FIFO')


def test_steady_steps_of_zero_seconds_are_a_table(tmp_path):
    """Steps recorded as 0 s (a clock too coarse) made the p90/median line a ZeroDivisionError."""
    one = one_rank()
    one['timing'].update(per_step={'step': [0.0] * 4, 'images': [8] * 4}, warmup_steps=0)
    code, out, err = forecast('--summary', write(tmp_path, 'one.json', one), '--machine', 'a100')
    assert code == 0 and '4 steady steps (p90/median -)' in out, err


def test_a_probe_into_a_folder_is_refused_before_it_runs(tmp_path):
    """The probe wrote its JSON after a minute of all-reduces: into a folder, a traceback then."""
    for path in (tmp_path, tmp_path / 'no' / 'probe.json'):
        refused(*forecast('--probe', path), '--probe', str(path), 'folder')


def test_a_missing_file_names_its_flag(tmp_path):
    refused(*forecast('--summary', tmp_path / 'nope.json', '--machine', 'a100'),
            '--summary', 'nope.json', 'does not exist')


# ------------------------------------------------------------- any bytes, any JSON: one sentence

def valid_files():
    pipeline = {'global_batch': 32, 'timing': {'steady_images_per_s': 25.6, 'pipeline': {
        'n_stages': 2, 'microbatches': 4, 'schedule': 'gpipe', 'span_s': 1.0,
        'stages': [{'compute_s': 0.8}, {'compute_s': 0.6}]}}}
    one = one_rank()
    one['timing']['per_step'] = {'step': [0.3, 0.25, 0.26, 0.24, 0.25], 'images': [8] * 5}
    one['timing']['warmup_steps'] = 1
    return {'--summary': one, '--slowed-from': more_ranks(work=0.15),
            '--measured': more_ranks(work=0.15), '--link': PROBE, '--pipeline': pipeline}


VALID = valid_files()


def argv_with(flag, path, tmp):
    if flag == '--pipeline':
        return ['--pipeline', path, '--pipeline-stages', '2,4']
    one = write(tmp, 'one.json', VALID['--summary'])
    link = ['--link', path] if flag == '--link' else ['--machine', 'a100']
    more = [flag, path] if flag in ('--slowed-from', '--measured') else []
    return ['--summary', path if flag == '--summary' else one, *link, '--gpus', '1,2,4', *more]


def answered(code, out, err, flag):
    """A table, or one sentence; a forecast is never above 100 % efficient."""
    if code == 2:
        assert out == '' and err.count('\n') == 1 and err.startswith('dlojz_scaling: error: '), err
        assert err.rstrip().endswith('.'), err
        return
    assert code == 0 and err == '', err
    if flag != '--pipeline':
        head = out.splitlines().index(next(li for li in out.splitlines() if 'GPUs' in li))
        for line in out.splitlines()[head + 1:]:
            assert float(line.split()[8].rstrip('%')) <= 100.0, line


JSON = json_values(text=8, keys=8, size=3, leaves=8)
FLAGS = sorted(VALID)
SETTINGS = settings(deadline=1000, max_examples=50,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.mark.parametrize('flag', FLAGS)
@SETTINGS
@given(data=st.binary(max_size=200))
def test_any_bytes_at_each_flag_give_a_table_or_one_sentence(tmp_path, flag, data):
    path = write(tmp_path, 'file.json', data)
    answered(*forecast(*argv_with(flag, path, tmp_path)), flag)


@pytest.mark.parametrize('flag', FLAGS)
@SETTINGS
@given(data=st.data())
def test_any_json_anywhere_in_each_file_gives_a_table_or_one_sentence(tmp_path, flag, data):
    at = data.draw(st.sampled_from(list(paths_of(VALID[flag]))))
    new = data.draw(JSON | st.just(DELETE) if at else JSON)
    path = write(tmp_path, 'file.json', json.dumps(replaced(VALID[flag], at, new)).encode())
    answered(*forecast(*argv_with(flag, path, tmp_path)), flag)


# ------------------------------------------------------------------------------ real summaries

@pytest.mark.slow  # ~40 s on 2 cores: a 1-rank and a 2-rank torchrun
def test_a_real_pair_of_runs_is_a_forecast(tmp_path, cache_dir):
    """Two runs of the same flags under torchrun, at 1 and 2 ranks, differ in their world size,
    learning rate (scaled with the global batch) and output folder only: --slowed-from takes one
    with the other (a forecast, or a measurement problem named on this busy machine, never
    another refusal); the --summary run's own summary is refused as --slowed-from."""
    flags = [*TINY, '--cache-dir', cache_dir, '--test-nsteps', '6', '--timing']
    for n in (1, 2):
        r = torchrun(n, *flags, '--output-dir', tmp_path / f'n{n}')
        assert r.returncode == 0, r.stderr[-2000:]
    one, two = (str(tmp_path / f'n{n}' / 'summary.json') for n in (1, 2))
    code, out, err = forecast('--summary', one, '--machine', 'a100', '--gpus', '1,2',
                              '--slowed-from', two, '--measured', two)
    assert code == 0 or 'measurement problem' in err, err
    answered(code, out, err, '--summary')
    refused(*forecast('--summary', one, '--machine', 'a100', '--slowed-from', one),
            'needs a run at 2')
