"""Tokenizer loading (Hugging Face `tokenizer.json` through the `tokenizers` library) and the
end-of-sequence ids a checkpoint declares."""
from __future__ import annotations

import json
import os

from tokenizers import Tokenizer as _HFTokenizer


def read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}): is it truncated? Download it again") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


class Tokenizer:
    def __init__(self, path: str) -> None:
        file = path if path.endswith(".json") else os.path.join(path, "tokenizer.json")
        if not os.path.isfile(file):
            raise OSError(f"no tokenizer.json at {path!r}")
        self.path = os.path.dirname(file)
        try:
            self._tk = _HFTokenizer.from_file(file)
        except Exception as e:  # the tokenizers library's message does not name the file
            raise ValueError(f"cannot load the tokenizer {file} ({e}): is it truncated or corrupt? "
                             "Download it again") from None
        config = read_json(os.path.join(self.path, "tokenizer_config.json"))
        eos = config.get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        self.eos_token_id = self._tk.token_to_id(eos) if isinstance(eos, str) else None
        self.vocab_size = self._tk.get_vocab_size(with_added_tokens=True)

    @property
    def backend(self) -> _HFTokenizer:
        """The underlying `tokenizers.Tokenizer`."""
        return self._tk

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tk.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tk.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_token(self, token_id: int) -> str:
        return self._tk.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes | None:
        """The bytes a token stands for, where its vocabulary entry shows them: a byte-level BPE
        piece (GPT-2's byte-to-character alphabet) or a byte-fallback piece ("<0xE2>"); None for
        other pieces (use the decoded text's UTF-8) and unknown ids."""
        piece = self._tk.id_to_token(token_id)
        if piece is None:
            return None
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                return None
        table = _byte_level_decoder()
        if all(c in table for c in piece):
            return bytes(table[c] for c in piece)
        return None

    def decode_tokens(self, token_ids: list[int]) -> list[str]:
        """decode_token of each id, in one call into the tokenizers library."""
        return self._tk.decode_batch([[t] for t in token_ids], skip_special_tokens=False)


_BYTE_LEVEL_DECODER: dict[str, int] | None = None


def _byte_level_decoder() -> dict[str, int]:
    """Character -> byte of byte-level BPE vocabularies (GPT-2's table: printable bytes stand for
    themselves, the others for U+0100 onwards in byte order)."""
    global _BYTE_LEVEL_DECODER
    if _BYTE_LEVEL_DECODER is None:
        printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                     *range(ord("\xae"), ord("\xff") + 1)]
        table, extra = {}, 0
        for b in range(256):
            if b in printable:
                table[chr(b)] = b
            else:
                table[chr(256 + extra)] = b
                extra += 1
        _BYTE_LEVEL_DECODER = table
    return _BYTE_LEVEL_DECODER


def load_tokenizer(path: str | None) -> Tokenizer | None:
    """The tokenizer in `path`, or None when the folder has no tokenizer.json."""
    if path is None:
        return None
    file = path if path.endswith(".json") else os.path.join(path, "tokenizer.json")
    return Tokenizer(path) if os.path.isfile(file) else None


def eos_token_ids(model_dir: str, tokenizer: Tokenizer | None, config_eos: list[int]) -> tuple[int, ...]:
    """EOS ids: generation_config.json first (it may list several), then config.json, then the tokenizer."""
    gen = _as_list(read_json(os.path.join(model_dir, "generation_config.json")).get("eos_token_id"))
    ids = gen or list(config_eos)
    if not ids and tokenizer is not None and tokenizer.eos_token_id is not None:
        ids = [tokenizer.eos_token_id]
    return tuple(dict.fromkeys(ids))
