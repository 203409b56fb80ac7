"""End-to-end runs through dlojz.main()/cli() on CPU: a smoke run writing a valid summary, a short run
that learns (accuracy above chance), the README's demo learning, checkpoint -> resume reproducing an
uninterrupted run's losses exactly, worker-count independence, the optional modes (fake data, profiler,
custom archs, compile), and every bad input ending with one sentence, a non-zero exit, no traceback and
nothing overwritten.

Run: python -m pytest -q tests/test_train.py
"""
import hashlib
import json
import math
import os

import pytest
import torch

from conftest import ROOT, TINY, latest, run_cli, run_main
import dlojz


def losses(records):
    return {r['global_step']: r['loss'] for r in records if r['type'] == 'train'}


def test_smoke_summary(tmp_path, cache_dir):
    s, recs = run_main(tmp_path, cache_dir, '--test-nsteps', '5', '--log-interval', '1')
    on_disk = json.load(open(tmp_path / 'summary.json'))
    assert on_disk['status'] == 'completed' and on_disk['version'] == 1
    assert on_disk['config']['test'] and on_disk['config']['test_nsteps'] == 5
    assert json.load(open(tmp_path / 'config.json'))['arch'] == 'resnet18'
    t = on_disk['timing']
    assert t['steps'] == 5 and t['warmup_steps'] == 1 and t['stats']['step']['n'] == 4
    assert t['phase_sum_error'] < 0.02
    steady = t['per_step']['step'][1:]  # a rate is a sum: the steady steps' images / their time
    assert t['train_throughput'] == pytest.approx(8 * len(steady) / sum(steady))
    assert t['gpu_throughput'] >= t['train_throughput'] > 0
    assert set(t['per_step']) >= {'step', 'data', 'h2d', 'forward', 'backward', 'optimizer', 'other'}
    assert on_disk['data']['source'] == 'synthetic' and on_disk['data']['classes'] == 4
    assert on_disk['data']['batches_per_epoch'] == 12  # 96 images / 8
    assert on_disk['val']['images'] == 24 and on_disk['val']['batches'] == 2
    assert on_disk['provenance']['torch'] == torch.__version__
    assert on_disk['memory']['host_peak_rss_bytes'] > 0
    assert [r['global_step'] for r in recs if r['type'] == 'train'] == [1, 2, 3, 4, 5]
    assert all(math.isfinite(r['loss']) for r in recs)


def test_short_run_beats_chance(tmp_path, cache_dir):
    s, recs = run_main(tmp_path, cache_dir, '-e', '4', '--optimizer', 'adamw', '--lr', '0.002',
                       '--scheduler', 'constant')
    val = [r for r in recs if r['type'] == 'val']
    assert len(val) == 4 and val[-1]['images'] == 24
    assert max(v['top1'] for v in val[-2:]) > 0.5  # chance is 0.25 with 4 classes


def test_resume_reproduces_uninterrupted_losses(tmp_path, cache_dir, two_epochs):
    full = two_epochs[1]
    _, first = run_main(tmp_path / 'part', cache_dir, '-e', '2', '--test-nsteps', '18', '--chkpt',
                        '--log-interval', '1')
    ckpt = torch.load(latest(tmp_path / 'part'), weights_only=False)
    assert (ckpt['epoch'], ckpt['step_in_epoch'], ckpt['global_step']) == (1, 6, 18)  # mid-epoch 2
    _, second = run_main(tmp_path / 'resumed', cache_dir, '-e', '2', '--log-interval', '1',
                         '--resume', latest(tmp_path / 'part'))
    ref, a, b = losses(full), losses(first), losses(second)
    assert sorted(ref) == list(range(1, 25)) and sorted(b) == list(range(19, 25))
    assert [a[k] for k in range(1, 19)] == [ref[k] for k in range(1, 19)]
    assert [b[k] for k in range(19, 25)] == [ref[k] for k in range(19, 25)]  # bit-exact on CPU
    final_ref = [r for r in full if r['type'] == 'val'][-1]
    final_res = [r for r in second if r['type'] == 'val'][-1]
    assert final_res['loss'] == final_ref['loss'] and final_res['top1'] == final_ref['top1']


