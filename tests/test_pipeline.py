"""--pipeline-stages, --microbatches, --pipeline-schedule and --pipeline-split (dist.pipeline,
dist.stages, measure.bubble), on CPU with gloo:

- a pipeline trains as one process running the same microbatches does, bit for bit: the loss of
  every step and the validation after them, at 2 ranks for each schedule this torch runs (GPipe,
  1F1B, interleaved), at 4 ranks (4 stages), and on a 2 x 2 mesh against 2 replicas of one stage.
  The reference is `--pipeline-stages 1 --microbatches M` in one process with as many threads as
  each pipeline rank (torch's CPU kernels add in another order with more threads), which runs the
  microbatches one after the other without torch's schedules; that one is held to a plain run
  (microbatches change only the rounding of a model without BatchNorm);
- a 2 x 2 mesh validates a checkpoint exactly as DDP at 2 ranks does (every image counted once);
- a pipeline's checkpoint is a folder of each stage's part; a resume keeps the cut and continues as
  the uninterrupted run, bit for bit; a resume at another number of stages is refused;
- --shard on the replicas' dimension (ZeRO-1, FSDP2's two modes) trains a 2 x 2 mesh as its
  replicas without it do, bit for bit, and a sliced checkpoint resumes;
- the measured bubble of balanced stages is within 5 points of the schedule's (S-1)/(M+S-1), and
  '>>> Bound by:' names it;
- the cut: the balance by hand counts and against every cut of small cases (a property test), the
  model's parts put back together are the model, the flags a pipeline cannot take are refused in
  one sentence, 1F1B on gloo below torch 2.8 too (the floor stage of .ci/run runs it).

The 2- and 4-rank launches are in the long tier; the cut, the parts and the refusals in the fast
one.
Run: python -m pytest -q -m "" tests/test_pipeline.py"""
import itertools
import json
import re

import pytest
import torch
from hypothesis import given, settings, strategies as st

from conftest import TINY, latest, run_cli, torchrun
import custom_models
from dlojzlib import flags
from dlojzlib.dist import pipeline, stages
from dlojzlib.errors import UsageError
from dlojzlib.record import summary

TORCH = tuple(int(v) for v in re.findall(r'\d+', torch.__version__)[:2])
VIT = ['--arch', 'timm:vit_tiny_patch16_224', '--optimizer', 'adamw', '--lr', '0.002',
       '--scheduler', 'constant', '--wd', '0', '--log-interval', '1']
SCHEDULES = [s for s in stages.SCHEDULES if s == 'gpipe' or TORCH >= stages.GLOO_P2P_TORCH]


def losses(out):
    """Each step's loss, then the validation's loss and top-1, as metrics.jsonl recorded them."""
    with open(out / 'metrics.jsonl') as f:
        records = [json.loads(line) for line in f]
    return ([r['loss'] for r in records if r['type'] == 'train'],
            [(r['loss'], r['top1'], r['images']) for r in records if r['type'] == 'val'])


def launched(tmp_path, cache, name, ranks, *flags_, env=None):
    out = tmp_path / name
    common = [*TINY, *VIT, '--cache-dir', cache, '--output-dir', out, *flags_]
    p = torchrun(ranks, *common, env=env) if ranks else \
        run_cli(*common, env={'OMP_NUM_THREADS': '1', **(env or {})})
    assert p.returncode == 0, p.stderr[-3000:]
    return out, p.stdout


# ---------------------------------------------------------------------------------- the long tier

@pytest.mark.slow  # 40 s: one process, then a 2-rank launch per schedule
def test_two_stages_train_as_one_process_running_the_same_microbatches(tmp_path, cache_dir):
    ref, _ = launched(tmp_path, cache_dir, 'ref', 0, '--microbatches', '4', '--test-nsteps', '4')
    want = losses(ref)
    assert len(want[0]) == 4 and want[1][0][2] == 24
    for schedule in SCHEDULES:
        out, stdout = launched(tmp_path, cache_dir, schedule, 2, '--pipeline-stages', '2',
                               '--microbatches', '4', '--pipeline-schedule', schedule,
                               '--test-nsteps', '4')
        assert losses(out) == want, schedule
        assert 'Pipeline: 2 stages x 1 replica(s)' in stdout, stdout


