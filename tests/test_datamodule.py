"""MulaDataModule: world-size-independent global batches, exact resume, mixtures, validation, bad inputs."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import lightning.pytorch as L
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from typing_extensions import get_protocol_members

from mula.data import MulaDataModule
from mula.data.loader import BatchLayout, StatefulLoader, TrainStream
from mula.data.prepare import SourceSpec, prepare
from mula.data.sampling import MixtureOrder, permute
from mula.data.tokenizer import load_tokenizer, train_tokenizer
from mula.training.strategy_contract import MulaStrategy

WORDS = [
    "the",
    "a",
    "mixture",
    "of",
    "experts",
    "routes",
    "each",
    "token",
    "to",
    "k",
    ";",
    "def",
    "return",
    "0",
    "1",
]
SEQ = 16


def make_docs(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 80))) for _ in range(n)]


def write_jsonl(path, docs) -> None:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """Two prepared sources ("big" ~3x "small", small upweighted 2x) and their token streams."""
    d = tmp_path_factory.mktemp("dm")
    write_jsonl(d / "big.jsonl", make_docs(150, seed=1))
    write_jsonl(d / "small.jsonl", make_docs(50, seed=2))
    tok = train_tokenizer(
        [str(d / "big.jsonl")], str(d / "tokenizer.json"), vocab_size=300, show_progress=False
    )
    sources = [
        SourceSpec("big", [str(d / "big.jsonl")]),
        SourceSpec("small", [str(d / "small.jsonl")], weight=2.0),
    ]
    prepare(sources, tok, str(d / "prepared"), num_workers=0, progress=False)
    from litdata import StreamingDataset
    from litdata.streaming.item_loader import TokensLoader

    streams = {}
    for name in ("big", "small"):
        ds = StreamingDataset(str(d / "prepared" / name), item_loader=TokensLoader(block_size=1))
        streams[name] = np.concatenate([ds[i] for i in range(len(ds))]).astype(np.int64)
    return SimpleNamespace(dir=str(d / "prepared"), root=d, tokenizer=tok, streams=streams)


def make_dm(data, **kw) -> MulaDataModule:
    args = {"seq_len": SEQ, "global_batch_size": 8, "micro_batch_size": 2, "val_samples": 6, "num_workers": 0}
    args["seed"] = 3
    args.update(kw)
    return MulaDataModule(data.dir, **args)


def rank_batches(data, rank: int, world: int, n_global: int, **kw) -> list[torch.Tensor]:
    """This rank's micro-batches of the first n_global global batches."""
    dm = make_dm(data, **kw)
    dm.set_data_parallel(rank, world)
    dm.setup("fit")
    it = iter(dm.train_dataloader())
    return [next(it) for _ in range(n_global * dm.layout.accumulation)]


def global_batches(data, world: int, micro: int, n_global: int, **kw) -> list[torch.Tensor]:
    """Global batches assembled from simulated ranks: rank-major concatenation of each step's micro-batches."""
    per_rank = [rank_batches(data, r, world, n_global, micro_batch_size=micro, **kw) for r in range(world)]
    acc = len(per_rank[0]) // n_global
    return [torch.cat([torch.cat(p[b * acc : (b + 1) * acc]) for p in per_rank]) for b in range(n_global)]


def test_permutation_is_a_bijection_and_keyed():
    for n in (1, 2, 3, 7, 64, 1000, 4099):
        p = permute(np.arange(n), n, key=11)
        assert sorted(p.tolist()) == list(range(n))
    assert not np.array_equal(permute(np.arange(100), 100, 1), permute(np.arange(100), 100, 2))
    np.testing.assert_array_equal(permute(np.arange(100), 100, 5), permute(np.arange(100), 100, 5))
    big = permute(np.arange(1000), 10**12, key=3)  # huge ranges need no memory
    assert len(set(big.tolist())) == 1000 and big.max() < 10**12


