import math

import pytest
import torch
import torch.nn.functional as F

from nanolm.loss import masked_cross_entropy, masked_cross_entropy_sum


def test_masked_cross_entropy_ignores_masked_positions():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)
    targets = torch.randint(7, (2, 5))
    mask = torch.tensor([[1, 1, 0, 1, 0], [0, 1, 1, 0, 1]], dtype=torch.bool)
    clean = masked_cross_entropy(logits, targets, mask)
    absurd = logits.clone()
    absurd[~mask] = torch.tensor([1e30, -1e30, float("inf"), float("nan"), 0.0, 3e4, -7.0])
    assert masked_cross_entropy(absurd, targets, mask).item() == pytest.approx(clean.item(), abs=0)
    absurd_targets = targets.clone()
    absurd_targets[~mask] = 3  # the targets of masked positions do not matter either
    assert masked_cross_entropy(logits, absurd_targets, mask).item() == pytest.approx(clean.item(), abs=0)


def test_masked_cross_entropy_is_mean_over_counted_positions():
    torch.manual_seed(1)
    logits = torch.randn(3, 4, 11)
    targets = torch.randint(11, (3, 4))
    mask = torch.rand(3, 4) > 0.4
    per_token = F.cross_entropy(logits.reshape(-1, 11), targets.reshape(-1), reduction="none")
    expected = per_token[mask.reshape(-1)].mean()
    torch.testing.assert_close(masked_cross_entropy(logits, targets, mask), expected)
    total, count = masked_cross_entropy_sum(logits, targets, mask)
    assert count.item() == mask.sum().item()
    torch.testing.assert_close(total, per_token[mask.reshape(-1)].sum())


def test_masked_cross_entropy_is_zero_not_nan_when_nothing_counts():
    logits = torch.randn(2, 3, 5, requires_grad=True)
    targets = torch.zeros(2, 3, dtype=torch.long)
    loss = masked_cross_entropy(logits, targets, torch.zeros(2, 3, dtype=torch.bool))
    loss.backward()
    assert loss.item() == 0.0 and torch.isfinite(logits.grad).all()


def test_masked_cross_entropy_runs_in_fp32_for_low_precision_logits():
    torch.manual_seed(2)
    logits = torch.randn(1, 8, 50) * 4
    targets = torch.randint(50, (1, 8))
    low = masked_cross_entropy(logits.bfloat16(), targets)
    assert low.dtype == torch.float32
    assert low.item() == pytest.approx(masked_cross_entropy(logits.bfloat16().float(), targets).item(), rel=1e-6)


def test_negative_targets_are_not_counted_without_a_mask():
    logits = torch.zeros(1, 4, 3)
    targets = torch.tensor([[0, -100, 1, -1]])
    total, count = masked_cross_entropy_sum(logits, targets)
    assert count.item() == 2 and total.item() == pytest.approx(2 * math.log(3))
