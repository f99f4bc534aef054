"""Byte compatibility with megatron-core's indexed dataset, both ways."""

import numpy as np
import pytest
import torch

from frugality.data.indexed import IndexedDataset, IndexedDatasetWriter, token_dtype
from frugality.errors import UserError

megatron = pytest.importorskip("megatron.core.datasets.indexed_dataset")


def _documents(vocab: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, vocab, size=rng.integers(1, 400)) for _ in range(50)]
    docs.insert(7, np.zeros(0, dtype=np.int64))  # an empty document is legal
    return docs


@pytest.mark.parametrize("vocab", [50277, 65500, 128256])
def test_files_are_byte_identical_to_megatron_core(tmp_path, vocab):
    dtype = token_dtype(vocab)
    assert dtype == (np.uint16 if vocab < 65500 else np.int32)
    assert dtype == megatron.DType.optimal_dtype(vocab)
    docs = _documents(vocab)

    ours = IndexedDatasetWriter(tmp_path / "ours", dtype)
    for d in docs:
        ours.add_document(d)
    ours.finalize()

    theirs = megatron.IndexedDatasetBuilder(str(tmp_path / "theirs.bin"), dtype=dtype.type)
    for d in docs:
        theirs.add_item(torch.from_numpy(d.astype(np.int64)))
        theirs.end_document()
    theirs.finalize(str(tmp_path / "theirs.idx"))

    for ext in ("bin", "idx"):
        assert (tmp_path / f"ours.{ext}").read_bytes() == (tmp_path / f"theirs.{ext}").read_bytes()

    # megatron-core reads what we wrote, and we read what it wrote.
    read_by_megatron = megatron.IndexedDataset(str(tmp_path / "ours"))
    read_by_us = IndexedDataset(tmp_path / "theirs")
    assert len(read_by_megatron) == len(read_by_us) == len(docs)
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(read_by_megatron[i], d)
        np.testing.assert_array_equal(read_by_us[i], d)
    np.testing.assert_array_equal(read_by_us.document_indices, read_by_megatron.document_indices)
    assert read_by_us.num_tokens == sum(len(d) for d in docs)


def test_reader_rejects_damaged_files(tmp_path):
    w = IndexedDatasetWriter(tmp_path / "d", np.uint16)
    w.add_document([1, 2, 3])
    w.finalize()
    (tmp_path / "d.bin").write_bytes(b"\x00" * 4)  # truncated data
    with pytest.raises(UserError, match="does not match the index"):
        IndexedDataset(tmp_path / "d")
    (tmp_path / "d.idx").write_bytes(b"NOTANIDX" + b"\x00" * 40)
    with pytest.raises(UserError, match="not a Megatron"):
        IndexedDataset(tmp_path / "d")
    with pytest.raises(UserError, match="does not exist"):
        IndexedDataset(tmp_path / "missing")


def test_aborted_writer_leaves_nothing(tmp_path):
    w = IndexedDatasetWriter(tmp_path / "d", np.uint16)
    w.add_document([1, 2, 3])
    w.abort()
    assert list(tmp_path.iterdir()) == []


def test_a_prefix_given_with_its_extension_is_taken(tmp_path):
    from frugality.data.indexed import IndexedDataset, IndexedDatasetWriter

    writer = IndexedDatasetWriter(tmp_path / "books", np.uint16)
    writer.add_document([1, 2, 3])
    writer.finalize()
    for name in ("books", "books.bin", "books.idx"):
        assert IndexedDataset(tmp_path / name).num_tokens == 3
    with pytest.raises(UserError, match="does not exist"):
        IndexedDataset(tmp_path / "other.bin")
