"""Model factories for dlojz: torchvision ResNets, the course's two custom variants, timm's models
and the course's CoAtNet-7.

    --arch resnet18 ... resnet152             torchvision's models, randomly initialised
    --arch <resnet>-heads (resnet152-heads)   add_conditional_heads: N classifier heads, one used per forward
    --arch <resnet>-sd    (resnet152-sd)      stochastic depth by masking the residual branch
    --arch timm:<name>                        any of timm's models by name (ViTs, CoAtNets, MaxViTs)
    --arch coatnet7                           CoAtNet-7 (2.43 B parameters) from timm's blocks

Behaviour follows the course's custom_models.py (reference/course.md §4):
- Conditional heads: a private CPU generator is re-seeded with a counter before every forward, so the
  choice of head is the same on every rank that runs the same number of forwards. Training: head 0 with
  probability 1 - p_active, else a uniform head in [1, n); eval: always a uniform head in [1, n).
  Unchosen heads receive no gradient, which is what DDP's find_unused_parameters is for.
- Stochastic depth: the residual branch is always computed, then multiplied by Bernoulli(1-p)/(1-p)
  noise (one draw per batch in "batch" mode), so every parameter gets a gradient every step. The drop
  probability rises linearly with depth, p_l = sd_prob * l / L for blocks l = 1..L. In eval the block is
  the plain torchvision block.
"""
from contextlib import contextmanager, nullcontext

import torch
import torch.nn as nn
import torchvision
from torch.utils.checkpoint import checkpoint
from torchvision.models.resnet import BasicBlock, Bottleneck, ResNet
from torchvision.ops import stochastic_depth

from dlojzlib import flags

RESNETS = {
    'resnet18': (BasicBlock, [2, 2, 2, 2]),
    'resnet34': (BasicBlock, [3, 4, 6, 3]),
    'resnet50': (Bottleneck, [3, 4, 6, 3]),
    'resnet101': (Bottleneck, [3, 4, 23, 3]),
    'resnet152': (Bottleneck, [3, 8, 36, 3]),
}
assert tuple(RESNETS) == flags.RESNETS  # the parser lists the names without importing torch
ARCHS = flags.ARCHS


class ClassifierMixture(nn.Module):
    def __init__(self, in_dim, num_classes, n_heads=3, p_active=0.33, seed=0):
        super().__init__()
        if n_heads < 2:
            raise ValueError('a classifier mixture needs at least 2 heads')
        self.heads = nn.ModuleList(nn.Linear(in_dim, num_classes) for _ in range(n_heads))
        self.p_active, self.seed = p_active, seed
        self.generator = torch.Generator()  # CPU: drawing a head never synchronises with the GPU

    def choose_head(self):
        self.generator.manual_seed(self.seed)
        self.seed += 1
        if self.training and torch.rand(1, generator=self.generator).item() >= self.p_active:
            return 0
        return int(torch.randint(1, len(self.heads), (1,), generator=self.generator).item())

    # Left out of torch.compile: the draw reads a CPU generator and a Python counter, which dynamo
    # would guard as constants and recompile for at every step until its limit. The trunk compiles
    # once; one eager Linear.
    @torch.compiler.disable
    def forward(self, feat):
        return self.heads[self.choose_head()](feat)

    # The counter travels in the state dict, so a resumed run continues the same head sequence.
    def get_extra_state(self):
        return {'seed': self.seed}

    def set_extra_state(self, state):
        self.seed = int(state['seed'])


def add_conditional_heads(m, n_heads=3):
    m.fc = ClassifierMixture(m.fc.in_features, m.fc.out_features, n_heads)
    return m


class _SDMixin:
    drop_prob = 0.0
    sd_mode = 'row'

    def _residual(self, x):
        raise NotImplementedError

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self._residual(x)
        if self.training and self.drop_prob > 0:
            out = stochastic_depth(out, p=self.drop_prob, mode=self.sd_mode, training=True)
        return self.relu(out + identity)


