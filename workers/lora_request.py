"""``LoRARequest``: the adapter one request runs with (vLLM's ``LoRARequest``), and adapter names."""

from __future__ import annotations

import re
from dataclasses import dataclass

ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def check_adapter_name(name: object, where: str = "lora") -> str:
    """``name`` when it is a valid adapter name (letters, digits, ``.``, ``_``, ``-``; no ``:``:
    requests address an adapter as ``NAME`` or ``BASE:NAME``), else ``ValueError`` naming ``where``."""
    if not isinstance(name, str) or not ADAPTER_NAME.fullmatch(name):
        raise ValueError(f"{where}: an adapter name is 1-128 letters, digits, '.', '_' or '-' "
                         f"(starting with a letter or digit), got {name!r}")
    return name


@dataclass(frozen=True)
class LoRARequest:
    """Run a request with the PEFT adapter in folder ``lora_path`` under the name ``lora_name``.

    ``lora_int_id`` is vLLM's unique positive id of the adapter; two requests with the same name
    must give the same path (an engine serves one adapter per name).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        check_adapter_name(self.lora_name, "lora_name")
        bad_id = isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int)
        if bad_id or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a non-empty path, got {self.lora_path!r}")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path