@pytest.mark.slow  # 60 s: 4-rank launches
def test_four_stages_and_a_two_by_two_mesh_train_as_their_references(tmp_path, cache_dir):
    ref, _ = launched(tmp_path, cache_dir, 'ref', 0, '--microbatches', '4', '--test-nsteps', '3')
    out, _ = launched(tmp_path, cache_dir, 'four', 4, '--pipeline-stages', '4', '--microbatches',
                      '4', '--pipeline-schedule', SCHEDULES[-1], '--test-nsteps', '3')
    assert losses(out) == losses(ref)
    # 2 replicas of one stage (the replicas' all-reduce alone), then of 2 stages
    two, _ = launched(tmp_path, cache_dir, 'two', 2, '--microbatches', '4', '--test-nsteps', '3')
    mesh, _ = launched(tmp_path, cache_dir, 'mesh', 4, '--pipeline-stages', '2', '--microbatches',
                       '4', '--pipeline-schedule', 'gpipe', '--test-nsteps', '3')
    assert losses(mesh) == losses(two)
    assert losses(mesh)[1][0][2] == 24  # every validation image once


@pytest.mark.slow  # 60 s: a 4-rank launch, then a 2-rank one
def test_a_slow_replica_of_a_stage_is_the_straggler_and_a_slow_stage_is_not(tmp_path, cache_dir):
    """2 stages x 2 replicas (rank = stage x 2 + replica), rank 1's loader sleeping 200 ms per image
    (the slow-loader failpoint: a cause outside the code that measures it; 1.6 s per step, three
    times the others' compute, 4 ranks sharing 2 cores; at 50 ms the others computed as long as
    it slept, and no one waited): its pipeline runs late, and the other pipeline's ranks wait for
    it in their stage's all-reduce, which each rank now times (measure.comm: CommTimer.wait). The
    job reads straggler, rank 1, bound by its loader. The same loader on a pipeline without replicas is the stage's own time: its other
    stage waits in the bubble, and no rank is a straggler."""
    out, stdout = launched(tmp_path, cache_dir, 'mesh', 4, '--pipeline-stages', '2',
                           '--microbatches', '4', '--pipeline-schedule', 'gpipe',
                           '--test-nsteps', '5', env={'DLOJZ_FAULT': 'slow-loader:1:0.2'})
    t = json.loads((out / 'summary.json').read_text())['timing']
    assert t['comm_measured'] == summary.PIPED[1], t
    assert (t['bound'], t['straggler_rank'], t['straggler_bound']) == ('straggler', 1, 'loader'), t
    assert t['typical_ranks'] == [0, 2], t
    assert "its steps" in stdout and "the others', bound by loader;" in stdout, stdout
    out, stdout = launched(tmp_path, cache_dir, 'stages', 2, '--pipeline-stages', '2',
                           '--microbatches', '4', '--pipeline-schedule', 'gpipe',
                           '--test-nsteps', '5', env={'DLOJZ_FAULT': 'slow-loader:0:0.2'})
    t = json.loads((out / 'summary.json').read_text())['timing']
    assert t['comm_measured'] == summary.PIPED[0] and t['bound'] != 'straggler', t
    assert 'straggler_rank' not in t, t


@pytest.mark.slow  # 90 s: 4-rank launches
def test_each_stage_shards_over_its_replicas_as_they_replicate(tmp_path, cache_dir):
    """--shard on the replicas' dimension of a 2 x 2 mesh: ZeRO-1 over each stage's replicas and
    FSDP2 slicing each stage's blocks over them train as the replicas without --shard do, bit for
    bit (two replicas: FSDP2's mean and DDP's divided sum agree); a --shard full checkpoint (a
    folder of each stage's slices) resumes as the uninterrupted run."""
    mesh = ['--pipeline-stages', '2', '--microbatches', '4', '--pipeline-schedule', 'gpipe']
    plain, _ = launched(tmp_path, cache_dir, 'none', 4, *mesh, '--test-nsteps', '4')
    want = losses(plain)
    for mode in ('optimizer', 'gradients', 'full'):
        out, _ = launched(tmp_path, cache_dir, mode, 4, *mesh, '--shard', mode, '--test-nsteps',
                          '4')
        assert losses(out) == want, mode
    cut, _ = launched(tmp_path, cache_dir, 'cut', 4, *mesh, '--shard', 'full', '--chkpt',
                      '--test-nsteps', '2')
    assert latest(cut).suffix == '.dcp'
    cut, _ = launched(tmp_path, cache_dir, 'cut', 4, *mesh, '--shard', 'full', '--chkpt',
                      '--test-nsteps', '4', '--resume', 'auto')
    assert losses(cut)[0] == want[0] and losses(cut)[1][-1] == want[1][-1]


