"""Contrastive training of an encoder: the loss, the retrieval metrics, and whole runs of a
micro BERT on WordNet pairs (evaluation records, bucketed shapes, bit-identical resume)."""

import json

import pytest
import torch
import torch.nn.functional as F

from frugality.config.recipe import load_recipe
from frugality.errors import UserError
from frugality.tasks import Contrastive
from frugality.tasks.contrastive import info_nce
from frugality.training import trainer


def test_info_nce_is_the_mean_of_both_directions_of_cross_entropy():
    torch.manual_seed(0)
    q, p = F.normalize(torch.randn(4, 8), dim=-1), F.normalize(torch.randn(4, 8), dim=-1)
    labels = torch.arange(4)
    expected = (F.cross_entropy(20 * q @ p.T, labels) + F.cross_entropy(20 * p @ q.T, labels)) / 2
    assert torch.allclose(info_nce(torch.cat([q, p]), 2, 20.0), expected)
    # hard negatives widen the queries' choice, not the positives'
    n = F.normalize(torch.randn(4, 8), dim=-1)
    with_negatives = (F.cross_entropy(20 * q @ torch.cat([p, n]).T, labels) + F.cross_entropy(20 * p @ q.T, labels)) / 2
    assert torch.allclose(info_nce(torch.cat([q, p, n]), 3, 20.0), with_negatives)


@pytest.mark.parametrize("groups", [2, 3])
def test_info_nce_over_gathered_parts_is_info_nce_over_their_union(groups):
    """Two parts of n pairs (data-parallel ranks), each scoring its own queries and
    positives against both parts' documents and queries: the mean of their losses, and its
    gradient, are those of one batch of 2n pairs."""
    n, d = 3, 8
    rows = F.normalize(torch.randn(groups, 2, n, d), dim=-1).requires_grad_()  # [group][part][pair]
    union = info_nce(rows.flatten(1, 2).flatten(0, 1), groups, 20.0)
    (full_grad,) = torch.autograd.grad(union, rows)

    def gather_for(part):
        def gather(local):  # this part's rows in place, the other part's as they are
            queries = torch.equal(local, rows[0, part])  # else the documents
            whole = rows[0, 1 - part] if queries else rows[1:, 1 - part].flatten(0, 1)
            return torch.cat([local, whole] if part == 0 else [whole, local]), part

        return gather

    parts = [info_nce(rows[:, p].flatten(0, 1), groups, 20.0, gather_for(p)) for p in (0, 1)]
    mean = (parts[0] + parts[1]) / 2
    (grad,) = torch.autograd.grad(mean, rows)
    assert torch.allclose(mean, union, atol=1e-6) and torch.allclose(grad, full_grad, atol=1e-6)
    assert not torch.allclose(parts[0], info_nce(rows[:, 0].flatten(0, 1), groups, 20.0))  # more negatives


def test_a_step_counts_its_real_tokens_at_every_level_and_configuring_keeps_what_is_not_named():
    from frugality.data.pairs import TextBatch

    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    batch = TextBatch(mask * 7, mask, 2)
    gather = object()
    task = Contrastive().configured(gather=gather, unpad=True).configured(unpad=False)
    assert task.setup.gather is gather and not task.setup.unpad
    assert task.tokens(batch) == Contrastive().configured(unpad=True).tokens(batch) == 10  # padding never counts


def test_evaluation_takes_its_loss_and_its_retrieval_embeddings_from_one_forward():
    from frugality.data.pairs import TextBatch
    from frugality.models.bert import Bert, BertConfig

    model = Bert(
        BertConfig(hidden_size=32, num_layers=1, num_heads=4, intermediate_size=64, head=(16,), pooler=False)
    ).eval()
    mask = (torch.arange(10) < torch.tensor([10, 4, 7, 2, 9, 5]).unsqueeze(1)).long()
    batch = TextBatch(torch.randint(1000, 2000, (6, 10)) * mask, mask, 3)
    calls = []
    model.register_forward_hook(lambda *a: calls.append(1))
    module = Contrastive().configured(unpad=True).training_module(model).eval()
    with torch.no_grad():
        evaluated = module(batch, evaluate=True)
        assert len(calls) == 1
        queries, positives = evaluated.outputs
        embedded = F.normalize(model.embed(batch.ids, batch.mask), dim=-1)
        assert torch.allclose(evaluated.loss, module(batch), atol=1e-6) and evaluated.weight == 2
    assert torch.allclose(queries, embedded[:2], atol=1e-6) and torch.allclose(positives, embedded[2:4], atol=1e-6)


def test_gather_negatives_is_refused_for_other_tasks():
    from frugality.runtime.layout import check_recipe

    with pytest.raises(UserError, match="parallel.gather_negatives = true: only contrastive training"):
        check_recipe(load_recipe("tiny", ["parallel.gather_negatives=true"]), torch.device("cpu"))