def test_validation_is_the_mean_over_images(tmp_path, cache_dir):
    """24 validation images in batches of 16 and 8: the loss and top-1 are per-image means, as torchvision's
    model computes them on torchvision's own ImageFolder pipeline, not means of batch means."""
    import torchvision
    from torchvision import transforms as T
    from dlojzlib.data.datasets import IMAGENET_MEAN, IMAGENET_STD
    s, _ = run_main(tmp_path, cache_dir, '--test-nsteps', '3', '--chkpt')
    model = torchvision.models.resnet18(num_classes=4)
    model.load_state_dict(torch.load(latest(tmp_path), weights_only=False)['model'])
    model.eval()
    root = os.path.join(s['data']['root'], 'val')
    ds = torchvision.datasets.ImageFolder(root, T.Compose([T.Resize(36), T.CenterCrop(32), T.PILToTensor()]))
    x = torch.stack([img for img, _ in ds]).float()
    y = torch.tensor([label for _, label in ds])
    x = (x - torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1) * 255) / (torch.tensor(IMAGENET_STD).view(1, 3, 1, 1) * 255)
    with torch.no_grad():
        logits = model(x)
    losses = torch.nn.functional.cross_entropy(logits, y, reduction='none')
    smoothed = torch.nn.functional.cross_entropy(logits, y, label_smoothing=0.1)  # the default criterion
    assert s['val']['images'] == 24 and s['val']['batches'] == 2
    # validation reports plain cross-entropy (as timm does); the training criterion's value under its own name
    assert s['val']['loss'] == pytest.approx(losses.mean().item(), rel=1e-5)
    assert s['val']['criterion_loss'] == pytest.approx(smoothed.item(), rel=1e-5)
    # the two can be told apart: their gap is many times the 1e-5 relative tolerance above (~1.4e-5 here)
    assert abs(smoothed.item() - losses.mean().item()) > 1e-4
    # two clocks: from the process's start (imports and set-up included) and from the run's, as MLPerf counts
    assert s['val']['process_wall_s'] > s['val']['wall_s'] > 0
    assert s['val']['top1'] == pytest.approx((logits.argmax(1) == y).float().mean().item())
    batch_means = (losses[:16].mean() + losses[16:].mean()).item() / 2
    assert abs(batch_means - losses.mean().item()) > 1e-3  # the check can tell the two apart


def test_losses_do_not_depend_on_worker_count(tmp_path, cache_dir):
    _, zero = run_main(tmp_path / 'w0', cache_dir, '--test-nsteps', '3', '--log-interval', '1')
    _, two = run_main(tmp_path / 'w2', cache_dir, '--test-nsteps', '3', '--log-interval', '1', '--num-workers', '2')
    assert losses(zero) == losses(two)


def test_fake_data_needs_no_files(tmp_path, cache_dir):
    s, _ = run_main(tmp_path, cache_dir, '--fake-data', '--fake-classes', '10', '--test-nsteps', '3')
    assert s['data']['source'] == 'fake' and s['timing']['steps'] == 3 and s['data']['classes'] == 10


def test_profiler_writes_traces(tmp_path, cache_dir):
    """--prof: a trace with the course's record_function tags; the profiled steps (1 warm-up + 2 active after
    1 waiting, the last one writing the trace) are timed but left out of the statistics."""
    s, _ = run_main(tmp_path, cache_dir, '--prof', '--test-nsteps', '6', '--prof-active', '2')
    traces = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / 'profiler') for f in fs if 'trace' in f]
    assert traces and all(os.path.getsize(t) > 0 for t in traces)
    text = ''.join(open(t, errors='replace').read() for t in traces)
    assert 'gradient compute' in text and 'inference and loss function' in text
    t = s['timing']
    assert t['profiled_steps'] == 3 and t['stats']['step']['n'] == 6 - 1 - 3


@pytest.mark.parametrize('arch', ['resnet18-heads', 'resnet18-sd'])
def test_custom_archs_train_with_grad_checkpointing(tmp_path, cache_dir, arch):
    s, recs = run_main(tmp_path, cache_dir, '--arch', arch, '--test-nsteps', '2', '--grad-checkpointing',
                       '--log-interval', '1')
    assert s['config']['arch'] == arch and [r['global_step'] for r in recs if r['type'] == 'train'] == [1, 2]


def err(capsys, *argv):
    code = dlojz.cli([str(a) for a in argv])
    captured = capsys.readouterr()
    lines = [l for l in captured.err.splitlines() if l.startswith('dlojz: error:')]
    assert 'Traceback' not in captured.err
    assert len(lines) == 1, captured.err
    return code, lines[0]