@pytest.mark.slow  # 40 s
def test_a_mesh_validates_a_checkpoint_as_ddp_does(tmp_path, cache_dir):
    """DDP's one-file checkpoint, validated by DDP at 2 ranks and by 2 replicas of 2 stages: the
    same shards of the validation set, the same logits, the same sums."""
    ddp, _ = launched(tmp_path, cache_dir, 'ddp', 2, '--test-nsteps', '2', '--chkpt')
    ckpt = latest(ddp)
    ev = []
    for name, ranks, more in (('ev-ddp', 2, []), ('ev-mesh', 4, ['--pipeline-stages', '2',
                                                                 '--pipeline-schedule', 'gpipe'])):
        out, _ = launched(tmp_path, cache_dir, name, ranks, '--evaluate', '--resume', ckpt, *more)
        ev.append(losses(out)[1])
    assert ev[0] == ev[1] and ev[0][0][2] == 24


@pytest.mark.slow  # 40 s
def test_a_pipeline_resumes_its_checkpoint_where_the_uninterrupted_run_is(tmp_path, cache_dir):
    pp = ['--pipeline-stages', '2', '--microbatches', '2', '--pipeline-schedule', 'gpipe',
          '--pipeline-split', 'params', '--chkpt']
    whole, _ = launched(tmp_path, cache_dir, 'whole', 2, *pp, '--test-nsteps', '4')
    cut, _ = launched(tmp_path, cache_dir, 'cut', 2, *pp, '--test-nsteps', '2')
    assert latest(cut).suffix == '.dcp'
    # another --pipeline-split on resume: the checkpoint's cut is kept
    cut, stdout = launched(tmp_path, cache_dir, 'cut', 2, *pp[:-3], '--pipeline-split', '3',
                           '--chkpt', '--resume', 'auto', '--test-nsteps', '4')
    assert 'cut as the checkpoint was' in stdout, stdout
    assert losses(cut)[0] == losses(whole)[0] and losses(cut)[1][-1] == losses(whole)[1][-1]
    p = torchrun(2, *TINY, *VIT, '--cache-dir', cache_dir, '--output-dir', cut, '--resume',
                 'auto', '--test-nsteps', '6', '--microbatches', '2')
    # each worker exits 2 (torchrun says 1)
    assert p.returncode != 0 and 'exitcode  : 2' in p.stderr, p.stderr[-2000:]
    assert '--pipeline-stages 1 differs from the checkpoint\'s 2' in p.stderr, p.stderr[-2000:]
    if 'interleaved' in SCHEDULES:  # its cut has 4 stages, the checkpoint's 2
        p = torchrun(2, *TINY, *VIT, '--cache-dir', cache_dir, '--output-dir', cut, '--resume',
                     'auto', '--test-nsteps', '6', *pp[:4], '--pipeline-schedule', 'interleaved')
        assert p.returncode != 0 and 'the checkpoint holds a pipeline of 2 stages' in p.stderr, \
            p.stderr[-2000:]


@pytest.mark.slow  # 30 s
def test_the_measured_bubble_of_balanced_stages_is_the_schedules(tmp_path, cache_dir):
    """Two equal stages (6 blocks each; the head and tail weigh little) at 128 px, where a
    microbatch's forward and backward take some 100 ms a stage against gloo's millisecond a
    transfer on this 2-core machine: the share of
    each step a stage waits is (S-1)/(M+S-1), measured from its own chunks, for GPipe and 1F1B
    (BENCHMARKS.md: at 64 px the transfers add 4 to 10 points; torch's interleaved schedule idles
    more than Megatron's (S-1)/(2M+S-1))."""
    for schedule, m in [('gpipe', 4), ('1f1b', 4)][:len(SCHEDULES) - 1 or 1]:
        out, stdout = launched(tmp_path, cache_dir, f'{schedule}{m}', 2, '--pipeline-stages', '2',
                               '--microbatches', str(m), '--pipeline-schedule', schedule,
                               '--pipeline-split', '6', '--fake-data', '--fake-train-size', '512',
                               '--fake-val-size', '32', '--image-size', '128', '--val-image-size',
                               '128', '--val-resize', '146', '--test-nsteps', '10',
                               '--warmup-steps', '2', '-b', '32')
        with open(out / 'summary.json') as f:
            p = json.load(f)['timing']['pipeline']
        want = stages.bubble(schedule, 2, m)
        assert p['expected_bubble'] == pytest.approx(want)
        # the pipeline's: the mean of its stages'; each stage's own within 10 points (the first
        # stage's span also holds the last sends' wait, a 2-core host's noise the rest)
        assert abs(p['measured_bubble'] - want) < 0.05, (schedule, m, p)
        for stage in p['stages']:
            assert abs(stage['bubble'] - want) < 0.10, (schedule, m, p)
        assert '>>> Pipeline:' in stdout and 'pipeline bubble' in stdout, stdout


