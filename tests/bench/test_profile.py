"""`frugality bench profile`: a step's time in categories that add up to the step."""

import json

from frugality.bench.profile import CATEGORIES, categorize
from frugality.cli.main import main


def test_categories_come_from_names_ancestors_and_shapes():
    vocab = 50304
    assert categorize("aten::mm", [], [[2048, 512], [512, vocab]], vocab) == "matrix products: output layer"
    assert categorize("aten::addmm", [], [[512], [2048, 512], [512, 1536]], vocab) == "matrix products: blocks"
    assert categorize("aten::mm", ["Optimizer.step#AdamW.step"], [], vocab) == "optimizer step"
    assert categorize("aten::_fused_adamw_", ["Optimizer.step#AdamW.step"], [], vocab) == "optimizer step"
    assert categorize("aten::_scaled_dot_product_flash_attention_for_cpu", [], [], vocab) == "attention"
    assert categorize("aten::bmm", [], [[64, 256, 64], [64, 64, 512]], vocab) == "attention"
    assert categorize("frugality::cross_entropy_rows", [], [], vocab) == "loss (softmax, cross-entropy)"
    assert categorize("aten::_log_softmax", [], [], vocab) == "loss (softmax, cross-entropy)"
    assert categorize("Torch-Compiled Region: 0/0", [], [], vocab) == "compiled (fused) kernels"
    assert categorize("aten::_foreach_norm", [], [], vocab) == "gradient clipping"
    assert categorize("aten::gelu", [], [], vocab) == "elementwise, norms, copies"
    for wrapper in ("MmBackward0", "LinearCrossEntropyBackward", "LogSoftmaxBackward0"):
        assert (
            categorize(f"autograd::engine::evaluate_function: {wrapper}", [], [], vocab)
            == "outside ops (Python, autograd, ctypes)"
        )
    assert categorize("LinearCrossEntropy", [], [], vocab) == "matrix products: output layer"  # its C products
    assert categorize("frugality::linear_product", [], [], vocab) == "matrix products: blocks"
    assert categorize("frugality::gelu", [], [], vocab) == "elementwise, norms, copies"
    assert categorize("aten::mm", [], [[2048, 512], [512, 2048]], 2048) == "matrix products: output layer"
    assert categorize("aten::mm", [], [[vocab]], vocab) == "matrix products: blocks"  # 2-D operands only


def test_bench_profile_splits_the_step_of_frugality_and_a_peer(micro_recipe_file, tmp_path, capsys):
    out = tmp_path / "rows.json"
    args = [
        "bench",
        "profile",
        str(micro_recipe_file),
        "--batch",
        "2",
        "--seq",
        "16",
        "--steps",
        "1",
        "--warmup",
        "1",
        "--baseline",
        "transformers,torchtitan",
        "--json",
        str(out),
    ]
    assert main(args) == 0
    rows = json.loads(out.read_text())
    assert [r["impl"] for r in rows] == ["frugality", "transformers", "torchtitan"]
    for r in rows[:2]:
        assert set(r["seconds"]) == set(CATEGORIES)
        # self times in one category each, plus the time outside ops: the step, no more
        assert abs(sum(r["seconds"].values()) - r["step_s"]) <= 0.02 * r["step_s"] + 1e-3
        assert r["seconds"]["matrix products: output layer"] > 0 and r["seconds"]["matrix products: blocks"] > 0
        assert r["seconds"]["optimizer step"] > 0
    # the rate where every product's FLOPs are known (transformers: aten's alone); frugality's
    # C products carry none, so its rate is given only while they take under 10% of the time
    assert rows[1]["matmul_gflops"] > 0 and (rows[0]["matmul_gflops"] is None or rows[0]["matmul_gflops"] > 0)
    assert rows[0]["seconds"]["loss (softmax, cross-entropy)"] > 0  # the C kernel's named range
    assert "needs CUDA" in rows[2]["skipped"]
    table = capsys.readouterr().out
    assert "| matrix products: output layer |" in table and "torchtitan: not profiled" in table


def test_bench_profile_refuses_a_list_of_precisions_in_one_line(micro_recipe_file, capsys):
    assert main(["bench", "profile", str(micro_recipe_file), "--precision", "fp32,bf16-sr"]) != 0
    err = capsys.readouterr().err
    assert "--precision 'fp32,bf16-sr': one policy" in err and "Traceback" not in err
