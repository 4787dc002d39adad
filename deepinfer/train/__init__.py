"""Training recipe for deepinfer's embedded default model: corpus, tokenizer, token shards, model training."""
