"""Hidden-state capture backends. Each returns, for a batch of token sequences, the aux hidden states at the
requested layers and the post-norm last hidden state, exactly sliced to each sequence's tokens."""
