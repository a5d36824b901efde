"""Dataset formats (loaders that normalise conversations) and chat-template rendering with loss masks."""
