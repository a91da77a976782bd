"""The training data: corpora, Hugging Face datasets, token files, shards."""