# ---------------------------------------------------------------------------------- the fast tier

def test_the_balance_by_hand():
    assert stages.balance([1, 1, 1, 1], 2) == [0, 2, 4]
    assert stages.balance([5, 1, 1, 1, 1, 1], 2) == [0, 1, 6]
    assert stages.balance([1, 2, 3, 4, 5, 6], 3) == [0, 3, 5, 6]  # 6, 9, 6
    assert stages.balance([3], 1) == [0, 1]
    with pytest.raises(ValueError):
        stages.balance([1, 1], 3)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 20), min_size=1, max_size=8), st.integers(1, 4))
def test_the_balance_is_the_best_contiguous_cut(costs, parts):
    """Against every cut: no other makes the slowest stage faster."""
    parts = min(parts, len(costs))
    bounds = stages.balance(costs, parts)
    assert bounds[0] == 0 and bounds[-1] == len(costs) and len(bounds) == parts + 1
    assert all(a < b for a, b in zip(bounds, bounds[1:]))
    worst = lambda b: max(sum(costs[i:j]) for i, j in zip(b, b[1:]))
    best = min(worst([0, *c, len(costs)])
               for c in itertools.combinations(range(1, len(costs)), parts - 1))
    assert worst(bounds) == best


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet='0123456789,tiemparsx -', max_size=12))
def test_a_split_is_read_or_refused_in_one_sentence(text):
    try:
        got = stages.parse_split(text)
    except ValueError as e:
        assert '\n' not in str(e) and str(e).startswith('--pipeline-split')
        return
    if isinstance(got, str):
        assert got in stages.BALANCE
    else:
        assert got[0] > 0 and list(got) == sorted(set(got))
        assert got == tuple(int(v) for v in text.strip().split(','))


def test_the_schedules_bubble_by_hand():
    assert stages.bubble('gpipe', 2, 4) == pytest.approx(1 / 5)
    assert stages.bubble('1f1b', 4, 8) == pytest.approx(3 / 11)
    assert stages.bubble('interleaved', 2, 4) == pytest.approx(1 / 9)


def vit():
    torch.manual_seed(0)
    return custom_models.build_model('timm:vit_tiny_patch16_224', 4, image_size=32).eval()


@pytest.mark.parametrize('bounds', [[0, 12], [0, 5, 12], [0, 1, 7, 11, 12]])
def test_the_parts_put_back_together_are_the_model(bounds):
    """Each rank's pruned copy runs its part; chained, they give the whole model's logits to the
    bit, and their state dicts share out the whole model's."""
    whole = vit()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        want = whole(x)
        h, keys = x, []
        for k in range(len(bounds) - 1):
            model = vit()
            fam = pipeline.family(model)
            part, = pipeline.prune(model, fam, bounds, [k])
            h = part(h)
            keys.append(set(model.state_dict()))
    assert torch.equal(h, want)
    assert set().union(*keys) == set(whole.state_dict())
    assert sum(map(len, keys)) == len(whole.state_dict())


def test_the_measured_pieces_give_the_shapes_between_stages():
    model = vit()
    fam = pipeline.family(model)
    costs, shapes = pipeline.measure(model, fam, torch.randn(2, 3, 32, 32), torch.device('cpu'),
                                     torch.autocast('cpu', enabled=False), 1)
    assert len(costs) == len(shapes) == 12 + 2 and all(c > 0 for c in costs)
    assert shapes[0] == ((2, 5, 192), torch.float32, (960, 192, 1))  # 4 patches, the class token
    assert shapes[-1] == ((2, 4), torch.float32, (4, 1))
    first_block = sum(p.numel() for p in model.blocks[0].parameters())
    assert pipeline.piece_params(model, fam)[1] == first_block
    assert sum(pipeline.piece_params(model, fam)) == sum(p.numel() for p in model.parameters())


def checked(*argv, world=2, version=TORCH, backend='gloo'):
    args = flags.get_args_parser().parse_args(['--test-nsteps', '2', '--wandb', 'off', *argv])
    return [s for refused, s in stages.refusals(flags.check_flags(args), world, version, backend)
            if refused]