@pytest.mark.parametrize('flags, expected', [
    (['-b', '0'], '--batch-size must be positive'),
    (['--image-size', '-3'], '--image-size must be positive'),
    (['--num-workers', '0', '--prefetch-factor', '4'], 'need worker processes'),
    (['--num-workers', '0', '--persistent-workers'], 'need worker processes'),
    (['--amp', 'fp16'], '--amp fp16 needs a CUDA GPU'),
    (['--device', 'cuda'], 'sees no CUDA GPU'),
    (['--val-image-size', '300'], 'larger than --val-resize'),
    (['--arch', 'vgg16'], 'unknown --arch'),
    (['--data-dir', '/nonexistent/imagenet'], 'does not exist'),
    (['--resume', '/nonexistent/checkpoint.pt'], 'does not exist'),
    (['--arch', 'resnet18-heads', '--static-graph'], 'uses a different head from step to step; drop --static-graph'),
])
def test_flag_errors(capsys, tmp_path, cache_dir, flags, expected):
    if torch.cuda.is_available() and ('cuda' in flags or 'fp16' in flags):
        pytest.skip('CPU-only refusal')
    code, line = err(capsys, *TINY, '--cache-dir', cache_dir, '--output-dir', tmp_path, '--test-nsteps', 2, *flags)
    assert code == 2 and expected in line


def test_unwritable_output_dir(capsys, tmp_path, cache_dir):
    blocker = tmp_path / 'file'
    blocker.write_text('not a folder')
    code, line = err(capsys, *TINY, '--cache-dir', cache_dir, '--output-dir', blocker / 'run', '--test-nsteps', 2)
    assert code == 2 and 'cannot write to output directory' in line


def sha(path):
    return hashlib.sha256(open(path, 'rb').read()).hexdigest()


@pytest.fixture
def trained(tmp_path, cache_dir):
    """A run folder holding a checkpoint, and the checkpoint's hash (nothing may write over it)."""
    out = tmp_path / 'run'
    run_main(out, cache_dir, '--test-nsteps', '3', '--chkpt')
    return out, latest(out), sha(latest(out))


def test_checkpoint_of_another_arch_is_refused(capsys, tmp_path, cache_dir, trained):
    out, ckpt, before = trained
    code, line = err(capsys, *TINY, '--cache-dir', cache_dir, '--output-dir', tmp_path / 'other', '--test-nsteps', 2,
                     '--arch', 'resnet34', '--resume', ckpt)
    assert code == 2 and 'holds resnet18' in line and '--arch resnet34' in line
    assert sha(ckpt) == before


def test_nan_stops_the_run_and_keeps_the_checkpoint(capsys, tmp_path, cache_dir):
    """A huge learning rate makes the loss overflow: the run stops at that step, logs no non-finite loss
    and writes no checkpoint at or after it (--chkpt-every 1 checkpoints every step before)."""
    out = tmp_path / 'run'
    code, line = err(capsys, *TINY, '--cache-dir', cache_dir, '--output-dir', out, '--test-nsteps', 10,
                     '--chkpt-every', 1, '--lr', '1e30', '--scheduler', 'constant')
    assert code == 3 and 'NaN or infinite at step' in line
    summary = json.load(open(out / 'summary.json'))
    failed = summary['failed_step']
    assert summary['status'] == 'nan' and 2 <= failed <= 10
    saved = sorted(int(p.stem.split('-')[1]) for p in out.glob('checkpoint-*.pt'))
    assert saved and max(saved) == failed - 1
    recs = [json.loads(line) for line in open(out / 'metrics.jsonl')]
    assert all(math.isfinite(r['loss']) for r in recs if r['type'] == 'train')


def test_truncated_checkpoint_is_one_sentence(capsys, tmp_path, cache_dir, trained):
    out, ckpt, before = trained
    truncated = tmp_path / 'truncated.pt'
    truncated.write_bytes(ckpt.read_bytes()[:1000])
    code, line = err(capsys, *TINY, '--cache-dir', cache_dir, '--output-dir', tmp_path / 'x', '--test-nsteps', 2,
                     '--resume', truncated)
    assert code == 2 and 'cannot be read' in line
    assert sha(ckpt) == before


