"""Distillation losses on one process. Oracles: ``torch.nn.functional.kl_div``, a float64 formula
written out here, and values worked by hand."""

import math

import pytest
import torch
import torch.nn.functional as F
from mcore_models.training import hidden_state_loss, logit_kl_loss


def _kl64(p_logits, q_logits, mask, temperature):
    """Masked mean over tokens of T² sum p (log p - log q), p = softmax(p_logits / T), in float64."""
    p_logits, q_logits = p_logits.double() / temperature, q_logits.double() / temperature
    log_p = p_logits - p_logits.exp().sum(-1, keepdim=True).log()
    log_q = q_logits - q_logits.exp().sum(-1, keepdim=True).log()
    per_token = (log_p.exp() * (log_p - log_q)).sum(-1)
    return ((per_token * mask).sum() / mask.sum() * temperature**2).item()


def _logits(seed, shape=(2, 5, 11)):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 3


def test_two_token_kl_by_hand():
    # teacher p = (1/2, 1/2), student q = (1/4, 3/4): KL(p||q) = 1/2 ln 2 + 1/2 ln(2/3)
    teacher = torch.tensor([[[0.0, 0.0]]])
    student = torch.tensor([[[0.0, math.log(3.0)]]])
    mask = torch.ones(1, 1)
    forward = logit_kl_loss(student, teacher, mask)
    assert forward.item() == pytest.approx(0.5 * math.log(2) + 0.5 * math.log(2 / 3), abs=1e-6)
    reverse = logit_kl_loss(student, teacher, mask, direction="reverse")  # KL(q||p)
    assert reverse.item() == pytest.approx(0.25 * math.log(0.5) + 0.75 * math.log(1.5), abs=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0, 4.0])
def test_forward_kl_matches_kl_div_and_float64(temperature):
    student, teacher = _logits(0), _logits(1)
    mask = torch.ones(2, 5)
    loss = logit_kl_loss(student, teacher, mask, temperature)
    reference = (
        F.kl_div(
            F.log_softmax(student / temperature, -1).flatten(0, 1),
            F.log_softmax(teacher / temperature, -1).flatten(0, 1),
            reduction="batchmean",
            log_target=True,
        )
        * temperature**2
    )
    assert loss.item() == pytest.approx(reference.item(), rel=1e-5)
    assert loss.item() == pytest.approx(_kl64(teacher, student, mask, temperature), rel=1e-5)


def test_reverse_kl_swaps_the_distributions_and_differs():
    student, teacher = _logits(2), _logits(3)
    mask = torch.ones(2, 5)
    forward = logit_kl_loss(student, teacher, mask)
    reverse = logit_kl_loss(student, teacher, mask, direction="reverse")
    assert reverse.item() == pytest.approx(_kl64(student, teacher, mask, 1.0), rel=1e-5)
    assert abs(forward.item() - reverse.item()) > 1e-2


def test_temperature_scales_by_t_squared_and_softens():
    student, teacher = _logits(4), _logits(5)
    mask = torch.ones(2, 5)
    t = 3.0
    # the loss at T equals T² times the unscaled KL of the logits divided by T
    assert logit_kl_loss(student, teacher, mask, t).item() == pytest.approx(
        t**2 * logit_kl_loss(student / t, teacher / t, mask).item(), rel=1e-5
    )


@pytest.mark.parametrize("direction", ["forward", "reverse"])
def test_zero_when_logits_match(direction):
    logits = _logits(6)
    loss = logit_kl_loss(logits, logits.clone(), torch.ones(2, 5), 2.0, direction)
    assert abs(loss.item()) < 1e-6


def test_mask_leaves_tokens_out():
    student, teacher = _logits(7), _logits(8)
    mask = torch.zeros(2, 5)
    mask[0, 1] = mask[1, 3] = 1.0
    expected = _kl64(teacher[mask.bool()][None], student[mask.bool()][None], torch.ones(1, 2), 1.0)
    assert logit_kl_loss(student, teacher, mask).item() == pytest.approx(expected, rel=1e-5)
    student_changed = student.clone()
    student_changed[0, 0] += 100.0  # a masked-out token
    assert logit_kl_loss(student_changed, teacher, mask).item() == pytest.approx(expected, rel=1e-5)


def test_padded_ids_at_minus_infinity_count_for_nothing_and_stay_finite():
    student, teacher = _logits(9), _logits(10)
    mask = torch.ones(2, 5)
    pad = torch.full((2, 5, 3), float("-inf"))
    padded_student = torch.cat([student, pad], -1).requires_grad_()
    for direction in ("forward", "reverse"):
        loss = logit_kl_loss(padded_student, torch.cat([teacher, pad], -1), mask, 1.0, direction)
        assert loss.item() == pytest.approx(
            logit_kl_loss(student, teacher, mask, 1.0, direction).item(), rel=1e-6
        )
        (grad,) = torch.autograd.grad(loss, padded_student)
        assert torch.isfinite(grad).all() and (grad[..., -3:] == 0).all()


def test_gradient_flows_to_student_only_and_in_float32():
    student = _logits(11).to(torch.bfloat16).requires_grad_()
    teacher = _logits(12).requires_grad_()
    loss = logit_kl_loss(student, teacher, torch.ones(2, 5))
    assert loss.dtype == torch.float32
    loss.backward()
    assert student.grad is not None and teacher.grad is None


def test_refuses_bad_temperature_and_direction():
    x = _logits(13)
    with pytest.raises(ValueError, match="temperature"):
        logit_kl_loss(x, x, torch.ones(2, 5), 0.0)
    with pytest.raises(ValueError, match="direction"):
        logit_kl_loss(x, x, torch.ones(2, 5), direction="both")


def test_cosine_and_mse_by_hand():
    student = torch.tensor([[[1.0, 0.0]], [[3.0, 4.0]]])  # [s=2, b=1, h=2]
    teacher = torch.tensor([[[0.0, 2.0]], [[6.0, 8.0]]])
    # cosine: token 0 orthogonal (1 - 0), token 1 parallel (1 - 1): mean 0.5
    assert hidden_state_loss(student, teacher, "cosine").item() == pytest.approx(0.5)
    # mse: token 0 ((1)² + (2)²) / 2 = 2.5, token 1 (9 + 16) / 2 = 12.5: mean 7.5
    assert hidden_state_loss(student, teacher, "mse").item() == pytest.approx(7.5)
    mask = torch.tensor([[0.0], [1.0]])  # only token 1
    assert hidden_state_loss(student, teacher, "mse", loss_mask=mask).item() == pytest.approx(12.5)


def test_projection_maps_widths_and_gets_gradients():
    student = torch.randn(4, 2, 3, generator=torch.Generator().manual_seed(0))
    teacher = torch.randn(4, 2, 5, generator=torch.Generator().manual_seed(1)).requires_grad_()
    projection = torch.nn.Linear(3, 5, bias=False)
    loss = hidden_state_loss(student, teacher, "mse", projection)
    expected = (projection(student) - teacher).square().mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    loss.backward()
    assert projection.weight.grad is not None and projection.weight.grad.abs().sum() > 0
    assert teacher.grad is None
    with pytest.raises(ValueError, match="width"):
        hidden_state_loss(student, teacher, "cosine")