class BottleneckSD(_SDMixin, Bottleneck):
    def _residual(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        return self.bn3(self.conv3(out))


class BasicBlockSD(_SDMixin, BasicBlock):
    def _residual(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        return self.bn2(self.conv2(out))


def resnet_with_stochastic_depth(base='resnet152', p_L=0.5, sd_mode='batch', num_classes=1000):
    block, layers = RESNETS[base]
    sd_block = BottleneckSD if block is Bottleneck else BasicBlockSD
    model = ResNet(sd_block, layers, num_classes=num_classes)
    stages = (model.layer1, model.layer2, model.layer3, model.layer4)
    blocks = [b for stage in stages for b in stage]
    for idx, b in enumerate(blocks, start=1):
        b.drop_prob = p_L * idx / len(blocks)
        b.sd_mode = sd_mode
    return model


def resnet152_with_stochastic_depth(p_L=0.5, sd_mode='batch', num_classes=1000):
    return resnet_with_stochastic_depth('resnet152', p_L, sd_mode, num_classes)


@contextmanager
def _frozen_bn_stats(module):
    """Keep BatchNorm running statistics unchanged while a checkpointed stage is recomputed in the
    backward pass; without this each training step would update them twice."""
    bns = [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    saved = [(m.momentum,
              m.num_batches_tracked.clone() if m.num_batches_tracked is not None else None)
             for m in bns]
    for m in bns:
        m.momentum = 0.0  # running = (1 - 0) * running + 0 * batch statistic
    try:
        yield
    finally:
        for m, (momentum, tracked) in zip(bns, saved):
            m.momentum = momentum
            if tracked is not None:
                m.num_batches_tracked.copy_(tracked)


def apply_grad_checkpointing(model):
    """Activation checkpointing: timm's own for its models (set_grad_checkpointing); the four ResNet
    stages otherwise.

    ResNets: the four stages' activations are recomputed in the backward pass instead of being
    stored. State-dict keys are unchanged.

    Eager mode replays the stage in backward, BatchNorm updates included, so the replay runs with
    frozen statistics. Under torch.compile a context_fn must return two TorchDispatchModes (a plain
    context manager fails to compile), and none is needed: AOTAutograd applies the buffer updates
    once, in the forward graph (tested against an uncheckpointed model with the aot_eager backend).
    """
    if not isinstance(model, ResNet):
        model.set_grad_checkpointing(True)
        return model
    for name in ('layer1', 'layer2', 'layer3', 'layer4'):
        stage = getattr(model, name)
        plain = stage.forward
        contexts = lambda stage=stage: (nullcontext(), _frozen_bn_stats(stage))

        def forward(x, plain=plain, contexts=contexts):
            if not torch.is_grad_enabled():
                return plain(x)
            if torch.compiler.is_compiling():
                return checkpoint(plain, x, use_reentrant=False)
            return checkpoint(plain, x, use_reentrant=False, context_fn=contexts)
        stage.forward = forward
    return model


def coatnet7(num_classes=1000, image_size=224):
    """CoAtNet-7 (Dai et al. 2021, appendix: L = 2-2-4-8-42-2, D = 192-256-512-1024-2048-3072), the
    course's fourth-day model, from timm's MBConv and relative-attention Transformer blocks: a stem
    of 192 channels, then stages of 2, 4 and 8 MBConv blocks and of 42 and 2 Transformer blocks.
    timm halves the resolution at every stage, where the paper keeps its 42-block stage at 1/16: the
    attention there runs at 1/32, which changes only the relative-position tables (2 432 M
    parameters against the paper's 2.44 B, 0.3 % fewer)."""
    from timm.models.maxxvit import MaxxVit, MaxxVitCfg  # seconds to import: only when asked for
    cfg = MaxxVitCfg(embed_dim=(256, 512, 1024, 2048, 3072), depths=(2, 4, 8, 42, 2),
                     block_type=('C', 'C', 'C', 'T', 'T'), stem_width=192)
    return MaxxVit(cfg, img_size=image_size, num_classes=num_classes)


def timm_model(name, num_classes, image_size):
    """timm's model `name`, randomly initialised, for images of image_size px where it takes a size
    (ViTs and MaxViTs fix their position tables to it)."""
    import timm
    try:
        return timm.create_model(name, pretrained=False, num_classes=num_classes,
                                 img_size=image_size)
    except TypeError:  # a model without a fixed input size (a timm ResNet, a ConvNeXt)
        return timm.create_model(name, pretrained=False, num_classes=num_classes)


def blocks(model):
    """The blocks --shard gradients and full shard one by one, in order: a ResNet's residual blocks,
    the members of every `blocks` sequence (timm's ViTs, CoAtNets, MaxViTs, ConvNeXts)."""
    if isinstance(model, ResNet):
        return [b for stage in (model.layer1, model.layer2, model.layer3, model.layer4)
                for b in stage]
    return [b for name, m in model.named_modules() if name.rpartition('.')[2] == 'blocks'
            and isinstance(m, (nn.Sequential, nn.ModuleList)) for b in m]


def build_model(arch, num_classes, sd_prob=0.5, n_heads=3, image_size=224):
    if arch.startswith(flags.TIMM):
        return timm_model(arch[len(flags.TIMM):], num_classes, image_size)
    if arch == 'coatnet7':
        return coatnet7(num_classes, image_size)
    if arch not in ARCHS:
        raise ValueError(f'unknown --arch {arch}; choose one of {", ".join(ARCHS)}')
    base, _, variant = arch.partition('-')
    if variant == 'sd':
        return resnet_with_stochastic_depth(base, sd_prob, 'batch', num_classes)
    model = getattr(torchvision.models, base)(weights=None, num_classes=num_classes)
    if variant == 'heads':
        add_conditional_heads(model, n_heads)
    return model
