"""Structured outputs: grammars (JSON schema, regex, choice, Lark) that constrain sampling through token masks."""