def test_retrieval_metrics_rank_each_querys_own_positive():
    queries = torch.eye(3)
    positives = torch.tensor([[1.0, 0, 0], [0, 0, 1.0], [0, 1.0, 0]])  # query 0 right; 1 and 2 swapped
    m = Contrastive().retrieval_metrics(queries, positives)
    assert m["recall@1"] == pytest.approx(1 / 3) and m["recall@10"] == 1.0
    assert m["mrr"] == pytest.approx((1 + 1 / 2 + 1 / 2) / 3) and m["candidates"] == 3


def test_a_run_logs_retrieval_metrics_uses_the_buckets_and_learns(micro_pairs_recipe, tmp_path):
    recipe = load_recipe(
        str(micro_pairs_recipe),
        [
            "train.steps=8",
            "train.eval_interval=8",
            "optim.lr=3e-3",
            "data.global_batch_size=4",
            "data.micro_batch_size=2",
        ],
    )
    result = trainer.train(recipe, run_dir=tmp_path / "run", progress=False)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, 8]
    for r in evals:
        assert 0 <= r["recall@1"] <= r["recall@10"] <= 1 and 0 < r["mrr"] <= 1
        assert r["candidates"] == 16  # train.eval_samples
        assert "perplexity" not in r
    assert result.evals[8] < result.evals[0]
    # a step counts its real tokens, not the 4 pairs x 2 texts x 16, 24 or 32 its bucket pads to
    steps = [r for r in records if r["kind"] == "train"]
    increments = [b["tokens"] - a["tokens"] for a, b in zip([{"tokens": 0}] + steps, steps, strict=False)]
    assert all(0 < i <= 4 * 2 * 32 for i in increments), increments
    assert not set(increments) <= {4 * 2 * 16, 4 * 2 * 24, 4 * 2 * 32}, increments
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["tokens_seen"] == steps[-1]["tokens"] and summary["median_tokens_per_s"] > 0


def test_a_stopped_contrastive_run_resumes_bit_identically(micro_pairs_recipe, tmp_path):
    recipe = load_recipe(str(micro_pairs_recipe))
    whole = trainer.train(recipe, run_dir=tmp_path / "whole", progress=False)
    trainer.train(recipe, run_dir=tmp_path / "split", progress=False, until_step=2)
    resumed = trainer.train(recipe, run_dir=tmp_path / "split", progress=False)
    assert resumed.start_step == 2 and resumed.evals[4] == whole.evals[4]
    losses = lambda run: [
        json.loads(line)["loss"]
        for line in (run / "metrics.jsonl").read_text().splitlines()
        if json.loads(line)["kind"] == "train"
    ]
    assert losses(tmp_path / "split") == losses(tmp_path / "whole")
    tokens = lambda run: json.loads((run / "summary.json").read_text())["tokens_seen"]
    assert tokens(tmp_path / "split") == tokens(tmp_path / "whole")  # counted across the resume


def test_a_pretrained_encoder_gains_a_head_and_a_learnt_temperature(micro_pairs_recipe, tmp_path, capsys):
    from frugality.cli.main import main

    plain = ["--set", "model.head=[]", "--set", "model.learn_temperature=false"]
    args = ["train", str(micro_pairs_recipe), "--no-progress", "--set", "train.steps=2"]
    assert main(args + plain + ["--run-dir", str(tmp_path / "plain")]) == 0
    assert main(args + ["--run-dir", str(tmp_path / "headed"), "--init-from", str(tmp_path / "plain")]) == 0
    out = capsys.readouterr().out
    assert "--init-from has no head.0, head.1, logit_scale: trained from their initialisation" in out
    assert f"initialised from {tmp_path / 'plain'}" in out


def test_plan_sizes_the_encoder_recipes(capsys):
    from frugality.cli.main import main

    assert main(["plan", "minilm-pairs"]) == 0 and main(["plan", "bert-mlm"]) == 0
    assert "minilm-pairs" in capsys.readouterr().out


def test_bad_pairs_and_a_decoder_are_one_line_each(micro_pairs_recipe, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"query": "a", "text": "b"}\n{"query": "c"}\n')
    with pytest.raises(UserError, match=r"bad.jsonl:2: field 'text' is missing"):
        trainer.train(
            load_recipe(str(micro_pairs_recipe), [f'data.dataset="{bad}"']), run_dir=tmp_path / "r1", progress=False
        )
    with pytest.raises(UserError, match="choose the fields with data.fields"):
        trainer.train(
            load_recipe(str(micro_pairs_recipe), ['data.fields=["query", "gloss"]']),
            run_dir=tmp_path / "r2",
            progress=False,
        )
    with pytest.raises(UserError, match="task contrastive trains encoders"):
        trainer.train(load_recipe("tiny", ["train.task=contrastive"]), run_dir=tmp_path / "r3", progress=False)
    with pytest.raises(UserError, match="train.task contrastive needs at least 2 samples per micro-batch"):
        trainer.train(
            load_recipe(str(micro_pairs_recipe), ["data.micro_batch_size=1"]), run_dir=tmp_path / "r4", progress=False
        )
    assert not any((tmp_path / r).exists() for r in ("r1", "r2", "r3", "r4"))
