"""Score OLMo's in-loop tasks with a `MulaLM`, as OLMo scores them (`olmo_eval.ICLMetric`), on any layout.

Per choice, Mula scores the sum of log p(continuation | context) with `MulaLM.score_tokens`: context and
continuation encoded apart, the query (context + continuation without its last token) cut from the
left to the model's positions, as OLMo's samples are. Then, per document, as `ICLMetric.compute`:

* the value each choice is ranked by (`choice_scores`): the sum (metric acc, f1), or the sum divided by
  the continuation's characters, its leading space included (len_norm; also ce_loss and bpb tasks);
* acc / len_norm: whether the first choice of the highest value (torch.argmax) is the answer;
  f1 (MRPC): OLMo's F1 with choice 0 as the positive label; ce_loss, bpb tasks: their one continuation's;
* `ce_loss` = -sum / characters and `bpb` = -sum / bytes * log2(e) of the answer (OLMo's "v2": the
  leading space counted), logged with acc and len_norm.

Documents are split over the data-parallel ranks of `MulaLM` (every choice of a document on one rank,
document i of a task on rank i mod ranks); a rank whose share is short, or empty, keeps forwarding in
lock step (`MulaLM.score_tokens`, then its gather); rank 0 receives every score and computes the metrics
in document order. Each task's result holds, beside its metrics, one record per document: its doc_id, the
answer (`target`), and per choice (in cont_id order) the summed log-likelihood, tokens, bytes and
characters, which is what comparing two runs, or two implementations, example by example needs.
"""

from __future__ import annotations

from typing import Any

import torch

from mula.downstream.lm import MulaLM
from mula.downstream.olmo_tasks import OLMO_HARNESS, Document, OlmoTasks

LOG_2_OF_E = 1.44269504089  # olmo_eval.metrics.LOG_2_OF_E, the value OLMo's bpb multiplies by
# metric types whose choices are ranked by log-likelihood per character (ICLMetric.update)
PER_CHARACTER = ("len_norm", "ce_loss", "bpb")


def choice_scores(loglikelihoods: torch.Tensor, chars: torch.Tensor, metric_type: str) -> torch.Tensor:
    """The values ICLMetric ranks a document's choices by (fp32, as it computes them): the summed
    log-likelihoods, per character of the continuation (leading space included) for len_norm."""
    return loglikelihoods / chars if metric_type in PER_CHARACTER else loglikelihoods


def document_values(doc: Document, loglikelihoods: list[float], metric_type: str) -> dict[str, Any]:
    """One document's prediction, and its answer's ce_loss and bpb, from its choices' summed log-likelihoods."""
    sums = torch.tensor(loglikelihoods, dtype=torch.float32)
    chars = torch.tensor([c.chars for c in doc.choices])
    scores = choice_scores(sums, chars, metric_type)
    gold = doc.label
    nbytes = torch.tensor(doc.choices[gold].bytes)
    return {
        "prediction": int(torch.argmax(scores).item()),
        "ce_loss": float((-sums[gold] / chars[gold]).item()),
        "bpb": float((-sums[gold] / nbytes * LOG_2_OF_E).item()),
    }


def task_metrics(metric_type: str, docs: list[Document], values: list[dict[str, Any]]) -> dict[str, float]:
    """The task's metrics from its documents' values (`document_values`), as ICLMetric.compute reports
    them: {metric type: value} with, for acc and len_norm, ce_loss and bpb of the answers."""
    n = len(docs)
    ce_loss = sum(v["ce_loss"] for v in values) / n
    bpb = sum(v["bpb"] for v in values) / n
    if metric_type == "ce_loss":
        return {"ce_loss": ce_loss}
    if metric_type == "bpb":
        return {"bpb": bpb}
    if metric_type == "f1":
        return {"f1": _f1([d.label for d in docs], [v["prediction"] for v in values], positive=0)}
    accuracy = sum(v["prediction"] == d.label for d, v in zip(docs, values)) / n
    return {metric_type: accuracy, "ce_loss": ce_loss, "bpb": bpb}


def _f1(labels: list[int], predictions: list[int], positive: int) -> float:
    """ICLMetric.custom_f1_score: F1 of the `positive` class (0 without true or predicted positives)."""
    tp = sum(y == positive and p == positive for y, p in zip(labels, predictions))
    fp = sum(y != positive and p == positive for y, p in zip(labels, predictions))
    fn = sum(y == positive and p != positive for y, p in zip(labels, predictions))
    if tp + fp == 0 or tp + fn == 0:
        return 0.0
    precision, recall = tp / (tp + fp), tp / (tp + fn)
    return 0.0 if precision + recall == 0 else 2 * precision * recall / (precision + recall)


def evaluate_olmo(lm: MulaLM, tasks: OlmoTasks, limit: int | float | None = None) -> dict[str, Any]:
    """{label: {"harness", "metric_type", "max_documents", "documents", "metrics", "samples"}} on rank 0 of `lm`'s
    data-parallel ranks ({} on the others, which must all call this); see the module docstring.

    `limit`: the first N documents of each task (a fraction of them below 1), as lm-eval's limit.
    """
    built = tasks.build(lm.mula_tokenizer, lm.max_length)
    selected = {label: task.select(limit, tasks.max_documents.get(label)) for label, task in built.items()}
    mine = [
        (label, i, choice)
        for label, docs in selected.items()
        for i in range(lm.rank, len(docs), lm.world_size)
        for choice in docs[i].choices
    ]
    scores = lm.score_tokens([(choice.context, choice.continuation) for _, _, choice in mine])
    share = [(label, i, choice.cont_id, score) for (label, i, choice), score in zip(mine, scores)]
    gathered = lm.gather_object(share, dst=0)
    if gathered is None:
        return {}
    found: dict[str, dict[int, dict[int, float]]] = {label: {} for label in selected}
    for label, i, cont_id, score in (item for part in gathered for item in part):  # type: ignore[union-attr]
        found[label].setdefault(i, {})[cont_id] = score
    results = {}
    for label, docs in selected.items():
        metric_type = built[label].metric_type
        lls = [[found[label][i][c.cont_id] for c in doc.choices] for i, doc in enumerate(docs)]
        values = [document_values(doc, ll, metric_type) for doc, ll in zip(docs, lls)]
        results[label] = {
            "harness": OLMO_HARNESS,
            "metric_type": metric_type,
            "max_documents": tasks.max_documents.get(label),
            "documents": len(docs),
            "metrics": task_metrics(metric_type, docs, values),
            "samples": [_record(doc, ll) for doc, ll in zip(docs, lls)],
        }
    return results


def _record(doc: Document, loglikelihoods: list[float]) -> dict[str, Any]:
    """A document's per-example record: per choice (cont_id order) its summed log-likelihood, tokens,
    bytes and characters."""
    return {
        "doc_id": doc.doc_id,
        "target": doc.label,
        "loglikelihoods": loglikelihoods,
        "tokens": [len(c.continuation) for c in doc.choices],
        "bytes": [c.bytes for c in doc.choices],
        "chars": [c.chars for c in doc.choices],
    }
