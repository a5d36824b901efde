"""Target models: locate, convert once (GGUF, llama2.c) to a cached safetensors folder, and load."""
