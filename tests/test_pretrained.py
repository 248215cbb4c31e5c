import dataclasses

import pytest
import torch

from labkit import pretrained


def test_shipped_adder_really_adds():
    model, log = pretrained.load_tiny_adder()
    task = pretrained.adder_task()
    assert task.evaluate(model, "test") >= 0.95  # measured now, on problems it never trained on
    assert log["val_step"][-1] == pretrained.RECIPE.steps
    assert len(log["val_digit_accuracy"][0]) == task.answer_width


def test_stale_asset_is_refused(tmp_path, monkeypatch):
    payload = torch.load(pretrained.ASSET, weights_only=False)
    payload["recipe"] = dataclasses.asdict(dataclasses.replace(pretrained.RECIPE, steps=1))
    path = tmp_path / "old.pt"
    torch.save(payload, path)
    with pytest.raises(RuntimeError, match="python -m labkit.pretrained"):
        pretrained.load_tiny_adder(path=path)
