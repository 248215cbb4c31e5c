import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from labkit.data import ArithmeticTask
from labkit.model import TransformerLM, tiny_config
from labkit.train import (AdamW, TrainConfig, clip_grad_norm, cross_entropy, load_checkpoint, loss_per_position,
                          lr_cosine_schedule, make_optimizer, save_checkpoint, train)


@pytest.mark.parametrize("shape", [(5, 11), (2, 3, 17), (1, 1)])
@pytest.mark.parametrize("scale", [1.0, 1e4])
def test_cross_entropy_matches_torch(shape, scale):
    torch.manual_seed(0)
    logits = torch.randn(shape, dtype=torch.float64) * scale
    targets = torch.randint(0, shape[-1], shape[:-1])
    expected = F.cross_entropy(logits.reshape(-1, shape[-1]), targets.reshape(-1))
    got = cross_entropy(logits, targets)
    assert torch.isfinite(got)
    torch.testing.assert_close(got, expected)


def test_cross_entropy_gradient_matches_torch():
    logits = torch.randn(6, 9, requires_grad=True)
    targets = torch.randint(0, 9, (6,))
    (g,) = torch.autograd.grad(cross_entropy(logits, targets), logits)
    (expected,) = torch.autograd.grad(F.cross_entropy(logits, targets), logits)
    torch.testing.assert_close(g, expected)


def test_cross_entropy_errors():
    with pytest.raises(ValueError, match="leading shape"):
        cross_entropy(torch.randn(4, 5), torch.zeros(3, dtype=torch.long))
    with pytest.raises(TypeError, match="integer"):
        cross_entropy(torch.randn(4, 5), torch.zeros(4))


def _params(seed):
    torch.manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(7, 5)), torch.nn.Parameter(torch.randn(3))]


def test_adamw_matches_torch_over_many_steps():
    ours, ref = _params(0), _params(0)
    kwargs = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    opt, ref_opt = AdamW(ours, **kwargs), torch.optim.AdamW(ref, **kwargs)
    gen = torch.Generator().manual_seed(1)
    for _ in range(200):
        grads = [torch.randn(p.shape, generator=gen) for p in ours]
        for p, q, g in zip(ours, ref, grads):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
    for p, q in zip(ours, ref):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)


def test_adamw_argument_errors():
    with pytest.raises(ValueError, match="betas"):
        AdamW(_params(0), betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="lr"):
        AdamW(_params(0), lr=-1)


@pytest.mark.parametrize("max_norm", [0.1, 1.0, 1e3])
def test_clip_grad_norm_matches_torch(max_norm):
    ours, ref = _params(0), _params(0)
    for p, q in zip(ours, ref):
        p.grad = torch.randn_like(p)
        q.grad = p.grad.clone()
    norm = clip_grad_norm(ours, max_norm)
    expected = torch.nn.utils.clip_grad_norm_(ref, max_norm)
    torch.testing.assert_close(norm, expected)
    for p, q in zip(ours, ref):
        torch.testing.assert_close(p.grad, q.grad)