@pytest.mark.parametrize('argv, says', [
    (['--pipeline-stages', '3'], 'needs a multiple of 3 ranks'),
    (['--pipeline-stages', '2', '--arch', 'resnet18'], 'BatchNorm over microbatches'),
    (['--microbatches', '3', '--arch', 'coatnet7'], 'does not split into --microbatches 3'),
    (['--pipeline-stages', '2', '--arch', 'coatnet7', '--accum-steps', '2'], 'drop --accum-steps'),
    (['--pipeline-stages', '2', '--arch', 'coatnet7', '--shard', 'full', '--microbatches', '2',
      '--pipeline-schedule', 'interleaved'], 'an FSDP2 root of its own'),
    (['--pipeline-stages', '2', '--arch', 'coatnet7', '--shard', 'full', '--cpu-offload'],
     'drop --cpu-offload'),
    (['--pipeline-stages', '2', '--arch', 'coatnet7', '--ema-decay', '0.9'], 'drop --ema-decay'),
    (['--pipeline-stages', '2', '--arch', 'coatnet7', '--compile'], 'drop --compile'),
    (['--pipeline-stages', '2', '--arch', 'coatnet7', '--amp', 'fp16'], 'use --amp bf16'),
    (['--pipeline-stages', '2', '--arch', 'coatnet7', '--mixup', '0.2'], 'drop them'),
    (['--pipeline-stages', '2', '--arch', 'coatnet7', '--microbatches', '3', '-b', '6',
      '--pipeline-schedule', 'interleaved'], 'a multiple of 2'),
    (['--pipeline-stages', '2', '--arch', 'coatnet7', '--pipeline-schedule', '1f1b'],
     'at least one microbatch per stage'),
])
def test_what_a_pipeline_cannot_take_is_refused_in_one_sentence(argv, says):
    said = checked(*argv)
    assert said and says in said[0], said
    assert '\n' not in said[0] and said[0].endswith('.')


def test_a_pipeline_of_tasks_sharing_a_gpu_is_refused_in_one_sentence():
    """gloo's send and recv hand a tensor's address to TCP, and a CUDA tensor's is on the GPU:
    ranks that share a GPU (gloo, --share-gpu or MPS) cannot run a pipeline's stages there. On
    103aea5 check_args let it through (the fifth GPU review, F2)."""
    argv = ['--test-nsteps', '2', '--wandb', 'off', '--pipeline-stages', '2', '--microbatches', '2',
            '--arch', 'coatnet7', '--pipeline-schedule', 'gpipe']  # 1F1B: refused on gloo below 2.8
    gpu = torch.device('cuda', 0)  # a device object only: nothing runs on it
    check = lambda backend: flags.check_args(flags.get_args_parser().parse_args(argv), gpu, 2,
                                             capability=(9, 0), backend=backend)
    with pytest.raises(UsageError) as e:
        check('gloo')
    said = str(e.value)
    assert 'gloo group of tasks sharing a GPU' in said and 'a GPU of its own' in said, said
    assert '\n' not in said and said.endswith('.')
    assert check('nccl').pipeline_stages == 2
    assert flags.check_args(flags.get_args_parser().parse_args(argv), torch.device('cpu'), 2,
                            backend='gloo').pipeline_stages == 2  # CPU tensors: gloo's own


def test_1f1b_on_gloo_is_refused_below_torch_2_8():
    argv = ['--pipeline-stages', '2', '--microbatches', '2', '--arch', 'coatnet7']
    assert checked(*argv, version=(2, 7)) == [
        '--pipeline-schedule 1f1b hangs on gloo below torch 2.8 (its batched sends and receives, '
        'pytorch/pytorch#152938; this is 2.7); use --pipeline-schedule gpipe, or upgrade torch.']
    assert checked(*argv, version=(2, 7), backend='nccl') == []
    assert checked(*argv, '--pipeline-schedule', 'gpipe', version=(2, 4)) == []
    assert checked(*argv, version=(2, 8)) == []


def test_a_model_without_blocks_is_refused_in_one_sentence():
    args = flags.get_args_parser().parse_args(['--pipeline-stages', '1', '--microbatches', '2',
                                               '--arch', 'timm:resnet18'])
    with pytest.raises(UsageError, match='is neither') as e:
        pipeline.build(args, custom_models.build_model('timm:resnet18', 4), torch.device('cpu'),
                       flags_dist(), None)
    assert '\n' not in str(e.value)


def flags_dist():
    from dlojzlib.dist.launch import DistInfo
    return DistInfo()


