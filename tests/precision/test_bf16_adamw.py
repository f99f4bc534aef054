"""BF16AdamW: the AdamW formula on flat bf16 buffers, and why stochastic rounding matters."""

import pytest
import torch

from frugality import kernels
from frugality.precision.bf16_adamw import BF16AdamW


def _params(seed=0):
    torch.manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(300, 7)), torch.nn.Parameter(torch.randn(50))]


def test_matches_torch_adamw_up_to_bf16_rounding():
    ref_params = _params()
    ours_params = [torch.nn.Parameter(p.detach().to(torch.bfloat16)) for p in ref_params]
    for p in ref_params:
        p.data = p.data.to(torch.bfloat16).float()  # same starting point
    ref = torch.optim.AdamW(ref_params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    ours = BF16AdamW(ours_params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, rounding="nearest", fused=False)
    torch.manual_seed(1)
    grads = [[torch.randn_like(p) for p in ref_params] for _ in range(3)]
    for step_grads in grads:
        for p, q, g in zip(ref_params, ours_params, step_grads, strict=True):
            p.grad = g
            q.grad = g.to(torch.bfloat16)
        ref.step()
        ours.step()
    for p, q in zip(ref_params, ours_params, strict=True):
        torch.testing.assert_close(q.float(), p.detach(), rtol=2e-2, atol=2e-2)
    assert all(q.dtype == torch.bfloat16 for q in ours_params)


def test_parameters_and_moments_are_views_of_flat_buffers_and_gradients_are_not():
    params = [torch.nn.Parameter(p.detach().to(torch.bfloat16)) for p in _params()]
    opt = BF16AdamW(params, fused=False)
    flat = opt._flat[0]
    assert params[0].data_ptr() == flat["param"].data_ptr()
    assert params[1].data_ptr() == flat["param"][2100:].data_ptr()
    assert opt.state[params[1]]["exp_avg"].data_ptr() == flat["exp_avg"][2100:].data_ptr()
    # backward hands its gradient to .grad as is (no zeroed buffer to add into), and
    # zero_grad frees it again
    (params[0].float().sum() * 2).backward()
    assert params[0].grad.dtype == torch.bfloat16 and torch.all(params[0].grad == 2)
    assert params[1].grad is None
    opt.zero_grad()
    assert params[0].grad is None


def test_parameters_without_gradients_are_skipped_on_every_path(monkeypatch):
    """As torch's AdamW: no update, no moment decay; and the parameters after a gap still
    draw the noise of their own place in the flat buffer (the same bits on every path)."""

    def run(fused):
        params = [torch.nn.Parameter(torch.randn(n).to(torch.bfloat16)) for n in (100, 30, 70)]
        before = [p.detach().clone() for p in params]
        opt = BF16AdamW(params, lr=1e-2, weight_decay=0.1, seed=2, fused=fused)
        for _ in range(2):
            params[0].grad = torch.ones(100, dtype=torch.bfloat16)
            params[2].grad = torch.full((70,), -0.5, dtype=torch.bfloat16)
            opt.step()
        assert torch.equal(params[1].detach(), before[1])
        assert torch.all(opt.state[params[1]]["exp_avg"] == 0)
        assert not torch.equal(params[2].detach(), before[2])
        return [p.detach() for p in params]

    torch.manual_seed(0)
    kernel_run = run(True)
    torch.manual_seed(0)
    for a, b in zip(kernel_run, run(False), strict=True):
        assert torch.equal(a, b)


def test_small_updates_survive_only_with_stochastic_rounding():
    """Updates of a tenth of a bf16 step: round-to-nearest drops every one of them."""
    results = {}
    for rounding in ("stochastic", "nearest"):
        p = torch.nn.Parameter(torch.ones(100_000, dtype=torch.bfloat16))
        # lr so small that each AdamW step (about lr in size) is 1/10 of bf16's step at 1.0.
        opt = BF16AdamW([p], lr=2**-7 / 10, betas=(0.0, 0.0), eps=1e-30, rounding=rounding, seed=3, fused=False)
        for _ in range(50):
            p.grad = torch.full_like(p, -1.0)  # always push upwards
            opt.step()
        results[rounding] = p.float().mean().item()
    assert results["nearest"] == 1.0
    assert results["stochastic"] == pytest.approx(1.0 + 50 * 2**-7 / 10, rel=2e-3)


def test_state_dict_round_trip_keeps_views_and_continues_identically():
    def run(steps, restore_at=None):
        params = [torch.nn.Parameter(p.detach().to(torch.bfloat16)) for p in _params()]
        opt = BF16AdamW(params, lr=1e-2, weight_decay=0.1, seed=5, fused=False)
        for step in range(steps):
            if step == restore_at:
                saved = {k: v for k, v in opt.state_dict().items()}
                saved_params = [p.detach().clone() for p in params]
                params = [torch.nn.Parameter(p.clone()) for p in saved_params]
                opt = BF16AdamW(params, lr=1e-2, weight_decay=0.1, seed=5, fused=False)
                opt.load_state_dict(saved)
                assert opt.state[params[0]]["exp_avg"].data_ptr() == opt._flat[0]["exp_avg"].data_ptr()
            torch.manual_seed(step)
            for p in params:
                p.grad = torch.randn_like(p)
            opt.step()
        return [p.detach() for p in params]

    for a, b in zip(run(6), run(6, restore_at=3), strict=True):
        assert torch.equal(a, b)


def _three_steps(fused: bool, rounding: str = "stochastic", device: str = "cpu", clip: bool = True):
    params = [torch.nn.Parameter(p.detach().to(device, torch.bfloat16)) for p in _params()]
    opt = BF16AdamW(params, lr=1e-2, weight_decay=0.1, seed=9, rounding=rounding, fused=fused)
    torch.manual_seed(0)
    for step in range(3):
        for p in params:
            p.grad = torch.randn(p.shape).to(device, torch.bfloat16)  # drawn on the CPU: the same numbers on any device
        if step == 1 and clip:
            opt.clip_grad_norm_(0.5)  # one clipped step: its scale goes through both paths
        opt.step()
    tensors = [p.detach() for p in params] + [opt.state[p][k] for p in params for k in ("exp_avg", "exp_avg_sq")]
    return [t.cpu() for t in tensors]


@pytest.mark.c_kernel
@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
def test_cpu_kernel_gives_the_same_bits_as_torch_ops(rounding):
    assert kernels.adamw_bf16_step() is not None, "the C kernel should build where a C compiler exists"
    for a, b in zip(_three_steps(True, rounding), _three_steps(False, rounding), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_the_compiled_update_matches_the_eager_one(monkeypatch, device):
    """The torch.compile path (Triton on a GPU, C++ on the CPU with the C kernel set aside)
    against the eager update on the CPU (whose bits the C kernel gives, above)."""
    from frugality.precision.bf16_adamw import _compiled_rounding_is_right

    if device == "cpu":
        if not _compiled_rounding_is_right(torch.device("cpu")):
            pytest.skip("Inductor's vectors here are narrower than AVX-512: the update runs eagerly (next test)")
        monkeypatch.setattr(kernels, "adamw_bf16_step", lambda: None)
    for a, b in zip(_three_steps(True, "stochastic", device), _three_steps(False), strict=True):
        # Same formula and noise; the compiler may order float32 operations differently (or
        # contract a multiply and an add into one FMA), moving a value across a rounding boundary now and then.
        assert (a != b).float().mean().item() < 0.01
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-2)


def test_the_compiled_update_rounds_stochastically_only_where_inductors_vectors_do_it_right(monkeypatch):
    """Inductor's AVX2 code for the update rounds wrongly (half the elements differ): CPUs
    whose Inductor vectors are narrower than AVX-512 take eager ops (under AVX2 emulation
    the test above then compares eager with eager: the same bits)."""
    from torch._inductor import cpu_vec_isa

    from frugality.precision.bf16_adamw import _compiled_rounding_is_right

    for bits, right in ((256, False), (512, True)):
        monkeypatch.setattr(
            cpu_vec_isa, "pick_vec_isa", lambda bits=bits: type("ISA", (), {"bit_width": lambda s: bits})()
        )
        assert _compiled_rounding_is_right(torch.device("cpu")) is right
    assert _compiled_rounding_is_right(torch.device("meta"))  # (not a CPU: Triton, XLA)
    # where it is not right, a fused step without the kernel compiles nothing and gives eager's bits
    from frugality.precision import bf16_adamw

    monkeypatch.setattr(bf16_adamw, "_compiled_rounding_is_right", lambda device: False)
    monkeypatch.setattr(kernels, "adamw_bf16_step", lambda: None)
    monkeypatch.setattr(torch, "compile", lambda *a, **k: pytest.fail("the update was compiled"))
    for a, b in zip(_three_steps(True), _three_steps(False), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "device", [pytest.param("cpu", marks=pytest.mark.c_kernel), pytest.param("cuda", marks=pytest.mark.cuda)]
)
@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
def test_the_eager_update_gives_the_cpu_kernels_bits(rounding, device):
    """The rounding noise is a hash of (key, index), so a GPU rounds exactly as the CPU does.
    (No clipping here: the norm's reduction order differs between devices.)"""
    for a, b in zip(
        _three_steps(True, rounding, "cpu", clip=False), _three_steps(False, rounding, device, clip=False), strict=True
    ):
        assert torch.equal(a, b)


def test_clipping_is_folded_into_the_next_step_in_float32():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(p.detach().to(torch.bfloat16)) for p in _params()]
    opt = BF16AdamW(params, lr=1e-2, betas=(0.9, 0.999), seed=1, rounding="nearest")
    grads = [torch.randn_like(p) * 3 for p in params]
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    norm = opt.clip_grad_norm_(1.0)
    reference = torch.nn.utils.get_total_norm([p.grad.double() for p in params])
    assert norm.item() == pytest.approx(reference.item(), rel=1e-6)  # the C kernel sums in double
    opt.step()
    assert opt._grad_scale == 1.0  # applied once, then reset
    for p in params:  # first moment after one step: (1 - beta1) * clipped gradient
        expected = 0.1 * p.grad.float() / reference.float()
        torch.testing.assert_close(opt.state[p]["exp_avg"].float(), expected, rtol=1e-2, atol=1e-6)


