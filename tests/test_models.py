"""custom_models: every --arch builds and gives the right shapes; conditional heads choose the same head
in two copies built with the same seed and never head 0 in eval; stochastic depth masks in training and
is exactly torchvision's ResNet in eval; activation checkpointing gives the same gradients and BatchNorm
statistics as torchvision's plain model.

Run: python -m pytest -q tests/test_models.py
"""
import copy

import pytest
import torch
import torchvision

import custom_models as CM


@pytest.mark.parametrize('arch', ['resnet18', 'resnet18-heads', 'resnet18-sd', 'resnet50-sd', 'resnet50-heads'])
def test_shapes(arch):
    torch.manual_seed(0)
    m = CM.build_model(arch, num_classes=7)
    m.train()
    out = m(torch.randn(2, 3, 64, 64))
    assert out.shape == (2, 7)


def test_resnet152_variants_have_course_structure():
    sd = CM.resnet152_with_stochastic_depth(p_L=0.5)
    blocks = [b for s in (sd.layer1, sd.layer2, sd.layer3, sd.layer4) for b in s]
    assert len(blocks) == 50 and all(b.sd_mode == 'batch' for b in blocks)
    assert blocks[0].drop_prob == pytest.approx(0.01) and blocks[-1].drop_prob == pytest.approx(0.5)
    heads = CM.build_model('resnet152-heads', 1000)
    assert len(heads.fc.heads) == 3 and heads.fc.heads[0].in_features == 2048
    ref = torchvision.models.resnet152(weights=None)
    assert sum(p.numel() for p in sd.parameters()) == sum(p.numel() for p in ref.parameters())


def test_head_choice_identical_across_copies_and_eval_never_head0():
    a = CM.ClassifierMixture(8, 3, n_heads=4)
    b = CM.ClassifierMixture(8, 3, n_heads=4)
    train_a = [a.choose_head() for _ in range(200)]
    train_b = [b.choose_head() for _ in range(200)]
    assert train_a == train_b
    share0 = train_a.count(0) / len(train_a)
    assert 0.55 < share0 < 0.8  # head 0 with probability 1 - 0.33
    assert set(train_a) == {0, 1, 2, 3}
    a.eval()
    assert 0 not in {a.choose_head() for _ in range(100)}


def test_head_counter_survives_state_dict():
    m = CM.build_model('resnet18-heads', 5)
    for _ in range(7):
        m.fc.choose_head()
    m2 = CM.build_model('resnet18-heads', 5)
    m2.load_state_dict(m.state_dict())
    assert m2.fc.seed == 7 and m2.fc.choose_head() == m.fc.choose_head()


def test_only_chosen_head_gets_gradient():
    torch.manual_seed(0)
    m = CM.build_model('resnet18-heads', 5)
    m.train()
    head = CM.ClassifierMixture(1, 1, 3)  # same seed sequence as the model's mixture
    chosen = head.choose_head()
    m(torch.randn(2, 3, 32, 32)).sum().backward()
    with_grad = [i for i, h in enumerate(m.fc.heads) if h.weight.grad is not None]
    assert with_grad == [chosen]


def test_stochastic_depth_eval_equals_torchvision():
    torch.manual_seed(0)
    sd = CM.build_model('resnet50-sd', 10, sd_prob=0.5)
    ref = torchvision.models.resnet50(weights=None, num_classes=10)
    ref.load_state_dict(sd.state_dict())
    sd.eval(), ref.eval()
    x = torch.randn(2, 3, 64, 64)
    torch.testing.assert_close(sd(x), ref(x))


def test_stochastic_depth_masks_in_training():
    torch.manual_seed(0)
    sd = CM.build_model('resnet18-sd', 10, sd_prob=0.9)
    ref = torchvision.models.resnet18(weights=None, num_classes=10)
    ref.load_state_dict(sd.state_dict())
    x = torch.randn(4, 3, 64, 64)
    outs = [sd(x) for _ in range(4)]
    assert any(not torch.allclose(outs[0], o) for o in outs[1:])  # different masks on different calls
    # sd_prob 0: the training forward is torchvision's training forward
    zero = CM.build_model('resnet18-sd', 10, sd_prob=0.0)
    zero.load_state_dict(ref.state_dict())
    torch.testing.assert_close(zero(x), ref(x))
    # every parameter receives a gradient, even with blocks dropped (DDP needs no unused-parameter search)
    sd.zero_grad()
    sd(x).sum().backward()
    assert all(p.grad is not None for p in sd.parameters())


def test_grad_checkpointing_matches_plain_model():
    torch.manual_seed(0)
    plain = torchvision.models.resnet18(weights=None, num_classes=5)
    ckpt = CM.apply_grad_checkpointing(copy.deepcopy(plain))
    x = torch.randn(4, 3, 32, 32)
    for m in (plain, ckpt):
        m.train()
        m(x).sum().backward()
    for (name, p), q in zip(plain.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    for (name, b), c in zip(plain.named_buffers(), ckpt.buffers()):
        torch.testing.assert_close(b, c, msg=name)  # BatchNorm statistics updated once, not twice
    assert plain.state_dict().keys() == ckpt.state_dict().keys()


def test_unknown_arch():
    with pytest.raises(ValueError, match='unknown --arch'):
        CM.build_model('vgg16', 10)
