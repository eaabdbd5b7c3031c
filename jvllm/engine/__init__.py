"""Front ends: Engine (LLM), AsyncEngine and their request streams, detokenizing and output processing."""
