"""Layers shared by the model families: parallel linears, embeddings, norms, RoPE, attention."""
