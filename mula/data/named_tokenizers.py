"""Named tokenizers: a bare name that stands for a tokenizer.json shipped inside an installed package.

Wherever Mula takes a tokenizer path -- `mula prepare --tokenizer_path`, a data recipe's ``tokenizer_path``,
``MulaDataModule``'s ``prepare.tokenizer_path``, `mula eval --tokenizer`, `mula export-hf --tokenizer`, anything
that calls ``mula.data.tokenizer.load_tokenizer`` -- it also takes one of these names:

    olmo    OLMo's BPE tokenizer (GPT-NeoX's, with OLMo's PII tokens), the one OLMoE-1B-7B-0924 was trained
            with: ``olmo_eval/tokenizers/allenai_gpt-neox-olmo-dolma-v1_5.json`` inside the wheel of
            ai2-olmo-eval, which `bash scripts/setup.sh` installs (Apache-2.0). 50,280 ids; EOS
            ``<|endoftext|>`` = 50279, appended to every document; pad ``<|padding|>`` = 1; no BOS.

A name is a bare word (letters, digits, ``_``, ``-``): it wins over a file or directory of that name in the
working directory, which is still reachable as ``./olmo``. A bare word that is neither a name nor an existing
path is refused with one sentence naming the known names; a missing ``.../tokenizer.json`` gets the usual
missing-file sentence.

Text is encoded exactly as ``tokenizers.Tokenizer.from_file(<file>).encode(text, add_special_tokens=False)``
encodes it, EOS appended at each document's end and no BOS -- with Mula's one rule for every tokenizer
(``LoadedTokenizer.encode_documents``): a special-token string written inside a document (a literal
``<|endoftext|>`` in a web page) is encoded as text, so EOS appears once per document, at its end.

What the prepared data and the checkpoints record (``summary.json``'s ``tokenizer.name``, the data module's
checkpoint state): the name, not the resolved file. The file lives inside a virtual environment, whose
path changes when the environment is rebuilt elsewhere (another cluster, another user, a container);
the name finds it again wherever ai2-olmo-eval is installed, and the recorded sha256 still tells whether
the file behind it is the one the data was tokenized with (`mula prepare` re-runs compare it).

The package is located without importing it (``importlib.util.find_spec``: importing ``olmo_eval`` pulls in
datasets and torchmetrics, seconds of start-up for a file path).
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# A bare word: what a name looks like (`./olmo`, `olmo.json` or `a/olmo` are paths).
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")


@dataclass(frozen=True)
class NamedTokenizer:
    """One named tokenizer: the installed package that ships its tokenizer.json, and its special tokens.

    Attributes:
        name: The name users write (``olmo``).
        package: The importable package that ships the file (located, never imported).
        distribution: The package's name on PyPI (for the error message).
        resource: The file's path inside the package.
        description: One line: what the tokenizer is.
        config: What a ``tokenizer_config.json`` next to the file would say: its EOS, pad and BOS tokens (a
            missing key: none), read by EOS discovery and by `mula export-hf`.
    """

    name: str
    package: str
    distribution: str
    resource: str
    description: str
    config: dict[str, Any] = field(default_factory=dict)

    def file(self) -> Path:
        """The tokenizer.json inside the installed package; one sentence (FileNotFoundError) when the
        package or the file is missing."""
        spec = importlib.util.find_spec(self.package)
        if spec is None:
            raise FileNotFoundError(
                f"the named tokenizer {self.name!r} ships with the {self.distribution} package, which is not "
                "installed; run `bash scripts/setup.sh` (it installs it) or give the path of a tokenizer.json."
            )
        for root in spec.submodule_search_locations or ():
            candidate = Path(root) / self.resource
            if candidate.is_file():
                return candidate
        raise FileNotFoundError(
            f"the installed {self.distribution} package ({', '.join(spec.submodule_search_locations or [])}) "
            f"has no {self.resource}, the named tokenizer {self.name!r}; reinstall it with `bash scripts/setup.sh`."
        )


NAMED_TOKENIZERS: dict[str, NamedTokenizer] = {
    "olmo": NamedTokenizer(
        name="olmo",
        package="olmo_eval",
        distribution="ai2-olmo-eval",
        resource="tokenizers/allenai_gpt-neox-olmo-dolma-v1_5.json",
        description="OLMo's GPT-NeoX BPE, the tokenizer of OLMoE-1B-7B-0924 (50,280 ids)",
        config={"eos_token": "<|endoftext|>", "pad_token": "<|padding|>"},
    ),
}


def named_tokenizer(reference: str) -> NamedTokenizer | None:
    """The named tokenizer `reference` names, or None when it is a path."""
    return NAMED_TOKENIZERS.get(reference)


def looks_like_a_name(reference: str) -> bool:
    """Whether `reference` is a bare word (a name, known or not) rather than a path."""
    return _NAME_RE.fullmatch(reference) is not None


def unknown_name_error(reference: str) -> ValueError:
    """The sentence for a bare word that is neither a named tokenizer nor an existing file or directory."""
    return ValueError(
        f"tokenizer {reference!r} is neither a named tokenizer ({', '.join(sorted(NAMED_TOKENIZERS))}) nor an "
        "existing file or directory; give one of the names or the path of a tokenizer.json."
    )