def test_mixture_order_proportions_and_heldout():
    m = MixtureOrder(["a", "b"], windows=[300, 100], weights=[1.0, 2.0], val_samples=20, seed=0)
    assert m.val_counts == [12, 8] and m.per_epoch == [288, 184]
    src, win = m.train(np.arange(2 * m.epoch_length))
    vs, vw = m.val()
    for s, k in ((0, 1), (1, 2)):
        for e in range(2):  # each mixture epoch: source a seen once, source b twice, no val window
            sel = src[e * m.epoch_length : (e + 1) * m.epoch_length] == s
            w = win[e * m.epoch_length : (e + 1) * m.epoch_length][sel]
            counts = np.bincount(w, minlength=m.windows[s])
            assert set(np.unique(counts[counts > 0])) == {k} and (counts > 0).sum() == m.train_counts[s]
            assert not set(vw[vs == s].tolist()) & set(w.tolist())
    # the validation split ignores the training seed; the training order does not
    m2 = MixtureOrder(["a", "b"], windows=[300, 100], weights=[1.0, 2.0], val_samples=20, seed=1)
    np.testing.assert_array_equal(m2.val()[1], vw)
    assert not np.array_equal(m2.train(np.arange(50))[1], win[:50])
    with pytest.raises(ValueError, match="too few to hold out"):
        MixtureOrder(["a"], windows=[5], weights=[1.0], val_samples=5, seed=0)


def test_same_global_batches_for_1_2_4_ranks(data):
    ref = global_batches(data, world=1, micro=2, n_global=5)  # accumulation 4
    assert ref[0].shape == (8, SEQ + 1) and ref[0].dtype == torch.long
    for world, micro in ((1, 8), (2, 2), (2, 4), (4, 1), (4, 2)):
        got = global_batches(data, world=world, micro=micro, n_global=5)
        for b, (x, y) in enumerate(zip(ref, got)):
            assert torch.equal(x, y), f"world={world} micro={micro} global batch {b}"
    other = global_batches(data, world=1, micro=2, n_global=1, seed=4)
    assert not torch.equal(ref[0], other[0])  # the seed matters, the world size does not


def test_windows_come_from_the_prepared_streams(data):
    dm = make_dm(data)
    dm.setup("fit")
    windows = {
        name: {tuple(s[i : i + SEQ + 1]) for i in range(0, len(s) - SEQ, SEQ + 1)}
        for name, s in data.streams.items()
    }
    it = iter(dm.train_dataloader())
    seen = {"big": 0, "small": 0}
    for _ in range(60):
        for row in next(it).tolist():
            hits = [n for n, w in windows.items() if tuple(row) in w]
            assert hits, "every sample is one aligned window of a source's token stream"
            seen[hits[0]] += 1
    # small has a third of big's windows but weight 2: about 40% of the samples (120 drawn here)
    frac = seen["small"] / sum(seen.values())
    assert abs(frac - dm.order.proportions()["small"]) < 0.15, seen
    assert dm.trainer is None and dm.layout.accumulation == 4
    from litdata import StreamingDataset
    from litdata.streaming.item_loader import TokensLoader

    lengths = [
        len(StreamingDataset(d, item_loader=TokensLoader(block_size=SEQ + 1))) for d in dm._reader.source_dirs
    ]
    assert dm._reader.num_windows() == lengths


