"""The tokenizer of a `mula export-hf` directory, so that transformers' AutoTokenizer loads the run's own.

The tokenizer comes from `--tokenizer`, or else from the checkpoint: `MulaDataModule` records the
tokenizer.json its data was prepared with in its checkpoint state. Exported files:

    tokenizer.json          a copy of the run's tokenizer
    tokenizer_config.json   the source's tokenizer_config.json when it has one (a Hugging Face
                            tokenizer directory, or a named tokenizer's own settings: `olmo`'s pad
                            token), else PreTrainedTokenizerFast; with the EOS token
                            Mula's data ends documents with and model_max_length = the model's positions
    generation_config.json  eos (and bos / pad when the tokenizer names them) token ids for `generate`
"""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path
from typing import Any

import torch

from mula.checkpoint.sharded import SHARDED_META_FILE
from mula.data.named_tokenizers import named_tokenizer
from mula.data.tokenizer import LoadedTokenizer, load_tokenizer, token_content
from mula.model.config import MulaConfig

TOKENIZER_CONFIG = "tokenizer_config.json"


def checkpoint_tokenizer_path(ckpt: Path) -> str | None:
    """The tokenizer a training run recorded in its checkpoint: a tokenizer.json path or a named tokenizer's
    name (None for a weights file, or a checkpoint written without MulaDataModule)."""
    from mula.data.datamodule import MulaDataModule  # imports Lightning: only needed here

    obj = read_training_state(ckpt)
    return MulaDataModule.tokenizer_path_in(obj) if obj is not None else None


def read_training_state(ckpt: Path) -> dict[str, Any] | None:
    """The checkpoint's top-level dict (global_step, the data module's state, ...; `meta.pt` of a sharded
    directory), or None when it has none (a file torch cannot read as a dict: its weights are read elsewhere)."""
    path = ckpt / SHARDED_META_FILE if ckpt.is_dir() else ckpt
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError, AttributeError):
        return None
    return obj if isinstance(obj, dict) else None


def check_fits(tokenizer: LoadedTokenizer, config: MulaConfig) -> None:
    """Raise ValueError when the tokenizer has ids the model has no embedding for."""
    if tokenizer.vocab_size > config.vocab_size:
        raise ValueError(
            f"the tokenizer {tokenizer.path} has {tokenizer.vocab_size} tokens but the model's vocab_size "
            f"is {config.vocab_size}; use the tokenizer the model was trained with."
        )


def _source_config(tokenizer: LoadedTokenizer) -> dict[str, Any]:
    """The tokenizer_config.json next to the source tokenizer.json, or a named tokenizer's own settings ({}
    when there is none or it is broken)."""
    return tokenizer.config


def special_token_ids(tokenizer: LoadedTokenizer) -> dict[str, int | None]:
    """eos/bos/pad token ids for config.json and generation_config.json.

    EOS is the token Mula's data ends every document with; bos and pad only when the source's
    tokenizer_config.json names tokens of the vocabulary (a tokenizer trained by Mula has neither).
    """
    source = _source_config(tokenizer)
    vocab = tokenizer.tokenizer.get_vocab(with_added_tokens=True)
    ids: dict[str, int | None] = {"eos_token_id": tokenizer.eos_id}
    for kind in ("bos", "pad"):
        ids[f"{kind}_token_id"] = vocab.get(token_content(source.get(f"{kind}_token")) or "")
    return ids


def write_tokenizer(tokenizer: LoadedTokenizer, config: MulaConfig, directory: Path) -> None:
    """Write tokenizer.json, tokenizer_config.json and generation_config.json into `directory`."""
    shutil.copyfile(tokenizer.path, directory / "tokenizer.json")
    tok_config = _source_config(tokenizer)
    tok_config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    # transformers 4's PreTrainedTokenizerFast also returns token_type_ids, which `generate` refuses
    tok_config.setdefault("model_input_names", ["input_ids", "attention_mask"])
    # byte-level BPE round-trips text exactly; transformers' clean-up would drop spaces before punctuation
    tok_config.setdefault("clean_up_tokenization_spaces", False)
    tok_config.update(eos_token=tokenizer.eos_token, model_max_length=config.max_position_embeddings)
    (directory / TOKENIZER_CONFIG).write_text(json.dumps(tok_config, indent=2) + "\n")
    generation = {k: v for k, v in special_token_ids(tokenizer).items() if v is not None}
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def resolve_tokenizer(ckpt: Path, tokenizer: str | None) -> tuple[LoadedTokenizer | None, str]:
    """(the tokenizer to export, or None with the reason) from `--tokenizer` or the checkpoint.

    A given `tokenizer` that does not exist or is not a tokenizer raises (FileNotFoundError /
    ValueError); a checkpoint's tokenizer that has gone missing since training is only a reason.
    """
    if tokenizer is not None:
        return load_tokenizer(tokenizer), ""
    recorded = checkpoint_tokenizer_path(ckpt)
    if recorded is None:
        return None, f"{ckpt} does not name the tokenizer it was trained with"
    if named_tokenizer(recorded) is None and not Path(recorded).is_file():
        return None, f"the tokenizer {recorded} recorded in {ckpt} no longer exists"
    return load_tokenizer(recorded), ""
