import pytest
import torch

from frugality.errors import UserError
from frugality.precision import PRECISIONS, get_policy


def test_every_policy_is_known_and_bf16_storage_halves_the_state():
    assert set(PRECISIONS) == {"fp32", "amp-bf16", "amp-fp16", "bf16-sr", "bf16", "fp8"}
    assert get_policy("bf16-sr").state_bytes_per_param * 2 <= get_policy("amp-bf16").state_bytes_per_param
    with pytest.raises(UserError, match="choose one of"):
        get_policy("fp16")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_fp8_is_refused_off_cuda_with_a_reason():
    with pytest.raises(UserError, match=r"fp8 needs a CUDA GPU of compute capability 8.9.*this run is on cpu"):
        get_policy("fp8").check_device(torch.device("cpu"))
