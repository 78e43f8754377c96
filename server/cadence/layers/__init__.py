"""Building blocks of the model implementations: tensor-parallel linear and embedding
layers, norms, rotary embeddings and the paged attention interface."""
