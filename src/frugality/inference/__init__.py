"""Inference: offline jobs over many inputs with a trained or imported model. `encoder`
loads an embedding model (BERT family, with its tokenizer and pooling); `embed` runs the
resumable, sharded embedding job behind `frugality embed`; `inputs` reads the texts."""