@pytest.mark.skipif(TORCH >= stages.GLOO_P2P_TORCH,
                    reason='the floor stage: 1F1B on gloo is refused below torch 2.8')
def test_the_floor_refuses_1f1b_on_gloo(tmp_path):
    p = torchrun(2, *TINY, *VIT, '--output-dir', tmp_path / 'run', '--pipeline-stages', '2',
                 '--microbatches', '2', '--test-nsteps', '1')
    assert p.returncode != 0 and 'hangs on gloo below torch 2.8' in p.stderr, p.stderr[-2000:]
    # torchrun prints its own traceback; none comes from dlojz's workers
    assert 'dlojz.py", line' not in p.stderr and 'dlojzlib' not in p.stderr, p.stderr[-3000:]


# ------------------------------------------------------------------ the measurement, by hand counts

class FakeStage:
    """A stage whose forward takes 2 and backward 3 units of a fake clock."""

    def __init__(self, clock, index):
        self.clock, self.stage_index = clock, index

    def forward_one_chunk(self, *a, **k):
        self.clock[0] += 2.0

    def backward_one_chunk(self, *a, **k):
        self.clock[0] += 3.0


def test_a_stage_timer_splits_a_step_into_chunks_and_waits(monkeypatch):
    """GPipe on the last of 2 stages, M = 2, by hand: it waits 1 for the first forward, then F F B
    B back to back, then 1 in the loss's all-reduce while the first stage drains: span 12, compute
    10, bubble 2."""
    from dlojzlib.measure import bubble
    clock = [0.0]
    monkeypatch.setattr(bubble.time, 'perf_counter', lambda: clock[0])
    stage = FakeStage(clock, 1)

    class Schedule:
        def step(self):
            clock[0] += 1.0
            for _ in range(2):
                stage.forward_one_chunk()
            for _ in range(2):
                stage.backward_one_chunk()

    class Pipe:
        stages, schedule = [stage], Schedule()

        @staticmethod
        def share_loss(losses):
            clock[0] += 1.0
    timer = bubble.StageTimer(torch.device('cpu')).attach(Pipe)
    Pipe.schedule.step()
    Pipe.share_loss([])
    got = bubble.resolve(timer.take())
    assert got['span'] == 12.0 and got['compute'] == 10.0
    assert got['forward'] == 4.0 and got['backward'] == 6.0
    assert got['chunks'] == [('F', 1, 1.0, 3.0), ('F', 1, 3.0, 5.0), ('B', 1, 5.0, 8.0),
                             ('B', 1, 8.0, 11.0)]
    assert timer.take() is None  # taken once


def test_the_bubble_is_a_share_of_the_steps_and_names_the_bound():
    from dlojz_chrono import step_shares, verdict
    shares = step_shares(10.0, 9.0, 1.0, idle=4.0)
    assert shares == {'compute': 5.0, 'bubble': 4.0, 'loader': 1.0, 'communication': 0.0,
                      'straggler': 0.0, 'host': 0.0}
    assert verdict(10.0, 9.0, 1.0, idle=6.0) == 'bubble'
    assert 'bubble' not in step_shares(10.0, 9.0, 1.0)  # a run without a pipeline


def rank(p, steps, span, idle):
    return {'pipe_rank': p, 'pipe_steps': steps, 'pipe_span_s': span, 'bubble_s': idle,
            'timeline': [('F', p, 0.0, 0.1)], 'timeline_span_s': span / steps}


def test_the_stages_summary_by_hand():
    """2 stages x 2 replicas, 4 steps each: stage 0 computes 0.8 s a step and waits 0.2, stage 1
    computes 0.6 and waits 0.4; the forecast paces the pipeline at the slowest stage, 0.8 s / (1 -
    1/5)."""
    ranks = [rank(0, 4, 4.0, 0.8), rank(0, 4, 4.0, 0.8), rank(1, 4, 4.0, 1.6),
             rank(1, 4, 4.0, 1.6)]
    p = stages.summary(ranks, 'gpipe', 2, 4)
    assert [s['compute_s'] for s in p['stages']] == pytest.approx([0.8, 0.6])
    assert [s['bubble'] for s in p['stages']] == pytest.approx([0.2, 0.4])
    assert p['measured_bubble'] == pytest.approx(0.3) and p['expected_bubble'] == 0.2
    assert p['forecast_span_s'] == pytest.approx(1.0) and p['span_s'] == pytest.approx(1.0)
    line = stages.line(p)
    assert line.startswith('>>> Pipeline: 2 stages, gpipe, 4 microbatches: bubble 30.0% measured, '
                           '20.0% the schedule')
    assert 'stage 1 computes 600.0 ms and waits 400.0 ms (40.0%)' in line
    assert stages.summary(ranks[:2], 'gpipe', 2, 4) is None  # a stage without a report
    assert stages.forecast(0.8, '1f1b', 4, 12) == pytest.approx(0.8 * 15 / 12)


