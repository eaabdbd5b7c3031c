"""Entry points above the engine and the server: the `jvllm` command line and the terminal chat."""
