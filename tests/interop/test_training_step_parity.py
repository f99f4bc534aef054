"""One training step from the same weights and batch gives the same loss in frugality and
in transformers, for every family: the loss of the step, and the loss after both take
the same AdamW update."""

import pytest
import torch
import torch.nn.functional as F

from frugality.interop import hf_bert, hf_gpt_neox, hf_llama
from frugality.models import Bert, BertConfig, GPTNeoX, GPTNeoXConfig, Llama, LlamaConfig

transformers = pytest.importorskip("transformers")
VOCAB = 400


def _pair(family):
    torch.manual_seed(0)
    if family == "gpt-neox":
        cfg = GPTNeoXConfig(hidden_size=64, num_layers=2, num_heads=4, vocab_size=VOCAB, max_seq_len=32)
        theirs_cfg = transformers.GPTNeoXConfig(
            **{k: v for k, v in hf_gpt_neox.config_to_hf(cfg).items() if k != "architectures"}
        )
        theirs = transformers.GPTNeoXForCausalLM(theirs_cfg)
        ours = GPTNeoX(cfg)
        ours.load_state_dict(hf_gpt_neox.from_hf(theirs.state_dict()))
    elif family == "llama":
        cfg = LlamaConfig(
            hidden_size=64,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            intermediate_size=96,
            vocab_size=VOCAB,
            max_seq_len=32,
            rms_norm_eps=1e-5,
        )
        theirs = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(**{k: v for k, v in hf_llama.config_to_hf(cfg).items() if k != "architectures"})
        )
        ours = Llama(cfg)
        ours.load_state_dict(hf_llama.from_hf(theirs.state_dict(), cfg))
    else:
        cfg = BertConfig(
            hidden_size=64,
            num_layers=2,
            num_heads=4,
            intermediate_size=128,
            vocab_size=VOCAB,
            max_seq_len=32,
            mlm_head=True,
            pooler=False,
        )
        # frugality's BERT has no dropout; switch transformers' off to compare like with like.
        theirs = transformers.BertForMaskedLM(
            transformers.BertConfig(
                **{k: v for k, v in hf_bert.config_to_hf(cfg).items() if k != "architectures"},
                hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0,
            )
        )
        ours = Bert(cfg)
        ours.load_state_dict(hf_bert.from_hf(theirs.state_dict(), cfg))
    theirs.config._attn_implementation = "eager"
    return ours.train(), theirs.train()


def _losses(family, model, ours: bool, batch):
    if family == "bert":
        inputs, labels = batch
        if ours:
            logits = model.mlm_logits(model(inputs))
            return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        return model(input_ids=inputs, labels=labels).loss
    if ours:
        return model(batch[:, :-1], targets=batch[:, 1:])
    return model(input_ids=batch, labels=batch).loss  # transformers shifts the labels itself


@pytest.mark.parametrize("family", ["gpt-neox", "llama", "bert"])
def test_one_training_step_gives_the_same_loss(family):
    ours, theirs = _pair(family)
    torch.manual_seed(1)
    if family == "bert":
        inputs = torch.randint(0, VOCAB, (4, 32))
        labels = torch.full_like(inputs, -100)
        masked = torch.rand(inputs.shape) < 0.15
        labels[masked] = inputs[masked]
        batch = (inputs, labels)
    else:
        batch = torch.randint(0, VOCAB, (4, 33))
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (ours, theirs)]
    losses = []
    for _ in range(2):
        pair = [_losses(family, ours, True, batch), _losses(family, theirs, False, batch)]
        losses.append([line.item() for line in pair])
        for loss, opt in zip(pair, optimizers, strict=True):
            loss.backward()
            opt.step()
            opt.zero_grad()
    for ours_loss, theirs_loss in losses:
        assert abs(ours_loss - theirs_loss) <= 1e-5, losses