def test_validation_windows_are_fixed_and_split_over_ranks(data):
    dm = make_dm(data, val_samples=7)
    dm.setup("validate")
    full = torch.cat(list(dm.val_dataloader()))
    assert full.shape == (7, SEQ + 1)
    other_seed = make_dm(data, val_samples=7, seed=99, num_workers=1)
    other_seed.setup("validate")
    assert torch.equal(torch.cat(list(other_seed.val_dataloader())), full)  # same windows for any seed
    parts = []
    for r in range(2):
        dm2 = make_dm(data, val_samples=7)
        dm2.set_data_parallel(r, 2)
        dm2.setup("validate")
        parts.append(torch.cat(list(dm2.val_dataloader())))
    assert parts[0].shape == parts[1].shape == (4, SEQ + 1)  # 7 windows padded to 2 x 4
    got = {tuple(x) for p in parts for x in p.tolist()}
    assert got == {tuple(x) for x in full.tolist()}
    no_val = make_dm(data, val_samples=0)
    no_val.setup("fit")
    assert no_val.val_dataloader() == []


def test_loader_state_round_trip_and_layout_change(data):
    dm = make_dm(data)
    dm.setup("fit")
    loader = dm.train_dataloader()
    it = iter(loader)
    seen = [next(it) for _ in range(7)]  # 1 global batch (4 micro) + 3 into the second
    state = loader.state_dict()
    assert state["samples"] == 8 and state["micro_in_batch"] == 3
    fresh = make_dm(data)
    fresh.setup("fit")
    fresh.load_state_dict(dm.state_dict())
    resumed = iter(fresh.train_dataloader())
    assert torch.equal(next(resumed), next(it))
    # another layout cannot resume mid-batch: it restarts that global batch from its first sample
    order, layout = dm.order, BatchLayout(8, 4, 0, 1)
    other = StatefulLoader(TrainStream(dm._reader, order, layout))
    other.load_state_dict(state)
    assert torch.equal(next(iter(other)), torch.cat(rank_batches(data, 0, 1, 2)[4:6]))
    assert torch.equal(torch.cat(seen[4:6]), torch.cat(rank_batches(data, 0, 1, 2)[4:6]))
    # a reloaded dataloader (reload_dataloaders_every_n_epochs) continues where the previous one stopped
    dm.train_dataloader()
    assert torch.equal(next(iter(dm.train_dataloader())), next(it))


class Recorder(L.LightningModule):
    """A tiny LM that records every micro-batch it trains on (and saves them per rank when asked)."""

    def __init__(self, vocab: int = 512, max_pos: int = 512, out: str | None = None) -> None:
        super().__init__()
        self.config = SimpleNamespace(vocab_size=vocab, max_position_embeddings=max_pos)
        self.emb = torch.nn.Embedding(vocab, 8)
        self.head = torch.nn.Linear(8, vocab)
        self.seen: list[torch.Tensor] = []
        self.out = out

    def training_step(self, batch, batch_idx):
        self.seen.append(batch.clone())
        logits = self.head(self.emb(batch[:, :-1]))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())

    def on_train_end(self) -> None:
        if self.out:
            torch.save(
                {"seen": self.seen, "accumulate": self.trainer.accumulate_grad_batches},
                f"{self.out}/rank{self.global_rank}.pt",
            )

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


FIT_DATA = {"global_batch_size": 4, "micro_batch_size": 2, "seq_len": 511}  # a few steps per epoch


def fit(data, max_steps: int, ckpt_dir=None, ckpt_path=None, every=None, num_workers=0) -> Recorder:
    model = Recorder()
    callbacks = []
    if every:
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=every, save_top_k=-1))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(every),
        callbacks=callbacks,
        limit_val_batches=0,
    )
    trainer.fit(model, datamodule=make_dm(data, num_workers=num_workers, **FIT_DATA), ckpt_path=ckpt_path)
    assert trainer.accumulate_grad_batches == 2 and trainer.global_step == max_steps
    return model