def test_lr_cosine_schedule_closed_form():
    args = dict(max_learning_rate=1.0, min_learning_rate=0.1, warmup_iters=10, cosine_cycle_iters=110)
    assert lr_cosine_schedule(0, **args) == 0.0
    assert lr_cosine_schedule(5, **args) == pytest.approx(0.5)
    assert lr_cosine_schedule(10, **args) == pytest.approx(1.0)
    assert lr_cosine_schedule(60, **args) == pytest.approx(0.1 + 0.5 * 0.9)
    assert lr_cosine_schedule(110, **args) == pytest.approx(0.1)
    assert lr_cosine_schedule(500, **args) == pytest.approx(0.1)
    values = [lr_cosine_schedule(t, **args) for t in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def _tiny(seed=0):
    torch.manual_seed(seed)
    task = ArithmeticTask(num_digits=1)
    return task, TransformerLM(tiny_config(task.vocab_size, d_model=32, d_ff=64, num_layers=1))


def test_checkpoint_round_trip_restores_model_optimizer_and_rng(tmp_path):
    task, model = _tiny()
    opt = make_optimizer(model, TrainConfig())
    train(model, task.tokens("train"), None, TrainConfig(steps=3, batch_size=4, context_length=8), optimizer=opt, progress=False)
    path = tmp_path / "ckpt.pt"
    torch.manual_seed(123)
    save_checkpoint(model, opt, 3, path)
    after_save = torch.rand(3)
    _, other = _tiny(seed=1)
    other_opt = make_optimizer(other, TrainConfig())
    assert load_checkpoint(path, other, other_opt) == 3
    assert torch.equal(torch.rand(3), after_save)
    for (k, v), (k2, v2) in zip(model.state_dict().items(), other.state_dict().items()):
        assert k == k2 and torch.equal(v, v2)
    assert str(opt.state_dict()) == str(other_opt.state_dict())


def test_checkpoint_save_is_atomic(tmp_path, monkeypatch):
    task, model = _tiny()
    opt = make_optimizer(model, TrainConfig())
    path = tmp_path / "ckpt.pt"
    save_checkpoint(model, opt, 1, path)
    good = path.read_bytes()

    def crash(obj, f, *args, **kwargs):
        f.write(b"partial")
        raise KeyboardInterrupt("power cut")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(model, opt, 2, path)
    assert path.read_bytes() == good
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]  # no temporary file left behind


def test_resume_continues_the_identical_trajectory(tmp_path):
    config = TrainConfig(steps=12, batch_size=4, context_length=8, eval_every=4, warmup_iters=2,
                         checkpoint_path=str(tmp_path / "ckpt.pt"), checkpoint_every=6)
    task, model = _tiny()
    data, val = task.tokens("train"), task.tokens("val")
    torch.manual_seed(7)
    full = train(model, data, val, config, progress=False)

    _, model2 = _tiny()
    torch.manual_seed(7)
    first = train(model2, data, val, config, stop_after=6, progress=False)  # "crash" after step 6
    _, model3 = _tiny(seed=5)  # a fresh process would start from other weights
    second = train(model3, data, val, config, resume_from=config.checkpoint_path, progress=False)
    assert first.train_loss + second.train_loss == full.train_loss
    assert first.val_loss + second.val_loss == full.val_loss
    assert second.step[0] == 7


def test_checkpoint_path_with_step_keeps_every_checkpoint(tmp_path):
    task, model = _tiny()
    config = TrainConfig(steps=4, batch_size=2, context_length=4, checkpoint_path=str(tmp_path / "c-{step}.pt"), checkpoint_every=2)
    train(model, task.tokens("train"), None, config, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c-2.pt", "c-4.pt"]


def test_train_reduces_loss_and_records_history():
    task, model = _tiny()
    config = TrainConfig(steps=60, batch_size=16, context_length=12, eval_every=20, max_lr=1e-2)
    history = train(model, task.tokens("train"), task.tokens("val"), config, progress=False)
    assert history.step == list(range(1, 61)) and history.val_step == [20, 40, 60]
    assert history.val_loss[-1] < history.val_loss[0] < math.log(task.vocab_size) + 0.5
    assert max(history.lr) == pytest.approx(1e-2, rel=0.1)


def test_train_config_errors():
    with pytest.raises(ValueError, match="steps"):
        TrainConfig(steps=0)
    with pytest.raises(ValueError, match="checkpoint_path"):
        TrainConfig(checkpoint_every=5)


def test_loss_per_position_averages_to_the_batch_loss():
    task, model = _tiny()
    data = task.tokens("val")
    per_position = loss_per_position(model, data, batch_size=8, context_length=12, seed=3)
    torch.manual_seed(3)
    from labkit.data import get_batch
    x, y = get_batch(data, 8, 12, "cpu")
    with torch.no_grad():
        expected = cross_entropy(model(x), y)
    assert per_position.shape == (12,)
    torch.testing.assert_close(per_position.mean(), expected)
