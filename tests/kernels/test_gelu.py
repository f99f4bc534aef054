"""Exact GELU through the C kernel (CPUs with AVX-512 and bf16): forward and gradient as
close to float64 as torch's, one op each inside compiled training, torch's GELU elsewhere."""

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.backends.debugging import aot_eager

from frugality.kernels import gelu as cpu_gelu
from frugality.kernels.dispatch import skip_reason
from frugality.kernels.gelu import gelu, gelu_backward_op, gelu_op

kernel = pytest.mark.skipif(not cpu_gelu.kernel_runs(), reason=skip_reason("gelu"))


def _relative_error(result, reference):
    return ((result.double() - reference).abs().max() / reference.abs().max()).item()


@kernel
@pytest.mark.parametrize("shape", [(3, 5), (64, 96), (4, 1000, 33)])  # lengths that end mid-vector
def test_forward_and_gradient_are_as_close_to_float64_as_torch(shape):
    torch.manual_seed(0)
    x = (torch.randn(shape) * 3).to(torch.bfloat16)
    x[..., 0] = 0.0
    if x.shape[-1] > 2:
        x[..., 1], x[..., 2] = 20.0, -20.0  # far tails: 0 and x, derivative 0 and 1
    grad = torch.randn(shape).to(torch.bfloat16)
    ours = x.clone().requires_grad_()
    out = gelu(ours)
    out.backward(grad)
    theirs = x.clone().requires_grad_()
    torch_out = F.gelu(theirs)
    torch_out.backward(grad)
    x64 = x.double().requires_grad_()
    ref = F.gelu(x64)
    ref.backward(grad.double())
    assert out.dtype == ours.grad.dtype == torch.bfloat16
    assert _relative_error(out, ref) <= max(_relative_error(torch_out, ref), 2**-8)
    assert _relative_error(ours.grad, x64.grad) <= max(_relative_error(theirs.grad, x64.grad), 2**-8)
    # within float32 rounding of torch: bf16 results at most one unit apart
    assert (out.float() - torch_out.float()).abs().max() <= torch_out.float().abs().max() * 2**-7


@kernel
def test_compiled_training_takes_the_ops_without_graph_breaks():
    torch.manual_seed(0)
    x = torch.randn(32, 64).to(torch.bfloat16).requires_grad_()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return aot_eager(gm, example_inputs)

    out = torch.compile(lambda t: gelu(t) * 2, backend=backend, fullgraph=True)(x)
    out.sum().backward()
    compiled = out.detach().clone(), x.grad.clone()
    x.grad = None
    eager = gelu(x) * 2
    eager.sum().backward()
    assert torch.equal(compiled[0], eager) and torch.equal(compiled[1], x.grad)
    assert len(graphs) == 1


@kernel
def test_ops_pass_torch_opcheck():
    torch.manual_seed(0)
    x, g = torch.randn(8, 40).to(torch.bfloat16), torch.randn(8, 40).to(torch.bfloat16)
    torch.library.opcheck(gelu_op, (x,))
    torch.library.opcheck(gelu_backward_op, (g, x))


def test_other_dtypes_and_layouts_take_torch_gelu(monkeypatch):
    monkeypatch.setattr(cpu_gelu, "gelu_op", lambda x: pytest.fail("the kernel took it"))
    x = torch.randn(8, 16)
    torch.testing.assert_close(gelu(x), F.gelu(x))  # float32
    wide = torch.randn(16, 8).to(torch.bfloat16)
    torch.testing.assert_close(gelu(wide.t()), F.gelu(wide.t()))  # not contiguous
    with torch.autocast("cpu", dtype=torch.bfloat16):
        gelu(torch.randn(8, 16).to(torch.bfloat16))