@pytest.mark.parametrize("where,num_workers", [("epoch_end", 0), ("mid_epoch", 1)])
def test_resume_continues_exactly(data, tmp_path, where, num_workers):
    dm = make_dm(data, **FIT_DATA)
    dm.setup("fit")
    steps_per_epoch = len(dm.train_dataloader()) // 2
    assert 2 <= steps_per_epoch <= 5
    stop_at = steps_per_epoch if where == "epoch_end" else steps_per_epoch + 1
    total = 2 * steps_per_epoch + 2  # crosses two epoch ends
    full = fit(data, max_steps=total)
    assert len(full.seen) == 2 * total
    assert len({tuple(b.flatten().tolist()) for b in full.seen}) > total  # real, changing data
    fit(data, max_steps=total, ckpt_dir=tmp_path, every=stop_at, num_workers=num_workers)
    ckpt = tmp_path / f"epoch={(stop_at - 1) // steps_per_epoch}-step={stop_at}.ckpt"
    assert ckpt.exists(), sorted(p.name for p in tmp_path.iterdir())
    resumed = fit(data, max_steps=total, ckpt_path=str(ckpt), num_workers=num_workers)
    assert len(resumed.seen) == 2 * (total - stop_at)
    for i, (a, b) in enumerate(zip(full.seen[2 * stop_at :], resumed.seen)):
        assert torch.equal(a, b), f"micro-batch {i} after resuming at step {stop_at}"


def _ddp_worker_dir(tmp_path):
    d = tmp_path / "ddp"
    d.mkdir()
    return d


def test_two_process_ddp_sees_the_single_process_global_batches(data, tmp_path):
    out = _ddp_worker_dir(tmp_path)
    model = Recorder(out=str(out))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp_spawn",
        max_steps=3,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
    )
    trainer.fit(model, datamodule=make_dm(data))
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)]
    assert [r["accumulate"] for r in ranks] == [2, 2]  # 8 / (2 ranks x 2)
    ddp = [torch.cat([torch.cat(r["seen"][b * 2 : (b + 1) * 2]) for r in ranks]) for b in range(3)]
    ref = global_batches(data, world=1, micro=2, n_global=3)
    for b in range(3):
        assert torch.equal(ddp[b], ref[b]), f"global batch {b}"


def test_bad_inputs_fail_with_one_sentence(data, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"data directory .*nowhere does not exist; prepare it"):
        MulaDataModule(str(tmp_path / "nowhere"), seq_len=SEQ).setup("fit")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"data directory .*empty is empty"):
        MulaDataModule(str(tmp_path / "empty"), seq_len=SEQ).validate_against(
            SimpleNamespace(vocab_size=10**6, max_position_embeddings=SEQ)
        )
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x.txt").write_text("x")
    with pytest.raises(ValueError, match=r"holds no prepared data \(no summary.json\)"):
        MulaDataModule(str(tmp_path / "other"), seq_len=SEQ).setup("fit")

    vocab = load_tokenizer(data.tokenizer).vocab_size
    dm = make_dm(data)
    dm.validate_against(SimpleNamespace(vocab_size=vocab, max_position_embeddings=SEQ))
    with pytest.raises(
        ValueError, match=f"the tokenizer has {vocab} tokens but the model's vocab_size is 100"
    ):
        dm.validate_against(SimpleNamespace(vocab_size=100, max_position_embeddings=SEQ))
    with pytest.raises(ValueError, match=f"data seq_len {SEQ} exceeds the model's max_position_embeddings 8"):
        dm.validate_against(SimpleNamespace(vocab_size=vocab, max_position_embeddings=8))
    with pytest.raises(
        ValueError, match="global_batch_size 8 is not divisible by data-parallel world size 3"
    ):
        dm.set_data_parallel(0, 3)
        dm.setup("fit")
    with pytest.raises(ValueError, match=r"weights name unknown sources \['nope'\]"):
        make_dm(data, weights={"nope": 1.0}).setup("fit")
    with pytest.raises(ValueError, match="no sequence of seq_len"):
        make_dm(data, seq_len=10**6, val_samples=0).setup("fit")

    # the trainer runs the same checks before the first step
    model = Recorder(vocab=100)
    trainer = L.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_progress_bar=False)
    with pytest.raises(ValueError, match="vocab_size is 100"):
        trainer.fit(model, datamodule=make_dm(data))
    assert model.seen == []
    trainer = L.Trainer(accelerator="cpu", max_steps=1, logger=False, accumulate_grad_batches=3)
    with pytest.raises(ValueError, match="accumulate_grad_batches=3 conflicts"):
        trainer.fit(Recorder(), datamodule=make_dm(data))


