"""The rotary table: angles exact to float64 at positions near a million, where a float32
product of position and frequency is off by up to 1/16 rad."""

from __future__ import annotations

import math

import torch

from astream.models.layers import RotaryTable, rotary_cos_sin

HEAD_DIM, THETA = 128, 1e6
NEAR_A_MILLION = torch.arange((1 << 20) - 64, (1 << 20) + 64)


def reference(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin from Python floats (float64) one angle at a time."""
    inv = [THETA ** (-i / HEAD_DIM) for i in range(0, HEAD_DIM, 2)]
    angles = [[p * f for f in inv] for p in positions.tolist()]
    cos = torch.tensor([[math.cos(a) for a in row] for row in angles], dtype=torch.float64)
    sin = torch.tensor([[math.sin(a) for a in row] for row in angles], dtype=torch.float64)
    return torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)


def test_the_table_matches_float64_near_a_million_positions():
    want_cos, want_sin = reference(NEAR_A_MILLION)
    cos, sin = rotary_cos_sin(NEAR_A_MILLION, HEAD_DIM, THETA, 1.0, torch.float32)
    assert cos.dtype == sin.dtype == torch.float32 and cos.shape == (128, HEAD_DIM)
    assert (cos.double() - want_cos).abs().max() < 1e-6
    assert (sin.double() - want_sin).abs().max() < 1e-6
    # What the float32 product gave: the highest frequency a tenth of a radian off.
    inv32 = 1.0 / (THETA ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    angles32 = NEAR_A_MILLION.float()[:, None] * inv32[None, :]
    assert (angles32.cos().double() - want_cos[:, :HEAD_DIM // 2]).abs().max() > 1e-2


def test_the_table_is_its_positions_rows():
    table = RotaryTable.build(HEAD_DIM, 4096, THETA, 2.0, torch.bfloat16, torch.device("cpu"))
    rows = torch.tensor([0, 1, 2047, 4095])
    cos, sin = rotary_cos_sin(rows, HEAD_DIM, THETA, 2.0, torch.bfloat16)
    assert table.cos.shape == (4096, HEAD_DIM) and table.cos.dtype == torch.bfloat16
    assert torch.equal(table.cos[rows], cos) and torch.equal(table.sin[rows], sin)
    assert torch.equal(table.cos[0], torch.ones(HEAD_DIM, dtype=torch.bfloat16))