def test_the_report_draws_each_stage_on_one_scale(tmp_path):
    from dlojzlib.tools.report import pipeline as view
    p = stages.summary([rank(0, 1, 1.0, 0.5), rank(1, 1, 1.0, 0.5)], 'gpipe', 2, 2)
    p['stages'][0]['timeline'] = [('F', 0, 0.0, 0.25), ('B', 0, 0.5, 1.0)]
    p['stages'][1]['timeline'] = [('F', 1, 0.25, 0.5)]
    assert view.text_timeline(p, width=8) == ['stage 0 |FF..BBBB|', 'stage 1 |..FF....|']


@settings(max_examples=20, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 20), st.floats(0.01, 5.0), st.floats(0.0, 1.0),
                          st.lists(st.tuples(st.sampled_from('FB'), st.floats(0, 1),
                                             st.floats(0, 1)), max_size=6)),
                min_size=1, max_size=4))
def test_the_report_reads_any_stages_summary(tmp_path_factory, per_stage):
    """Whatever the stages measured (any steps, spans, waits, chunks, even past the span), the
    report's text timeline has a row per stage of F, B and '.', and its table's bubble is the
    waits' share of the span."""
    from dlojzlib.tools.report import pipeline as view
    ranks = [{**rank(p, steps, span, span * idle),
              'timeline': [(k, p, min(a, b), max(a, b)) for k, a, b in chunks]}
             for p, (steps, span, idle, chunks) in enumerate(per_stage)]
    p = stages.summary(ranks, 'gpipe', len(ranks), 4)
    rows = view.text_timeline(p, width=20)
    assert len(rows) == len(ranks)
    assert all(re.fullmatch(r'stage \d+ \|[FB.]{20}\|', r) for r in rows), rows

    class Run:
        name = 'run'

        def get(self, key):
            return {'pipeline': p} if key == 'timing' else None

    class Rep:
        runs, out = [Run()], str(tmp_path_factory.mktemp('report'))
    md = view.pipeline_view(Rep)
    table = [line for line in md if re.match(r'\| \d+ \|', line)]
    assert len(table) == len(ranks)
    for line, (_, _, idle, _) in zip(table, per_stage):
        assert float(line.strip('|').split('|')[3]) == pytest.approx(idle * 100, abs=0.06)


def measured_pipeline(compute=(0.8, 0.6), span=1.0, step=1.25, m=4, schedule='gpipe'):
    return {'global_batch': 32, 'timing': {'steady_images_per_s': 32 / step, 'pipeline': {
        'n_stages': len(compute), 'microbatches': m, 'schedule': schedule, 'span_s': span,
        'stages': [{'compute_s': c} for c in compute]}}}


def test_the_pipeline_forecast_by_hand():
    """The slowest stage computes 0.8 s a step at 2 stages: 4 stages halve it, 8 microbatches
    shrink GPipe's bubble from 1/5 to 1/9 (S=2) or 3/11 (S=4); the loader and optimizer's 0.25 s
    stay."""
    rows = stages.forecast_rows(measured_pipeline(), [2, 4], [4, 8])
    got = {(r['stages'], r['microbatches']): r for r in rows}
    assert got[2, 4]['span_s'] == pytest.approx(1.0)  # the run's own point
    assert got[2, 8]['span_s'] == pytest.approx(0.8 / (1 - 1 / 9))
    assert got[4, 8]['span_s'] == pytest.approx(0.4 / (1 - 3 / 11))
    assert got[4, 8]['step_s'] == pytest.approx(0.4 / (1 - 3 / 11) + 0.25)
    assert got[4, 8]['images_per_s'] == pytest.approx(32 / got[4, 8]['step_s'])