@pytest.fixture
def bad_data(tmp_path, cache_dir):
    """A copy of the tiny dataset (TINY's, generated on first use; another test's set in the same
    cache, listed first, held no such image) with one undecodable training image."""
    import shutil
    from dlojzlib.data.datasets import synthetic_root
    args = dlojz.get_args_parser().parse_args([*TINY, '--cache-dir', cache_dir])
    src = synthetic_root(args)
    if not os.path.isdir(src):
        assert run_cli(*TINY, '--cache-dir', cache_dir, '--output-dir', tmp_path / 'make',
                       '--test-nsteps', 1).returncode == 0
    root = tmp_path / 'data'
    shutil.copytree(src, root)
    (root / 'train' / 'n00000002' / 'train_0002_00001.JPEG').write_bytes(b'\xff\xd8\xff\xe0 not really a jpeg')
    return [*TINY, '--data-dir', root, '-b', '96', '--test-nsteps', 1, '--num-workers', 1]


def test_bad_image_stops_with_its_name(capsys, tmp_path, bad_data):
    code, line = err(capsys, *bad_data, '--output-dir', tmp_path / 'strict')
    assert code == 2 and 'train_0002_00001.JPEG' in line and '--skip-bad-images' in line
    assert json.load(open(tmp_path / 'strict' / 'summary.json'))['status'] == 'failed'


def test_bad_image_is_skipped_and_counted(tmp_path, bad_data):
    assert dlojz.cli([str(a) for a in bad_data] + ['--output-dir', str(tmp_path / 'lenient'), '--skip-bad-images']) == 0
    assert json.load(open(tmp_path / 'lenient' / 'summary.json'))['data']['bad_images_skipped'] == 1


def test_cli_subprocess_prints_course_lines(tmp_path, cache_dir):
    p = run_cli(*TINY, '--cache-dir', cache_dir, '--output-dir', tmp_path, '--test-nsteps', 3)
    assert p.returncode == 0, p.stderr
    for line in ('>>> Training complete in:', '>>> Training performance time: min', '>>> Loading performance time',
                 '>>> Validation time:', '>>> Number of batch per epoch: 12'):
        assert line in p.stdout


def test_cli_bad_flag_is_one_line(tmp_path):
    p = run_cli('--output-dir', tmp_path, '-b', '-1')
    assert p.returncode == 2 and p.stderr == 'dlojz: error: -b/--batch-size must be positive (got -1); see python ' \
        'dlojz.py --help.\n' and p.stdout == ''
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


@pytest.mark.slow
def test_compile(tmp_path, cache_dir, monkeypatch):
    """--compile wraps the model in torch.compile (here with the aot_eager backend: it traces the graph and
    autograd as inductor would, in seconds instead of ~40 s); the checkpoint holds plain state-dict keys that
    an uncompiled torchvision model loads."""
    import torch._dynamo
    import torchvision
    real, calls = torch.compile, []
    monkeypatch.setattr(torch, 'compile', lambda m, mode=None, dynamic=None: calls.append((mode, dynamic)) or
                        real(m, backend='aot_eager', dynamic=dynamic))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    s, _ = run_main(tmp_path, cache_dir, '--compile', '--test-nsteps', '3', '--chkpt')
    assert calls == [(None, False)] and torch._dynamo.utils.counters['stats']['unique_graphs'] >= 1
    state = torch.load(latest(tmp_path), weights_only=False)['model']
    assert not any(k.startswith('_orig_mod.') for k in state)
    torchvision.models.resnet18(num_classes=4).load_state_dict(state)


@pytest.mark.slow
def test_readme_demo_learns(tmp_path):
    """The README's demo command, as written there, learns: validation loss below 1.3 ln(classes) and top-1
    above chance on the built-in data (generated here into a fresh cache, as on a new machine)."""
    readme = open(os.path.join(ROOT, 'README.md')).read()
    demo = next(line for line in readme.splitlines() if line.startswith('python dlojz.py'))
    flags = demo.split('#')[0].split()[2:]
    p = run_cli(*flags, '--cache-dir', tmp_path / 'cache', '--output-dir', tmp_path / 'run', timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    s = json.load(open(tmp_path / 'run' / 'summary.json'))
    classes = s['data']['classes']
    assert s['val']['loss'] < 1.3 * math.log(classes) and s['val']['top1'] > 1 / classes, s['val']
    assert f"Validation epoch 1: loss {s['val']['loss']:.4f} top-1 {s['val']['top1']:.4f}" in p.stdout
