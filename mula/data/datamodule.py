"""`MulaDataModule`: streams windows of ``seq_len + 1`` tokens from data written by `mula prepare`.

Batches are LongTensor [micro_batch_size, seq_len + 1]. The order of samples is a function of (seed, global
batch size) only: global batch b is the same list of windows for 1, 2 or 4096 data-parallel ranks; each rank
takes a fixed slice of it in micro-batches and Lightning accumulates them (``accumulate_grad_batches`` is set
here to ``global_batch_size / (dp_world_size * micro_batch_size)``). The loader position is saved in
checkpoints, so a resumed run continues with the next micro-batch, also on another number of ranks.

With a ``prepare`` spec the data is prepared on first use (and the tokenizer trained if its file is missing),
in ``prepare_data``, i.e. on global rank 0 only while the other ranks wait.
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import lightning.pytorch as L
from lightning.pytorch.strategies import ModelParallelStrategy
from typing_extensions import override

from mula.data.loader import BatchLayout, StatefulLoader, TrainStream, ValStream, WindowReader
from mula.data.named_tokenizers import looks_like_a_name, named_tokenizer, unknown_name_error
from mula.data.paths import expand_paths, expand_pattern
from mula.data.prepare import prepare
from mula.data.prepare_summary import SOURCE_MARKER, SUMMARY_FILE, SourceSpec, recorded_tokenizer
from mula.data.readers import iter_documents
from mula.data.sampling import MixtureOrder
from mula.data.tokenizer import EOS_TOKEN, load_tokenizer, train_bpe
from mula.layout.rules import micro_batches_per_step
from mula.training.strategy_contract import mula_strategy

log = logging.getLogger(__name__)
TOKENIZER_STATE_KEY = "tokenizer_path"
TOKENS_SEEN_KEY = "tokens_seen"
# Lightning warns about every IterableDataset with a length; ours split work between DataLoader workers
# explicitly (micro-batch k goes to worker k % num_workers), so the length is exact.
warnings.filterwarnings("ignore", message=r"Your `IterableDataset` has `__len__` defined")


@dataclass
class TokenizerTrainSpec:
    """How to train the tokenizer when ``PrepareSpec.tokenizer_path`` does not exist yet.

    Attributes:
        vocab_size: Vocabulary size, including the 256 byte tokens and the EOS token.
        min_frequency: Minimum count of a pair to be merged.
        max_documents: Train on at most this many documents of the sources (None: all).
        eos_token: The end-of-document special token.
    """

    vocab_size: int = 4096
    min_frequency: int = 2
    max_documents: int | None = None
    eos_token: str = EOS_TOKEN


@dataclass
class PrepareSpec:
    """Data to prepare into ``data_dir`` on first use (what `mula prepare` would be given).

    Attributes:
        sources: Named sources with path globs (``{stdlib}`` = the Python standard library) and weights.
        tokenizer_path: The tokenizer.json to tokenize with; trained on the sources first if it does not exist
            and ``train_tokenizer`` is given. Or a named tokenizer (``olmo``, mula/data/named_tokenizers.py),
            never trained.
        train_tokenizer: Settings for training the tokenizer when its file is missing.
        num_workers: Tokenizer processes (default: all CPU cores).
        skip_bad_records: Skip and count malformed records instead of failing.
    """

    sources: list[SourceSpec]
    tokenizer_path: str
    train_tokenizer: TokenizerTrainSpec | None = None
    num_workers: int | None = None
    skip_bad_records: bool = False


def _as_dataclass(value: Any, cls: type) -> Any:
    return cls(**value) if isinstance(value, dict) else value


@runtime_checkable
class ConfiguredModule(Protocol):
    """A LightningModule whose model `config` the data is checked against before the first step
    (`MulaLightningModule`): its `vocab_size` and `max_position_embeddings` (`validate_against`)."""

    config: Any


class MulaDataModule(L.LightningDataModule):
    """Token windows from prepared litdata chunks, in a world-size-independent, resumable order.

    Args:
        data_dir: Output directory of `mula prepare` (holds summary.json and one folder per source).
        seq_len: Tokens per training sequence; batches hold ``seq_len + 1`` tokens (inputs + shifted targets).
        global_batch_size: Sequences per optimizer step, over all data-parallel ranks.
        micro_batch_size: Sequences per forward/backward pass on one rank.
        seed: Seed of the training order (the validation windows do not depend on it).
        val_samples: Held-out validation windows (split over sources in mixture proportion); 0 disables.
        num_workers: DataLoader worker processes per rank.
        weights: Mixture weight per source name, replacing the weights given to `mula prepare`
            (1.0 = natural proportion, 2.0 = twice as often).
        prepare: Prepare ``data_dir`` on first use from these sources (and train the tokenizer if needed).
    """

    def __init__(
        self,
        data_dir: str,
        seq_len: int = 2048,
        global_batch_size: int = 3072,
        micro_batch_size: int = 4,
        seed: int = 42,
        val_samples: int = 256,
        num_workers: int = 2,
        weights: dict[str, float] | None = None,
        prepare: PrepareSpec | None = None,
    ) -> None:
        super().__init__()
        for name, value in (
            ("seq_len", seq_len),
            ("global_batch_size", global_batch_size),
            ("micro_batch_size", micro_batch_size),
        ):
            if value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value}.")
        if val_samples < 0 or num_workers < 0:
            raise ValueError("val_samples and num_workers must be >= 0.")
        self.data_dir = os.path.abspath(expand_pattern(data_dir))
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.seed = seed
        self.val_samples = val_samples
        self.num_workers = num_workers
        self.weights = dict(weights) if weights else None
        if prepare is not None:
            prepare = _as_dataclass(prepare, PrepareSpec)
            prepare.sources = [_as_dataclass(s, SourceSpec) for s in prepare.sources]
            prepare.train_tokenizer = _as_dataclass(prepare.train_tokenizer, TokenizerTrainSpec)
        self.prepare_spec = prepare
        # Auto-preparation writes shared files: one process in the whole job does it, the others wait.
        self.prepare_data_per_node = False
        self._dp: tuple[int, int] | None = None
        self._summary: dict[str, Any] | None = None
        self.layout: BatchLayout | None = None
        self.order: MixtureOrder | None = None
        self._reader: WindowReader | None = None
        self._train_loader: StatefulLoader | None = None
        self._pending_state: dict[str, Any] | None = None

    # ---- data parallelism -------------------------------------------------------------------------------

    def set_data_parallel(self, rank: int, world_size: int) -> None:
        """Override the data-parallel rank and world size (default: from the trainer / strategy).

        For strategies whose ranks are not all data parallel (tensor parallelism) or that know better.
        Expert parallelism needs no override: every rank is a data-parallel rank there.
        """
        if not 0 <= rank < world_size:
            raise ValueError(f"data-parallel rank {rank} is not in [0, {world_size}).")
        self._dp = (rank, world_size)

    def data_parallel_rank_world(self) -> tuple[int, int]:
        """(rank, world size) of data parallelism: the override, the strategy's, or the trainer's."""
        if self._dp is not None:
            return self._dp
        trainer = self.trainer
        if trainer is None:
            return 0, 1
        contract = mula_strategy(trainer.strategy)
        if contract is not None:
            return contract.data_parallel_rank, contract.data_parallel_size
        if isinstance(trainer.strategy, ModelParallelStrategy):  # Lightning's FSDP2 + TP
            mesh = trainer.strategy.device_mesh
            if "data_parallel" in (mesh.mesh_dim_names or ()):
                dp = mesh["data_parallel"]
                return dp.get_local_rank(), dp.size()
        return trainer.global_rank, trainer.world_size

    # ---- checks -----------------------------------------------------------------------------------------

    def _read_summary(self) -> dict[str, Any]:
        """summary.json of data_dir, checked; one clear sentence when the data is missing or broken."""
        d = self.data_dir
        hint = "prepare it with `mula prepare` or give the data module a `prepare` spec"
        if not os.path.isdir(d):
            raise FileNotFoundError(f"data directory {d} does not exist; {hint}.")
        path = os.path.join(d, SUMMARY_FILE)
        if not os.path.isfile(path):
            state = "is empty" if not os.listdir(d) else f"holds no prepared data (no {SUMMARY_FILE})"
            raise ValueError(f"data directory {d} {state}; {hint}.")
        try:
            with open(path) as fh:
                summary = json.load(fh)
            sources = summary["sources"]
            summary["tokenizer"]["vocab_size"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{path} is not a summary written by `mula prepare` ({e!r}).") from None
        for s in sources:
            src_dir = os.path.join(d, s["name"])
            if not os.path.isfile(os.path.join(src_dir, SOURCE_MARKER)):
                raise ValueError(f"source folder {src_dir} is missing or incomplete; re-run `mula prepare`.")
        if not sources:
            raise ValueError(f"{path} lists no sources; re-run `mula prepare`.")
        if self.weights:
            unknown = sorted(set(self.weights) - {s["name"] for s in sources})
            if unknown:
                raise ValueError(
                    f"weights name unknown sources {unknown}; {d} has {[s['name'] for s in sources]}."
                )
        return summary

    def _tokenizer_vocab_size(self) -> int | None:
        """Vocabulary size of the data's tokenizer, from the prepared data or the `prepare` spec."""
        if os.path.isfile(os.path.join(self.data_dir, SUMMARY_FILE)):
            return int(self._read_summary()["tokenizer"]["vocab_size"])
        spec = self.prepare_spec
        if spec is None:
            self._read_summary()  # raises the missing / empty data directory error
            return None
        if named_tokenizer(spec.tokenizer_path) is not None or os.path.exists(
            expand_pattern(spec.tokenizer_path)
        ):
            return load_tokenizer(expand_pattern(spec.tokenizer_path)).vocab_size
        if spec.train_tokenizer is not None:
            return spec.train_tokenizer.vocab_size
        if looks_like_a_name(spec.tokenizer_path):
            raise unknown_name_error(spec.tokenizer_path)
        raise FileNotFoundError(
            f"tokenizer file {spec.tokenizer_path} does not exist; train it with `mula train-tokenizer` or set "
            "prepare.train_tokenizer."
        )

    @property
    def tokenizer_path(self) -> str | None:
        """The tokenizer the data was (or will be) tokenized with, if known, as `load_tokenizer` takes it:
        its name for a named tokenizer (`olmo`), else the path of its tokenizer.json."""
        summary_file = os.path.join(self.data_dir, SUMMARY_FILE)
        if os.path.isfile(summary_file):
            return recorded_tokenizer(self._read_summary())
        return expand_pattern(self.prepare_spec.tokenizer_path) if self.prepare_spec else None

    def validate_against(self, model_config: Any) -> None:
        """Check, before any expensive work, that this data can train a model with ``model_config``.

        ``model_config`` needs ``vocab_size`` and ``max_position_embeddings`` (a MulaConfig). Raises
        FileNotFoundError / ValueError (one sentence) for a missing or empty data directory (unless it will be
        prepared on first use), a tokenizer vocabulary larger than the model's, or ``seq_len`` beyond the
        model's positions.
        """
        max_pos = model_config.max_position_embeddings
        if self.seq_len > max_pos:
            raise ValueError(
                f"data seq_len {self.seq_len} exceeds the model's max_position_embeddings {max_pos}; "
                "lower data.seq_len or use a model with more positions."
            )
        vocab = self._tokenizer_vocab_size()
        model_vocab = model_config.vocab_size
        if vocab is not None and vocab > model_vocab:
            raise ValueError(
                f"the tokenizer has {vocab} tokens but the model's vocab_size is {model_vocab}; "
                "use a smaller tokenizer or a model with a larger vocabulary."
            )

    # ---- Lightning hooks --------------------------------------------------------------------------------

    @override
    def prepare_data(self) -> None:
        """Prepare data_dir from the `prepare` spec if it holds no prepared data yet (global rank 0 only)."""
        if self.prepare_spec is None or os.path.isfile(os.path.join(self.data_dir, SUMMARY_FILE)):
            return
        spec = self.prepare_spec
        tokenizer_path = expand_pattern(spec.tokenizer_path)
        named = named_tokenizer(tokenizer_path) is not None
        if not named and not os.path.exists(tokenizer_path) and spec.train_tokenizer is not None:
            t = spec.train_tokenizer
            log.info("training a %d-token BPE tokenizer -> %s", t.vocab_size, tokenizer_path)
            train_bpe(
                self._source_documents(),
                tokenizer_path,
                vocab_size=t.vocab_size,
                min_frequency=t.min_frequency,
                max_documents=t.max_documents,
                eos_token=t.eos_token,
            )
        prepare(
            spec.sources,
            tokenizer_path,
            self.data_dir,
            num_workers=spec.num_workers,
            skip_bad_records=spec.skip_bad_records,
            distributed=False,  # called on global rank 0 of a training job only
        )

    def _source_documents(self) -> Iterator[str]:
        """Documents of all sources of the `prepare` spec, source by source (tokenizer training text)."""
        assert self.prepare_spec is not None
        spec = self.prepare_spec
        for source in spec.sources:
            for file in expand_paths(source.paths, what=f"source {source.name!r}"):
                yield from iter_documents(
                    file,
                    format=source.format,
                    text_key=source.text_key,
                    skip_bad_records=spec.skip_bad_records,
                )

    @override
    def setup(self, stage: str | None = None) -> None:
        """Read the prepared data, fix this rank's batch layout and set the trainer's gradient accumulation."""
        summary = self._read_summary()
        self._configure_batches()
        names = [s["name"] for s in summary["sources"]]
        weights = [
            float((self.weights or {}).get(s["name"], s.get("weight", 1.0))) for s in summary["sources"]
        ]
        self._reader = WindowReader([os.path.join(self.data_dir, n) for n in names], self.seq_len + 1)
        windows = self._reader.num_windows()
        if sum(windows) == 0:
            raise ValueError(
                f"the data in {self.data_dir} has no sequence of seq_len + 1 = {self.seq_len + 1} tokens; "
                "lower seq_len or prepare more data."
            )
        self.order = MixtureOrder(names, windows, weights, self.val_samples, self.seed)
        self._summary = summary
        log.info(
            "data: %s windows of %d tokens, mixture %s, %d validation windows, %d micro-batches of %d per step "
            "on each of %d data-parallel ranks",
            sum(windows),
            self.seq_len + 1,
            {k: round(v, 4) for k, v in self.order.proportions().items()},
            sum(self.order.val_counts),
            self.layout.accumulation,
            self.micro_batch_size,
            self.layout.world_size,
        )

    def _configure_batches(self) -> None:
        """Fix this rank's batch layout (the split checked) and set the trainer's gradient accumulation."""
        rank, world = self.data_parallel_rank_world()
        micro_batches_per_step(self.global_batch_size, world, self.micro_batch_size)  # checks the split
        micro = self.micro_batch_size
        contract = mula_strategy(self.trainer.strategy) if self.trainer is not None else None
        if contract is not None and contract.consumes_whole_step:
            # Pipeline stages: one batch per step (this rank's whole share of the global batch); the
            # strategy cuts it into micro_batch_size pipeline micro-batches.
            micro = self.global_batch_size // world
        self.layout = BatchLayout(self.global_batch_size, micro, rank, world)
        trainer = self.trainer
        if trainer is not None:
            current = trainer.accumulate_grad_batches
            if current not in (1, self.layout.accumulation):
                raise ValueError(
                    f"trainer.accumulate_grad_batches={current} conflicts with the data module, which sets it to "
                    f"{self.layout.accumulation} from global_batch_size; remove it from the trainer settings."
                )
            trainer.accumulate_grad_batches = self.layout.accumulation
            module = trainer.lightning_module
            if isinstance(module, ConfiguredModule):
                self.validate_against(module.config)

    def _ready(self) -> tuple[WindowReader, MixtureOrder, BatchLayout]:
        if self._reader is None or self.order is None or self.layout is None:
            raise RuntimeError("MulaDataModule.setup() must run before its dataloaders are requested.")
        return self._reader, self.order, self.layout

    @override
    def train_dataloader(self) -> StatefulLoader:
        """Endless, resumable micro-batches of this rank (one Lightning epoch = one mixture epoch)."""
        reader, order, layout = self._ready()
        loader = StatefulLoader(TrainStream(reader, order, layout), num_workers=self.num_workers)
        if self._pending_state is not None:
            loader.load_state_dict(self._pending_state)
            self._pending_state = None
        elif self._train_loader is not None:  # reloaded dataloaders continue where the previous one stopped
            loader.load_state_dict(self._train_loader.state_dict())
        self._train_loader = loader
        return loader

    @override
    def val_dataloader(self) -> Any:
        """The held-out windows of this rank (the same windows for every seed); [] when val_samples is 0."""
        reader, order, layout = self._ready()
        stream = ValStream(reader, order, self.micro_batch_size, layout.rank, layout.world_size)
        if len(stream) == 0:
            return []
        from torch.utils.data import DataLoader

        return DataLoader(stream, batch_size=None, num_workers=min(self.num_workers, len(stream)))

    @override
    def test_dataloader(self) -> Any:
        """Same as the validation windows (the corpus has no separate test split)."""
        return self.val_dataloader()

    # ---- checkpointing ----------------------------------------------------------------------------------

    @override
    def state_dict(self) -> dict[str, Any]:
        """The training loader's position (Lightning also saves it with the loop state), the
        tokenizer of the data (its name, or the absolute path of its tokenizer.json), which `mula export-hf`
        ships with the model and `mula eval` reads with, and the training tokens seen so far (input tokens of
        completed global batches, which `mula eval` plots against)."""
        state: dict[str, Any] = {}
        if self._summary is not None:
            state[TOKENIZER_STATE_KEY] = recorded_tokenizer(self._summary)
        if self._train_loader is not None:
            state["train_loader"] = self._train_loader.state_dict()
            state[TOKENS_SEEN_KEY] = state["train_loader"]["samples"] * self.seq_len
        return state

    @property
    def tokens_seen(self) -> int | None:
        """Training tokens of the completed global batches so far (None before training has a loader)."""
        return self.state_dict().get(TOKENS_SEEN_KEY)

    @classmethod
    def tokenizer_path_in(cls, checkpoint: dict[str, Any]) -> str | None:
        """The tokenizer recorded in a Lightning checkpoint dict by `state_dict`: a named tokenizer's name or
        a tokenizer.json path (None if absent)."""
        state = checkpoint.get(cls.__qualname__)  # where Lightning keeps a data module's state_dict
        path = state.get(TOKENIZER_STATE_KEY) if isinstance(state, dict) else None
        return path if isinstance(path, str) else None

    @classmethod
    def tokens_seen_in(cls, checkpoint: dict[str, Any]) -> int | None:
        """The training tokens seen recorded in a Lightning checkpoint dict by `state_dict` (None if absent)."""
        state = checkpoint.get(cls.__qualname__)
        tokens = state.get(TOKENS_SEEN_KEY) if isinstance(state, dict) else None
        return tokens if isinstance(tokens, int) else None

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume the training loader at a saved position (applied when the loader is created)."""
        state = state_dict.get("train_loader")
        if state is None:
            return
        if self._train_loader is not None:
            self._train_loader.load_state_dict(state)
        else:
            self._pending_state = state
