"""scripts/gpu_check.py's own logic, without a GPU (CI runs the whole check's dry run after
the suite): a row that ran on the CPU fails a GPU's section, the order of importance, each
section's limit from the times measured on the H200."""

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # (its dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


def test_a_row_that_ran_on_the_cpu_is_found_in_any_of_a_sections_tables(tmp_path):
    check = _gpu_check()
    section = check.Section("embed", 60, [], tables=["embed.md", "serve.md", "energy.md", "notes.md"])
    (tmp_path / "embed.json").write_text(json.dumps([{"device": "cuda:0"}, {"device": "cpu", "x": 1}]))
    serve = {"device": "cuda:0 (NVIDIA H200)", "levels": [{"device": "cuda:0 (NVIDIA H200)"}], "peers": []}
    (tmp_path / "serve.json").write_text(json.dumps(serve))
    (tmp_path / "energy.json").write_text(json.dumps([{"device": "AMD EPYC"}]))  # bench train's: the CPU's name
    assert check.cpu_rows(tmp_path, section, "AMD EPYC") == ["embed.json: cpu", "energy.json: AMD EPYC"]
    serve["peers"] = [{"levels": [{"device": "cpu (its --device)"}]}]
    (tmp_path / "serve.json").write_text(json.dumps(serve))
    assert "serve.json: cpu (its --device)" in check.cpu_rows(tmp_path, section, "AMD EPYC")
    (tmp_path / "embed.json").write_text("{not json")
    assert check.cpu_rows(tmp_path, section, "AMD EPYC")[0] == "embed.json: not JSON"


def test_inference_comes_first_and_each_section_has_its_measured_limit(tmp_path):
    check = _gpu_check()
    models = {"encoder": tmp_path / "encoder", "decoder": tmp_path / "decoder"}
    plan = check.sections(tmp_path, tmp_path, True, models)
    names = [s.name for s in plan]
    assert names[:7] == ["cuda-tests", "embed", "serve", "generate", "train-pythia-1b", "train-llama-1b", "energy"]
    assert names.index("largest") > names.index("energy")  # (300 s: run alone with --only largest)
    for section in plan:
        assert section.limit_s == check.LIMITS_S.get(section.name, section.limit_s)
    # Llama's peers in one command (three models' state at most), liger-kernel in its own section
    (llama,) = [s for s in plan if s.name == "train-llama-1b"]
    assert len(llama.commands) == 1 and "transformers-compiled:amp-bf16,torchtitan:amp-bf16" in llama.commands[0]
    assert "liger-kernel:amp-bf16" in next(s for s in plan if s.name == "train-llama-1b-liger").commands[0]


def test_the_checks_own_sections_fit_its_default_budget_with_set_up():
    check = _gpu_check()
    assert sum(check.LIMITS_S.values()) + check.SETUP_S + check.RESERVE_S <= check.BUDGET_S


def test_a_skipped_gpu_test_is_named_unless_it_needs_a_newer_gpu(tmp_path):
    check = _gpu_check()
    (tmp_path / "cuda-tests.xml").write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="a" name="test_ran"/>'
        '<testcase classname="a" name="test_no_client"><skipped message="could not import \'openai\'"/></testcase>'
        '<testcase classname="a" name="test_fp8"><skipped message="needs compute capability 8.9 or later"/></testcase>'
        "</testsuite></testsuites>"
    )
    assert check.skipped_tests(tmp_path / "cuda-tests.xml") == ["test_no_client: could not import 'openai'"]
    assert check.skipped_tests(tmp_path / "none.xml") == []


def test_the_check_imports_every_module_serve_refuses_to_start_without():
    # (the GPU image lacked orjson: the serve section would have failed on the machine, not here)
    from frugality.cli.serve import SERVE_NEEDS

    assert set(SERVE_NEEDS) <= set(_gpu_check().IMPORTS["serve"])
    wheels = (ROOT / "scripts" / "gpu-check.sh").read_text()
    assert "orjson==" in wheels and "httptools==" in wheels  # (not in the image: KINDS.md of the device machines)
