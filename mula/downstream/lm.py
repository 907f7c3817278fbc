"""`MulaLM`: an lm-evaluation-harness model class that scores text with a `Mula` model directly.

No export step: the model runs on whatever device it is on (CPU, CUDA, XPU), under an optional
autocast dtype, with the tokenizer the run trained with (`mula.data.tokenizer.LoadedTokenizer`,
encoding text exactly as `mula prepare` did). It implements the log-likelihood requests that
multiple-choice and perplexity tasks make (`loglikelihood`, `loglikelihood_rolling`) the way
lm-eval's Hugging Face class does: the same context/continuation split, the same prefix token for an
empty context (BOS when the tokenizer names one, else EOS, the token Mula's documents end with),
the same left truncation to the model's positions. Generation tasks are refused.

With `data_parallel=True` inside a torch.distributed process group, every rank holds the whole model
and lm-eval splits the documents over the ranks (`rank`, `world_size`, and the `all_gather`,
`gather_object` and `barrier` it calls); rank 0 receives the results.

With a `spread` model (`SpreadModel`: experts, pipeline stages, tensor shards or sequence slices on
other ranks, as the training strategy laid them out) lm-eval runs on every rank and splits the
documents over the *data-parallel* ranks; the ranks that share a data-parallel index (one per stage,
one per tensor shard, one per context-parallel slice) build the same requests in the same order, so
they run the same batches together. Ranks with different documents forward in lock step: before each
forward every rank says whether it has a batch (`SpreadModel.any_active`, one small all-reduce) and a
rank without one, waiting at one of lm-eval's gathers or barriers, runs a one-token dummy batch, so
every expert all-to-all has all its ranks; the last stage's scores are sent to the other stages
(`SpreadModel.share`). Global rank 0 receives the results.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM

from mula.data.tokenizer import LoadedTokenizer
from mula.model.transformer import Mula

# One scored request: ((context, continuation) strings or None, context token ids, continuation token ids)
TokenRequest = tuple[tuple[str, str] | None, list[int], list[int]]


class SpreadModel(Protocol):
    """A model whose pieces live on several ranks (the training layout): how `MulaLM` runs it.

    Implemented by the training strategy (`strategies.eval_forward.SpreadForward`); every method is a
    collective over the ranks named in its docstring.
    """

    device: torch.device
    data_parallel_rank: int  # lm-eval's rank: which share of the documents this rank scores
    data_parallel_size: int
    data_parallel_group: Any  # the ranks lm-eval gathers over (None: the default group)

    def any_active(self, active: bool) -> bool:
        """Whether any rank of the job has a batch to forward now (all ranks)."""
        ...

    def logits(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """Forward of token ids [B, T] (all ranks): full logits [B, T, V] where the LM head is, else None."""
        ...

    def share(self, scores: torch.Tensor) -> torch.Tensor:
        """The scores computed where the logits are, on every rank that ran this forward."""
        ...

    def close(self) -> None:
        """The evaluation is over: release what was kept for its batch shapes (this rank)."""
        ...


class GenerationNotSupported(ValueError):
    """A task asked Mula's lm-eval model to generate text (a ValueError: `mula` prints one line, exit 2)."""


