"""Masked language modelling: BERT's 80/10/10 masking, evaluation masks that do not change
between evaluations, and a micro BERT that learns on the bundled corpus."""

import pytest
import torch

from frugality.config.recipe import load_recipe
from frugality.errors import UserError
from frugality.models.bert import Bert, BertConfig
from frugality.tasks import MaskedLM
from frugality.tasks.masked_lm import mask
from frugality.training import trainer

MICRO = [
    "model.hidden_size=32",
    "model.num_layers=2",
    "model.num_heads=4",
    "model.intermediate_size=64",
    "data.seq_len=32",
    "data.global_batch_size=8",
    "data.micro_batch_size=8",
    "train.steps=12",
    "train.eval_interval=12",
    "train.eval_samples=16",
    "optim.warmup_steps=1",
    "train.precision=fp32",
    "metrics.peak_tflops=1.0",
]


def test_masking_follows_berts_80_10_10_rule():
    task = MaskedLM().configured(mask_id=103, mask_prob=0.15)
    tokens = torch.randint(1000, 2000, (64, 512), generator=torch.Generator().manual_seed(0))
    inputs, targets = mask(tokens, task.setup, 30522, torch.Generator().manual_seed(1))
    chosen = targets != -100
    assert chosen.float().mean().item() == pytest.approx(0.15, abs=0.01)
    assert torch.equal(targets[chosen], tokens[chosen]) and torch.equal(inputs[~chosen], tokens[~chosen])
    n = chosen.sum().item()
    assert (inputs[chosen] == 103).sum().item() / n == pytest.approx(0.8, abs=0.02)
    assert (inputs[chosen] == tokens[chosen]).sum().item() / n == pytest.approx(0.1, abs=0.02)


def test_evaluation_masks_the_same_positions_every_time():
    task = MaskedLM().configured(mask_id=103, mask_prob=0.15)
    model = Bert(BertConfig(hidden_size=32, num_layers=1, num_heads=4, intermediate_size=64, mlm_head=True))
    module = task.training_module(model).eval()
    batch = torch.randint(1000, 2000, (2, 33))
    with torch.no_grad():
        assert module(batch, evaluate=True).loss == module(batch, evaluate=True).loss
    module.train()
    assert module(batch) != module(batch)  # training draws new masks


def test_each_rank_masks_its_own_positions_and_a_resume_masks_alike(monkeypatch):
    import frugality.tasks.masked_lm as masked_lm

    task = MaskedLM().configured(mask_id=103, mask_prob=0.15)
    model = Bert(BertConfig(hidden_size=32, num_layers=1, num_heads=4, intermediate_size=64, mlm_head=True))
    module = task.training_module(model).train()
    seen = []
    monkeypatch.setattr(module, "_loss", lambda inputs, targets: seen.append(targets != -100))
    batch = torch.randint(1000, 2000, (4, 129))
    for rank in (0, 1, 0):
        monkeypatch.setattr(masked_lm, "rank", lambda rank=rank: rank)
        torch.manual_seed(7)  # the global generator: alike on every rank, restored on resume
        module(batch)
    assert torch.equal(seen[0], seen[2]) and not torch.equal(seen[0], seen[1])


def test_a_micro_bert_learns_the_bundled_corpus(tmp_path):
    result = trainer.train(
        load_recipe("bert-mlm", MICRO + ["optim.lr=1e-2", "optim.min_lr=1e-3"]),
        run_dir=tmp_path / "run",
        progress=False,
    )
    assert result.evals[12] < result.evals[0] - 0.5  # from ~ln(30522) = 10.3


def test_special_tokens_are_never_masked():
    task = MaskedLM().configured(mask_id=103, mask_prob=0.5, special_ids=(101, 102))
    tokens = torch.full((8, 64), 102)
    tokens[:, ::2] = 2000
    _, targets = mask(tokens, task.setup, 30522, torch.Generator().manual_seed(0))
    assert (targets[:, 1::2] == -100).all() and (targets[:, ::2] != -100).any()


def test_a_bert_without_the_masked_lm_head_is_refused(tmp_path):
    with pytest.raises(UserError, match="needs model.mlm_head = true"):
        trainer.train(
            load_recipe("bert-mlm", MICRO + ["model.mlm_head=false"]), run_dir=tmp_path / "run", progress=False
        )
    assert not (tmp_path / "run").exists()


def test_a_tokenizer_without_mask_is_refused(tmp_path):
    with pytest.raises(UserError, match=r"has no \[MASK\] token"):
        trainer.train(
            load_recipe("bert-mlm", MICRO + ["data.tokenizer=gpt2", "model.vocab_size=50304"]),
            run_dir=tmp_path / "run",
            progress=False,
        )
    assert not (tmp_path / "run").exists()
