"""The tokenizer a checkpoint ships (a Hugging Face tokenizer directory), the vocabulary rule, and a tiny one.

DeepSeek's releases ship `tokenizer.json` + `tokenizer_config.json` (with the `chat_template`) beside the
weights; `transformers.AutoTokenizer` reads them offline, after every file it may read was checked to be a regular
file inside the directory (`check_tokenizer_dir`: a FIFO would hang it, a link could read from anywhere). The
model's embedding may have more rows than the tokenizer has entries (V3: 129,280 rows, ~128.8k entries: padded for
the GEMMs), never fewer.

`train_tiny_tokenizer` makes a byte-level BPE with DeepSeek-V3's special tokens and a chat template of the
same format (`<｜begin▁of▁sentence｜>`, `<｜User｜>` + text, `<｜Assistant｜>` + text + `<｜end▁of▁sentence｜>`),
trained on Python's own documentation (`pydoc_data.topics`, on every machine): the tests and the fine-tuning
example need a real tokenizer without downloads.
"""

from __future__ import annotations

import json
import os

from dsv3_plugin.errors import DataError
from dsv3_plugin.safe_files import check_regular

__all__ = [
    "TOKENIZER_FILES",
    "BOS",
    "EOS",
    "PAD",
    "USER",
    "ASSISTANT",
    "CHAT_TEMPLATE",
    "has_tokenizer",
    "check_tokenizer_dir",
    "load_tokenizer",
    "check_vocab_fits",
    "pydoc_texts",
    "train_tiny_tokenizer",
]

# What a tokenizer directory may hold (copied with an exported model).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")

BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"

# DeepSeek-V3's chat format (system text first, untagged; then the turns), without the tool-call branches.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}"
    "{% elif message['role'] == 'user' %}{{ '" + USER + "' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}{{ '" + ASSISTANT + "' + message['content'] + eos_token }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '" + ASSISTANT + "' }}{% endif %}"
)


def has_tokenizer(path: str | os.PathLike) -> bool:
    """Whether directory `path` holds a Hugging Face tokenizer (`tokenizer.json` or `tokenizer.model`)."""
    return any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer.model"))


# Files in a tokenizer directory that no tokenizer loader reads: the weights of a checkpoint directory.
_NOT_READ_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".gguf", ".distcp")
_TEMPLATE_DIR = "additional_chat_templates"  # transformers reads every *.jinja in it


def check_tokenizer_dir(path: str | os.PathLike) -> list[str]:
    """Check every file of tokenizer directory `path` that a tokenizer loader may read, before any is opened: each
    must be a regular file inside `path` (`dsv3_plugin.safe_files`; a Hugging Face cache snapshot's links into its
    own blobs are fine).

    `transformers` picks its files by name, and which names depends on the tokenizer class and on
    `tokenizer_config.json` (tokenizer.json, tokenizer.model, vocab.json, merges.txt, added_tokens.json,
    chat_template.jinja, config.json, ...), so every top-level entry is checked except hidden names, the weights
    (`*.safetensors`, `*.bin`, ...) and subdirectories other than `additional_chat_templates/` (whose files are
    checked too).

    Args:
        path: the directory.

    Returns:
        The names checked (relative to `path`), sorted.

    Raises:
        DataError: an entry is a link out of `path`, a dangling link, or not a regular file (a FIFO would block
            the loader forever); the message names it.
    """
    path = os.fspath(path)
    checked = []
    for name in sorted(os.listdir(path)):
        p = os.path.join(path, name)
        if name.startswith(".") or name.endswith(_NOT_READ_SUFFIXES):
            continue
        if os.path.isdir(p):
            if name == _TEMPLATE_DIR:
                for sub in sorted(os.listdir(p)):
                    check_regular(os.path.join(p, sub), DataError, path, "chat template file")
                    checked.append(f"{name}/{sub}")
            continue  # other subdirectories: no tokenizer loader reads them
        check_regular(p, DataError, path, "tokenizer file")
        checked.append(name)
    return checked


def load_tokenizer(path: str | os.PathLike):
    """The tokenizer in directory `path` (offline, `transformers.AutoTokenizer`), after `check_tokenizer_dir`.

    Args:
        path: a directory with `tokenizer.json` (or `tokenizer.model`) and `tokenizer_config.json`, e.g. a
            released checkpoint.

    Returns:
        A transformers tokenizer (`len(tok)` entries, `tok.chat_template` when the directory has one).

    Raises:
        DataError: `path` is not a directory, holds no tokenizer, or a file the loader may read is a link out of
            it or not a regular file (the message names it).
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise DataError(f"{path}: tokenizer directory does not exist")
    check_tokenizer_dir(path)
    if not has_tokenizer(path):
        raise DataError(f"{path}: no tokenizer.json or tokenizer.model (a Hugging Face tokenizer directory is needed)")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, json.JSONDecodeError) as e:
        raise DataError(f"{path}: cannot load the tokenizer ({type(e).__name__}: {e})") from e


def check_vocab_fits(tokenizer, vocab_size: int, where: str) -> None:
    """The release's rule: the tokenizer's ids must index the embedding (`len(tokenizer) <= vocab_size`); an
    embedding larger than the tokenizer (padded rows) is normal.

    Raises:
        DataError: naming `where` (the tokenizer directory) and both sizes.
    """
    n = len(tokenizer)
    if n > vocab_size:
        raise DataError(
            f"{where}: the tokenizer has {n} entries but the model's vocab_size is {vocab_size}: token ids "
            f"{vocab_size}..{n - 1} have no embedding row (a tokenizer may be smaller than the model, not larger)"
        )


def pydoc_texts(min_chars: int = 200) -> list[str]:
    """Python's own documentation topics longer than `min_chars`, in a fixed order (real text, no download)."""
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics) if len(topics[k]) > min_chars]


def train_tiny_tokenizer(out_dir: str | os.PathLike, vocab_size: int = 1024, texts: list[str] | None = None) -> str:
    """Train a byte-level BPE with DeepSeek-V3's special tokens and chat format and save it as a Hugging Face
    tokenizer directory (`tokenizer.json`, `tokenizer_config.json`).

    Args:
        out_dir: the directory to write (created; existing tokenizer files are replaced).
        vocab_size: entries including the special tokens.
        texts: the training text; default `pydoc_texts()`.

    Returns:
        `out_dir`.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    specials = [BOS, EOS, PAD, USER, ASSISTANT]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(pydoc_texts() if texts is None else texts, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    # BOS before plain text, as DeepSeek-V3's tokenizer does (its post-processor, not `add_bos_token`).
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": 16384,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
    return out_dir
