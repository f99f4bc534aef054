"""The C transpose moves every element to its place, tile edges and row strides included."""

import pytest
import torch

from frugality import kernels


@pytest.mark.c_kernel
@pytest.mark.parametrize("rows, cols", [(1, 1), (8, 8), (13, 21), (300, 9), (257, 520), (1, 700)])
def test_transposed_equals_torch(rows, cols):
    assert kernels.transpose_2byte() is not None, "the C kernel should build where a C compiler exists"
    x = torch.randn(rows, cols + 5, dtype=torch.bfloat16)[:, :cols]  # rows cols + 5 apart
    assert torch.equal(kernels.transposed(x), x.t().contiguous())


def test_other_dtypes_fall_back_to_torch():
    x = torch.randn(30, 17)
    out = kernels.transposed(x)
    assert torch.equal(out, x.t()) and out.is_contiguous()
