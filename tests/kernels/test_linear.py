"""Linear layers' products through the AMX kernels (where the CPU has AMX): the weight
gradient, the forward product and the input gradient as close to float64 as torch's
products, the same module and state dict as nn.Linear, one op each inside compiled
training, and torch's products wherever the kernels do not apply."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.backends.debugging import aot_eager

from frugality.kernels import linear as cpu_linear
from frugality.kernels.dispatch import skip_reason
from frugality.kernels.linear import AMXLinear, amx_product_applies, linear, product, weight_grad, weight_grad_applies

amx = pytest.mark.skipif(not cpu_linear.amx_kernel_runs(), reason=skip_reason("amx-linear"))


def _relative_error(result, reference):
    return ((result.double() - reference).abs().max() / reference.abs().max()).item()


@amx
@pytest.mark.parametrize("tokens, outputs, inputs", [(32, 32, 32), (96, 64, 160), (64, 800, 96), (256, 96, 64)])
def test_kernel_is_as_close_to_float64_as_torch(tokens, outputs, inputs):
    """Several token blocks, output panels (800: three panels and a partial one), input blocks."""
    torch.manual_seed(tokens + outputs)
    grad_out = torch.randn(tokens, outputs).to(torch.bfloat16)
    x = torch.randn(tokens, inputs).to(torch.bfloat16)
    assert weight_grad_applies(grad_out, x)
    reference = grad_out.double().t() @ x.double()
    result, bias = weight_grad(grad_out, x)
    assert result.shape == (outputs, inputs) and result.is_contiguous() and result.dtype == torch.bfloat16
    assert _relative_error(result, reference) <= max(_relative_error(grad_out.t() @ x, reference), 2**-8)
    bias_reference = grad_out.double().sum(0)
    assert bias.shape == (outputs,) and bias.dtype == torch.bfloat16
    assert _relative_error(bias, bias_reference) <= max(_relative_error(grad_out.sum(0), bias_reference), 2**-8)


@amx
def test_kernel_reads_rows_of_wider_tensors():
    """Operands that are column slices (rows further apart than their length) give the
    same bits as contiguous copies."""
    torch.manual_seed(0)
    wide_g = torch.randn(64, 160).to(torch.bfloat16)
    wide_x = torch.randn(64, 96).to(torch.bfloat16)
    g, x = wide_g[:, 32:96], wide_x[:, :64]
    for a, b in zip(weight_grad(g, x), weight_grad(g.contiguous(), x.contiguous()), strict=True):
        assert torch.equal(a, b)


@amx
def test_linear_module_matches_nn_linear_and_keeps_its_state_dict():
    torch.manual_seed(0)
    ours, reference = AMXLinear(64, 96), nn.Linear(64, 96)
    assert list(ours.state_dict()) == ["weight", "bias"]
    reference.load_state_dict(ours.state_dict())
    ours.bfloat16(), reference.bfloat16()
    x = torch.randn(2, 16, 64).to(torch.bfloat16)
    grad = torch.randn(2, 16, 96).to(torch.bfloat16)
    xs = [x.clone().requires_grad_() for _ in range(2)]
    outs = [ours(xs[0]), reference(xs[1])]
    exact = x.double() @ ours.weight.double().t() + ours.bias.double()
    assert _relative_error(outs[0], exact) <= max(_relative_error(outs[1], exact), 2**-8)
    outs[0].backward(grad), outs[1].backward(grad)
    exact_x = grad.double() @ ours.weight.double()
    assert _relative_error(xs[0].grad, exact_x) <= max(_relative_error(xs[1].grad, exact_x), 2**-8)
    full = grad.double().flatten(0, 1).t() @ x.double().flatten(0, 1)
    assert _relative_error(ours.weight.grad, full) <= max(_relative_error(reference.weight.grad, full), 2**-8)
    bias = grad.double().sum((0, 1))
    assert _relative_error(ours.bias.grad, bias) <= max(_relative_error(reference.bias.grad, bias), 2**-8)


@amx
def test_compiled_training_calls_the_kernels_without_graph_breaks(monkeypatch):
    torch.manual_seed(0)
    products = []
    into = cpu_linear.amx_product_into
    monkeypatch.setattr(cpu_linear, "amx_product_into", lambda *a: products.append(a[3]) or into(*a))
    layer = AMXLinear(64, 64).bfloat16()
    x = torch.randn(4, 32, 64).to(torch.bfloat16).requires_grad_()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return aot_eager(gm, example_inputs)

    out = torch.compile(layer, backend=backend, fullgraph=True)(x)
    out.sum().backward()
    assert products == [True]  # the forward product; the input gradient (K = 64) is oneDNN's
    compiled_grads = layer.weight.grad.clone(), x.grad.clone()
    layer.weight.grad = x.grad = None
    eager_out = layer(x)
    eager_out.sum().backward()
    # the same kernels, compiled or not
    assert torch.equal(out, eager_out) and torch.equal(compiled_grads[0], layer.weight.grad)
    assert torch.equal(compiled_grads[1], x.grad)
    assert len(graphs) == 1


@amx
def test_weight_grad_op_passes_torch_opcheck():
    torch.manual_seed(0)
    g, x = torch.randn(64, 96).to(torch.bfloat16), torch.randn(64, 32).to(torch.bfloat16)
    torch.library.opcheck(weight_grad, (g, x))


@amx
@pytest.mark.parametrize(
    "rows, inputs, outputs, transposed, with_bias",
    [
        (32, 32, 32, True, True),
        (96, 64, 800, True, False),
        (64, 160, 96, False, False),
        (256, 2048, 64, True, True),
        (64, 4096, 32, False, False),
        (288, 4640, 64, False, False),
        (64, 8192, 96, False, False),
    ],
)
def test_product_is_as_close_to_float64_as_torch(rows, inputs, outputs, transposed, with_bias):
    """The forward product (weight (outputs, inputs), bias) and the input gradient (weight
    read as (K, N)); 800 outputs: two panels, the second partial; K up to the kernel's 4096,
    and past it the chunked input gradient (288 rows: a partial group of rows; 4640: a
    partial chunk of K)."""
    torch.manual_seed(rows + outputs)
    a = torch.randn(rows, inputs).to(torch.bfloat16)
    weight = (torch.randn(outputs, inputs) if transposed else torch.randn(inputs, outputs)).to(torch.bfloat16)
    bias = torch.randn(outputs).to(torch.bfloat16) if with_bias else None
    assert amx_product_applies(a, weight, bias, transposed)
    result = product(a, weight, bias, transposed)
    w64 = weight.double().t() if transposed else weight.double()
    reference = a.double() @ w64 + (bias.double() if with_bias else 0)
    torch_result = F.linear(a, weight, bias) if transposed else a @ weight
    assert result.shape == (rows, outputs) and result.dtype == torch.bfloat16
    assert _relative_error(result, reference) <= max(_relative_error(torch_result, reference), 2**-8)


@amx
def test_product_reads_rows_of_wider_tensors():
    torch.manual_seed(0)
    wide_a, wide_w = torch.randn(64, 160).to(torch.bfloat16), torch.randn(96, 128).to(torch.bfloat16)
    a, w = wide_a[:, 32:96], wide_w[:, :64]
    assert torch.equal(product(a, w, None, True), product(a.contiguous(), w.contiguous(), None, True))
    odd = torch.randn(96, 97).to(torch.bfloat16)[:, :64]  # rows an odd number of elements apart
    assert torch.equal(product(a, odd, None, True), product(a.contiguous(), odd.contiguous(), None, True))


@amx
def test_product_op_passes_torch_opcheck():
    torch.manual_seed(0)
    a, w, b = (torch.randn(*s).to(torch.bfloat16) for s in ((64, 96), (32, 96), (32,)))
    torch.library.opcheck(product, (a, w, b, True))
    torch.library.opcheck(product, (a, w.t().contiguous(), None, False))


def test_product_takes_only_what_the_kernel_does():
    bf16 = lambda *s: torch.randn(*s).to(torch.bfloat16)
    assert not amx_product_applies(torch.randn(32, 64), torch.randn(32, 64), None, True)  # float32
    assert not amx_product_applies(bf16(32, 48), bf16(32, 48), None, True)  # K not a multiple of 32
    assert not amx_product_applies(bf16(32, 64), bf16(48, 64), None, True)  # N not a multiple of 32
    assert not amx_product_applies(bf16(32, 8192), bf16(32, 8192), None, True)  # K past the kernel's panels
    # the input gradient (chunked), where the kernel runs at all
    assert amx_product_applies(bf16(32, 8192), bf16(8192, 32), None, False) == cpu_linear.amx_kernel_runs()
    assert not amx_product_applies(bf16(32, 64), bf16(64, 32), None, True)  # shapes that do not chain
    assert not amx_product_applies(bf16(32, 64), bf16(32, 64), torch.randn(32), True)  # float32 bias


@amx
def test_kernel_leaves_onednn_products_correct():
    a, b = torch.randn(256, 512, dtype=torch.bfloat16), torch.randn(512, 384, dtype=torch.bfloat16)
    before = a @ b
    weight_grad(torch.randn(64, 64).to(torch.bfloat16), torch.randn(64, 32).to(torch.bfloat16))
    product(torch.randn(64, 64).to(torch.bfloat16), torch.randn(32, 64).to(torch.bfloat16), None, True)
    torch.testing.assert_close(a @ b, before, rtol=0, atol=0)


def test_other_dtypes_and_shapes_take_torch_linear(monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_linear._Linear, "apply", lambda *a: calls.append(a) or F.linear(*a))
    monkeypatch.setattr(cpu_linear, "product", lambda *a: calls.append(a))
    weight = torch.randn(64, 64, requires_grad=True)
    linear(torch.randn(32, 64), weight)  # float32
    bf16 = weight.detach().bfloat16().requires_grad_()
    linear(torch.randn(30, 64).to(torch.bfloat16), bf16)  # 30 tokens: not a multiple of 32
    with torch.no_grad():
        linear(torch.randn(30, 64).to(torch.bfloat16), bf16)
    frozen = weight.detach().bfloat16()  # a frozen weight, an input that wants its gradient:
    x = torch.randn(32, 64).to(torch.bfloat16).requires_grad_()
    linear(x, frozen).sum().backward()  # torch's op, whose backward reaches x
    assert x.grad is not None
    assert calls == []
    assert not weight_grad_applies(torch.randn(32, 64), torch.randn(32, 64))
    assert not weight_grad_applies(torch.randn(32, 48).bfloat16(), torch.randn(32, 64).bfloat16())
    assert not weight_grad_applies(torch.randn(0, 64).bfloat16(), torch.randn(0, 64).bfloat16())  # no tokens


@amx
def test_wide_layers_take_the_chunked_input_gradient(monkeypatch):
    """K past 4096 (an output layer's vocabulary): the input gradient through the kernel."""
    taken = []
    into = cpu_linear.amx_product_into
    monkeypatch.setattr(cpu_linear, "amx_product_into", lambda *a: taken.append(a[3]) or into(*a))
    torch.manual_seed(0)
    layer = AMXLinear(64, 4128, bias=False).bfloat16()
    x = torch.randn(32, 64).to(torch.bfloat16).requires_grad_()
    grad = torch.randn(32, 4128).to(torch.bfloat16)
    layer(x).backward(grad)
    assert taken == [True, False]
    exact = grad.double() @ layer.weight.double()
    assert _relative_error(x.grad, exact) <= max(_relative_error(grad @ layer.weight, exact), 2**-8)


@amx
def test_inference_takes_the_forward_product(monkeypatch):
    """No gradient wanted: the product kernel alone, as close to float64 as F.linear."""
    taken = []
    into = cpu_linear.amx_product_into
    monkeypatch.setattr(cpu_linear, "amx_product_into", lambda *a: taken.append(a[3]) or into(*a))
    layer = AMXLinear(64, 96).bfloat16()
    x = torch.randn(2, 16, 64).to(torch.bfloat16)
    with torch.no_grad():
        out = layer(x)
    assert taken == [True] and out.shape == (2, 16, 96)
    exact = x.double() @ layer.weight.double().t() + layer.bias.double()
    assert _relative_error(out, exact) <= max(_relative_error(F.linear(x, layer.weight, layer.bias), exact), 2**-8)
