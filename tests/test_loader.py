"""--loader-only and the loader doctor (--tune-loader):

- the measurement against a hand count on a fake clock (warm-up left out, epochs crossed);
- --loader-only on the built-in data: batches, images and epochs counted by hand, the console line, the
  summary's loader section, the workers' memory counted; its folder is named after the loader (not
  --arch) and the console says where it is;
- the flags passed on to the doctor's trials parse back to the same run; the sweep and the verdict;
- the doctor end to end: a table row per trial, a verdict, tune-loader.json/.csv, and the report's section.

Run: python -m pytest -q tests/test_loader.py
"""
import csv
import json
import os
import re

import pytest
import torch

from conftest import TINY
import dlojz
from dlojzlib.data import dali
from dlojzlib.modes import doctor as L
from dlojzlib.tools import report


class Clock:
    def __init__(self, times):
        self.times = list(times)

    def __call__(self):
        return self.times.pop(0)


def test_measure_leaves_out_the_warmup_and_crosses_epochs():
    """Batches of 4 images, 3 per epoch; the clock reads 0 at the start, then at each batch 1.0 (worker
    start-up; read again once the device is synchronised there), 1.5, 2.0, 2.5, 3.0, and 3.0 at the
    end. Steady: 4 batches x 4 images in 3.0 - 1.0 s = 8 img/s."""
    batches = [(torch.zeros(4, 3, 2, 2), torch.zeros(4))] * 3
    epochs = []
    m = L.measure(batches, 5, 1, torch.device('cpu'), set_epoch=epochs.append,
                  clock=Clock([0.0, 1.0, 1.0, 1.5, 2.0, 2.5, 3.0, 3.0]))
    assert m['images_per_second'] == pytest.approx(8.0)
    assert (m['steps'], m['images'], m['epochs_started'], epochs) == (5, 20, 2, [0, 1])
    assert m['first_batch_s'] == pytest.approx(1.0) and m['wait_mean_s'] == pytest.approx(0.5)


def test_loader_only_measures_the_training_loader(tmp_path, cache_dir, capsys):
    """TINY: 96 train images in batches of 8, so 12 per epoch; with -e 2, 15 batches cross into a
    second epoch, the first 4 (2 workers x prefetch 2) left out of the rate."""
    out = tmp_path / 'run'
    assert dlojz.cli([*TINY, '--cache-dir', cache_dir, '--output-dir', str(out), '--loader-only',
                      '--test-nsteps', '15', '-e', '2', '--num-workers', '2']) == 0
    text = capsys.readouterr().out
    line = re.search(r'>>> Loader throughput: ([\d.]+) images/second \(([\d.]+) per worker\)', text)
    assert line, text
    with open(out / 'summary.json') as f:
        s = json.load(f)
    m = s['loader']
    # warm-up: 2 workers x prefetch 2 batches (they arrive together at start), 11 more timed
    assert (s['mode'], s['status'], m['warmup_steps'], m['steps'], m['images'], m['epochs_started']) == (
        'loader', 'completed', 4, 15, 120, 2)
    assert (m['num_workers'], m['prefetch_factor'], m['decode']) == (2, 2, 'fast')
    assert float(line.group(1)) == pytest.approx(m['images_per_second'], rel=1e-3)
    assert m['images_per_second_per_worker'] == pytest.approx(m['images_per_second'] / 2)
    assert m['host_peak_workers_bytes'] > 0 and m['host_peak_main_bytes'] > 0  # two workers' VmHWM counted
    assert sorted(os.listdir(out)) == ['config.json', 'summary.json']
    assert text.rstrip().splitlines()[-1] == f'Run written to {out}'