def test_prepare_on_first_use(tmp_path):
    write_jsonl(tmp_path / "web.jsonl", make_docs(60, seed=7))
    (tmp_path / "code").mkdir()
    for i in range(5):
        (tmp_path / "code" / f"m{i}.py").write_text("\n".join(make_docs(3, seed=20 + i)))
    spec = {
        "sources": [
            {"name": "web", "paths": [str(tmp_path / "web.jsonl")]},
            {"name": "code", "paths": [str(tmp_path / "code/*.py")], "format": "text", "weight": 0.5},
        ],
        "tokenizer_path": str(tmp_path / "tok" / "tokenizer.json"),
        "train_tokenizer": {"vocab_size": 300},
        "num_workers": 0,
    }
    dm = MulaDataModule(
        str(tmp_path / "data"),
        seq_len=SEQ,
        global_batch_size=4,
        micro_batch_size=4,
        val_samples=8,
        prepare=spec,
    )
    dm.validate_against(SimpleNamespace(vocab_size=300, max_position_embeddings=SEQ))  # fine before preparing
    with pytest.raises(ValueError, match="the tokenizer has 300 tokens"):
        dm.validate_against(SimpleNamespace(vocab_size=299, max_position_embeddings=SEQ))
    dm.prepare_data()
    tok = load_tokenizer(tmp_path / "tok" / "tokenizer.json")
    summary = json.loads((tmp_path / "data" / "summary.json").read_text())
    assert [s["name"] for s in summary["sources"]] == ["web", "code"] and summary["tokenizer"][
        "vocab_size"
    ] == 300
    assert tok.vocab_size == 300 and dm.tokenizer_path == tok.path
    dm.setup("fit")
    assert next(iter(dm.train_dataloader())).shape == (4, SEQ + 1)
    mtime = (tmp_path / "data" / "summary.json").stat().st_mtime_ns
    dm.prepare_data()  # prepared already: nothing to do
    assert (tmp_path / "data" / "summary.json").stat().st_mtime_ns == mtime
    assert dm.prepare_spec.sources[1].weight == 0.5


def test_a_pipeline_strategy_gets_each_step_whole(data):
    """A strategy with pipeline stages (`consumes_whole_step`) gets a data-parallel rank's share of each
    global batch as one batch -- the rows of its accumulation micro-batches, in order -- and learns the
    number of micro-batches per step from its rows and micro_batch_size (the data module writes nothing
    into the strategy); Lightning then accumulates nothing."""
    # a strategy with Mula's whole strategy contract, of which the data module reads these three
    contract = {name: lambda *args, **kwargs: None for name in get_protocol_members(MulaStrategy)}
    pipeline = {"consumes_whole_step": True, "data_parallel_rank": 1, "data_parallel_size": 2}
    strategy = SimpleNamespace(**{**contract, **pipeline})
    before = dict(vars(strategy))
    dm = make_dm(data)
    dm.trainer = SimpleNamespace(strategy=strategy, accumulate_grad_batches=1, lightning_module=None)
    dm.setup("fit")
    assert dm.trainer.accumulate_grad_batches == 1 and vars(strategy) == before
    it = iter(dm.train_dataloader())
    whole = [next(it) for _ in range(3)]
    assert whole[0].shape[0] // dm.micro_batch_size == 2
    micro = rank_batches(data, 1, 2, 3)  # the same rank without stages: 2 micro-batches per step
    for step in range(3):
        assert torch.equal(whole[step], torch.cat(micro[2 * step : 2 * step + 2]))
