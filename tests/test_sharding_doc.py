"""docs/sharding.md's memory plans are what dlojz prints: the ResNet-18 plan block, the refusal of
ViT-g/14 under DDP on 4 GPUs of 16 GB, and the --shard full figures beside it, each computed here
by dlojz's own planner (measure.memory over the model built on the meta device, the flags'
defaults) and compared with the doc's text, so that the doc cannot drift from the code (it had
said 3.77 / 3.97 GiB where the plan printed 3.78 / 3.96).

Run: python -m pytest -q tests/test_sharding_doc.py"""
import os
import re

import pytest
import torch

from conftest import ROOT
import custom_models
import dlojz
from dlojzlib.dist import plan
from dlojzlib.errors import UsageError
from dlojzlib.measure import memory

VIT_G = 'timm:vit_giant_patch14_224'


@pytest.fixture(scope='module')
def doc():
    with open(os.path.join(ROOT, 'docs', 'sharding.md')) as f:
        return f.read()


def meta_model(arch, classes):
    try:
        with torch.device('meta'):
            return custom_models.build_model(arch, classes)
    except (RuntimeError, NotImplementedError) as e:  # timm 1.0.3 (see tests/test_shard.py)
        pytest.skip(f'this timm cannot build {arch} on the meta device: {e}')


def plans_of(model, world, *argv, capacity=None):
    """-> (the flags' args, the plans) as dlojz makes them before the first step."""
    args = dlojz.get_args_parser().parse_args(list(argv))
    return args, memory.plan_model(args, model, custom_models.blocks(model), world, capacity)


def test_the_resnet18_plan_block_is_the_printed_plan(doc):
    """ResNet-18 with SGD at 2 ranks, on the synthetic data's 10 classes (the default)."""
    block = re.search(r'ResNet-18 with SGD at 2 ranks.*?\n```\n(.*?)\n```', doc, re.S)
    args, plans = plans_of(meta_model('resnet18', 10), 2, '--arch', 'resnet18', '--shard',
                           'gradients')
    assert block.group(1).splitlines() == plan.plan_lines(plans, args.shard, 2)


def test_the_vit_g_refusal_and_full_sharding_figures_are_the_printed_ones(doc):
    """ViT-g/14 with AdamW on 4 GPUs of 16 GB (16e9 bytes): DDP's refusal, word for word, and
    --shard full's model states and peak (with the two blocks it gathers), as dlojz rounds them."""
    model = meta_model(VIT_G, 1000)
    flags = ['--arch', VIT_G, '--optimizer', 'adamw']
    with pytest.raises(UsageError) as refused:
        plans_of(model, 4, *flags, capacity=16e9)
    line = re.search(r'^dlojz: error: (--arch ' + re.escape(VIT_G) + r' .*)$', doc, re.M)
    assert line.group(1) == str(refused.value)
    _, plans = plans_of(model, 4, *flags, '--shard', 'full', capacity=16e9)
    said = re.search(r'`--shard full` plans ([\d.]+) GiB there, ([\d.]+) GiB with the two blocks',
                     doc)
    assert said.groups() == (plan.gib(plans['full']['model_states']),
                             plan.gib(plans['full']['peak']))
