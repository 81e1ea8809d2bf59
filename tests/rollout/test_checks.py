"""The shared argument checks: numpy and torch forms count as ints, numbers
and token lists, come back as plain Python values, and bools never count."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rollout.checks import (
    array_shape,
    as_number,
    as_token_ids,
    check_int,
    check_number,
    check_positive,
    is_int,
    is_number,
    next_version,
)

INTS = [3, np.int8(3), np.int64(3), np.uint64(3), np.intp(3)]
FLOATS = [0.5, np.float16(0.5), np.float32(0.5), np.float64(0.5)]
NOT_NUMBERS = [True, np.bool_(True), "3", None, np.array(3), np.array([3]), torch.tensor(3), 3j, np.complex64(3)]


@pytest.mark.parametrize("value", INTS)
def test_ints_are_ints_and_numbers(value):
    assert is_int(value) and is_number(value)
    assert type(check_int("x", value, 0)) is int and check_int("x", value, 0) == 3
    assert type(as_number(value)) is int


@pytest.mark.parametrize("value", FLOATS)
def test_floats_are_numbers_not_ints(value):
    assert is_number(value) and not is_int(value)
    assert type(check_number("x", value, ">= 0")) is float and as_number(value) == 0.5
    with pytest.raises(TypeError, match="x must be an int >= 0, got"):
        check_int("x", value, 0)


@pytest.mark.parametrize("value", NOT_NUMBERS)
def test_bools_strings_and_arrays_are_not_numbers(value):
    assert not is_int(value) and not is_number(value)
    with pytest.raises(TypeError, match="x must be an int"):
        check_int("x", value, 0)
    with pytest.raises(TypeError, match="x must be a number in"):
        check_number("x", value, "in [0, 1]")


def test_ranges_are_checked_after_conversion():
    with pytest.raises(ValueError, match=r"x must be an int >= 1 \(extra\), got 0"):
        check_int("x", np.int64(0), 1, "(extra)")
    assert type(check_positive("t", np.float32(2.5))) is float
    with pytest.raises(ValueError, match="t must be a number > 0"):
        check_positive("t", np.float64(0))
    assert next_version(1, np.int64(4)) == 4 and type(next_version(1, np.int64(4))) is int
    with pytest.raises(TypeError, match="version"):
        next_version(1, np.bool_(True))
    with pytest.raises(ValueError, match="version must be > the current policy version 5"):
        next_version(5, np.int32(5))


@pytest.mark.parametrize(
    "ids",
    [
        [1, 2, 3],
        (1, 2, 3),
        range(1, 4),
        [np.int64(1), np.uint8(2), 3],
        np.array([1, 2, 3]),
        np.array([1, 2, 3], dtype=np.uint32),
        torch.tensor([1, 2, 3]),
        torch.tensor([1, 2, 3], dtype=torch.int16),
        torch.tensor([0, 1, 2, 3, 4])[1::1][:3],  # a view
    ],
)
def test_token_ids_become_a_plain_list(ids):
    out = as_token_ids("ids", ids)
    assert out == [1, 2, 3] and type(out) is list and all(type(t) is int for t in out)


@pytest.mark.parametrize(
    "ids,needle",
    [
        ("123", "ids must be a list of int token ids, got str"),
        (b"12", "got bytes"),
        (5, "got int"),
        (np.int64(5), "got int64"),
        ([1, 2.0], r"ids must hold int token ids, got 2.0 \(float\)"),
        ([1, True], "ids must hold int token ids, got True"),
        ([1, np.bool_(False)], "ids must hold int token ids"),
        (np.array([1.0, 2.0]), "ids must hold int token ids, got an array of dtype float64"),
        (np.array([True]), "dtype bool"),
        (np.array(["a"]), "dtype <U1"),
        (torch.tensor([1.0]), "dtype torch.float32"),
        (torch.tensor([True]), "dtype torch.bool"),
        (np.array([[1, 2]]), "ids must be a 1-D sequence of int token ids, got a 2-D array"),
        (torch.tensor([[1, 2]]), "got a 2-D array"),
        (np.array(3), "got a 0-D array"),
    ],
)
def test_other_token_ids_are_refused_naming_the_field(ids, needle):
    with pytest.raises(TypeError, match=needle):
        as_token_ids("ids", ids)


def test_array_shape_reads_numpy_and_torch_only():
    assert array_shape(np.zeros((2, 3), dtype=np.int32)) == (2, "i")
    assert array_shape(np.zeros(2, dtype=np.uint8)) == (1, "u")
    assert array_shape(torch.zeros(2, dtype=torch.long)) == (1, "i")
    assert array_shape(torch.zeros(2, dtype=torch.bfloat16)) == (1, "f")
    assert array_shape(torch.zeros(2, dtype=torch.bool)) == (1, "b")
    assert array_shape([1, 2]) is None and array_shape(np.int64(1)) is None