json_values = st.recursive(st.none() | st.booleans() | st.integers(-3, 40) | st.floats()
                           | st.text(max_size=4),
                           lambda kids: st.lists(kids, max_size=3)
                           | st.dictionaries(st.sampled_from(
                               ['timing', 'pipeline', 'global_batch', 'steady_images_per_s',
                                'n_stages', 'microbatches', 'schedule', 'span_s', 'stages',
                                'compute_s']), kids, max_size=5), max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(json_values)
def test_a_summary_the_forecast_cannot_read_is_one_sentence(summary):
    try:
        rows = stages.forecast_rows(summary, [2, 4], [1, 8])
    except ValueError as e:
        assert '\n' not in str(e) and str(e).endswith('.')
        return
    assert all(r['span_s'] > 0 and r['images_per_s'] > 0 for r in rows)


def test_the_forecast_command_prints_its_table(tmp_path):
    path = tmp_path / 'summary.json'
    path.write_text(json.dumps(measured_pipeline()))
    from dlojzlib.measure import scaling
    import contextlib
    import io
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert scaling.main(['--pipeline', str(path), '--pipeline-stages', '4',
                             '--microbatches', '8']) == 0
    last = out.getvalue().splitlines()[-1].split()
    assert last[:2] == ['4', '8'] and float(last[2]) == pytest.approx(300 / 11, abs=0.05)


def test_a_non_finite_loss_stops_a_microbatched_run_before_its_step(tmp_path, cache_dir):
    """The NaN guard watches the pipeline's loss: a huge learning rate ends the run with status
    'nan' and no checkpoint at or after the bad step (the pipeline's own step, one stage here)."""
    out = tmp_path / 'run'
    p = run_cli(*TINY, *VIT[:2], '--cache-dir', cache_dir, '--output-dir', out, '--microbatches',
                '2', '--test-nsteps', '8', '--chkpt-every', '1', '--lr', '1e30', '--scheduler',
                'constant')
    assert p.returncode == 3 and 'NaN or infinite at step' in p.stderr, p.stderr[-2000:]
    summary = json.loads((out / 'summary.json').read_text())
    saved = [int(c.stem.split('-')[1]) for c in out.glob('checkpoint-*.pt')]
    assert summary['status'] == 'nan' and max(saved, default=0) == summary['failed_step'] - 1


def test_the_memory_plan_does_not_refuse_a_pipeline():
    """DDP's plan of the whole model would not fit a 1 GiB GPU; a pipeline's ranks hold a part,
    which the plan does not know: no plan, no refusal."""
    import argparse
    from dlojzlib.measure import memory
    said = []
    args = argparse.Namespace(pipeline_stages=2, wd=0.0, wd_norm_bias=True, optimizer='adamw',
                              mom=0.9, shard='none', cpu_offload=False, arch='coatnet7')
    assert memory.plan_run(args, vit, custom_models.blocks, 2, 2 ** 30, said.append) is None
    assert said and said[0].startswith('Memory plan: not made for --pipeline-stages 2')
    args.pipeline_stages = 1
    try:
        got = memory.plan_run(args, lambda: custom_models.build_model('coatnet7', 4),
                              custom_models.blocks, 2, 2 ** 30, said.append)
    except UsageError as e:
        assert 'more than this GPU' in str(e)
    else:  # timm 1.0.3 (the floor) cannot build it on the meta device: no plan there
        assert got is None and 'cannot be built on the meta device' in said[-1], said


def test_the_cut_follows_the_measured_time():
    """The head's time counts with the first block and the tail's with the last: a slow head moves
    the cut towards it; parameters or given blocks cut where they say."""
    costs = [3.0, 1.0, 1.0, 1.0, 1.0, 0.0]  # head, 4 blocks, tail
    assert pipeline.plan_cut('time', costs, 2) == [0, 1, 4]
    assert pipeline.plan_cut('time', [0.0, 1.0, 1.0, 1.0, 1.0, 3.0], 2) == [0, 3, 4]
    assert pipeline.plan_cut((2,), costs, 2) == [0, 2, 4]
    with pytest.raises(ValueError, match='does not cut the 4 blocks into 3 stages'):
        pipeline.plan_cut((2,), costs, 3)


def test_what_microbatches_change_in_batchnorm_is_said():
    """A CoAtNet's MBConv stages hold BatchNorm: the note counts its layers and names the
    microbatch's size; a ViT holds none."""
    model = custom_models.build_model('timm:coatnet_nano_rw_224', 4, image_size=32)
    n = sum(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules())
    note = pipeline.batchnorm_note(model, 'timm:coatnet_nano_rw_224', 32, 4)
    assert n > 0 and f'has {n} BatchNorm layers' in note
    assert 'microbatches of 8 images, not -b 32' in note
    assert pipeline.batchnorm_note(model, 'x', 32, 1) is None
    assert pipeline.batchnorm_note(vit(), 'x', 32, 4) is None
