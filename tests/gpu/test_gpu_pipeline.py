"""--pipeline-stages and --microbatches on a GPU (what tests/test_pipeline.py cannot show on CPU):

- the cut's measurement runs each piece on the GPU and leaves the model on the host (a model larger
  than one GPU is never whole on it), with the CPU's shapes between the pieces and bf16 autocast's
  dtypes;
- the stage timer's CUDA events: a stage's chunks are timed on the device clock without a host
  wait, their sum within the schedule's span;
- one process runs its microbatches on CUDA under bf16, with a loss near the unsplit batch's;
- two ranks sharing the GPU (gloo, whose send and recv take host memory only) are refused a
  pipeline in one sentence, exit 2; two GPUs (NCCL) run a 2-stage GPipe end to end, the bubble
  measured by events (skipped on a node with one GPU).

Run: python -m pytest -q tests/gpu/test_gpu_pipeline.py
"""
import json
import os

import pytest
import torch

import custom_models
from conftest import TINY, run_cli, torchrun
from dlojzlib.dist import pipeline
from dlojzlib.measure import bubble

VIT = [*TINY, '--arch', 'timm:vit_tiny_patch16_224', '--image-size', '64', '--val-image-size',
       '64', '--val-resize', '72', '-b', '32', '--device', 'cuda', '--amp', 'bf16',
       '--optimizer', 'adamw', '--test-nsteps', '8', '--log-interval', '1']


def bf16():
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip('--amp bf16 needs compute capability 8.0')


def test_the_cut_is_measured_on_the_gpu_and_the_model_stays_on_the_host():
    bf16()
    model = custom_models.build_model('timm:vit_tiny_patch16_224', 4, image_size=64)
    fam = pipeline.family(model)
    x = torch.randn(8, 3, 64, 64)
    cpu = pipeline.measure(model, fam, x, torch.device('cpu'),
                           torch.autocast('cpu', enabled=False), 0)[1]
    costs, shapes = pipeline.measure(model, fam, x, torch.device('cuda'),
                                     torch.autocast('cuda', dtype=torch.bfloat16), 3)
    assert all(c > 0 for c in costs)
    assert [s for s, _ in shapes] == [s for s, _ in cpu]
    assert {p.device.type for p in model.parameters()} == {'cpu'}
    assert all(p.grad is None for p in model.parameters())


def test_stage_chunks_are_timed_by_events_without_a_host_wait():
    a = torch.randn(2048, 2048, device='cuda')

    class Stage:
        stage_index = 0

        def forward_one_chunk(self, *args, **kw):
            for _ in range(5):
                a @ a

        def backward_one_chunk(self, *args, **kw):
            for _ in range(10):
                a @ a

    class Schedule:
        def step(self):
            for _ in range(2):
                stage.forward_one_chunk()
            torch.cuda._sleep(10 ** 6)  # waiting for another stage, on the device
            for _ in range(2):
                stage.backward_one_chunk()

    stage = Stage()

    class Pipe:
        stages, schedule = [stage], Schedule()

        @staticmethod
        def share_loss(losses):
            torch.cuda._sleep(10 ** 6)  # the drain
    timer = bubble.StageTimer(torch.device('cuda')).attach(Pipe)
    torch.cuda.synchronize()
    Pipe.schedule.step()
    Pipe.share_loss([])
    step = timer.take()
    assert not step[-1].query()  # queued: the host went on
    torch.cuda.synchronize()
    got = bubble.resolve(step)
    assert 0 < got['compute'] < got['span']
    assert got['backward'] > 1.5 * got['forward']
    assert got['span'] - got['compute'] > 0  # the sleep


def test_microbatches_train_on_the_gpu(tmp_path, cache_dir):
    bf16()
    losses = {}
    for m in (1, 4):
        out = tmp_path / f'm{m}'
        p = run_cli(*VIT, '--cache-dir', cache_dir, '--output-dir', out, '--microbatches', m)
        assert p.returncode == 0, p.stderr[-3000:]
        with open(out / 'metrics.jsonl') as f:
            losses[m] = [r['loss'] for r in map(json.loads, f) if r['type'] == 'train']
    assert losses[4][0] == pytest.approx(losses[1][0], rel=0.02)  # the same images, bf16 apart


def test_two_ranks_sharing_the_gpu_are_refused_a_pipeline_in_one_sentence(tmp_path, cache_dir):
    """Tasks sharing a GPU all-reduce on gloo, whose send and recv take host memory only: a
    pipeline's activations, on the GPU, cannot travel there. The launch as a node makes it (two
    ranks, one visible GPU, --share-gpu: launch chooses gloo) is refused by each rank in one
    sentence, exit 2, before any send."""
    bf16()
    first_gpu = os.environ.get('CUDA_VISIBLE_DEVICES', '0').split(',')[0]
    p = torchrun(2, *VIT, '--cache-dir', cache_dir, '--output-dir', tmp_path / 'pp',
                 '--share-gpu', '--pipeline-stages', '2', '--microbatches', '4',
                 '--pipeline-schedule', 'gpipe', env={'CUDA_VISIBLE_DEVICES': first_gpu})
    # each worker exits 2 (torchrun says 1) with the sentence; torchrun prints its own traceback,
    # none comes from dlojz's workers
    assert p.returncode != 0 and 'exitcode  : 2' in p.stderr, p.stderr[-3000:]
    assert 'the gloo group of tasks sharing a GPU cannot do' in p.stderr, p.stderr[-3000:]
    assert 'dlojz.py", line' not in p.stderr and 'dlojzlib' not in p.stderr, p.stderr[-3000:]


def test_two_gpus_run_a_pipeline(tmp_path, cache_dir):
    """A 2-stage GPipe on two GPUs, a rank each (NCCL: the stages' sends go GPU to GPU) end to
    end, its bubble measured by CUDA events. The lent node has one GPU: skipped there."""
    if torch.cuda.device_count() < 2:
        pytest.skip('needs 2 GPUs on this node')
    bf16()
    out = tmp_path / 'pp'
    p = torchrun(2, *VIT, '--cache-dir', cache_dir, '--output-dir', out, '--pipeline-stages', '2',
                 '--microbatches', '4', '--pipeline-schedule', 'gpipe')
    assert p.returncode == 0, p.stderr[-3000:]
    with open(os.path.join(out, 'summary.json')) as f:
        t = json.load(f)['timing']
    assert t['clock'] == 'cuda-events' and t['pipeline']['measured_bubble'] > 0
    assert '>>> Pipeline:' in p.stdout
