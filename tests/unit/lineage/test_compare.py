"""Checkpoints compared bit for bit: the first differing tensor, its element and values."""

from __future__ import annotations

import math

import torch

from relay.lineage.compare import count_tensors, first_difference


def state() -> dict:
    return {"step": 40,
            "model": {"a.weight": torch.zeros(2, 3), "a.bias": torch.ones(3)},
            "optimizer": {"state": {0: {"exp_avg": torch.zeros(2)}}, "param_groups": [
                {"lr": 0.1, "params": [0]}]},
            "rng": {"python": (3, (1, 2), None)}}


def test_identical_states_have_no_difference() -> None:
    assert first_difference(state(), state()) is None
    assert count_tensors(state(), frozenset({"rng"})) == 3


def test_the_first_differing_element_is_named_with_both_values() -> None:
    a, b = state(), state()
    b["model"]["a.weight"][1, 2] = 0.5
    b["model"]["a.bias"][0] = 2.0  # later in the order: not the first
    found = first_difference(a, b)
    assert found is not None
    assert (found.name, found.index, found.first, found.second) == \
        ("model.a.weight", (1, 2), "0.0", "0.5")
    assert found.describe("fault-free", "faulty") == \
        "model.a.weight[1, 2]: 0.0 (fault-free) vs 0.5 (faulty)"


def test_bits_not_values_are_compared() -> None:
    a, b = state(), state()
    a["model"]["a.bias"][1], b["model"]["a.bias"][1] = math.nan, math.nan
    assert first_difference(a, b) is None  # the same NaN
    b["model"]["a.bias"][2] = -1.0
    a["model"]["a.bias"][2] = -1.0
    b["model"]["a.bias"][0], a["model"]["a.bias"][0] = -0.0, 0.0
    found = first_difference(a, b)
    assert found is not None and found.index == (0,)


def test_plain_values_shapes_and_missing_keys_are_differences() -> None:
    a, b = state(), state()
    b["optimizer"]["param_groups"][0]["lr"] = 0.2
    found = first_difference(a, b)
    assert found is not None and found.name == "optimizer.param_groups[0].lr"
    b = state()
    b["model"]["a.bias"] = torch.ones(4)
    found = first_difference(a, b)
    assert found is not None and (found.first, found.second) == \
        ("torch.float32 [3]", "torch.float32 [4]")
    b = state()
    b["scheduler"] = {"last_epoch": 3}
    found = first_difference(a, b)
    assert found is not None and (found.name, found.first) == ("scheduler.last_epoch",
                                                               "(missing)")


def test_skipped_keys_are_left_out() -> None:
    a, b = state(), state()
    b["rng"]["python"] = (3, (1, 9), None)
    assert first_difference(a, b, skip=frozenset({"rng"})) is None
    found = first_difference(a, b)
    assert found is not None and found.name == "rng.python[1][1]"