@pytest.mark.parametrize('epochs, steps, accum', [(1, 15, 1), (2, 15, 1), (1, 8, 1), (1, 5, 2)])
def test_the_loader_alone_reads_the_batches_training_reads(tmp_path, cache_dir, epochs, steps, accum):
    """A loader-alone figure below what training reached with the same loader is a defect (issue 45):
    bench.py's loader rows drew 46 batches from a 30-batch epoch, timing an epoch restart training
    never made. --loader-only now reads what a training run of the same flags reads: --test-nsteps
    batches within its epochs (12 per epoch here; -e 1 stops training at 12 of 15), in as many
    epochs; with --accum-steps 2 each step reads two batches (a review found the loader alone read
    half of them). Expected values from the training run itself."""
    flags = [*TINY, '--cache-dir', cache_dir, '--test-nsteps', steps, '-e', epochs, '--accum-steps', accum]
    trained = dlojz.main(dlojz.get_args_parser().parse_args(
        [str(f) for f in flags] + ['--output-dir', str(tmp_path / 'train')]))
    alone = dlojz.main(dlojz.get_args_parser().parse_args(
        [str(f) for f in flags] + ['--output-dir', str(tmp_path / 'loader'), '--loader-only']))['loader']
    per_epoch = 12 // accum  # optimizer steps per epoch: 96 images, 8 per batch
    assert trained['global_step'] == min(steps, epochs * per_epoch)
    assert alone['steps'] == trained['global_step'] * accum
    assert alone['epochs_started'] == -(-trained['global_step'] // per_epoch)
    assert alone['images'] == trained['global_step'] * 8 * accum


def test_loader_modes_name_their_default_folder():
    from argparse import Namespace
    from dlojzlib.record.rundir import default_output_dir
    dist = Namespace(job_id='77')
    for flags, name in ((dict(loader_only=True), '77_loader_bs8'), (dict(tune_loader=True), '77_tune-loader_bs8'),
                        (dict(), '77_resnet50_bs8')):
        args = Namespace(**{'run_name': None, 'arch': 'resnet50', 'batch_size': 8, 'loader_only': False,
                            'tune_loader': False, **flags})
        assert default_output_dir(args, dist) == os.path.join('runs', name)


def test_loader_modes_refuse_what_they_cannot_measure(tmp_path, capsys):
    assert dlojz.cli([*TINY, '--output-dir', str(tmp_path / 'a'), '--loader-only', '--fake-data']) == 2
    assert dlojz.cli([*TINY, '--output-dir', str(tmp_path / 'b'), '--loader-only', '--tune-loader']) == 2
    err = capsys.readouterr().err
    assert '--loader-only measures the data loader of a new run; drop --fake-data' in err
    assert '--loader-only and --tune-loader exclude each other; drop one.' in err
    assert not os.path.exists(tmp_path / 'a')


def test_the_trials_get_the_users_flags_back():
    """What the doctor passes on parses back to the same values (but the flags it sets itself)."""
    parser = dlojz.get_args_parser()
    given = ['-b', '16', '--arch', 'resnet18', '--no-channels-last', '--deterministic', '--image-size', '64',
             '--lr', '0.5', '--num-workers', '3', '--tune-loader', '--output-dir', 'x']
    raw = vars(parser.parse_args(given))
    argv = L.to_argv(parser, raw)
    assert '--num-workers' not in argv and '--tune-loader' not in argv and '--output-dir' not in argv
    back = vars(parser.parse_args(argv))
    for k, v in raw.items():
        if k not in L._TRIAL_FLAGS:
            assert back[k] == v, k
    assert sorted(argv) == sorted(['--batch-size', '16', '--arch', 'resnet18', '--no-channels-last',
                                   '--deterministic', '--image-size', '64', '--lr', '0.5'])


def test_sweep_and_verdict_by_hand():
    assert [(t['num_workers'], t['prefetch_factor'], t['pin_memory'], t['decode']) for t in L.sweep(2, False)] == [
        (0, None, None, 'fast'), (1, 2, None, 'fast'), (1, 4, None, 'fast'), (2, 2, None, 'fast'),
        (2, 4, None, 'fast'), (2, 2, None, 'pil'), (2, 4, None, 'pil')]  # the other decode path at the top
    gpu = L.sweep(12, True)
    assert sorted({t['num_workers'] for t in gpu}) == [0, 1, 2, 4, 8, 12] and len(gpu) == 2 + 4 * 2 * 2 + 3 * 2 * 2
    assert {t['decode'] for t in gpu if t['num_workers'] == 12} == {'fast', 'pil', 'gpu'}  # nvJPEG on a GPU only
    assert {t['decode'] for t in L.sweep(4, True, decode='gpu')} == {'gpu', 'fast'}

    def trial(w, ips, mem):
        return {'num_workers': w, 'prefetch_factor': 2 if w else None, 'pin_memory': None, 'decode': 'fast',
                'images_per_second': ips,
                'images_per_second_per_worker': ips / max(1, w), 'host_peak_bytes': mem}
    trials = [trial(0, 100, 1), trial(4, 800, 2), trial(8, 1200, 9)]
    v = L.verdict(trials, 3000, budget=5)  # 8 workers do not fit: the best that fits is 4 workers, 800 img/s
    assert (v['bound'], v['best']['num_workers'], v['within_budget']) == ('loader', 4, True)
    assert v['loader_over_ceiling'] == pytest.approx(800 / 3000)
    assert v['workers_for_ceiling'] == 15  # 3000 / 200 img/s per worker (the best per-worker rate)
    # fed 800 img/s, a model taking 3000 waits 1 - 800/3000 = 73 % of each step: the largest share
    assert v['data_wait_share'] == pytest.approx(1 - 800 / 3000)
    assert 'loader-bound (data wait 73% of each step, compute 27%): the model could take 3.75x' in \
        L.verdict_lines(v)[-1]
    # the margin: fed 800 img/s, a model taking 1000 computes 80 % of each step and waits 20 %. The
    # run's '>>> Bound by' line says compute (its largest share), and so does the doctor, with the
    # wait.
    v = L.verdict(trials, 1000, budget=5)
    assert v['bound'] == 'compute' and v['data_wait_share'] == pytest.approx(0.2)
    assert L.verdict_lines(v)[-1].startswith('>>> Verdict: compute-bound (data wait 20% of each '
                                             'step, compute 80%): use --num-workers 4')
    v = L.verdict(trials, 500, budget=None)
    assert (v['bound'], v['best']['num_workers']) == ('compute', 8)
    assert L.verdict_lines(v)[-1].endswith('use --num-workers 8 --decode fast --prefetch-factor 2.')


@pytest.mark.parametrize('feeds', [0.3, 0.45, 0.55, 0.8, 1.2])
def test_the_doctor_says_the_word_the_run_would_say(feeds):
    """A loader feeding `feeds` x what the model takes (1000 img/s, batch 100): on the host clock
    the Chronometer of a run with workers loading while it computes measures a data wait of max(0,
    100 / L - 0.1) s per step beside 0.1 s of compute. The doctor's verdict from L and the ceiling
    is the word the run's Chronometer gives; the doctor's wait share is the one the run measures."""
    from dlojz_chrono import Chronometer
    clock = type('Clock', (), {'t': 0.0, '__call__': lambda self: self.t})()
    loader_ips, ceiling = 1000 * feeds, 1000.0

    def batches(steps=12):
        for _ in range(steps):
            clock.t += max(0.0, 100 / loader_ips - 100 / ceiling)  # the workers' batch is this late
            yield torch.zeros(100, 1), torch.zeros(100)
    run = Chronometer('cpu', warmup=2, clock=clock)
    for _ in run.iterate(batches()):
        clock.t += 100 / ceiling  # the step's compute
    t = run.summary(global_batch=100)
    v = L.verdict([{'num_workers': 2, 'prefetch_factor': 2, 'pin_memory': None, 'decode': 'fast',
                    'images_per_second': loader_ips, 'images_per_second_per_worker': loader_ips / 2,
                    'host_peak_bytes': 1}], ceiling, budget=None)
    assert v['bound'] == t['bound'] == ('loader' if feeds < 0.5 else 'compute')
    assert v['data_wait_share'] == pytest.approx(t['shares']['loader'], abs=1e-9)


@pytest.mark.slow
def test_the_doctor_measures_trials_and_the_ceiling(tmp_path, cache_dir, capsys, monkeypatch):
    monkeypatch.setattr(L, 'usable_cores', lambda: 1)  # 0 workers; 1 worker x prefetch 2, 4 x decode fast, pil
    monkeypatch.setattr(dali, 'dali', lambda: None)  # its trial: tests/test_dali.py
    out = tmp_path / 'doctor'
    assert dlojz.cli([*TINY, '--cache-dir', cache_dir, '--output-dir', str(out), '--tune-loader',
                      '--test-nsteps', '4']) == 0
    text = capsys.readouterr().out
    rows = [line for line in text.splitlines() if re.match(r'\| \d+ \|', line)]
    assert len(rows) == 5 and 'Verdict: ' in text and '>>> Compute ceiling (--fake-data): ' in text
    with open(out / 'tune-loader.json') as f:
        tune = json.load(f)
    assert [(t['num_workers'], t['decode']) for t in tune['trials']] == [(0, 'fast'), (1, 'fast'), (1, 'fast'),
                                                                         (1, 'pil'), (1, 'pil')]
    with open(tune['ceiling']['dir'] + '/summary.json') as f:
        ceiling = json.load(f)
    assert ceiling['config']['fake_data'] and ceiling['config']['fake_classes'] == 4  # TINY's classes
    assert ceiling['config']['arch'] == 'resnet18' and ceiling['config']['image_size'] == 32  # the user's flags
    assert tune['ceiling']['images_per_second'] == ceiling['timing']['gpu_throughput']  # compute only
    with open(out / 'tune-loader.csv') as f:
        assert [int(r['num_workers']) for r in csv.DictReader(f)] == [0, 1, 1, 1, 1]
    assert report.cli([str(out), '--out', str(tmp_path / 'report')]) == 0
    with open(tmp_path / 'report' / 'report.md') as f:
        text = f.read()
    assert '## Loader doctor' in text and os.path.exists(tmp_path / 'report' / 'doctor-doctor.png')


def test_memory_budget_is_one_tasks_share(tmp_path):
    """By hand: 16 CPUs x 4000 MiB (--mem-per-cpu), 4 tasks on the node, 100 GiB available: 62.5 GiB / 4."""
    meminfo = tmp_path / 'meminfo'
    meminfo.write_text(f'MemTotal: {200 * 2**20} kB\nMemAvailable: {100 * 2**20} kB\n')
    env = {'SLURM_MEM_PER_CPU': '4000', 'SLURM_CPUS_ON_NODE': '16', 'SLURM_NTASKS_PER_NODE': '4'}
    assert L.memory_budget(env, cgroup=lambda: None, meminfo=str(meminfo)) == 4000 * 16 * 2**20 // 4
    assert L.memory_budget({}, cgroup=lambda: 8 * 2**30, meminfo=str(meminfo)) == 8 * 2**30  # the cgroup's
    assert L.memory_budget({'SLURM_NTASKS_PER_NODE': '2(x3)'}, cgroup=lambda: None,
                           meminfo=str(meminfo)) == 50 * 2**30


def test_the_loader_alone_times_its_batches_work_on_the_device():
    """--decode gpu's batches are decoded on the GPU when the step takes them (.to()): the host
    returns at once and the device works 1 s per batch, one after the other. The loader alone must
    time that work, all of it and only its own (issue 45: a loader figure must be what training
    gets): synchronised where the steady window starts and where it ends, 4 steady batches of 8
    images in 4 s of device time, 8 img/s. Timed from the host's return after the warm-up batch
    (its device work still queued) it read 6.4 img/s; without the end's synchronisation, 3,200."""
    timeline = {'host': 0.0, 'device': 0.0}

    class Decoded:
        def to(self, device, non_blocking=False):
            timeline['device'] = max(timeline['device'], timeline['host']) + 1.0  # queued, not waited for
            timeline['host'] += 0.01
            return self

    class Labels(list):
        def to(self, device, non_blocking=False):
            return self
    batches = [(Decoded(), Labels(range(8))) for _ in range(5)]

    def synchronize():
        timeline['host'] = max(timeline['host'], timeline['device'])
    m = L.measure(batches, 5, 1, torch.device('cuda', 0), clock=lambda: timeline['host'],
                  synchronize=synchronize)
    assert m['images_per_second'] == pytest.approx(8.0) and m['steps'] == 5


@pytest.mark.parametrize('dali_installed', [False, True])
def test_every_doctor_trial_leaves_its_steps_to_time(tmp_path, monkeypatch, dali_installed):
    """Each trial of the loader doctor draws its --test-nsteps batches after its own warm-up, as the
    trial's process computes it from the flags it is given (parsed here, as dlojz.py parses them). A
    DALI trial gives no --prefetch-factor: the doctor counted none, the trial torch's default 2, and
    the trial refused (4 batches, 4 of warm-up, in CI's DALI stage)."""
    monkeypatch.setattr(L, 'usable_cores', lambda: 2)
    from dlojzlib.data import dali
    monkeypatch.setattr(dali, 'dali', lambda: object() if dali_installed else None)
    commands = []

    def run(cmd, out, shape=None):  # doctor._run; the summary below is of its shape
        commands.append(cmd)
        return {'status': 'completed', 'loader': {'images_per_second': 10.0, 'images_per_second_per_worker': 5.0,
                                                  'wait_mean_s': 0.1, 'first_batch_s': 0.1,
                                                  'host_peak_main_bytes': 1, 'host_peak_workers_bytes': 1},
                'data': {'classes': 4}, 'timing': {'train_throughput': 20.0}}
    monkeypatch.setattr(L, '_run', run)
    parser = dlojz.get_args_parser()
    args = parser.parse_args([*TINY, '--tune-loader', '--test-nsteps', '3', '--output-dir', str(tmp_path)])
    L.tune_loader(args, dict(vars(args)), parser, dlojz.get_dist_info(), torch.device('cpu'), lambda s: None)
    trials = [cmd for cmd in commands if '--loader-only' in cmd]
    assert len(trials) == len(L.sweep(2, False, decode=args.decode, dali=dali_installed))
    for cmd in trials:
        t = parser.parse_args(cmd[2:])
        assert t.test_nsteps - L.loader_warmup(t.warmup_steps, t.num_workers, t.prefetch_factor) == 3, cmd
