"""Loading models: HF folders, GGUF files, packaged models and dummy weights, sharded if asked."""
