"""What the server was configured with (from `jvllm serve` flags or a test)."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class ServerSettings:
    served_model_names: list[str]
    api_key: str | None = None
    enable_log_requests: bool = False
    max_logprobs: int = 20
    chat_template: str | None = None  # overrides the tokenizer's template when set
    model_root: str | None = None  # where the weights came from, shown by /v1/models

    def __post_init__(self) -> None:
        if not self.served_model_names:
            raise ValueError("the server needs at least one served model name")

    @property
    def model_name(self) -> str:
        """The name responses report (the first served name, as in vLLM)."""
        return self.served_model_names[0]

    @property
    def api_key_bytes(self) -> bytes | None:
        return self.api_key.encode() if self.api_key else None