class MulaLM(TemplateLM):
    """lm-eval model over an in-memory `Mula` (`loglikelihood`, `loglikelihood_rolling`).

    Args:
        model: The model, already on its device; it is put in eval mode while scoring and restored after.
        tokenizer: The run's tokenizer.
        batch_size: Sequences per forward pass.
        autocast_dtype: Run the forward under `torch.autocast(device, dtype)` (e.g. bf16 on a GPU); None: as stored.
        prefix_token_id: Token that stands for an empty context; default BOS if the tokenizer names one, else EOS.
        data_parallel: Split the documents over the ranks of the default process group (when there is one).
        on_batch: Called after every forward pass (e.g. to feed a hang watchdog during a long evaluation).
        spread: The model's pieces on other ranks and how to run them together (`SpreadModel`); `model`
            is then this rank's part of it (its config, its train/eval mode), and the documents are split
            over `spread`'s data-parallel ranks.
    """

    def __init__(
        self,
        model: Mula,
        tokenizer: LoadedTokenizer,
        batch_size: int = 8,
        autocast_dtype: torch.dtype | None = None,
        prefix_token_id: int | None = None,
        data_parallel: bool = False,
        on_batch: Callable[[], None] | None = None,
        spread: SpreadModel | None = None,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}.")
        self.model = model
        self.mula_tokenizer = tokenizer
        self._batch_size = batch_size
        self.autocast_dtype = autocast_dtype
        self._prefix_token_id = tokenizer.eos_id if prefix_token_id is None else prefix_token_id
        self._on_batch = on_batch
        self.spread = spread
        self._group = None  # lm-eval's gathers: the default group, or the spread model's data-parallel ranks
        if spread is not None:
            self._device = spread.device
            self._rank, self._world_size = spread.data_parallel_rank, spread.data_parallel_size
            self._group = spread.data_parallel_group
        else:
            self._device = next(model.parameters()).device
            if data_parallel and dist.is_available() and dist.is_initialized():
                self._rank, self._world_size = dist.get_rank(), dist.get_world_size()

    @property
    def eot_token_id(self) -> int:
        """The end-of-document token."""
        return self.mula_tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        """The token that conditions a continuation scored without context."""
        return self._prefix_token_id

    @property
    def max_length(self) -> int:
        """Longest sequence the model scores at once (its positions)."""
        return self.model.config.max_position_embeddings

    @property
    def tokenizer_name(self) -> str:
        """Identifies the tokenizer in lm-eval's request cache."""
        return str(self.mula_tokenizer.path).replace("/", "__")

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's `tensor`, concatenated along a new first dimension (lm-eval gathers request counts)."""
        if self.world_size == 1:
            return tensor
        self._drain()
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor, group=self._group)
        return torch.stack(parts)

    def gather_object(self, obj: object, dst: int = 0) -> list[object] | None:
        """Every rank's `obj` on rank `dst` (None elsewhere)."""
        if self.world_size == 1:
            return [obj]
        self._drain()
        out: list[object] | None = [None] * self.world_size if self.rank == dst else None
        root = dst if self._group is None else dist.get_global_rank(self._group, dst)
        dist.gather_object(obj, out, dst=root, group=self._group)
        return out

    def barrier(self) -> None:
        """Wait for every rank."""
        if self.world_size > 1:
            self._drain()
            dist.barrier(group=self._group)

    @torch.no_grad()
    def _drain(self) -> None:
        """A spread model: run one-token dummy batches while another rank still forwards real ones (every
        rank must take part in every expert all-to-all and pipeline hand-over), until none does."""
        if self.spread is None:
            return
        with self._scoring():
            while self.spread.any_active(False):
                self.spread.logits(torch.zeros(1, 1, dtype=torch.long, device=self._device))
                if self._on_batch is not None:
                    self._on_batch()

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """Token ids of `string` as Mula's data preparation encodes text (no special tokens added)."""
        return self.mula_tokenizer.tokenizer.encode(string, add_special_tokens=False).ids

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of whole documents, in windows of the model's length (as lm-eval's HF class)."""
        results = []
        for (string,) in (req.args for req in requests):
            windows = [
                (None, *lm_utils.make_disjoint_window(w))
                for w in lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                )
            ]
            total = sum(ll for ll, _ in self._loglikelihood_tokens(windows, disable_tqdm=True))
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
            results.append(total)
        return results

    def score_tokens(self, requests: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[float]:
        """Sum of log p(continuation | context) of each (context ids, continuation ids), encoded apart.

        The query is context + continuation without its last token, cut from the left to the model's
        positions (what OLMo's in-loop evaluation and lm-eval feed the model); an empty context is the
        prefix token, as lm-eval's `loglikelihood` makes it. Every rank of a spread model calls this (with
        its own share, possibly empty); the ranks keep forwarding in lock step at the next gather.
        """
        tokens: list[TokenRequest] = []
        for ctx, cont in requests:
            if not cont:
                raise ValueError("a scored continuation needs at least one token.")
            tokens.append((None, list(ctx) or [self.prefix_token_id], list(cont)))
        return [ll for ll, _ in self._loglikelihood_tokens(tokens, disable_tqdm=True)]

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Refused: Mula's lm-eval model scores log-likelihoods only."""
        raise GenerationNotSupported(
            "Mula's lm-eval model scores log-likelihoods only (multiple-choice and perplexity tasks); "
            "generation tasks (output_type generate_until) are not supported."
        )

    @torch.no_grad()
    def _loglikelihood_tokens(
        self, requests: list[TokenRequest], disable_tqdm: bool = False, **kwargs
    ) -> list[tuple[float, bool]]:
        """(sum of log p(continuation | context), whether greedy decoding yields the continuation) per request.

        Longest first, so that a batch pads little; inputs are padded on the right, which a causal
        model never attends to.
        """
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        with self._scoring():
            for start in range(0, len(order), self._batch_size):
                batch = order[start : start + self._batch_size]
                if self.spread is not None:
                    self.spread.any_active(True)  # the other ranks forward with this one
                for i, answer in zip(batch, self._score_batch([requests[i] for i in batch])):
                    results[i] = answer
                    if requests[i][0] is not None:
                        self.cache_hook.add_partial("loglikelihood", requests[i][0], answer)
                if self._on_batch is not None:
                    self._on_batch()
        return results  # type: ignore[return-value]

    def _score_batch(self, requests: list[TokenRequest]) -> list[tuple[float, bool]]:
        # the last max_length + 1 tokens of context + continuation; the final token is only a target
        inputs = [(ctx + cont)[-(self.max_length + 1) :][:-1] for _, ctx, cont in requests]
        width = max(len(x) for x in inputs)
        batch = torch.zeros(len(inputs), width, dtype=torch.long)
        for row, x in enumerate(inputs):
            batch[row, : len(x)] = torch.tensor(x, dtype=torch.long)
        batch = batch.to(self._device)
        logits = self.model(batch).logits if self.spread is None else self.spread.logits(batch)
        # [log p(continuation), 1 if greedy decoding yields it]: fp32, as one tensor to share
        scores = torch.zeros(len(requests), 2, dtype=torch.float32, device=self._device)
        for row, ((_, _, cont), x) in enumerate(zip(requests, inputs)):
            if logits is None:
                break  # a pipeline stage without the LM head: the last stage's scores arrive below
            scored = logits[row, len(x) - len(cont) : len(x)].float().log_softmax(dim=-1)
            target = torch.tensor(cont, dtype=torch.long, device=scored.device)
            scores[row, 0] = scored.gather(-1, target[:, None]).sum()
            scores[row, 1] = (scored.argmax(dim=-1) == target).all()
        if self.spread is not None:
            scores = self.spread.share(scores)
        return [(logprob, bool(greedy)) for logprob, greedy in scores.tolist()]

    @contextlib.contextmanager
    def _scoring(self) -> Iterator[None]:
        """Eval mode and the autocast dtype for the duration; the model's mode is restored after."""
        was_training = self.model.training
        self.model.eval()
        autocast = (
            torch.autocast(self._device.type, dtype=self.autocast_dtype)
            if self.autocast_dtype is not None
            else contextlib.nullcontext()
        )
        try:
            with autocast:
                yield
        finally:
            self.model.train(was_training)