@pytest.mark.c_kernel
@pytest.mark.parametrize("n", [1, 15, 4096, 4096 * 3 + 17])
def test_the_norm_kernel_matches_a_double_reference(n):
    """Sixteen lanes per 4096-value block and a scalar tail: every size path."""
    kernel = kernels.bf16_sum_squares()
    assert kernel is not None, "the C kernel should build where a C compiler exists"
    torch.manual_seed(n)
    x = (torch.randn(n) * 3).to(torch.bfloat16)
    expected = x.double().square().sum().item()
    assert kernel(x.data_ptr(), n, 2) == pytest.approx(expected, rel=1e-6)
    x[n // 2] = float("inf")
    assert kernel(x.data_ptr(), n, 2) == float("inf")  # a non-finite gradient poisons the step


def test_a_shard_of_rows_rounds_each_element_with_the_noise_of_its_place_in_the_whole():
    """Tensor parallel's row-wise layers shard dim 1: a rank's (8, 3) shard at column 5 of an
    (8, 12) parameter updates in one pass, each element rounded as the one-process update
    of the whole parameter rounds it."""
    from frugality.precision.bf16_adamw import _update
    from frugality.precision.stochastic_rounding import mix_key

    torch.manual_seed(0)
    whole = [torch.randn(8, 12).to(torch.bfloat16) for _ in range(2)] + [
        (torch.rand(8, 12) * 0.1).to(torch.bfloat16) for _ in range(2)
    ]
    shard = [t[:, 5:8].contiguous() for t in whole]
    f32 = {"lr": 1e-2, "beta1": 0.9, "one_minus_beta1": 0.1, "beta2": 0.99, "one_minus_beta2": 0.01}
    f32 |= {"eps": 1e-8, "decay": 0.999, "bc1": 0.1, "bc2_sqrt": 0.1, "grad_scale": 1.0}
    scalars = {k: torch.tensor(v, dtype=torch.float32) for k, v in f32.items()}
    scalars["key"] = torch.tensor(mix_key(3, 0, 1), dtype=torch.int64)
    start = torch.tensor(100 + 5, dtype=torch.int64)  # the parameter at 100 in its group, the shard at column 5
    rows = (torch.tensor(3), torch.tensor(12))
    _update(*(t.view(-1) for t in shard), start, **scalars, stochastic=True, rows=rows)
    _update(*(t.view(-1) for t in whole), torch.tensor(100), **scalars, stochastic=True)
    for a, b in zip(shard, whole, strict=True):
        assert torch.equal(a, b[:, 5:8])
