"""`MulaLightningModule`: the training loop's view of a Mula model.

Loss = cross-entropy + `router_aux_loss_coef` * load-balancing loss + `router_z_loss_coef` * z-loss
(both coefficients live in `MulaConfig`, so a recipe changes them with `overrides`). AdamW with a
linear warmup from `min_lr` to `lr`, then a cosine decay back to `min_lr` (`mula.training.lr_schedule`).
Gradient clipping is the Trainer's (`gradient_clip_val` in the recipe) so that strategies can clip
sharded gradients.

With `optimizer="muon"` the blocks' matrices train with Muon and the rest with AdamW, in one optimizer
under the same lr schedule (Moonlight's rule, `mula.training.muon`, docs/muon.md).

Weight decay follows OLMo-core (the OLMo 2 / OLMoE training code): every parameter is decayed
except the token embedding (`no_decay=["embed.weight"]`). Norm weights are decayed too; the paper's
recipes use the same single weight decay of 0.1.

Validation logs `val/loss` (mean cross-entropy in nats per target token), `val/ppl` = exp(val/loss) and
`val/bpb`, bits per UTF-8 byte of the same targets (`mula.training.bits_per_byte`), which compares runs
with different tokenizers. `val/bpb` needs the run's tokenizer: the data module's `tokenizer_path`
(`MulaDataModule` records the one its data was prepared with). With no tokenizer recorded (synthetic data,
plain dataloaders), or one whose bytes per token are not defined (not byte-level) or that cannot be
loaded any more, `val/bpb` is not logged and `val/loss` is unchanged.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor
from typing_extensions import override

from mula.layout.rules import check_master_weights as rules_check_master_weights
from mula.model.compile import CompileWatch, compile_blocks, parse_compile, rank_cache_dir, use_cache_dir
from mula.model.config import MulaConfig, resolve_config
from mula.model.moe import iter_moe_layers
from mula.model.moe.balancing import step_counts, update_router_bias
from mula.model.mtp import check_mtp_sequence, mtp_cross_entropy, shifted_ids, shifted_targets
from mula.model.transformer import Mula, parse_activation_checkpointing
from mula.training.bits_per_byte import BitsPerByte, TokenizedData, target_bytes, tokenizer_byte_table
from mula.training.host_allocator import reuse_freed_host_memory
from mula.training.lightning_compat import FullPrecisionMean, ends_optimizer_step, logs_train_step
from mula.training.lr_schedule import lr_factor
from mula.training.lr_schedule import warmup_cosine as warmup_cosine  # re-exported: tests import it here
from mula.training.muon import MulaMuon, check_muon_options, optimizer_param_groups
from mula.training.strategy_contract import MulaStrategy, mula_strategy

OPTIMIZERS = ("adamw", "muon")
# The per-step loss metrics, in the order of the all-reduced vector (see `_log_step_losses`); the MTP loss
# (`mtp_loss_weight` not applied) only with multi-token prediction, as the last entry.
STEP_LOSSES = ("train/loss", "train/ce_loss", "train/aux_loss", "train/z_loss", "train/mtp_loss")


class MulaLightningModule(L.LightningModule):
    """Trains a `Mula` language model (dense or MoE) on batches of token ids [B, seq_len + 1].

    Args:
        config: A preset name (`mula-tiny-moe`, `mula-7b-a1b`, ...) or a `MulaConfig`.
        overrides: `MulaConfig` fields replacing the preset's, e.g. `{num_layers: 2}`.
        lr: Peak learning rate, reached after `warmup_steps`.
        min_lr: Learning rate at step 0 and at the end of the cosine decay.
        warmup_steps: Optimizer steps of linear warmup from `min_lr` to `lr`.
        decay_steps: Step at which the cosine reaches `min_lr`; default: the Trainer's `max_steps`
            (or its estimated number of optimizer steps when `max_steps` is unset).
        weight_decay: AdamW weight decay (decoupled) of every parameter not matched by `no_decay`.
        betas: AdamW betas.
        eps: AdamW epsilon.
        no_decay: Glob patterns of `Mula` parameter names trained without weight decay.
        init_weights: A Mula weights file (`mula import-hf` output, `.pt`) or a Lightning `.ckpt` of
            this module to start from instead of a random initialisation.
        verify_init_weights: Verify `init_weights` against its manifest when the module is created
            and refuse a corrupted or incomplete one (`mula.checkpoint.verify_for_reading`; in a multi-rank
            launch the checksums wait for the process group and each file is read by one rank,
            `mula.checkpoint.group_verify`); on the command line this is `--verify`.
        activation_checkpointing: What backward recomputes instead of keeping in memory: "none",
            "full" (every block) or a list of block parts among "moe", "attention", "norms", e.g.
            `[moe, attention]`. Gradients are unchanged; a training setting, not the architecture.
        optimizer: "adamw" (every parameter) or "muon": Muon for the blocks' matrices, AdamW for the
            embedding, LM head and norms, with the same lr, schedule and weight decay (docs/muon.md).
        muon_momentum: Muon's (Nesterov) momentum.
        muon_ns_steps: Newton-Schulz iterations per Muon update.
        muon_adjust_lr: Muon's update scale: "match_rms_adamw" (0.2 * sqrt(max(m, n)), Moonlight's: AdamW's
            lr and weight decay carry over) or "original" (sqrt(max(1, m / n)), Keller Jordan's).
        muon_ns_dtype: What Newton-Schulz runs in: "bfloat16" (torch's, Moonlight's) or "float32".
        compile: `torch.compile` each transformer block: false, true, or a mapping of
            `mula.model.compile.CompileSettings` fields (`mode`, `dynamic`, `fullgraph`, `backend`, `options`,
            `cache_dir`, `warmup_steps`); applied when training starts, after the strategy laid the
            model out (docs/compile.md). Parameter names are unchanged.
    """

    def __init__(
        self,
        config: str | MulaConfig = "mula-tiny-moe",
        overrides: dict[str, Any] | None = None,
        lr: float = 4e-4,
        min_lr: float = 4e-5,
        warmup_steps: int = 2500,
        decay_steps: int | None = None,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        no_decay: Sequence[str] = ("embed.weight",),
        init_weights: str | None = None,
        verify_init_weights: bool = True,
        activation_checkpointing: str | list[str] = "none",
        compile: bool | dict[str, Any] = False,
        optimizer: str = "adamw",
        muon_momentum: float = 0.95,
        muon_ns_steps: int = 5,
        muon_adjust_lr: str = "match_rms_adamw",
        muon_ns_dtype: str = "bfloat16",
    ) -> None:
        super().__init__()
        self.config = resolve_config(config, overrides)
        if isinstance(config, MulaConfig):
            # hyperparameters must be plain data: checkpoints are read with torch.load(weights_only=True)
            config = dataclasses.asdict(config)
        if not 0.0 <= min_lr <= lr:
            raise ValueError(f"min_lr must be in [0, lr={lr}], got {min_lr}.")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}.")
        parse_activation_checkpointing(activation_checkpointing)  # refuse an unknown part now
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}.")
        check_muon_options(muon_momentum, muon_ns_steps, muon_adjust_lr, muon_ns_dtype)
        self.optimizer = optimizer
        self.muon_options = {
            "momentum": muon_momentum, "ns_steps": muon_ns_steps,
            "adjust_lr": muon_adjust_lr, "ns_dtype": muon_ns_dtype,
        }  # fmt: skip
        self.activation_checkpointing = activation_checkpointing
        self.compile_settings = parse_compile(compile)  # refuse a bad setting now
        self._compile_watch: CompileWatch | None = None
        if init_weights is not None:
            # here, before any work, rather than when the model is built
            from mula.checkpoint import verify_for_reading  # imported lazily: only needed with init_weights
            from mula.checkpoint.group_verify import launch_world_size

            # In a multi-rank launch the checksums wait for the process group (`_load_init_weights`),
            # where each file is read by one rank instead of every process reading all of it here.
            verify_for_reading(init_weights, verify_init_weights, defer=launch_world_size() > 1)
        self.lr, self.min_lr, self.warmup_steps, self.decay_steps = lr, min_lr, warmup_steps, decay_steps
        self.weight_decay, self.betas, self.eps = weight_decay, tuple(betas), eps
        self.no_decay = list(no_decay)
        self.init_weights = init_weights
        self.save_hyperparameters()
        self.model: Mula | None = None  # built in configure_model (possibly on meta / sharded)
        self.val_loss = FullPrecisionMean()  # float32 sums under bf16-true's cast of the module
        self.val_bpb = BitsPerByte()
        # token id -> UTF-8 bytes of the run's tokenizer, on the device (None: val/bpb is not logged), and
        # the tokenizer it was built from; built once per tokenizer (`_load_token_bytes`), never per batch
        self._token_bytes: Tensor | None = None
        self._token_bytes_of: str | None = None
        self._batch_shape: tuple[int, int] | None = None
        # Detached [loss, ce, aux, z] summed over the micro-batches of the current optimizer step.
        self._step_sums: Tensor | None = None
        self._step_micro_batches = 0
        # [MoE layers, E] tokens per expert of this rank's micro-batches in the current step
        self._step_counts: Tensor | None = None
        self.step_expert_counts: Tensor | None = None  # the last step's, summed over all ranks

    # ----- model ---------------------------------------------------------------------------------
    @override
    def configure_model(self) -> None:
        """Build the model (once); strategies may call this under a meta-device or sharding context."""
        if self.model is not None:
            return
        if self._trainer is not None:
            check_master_weights(str(self._trainer.precision), self._trainer.strategy)
        self.model = Mula(self.config)
        self.model.set_activation_checkpointing(self.activation_checkpointing)
        if self.init_weights is not None:
            self._load_init_weights(self.init_weights)

    def _load_init_weights(self, path: str) -> None:
        """Copy the weights of a Mula weights file / checkpoint into `self.model`, checking the architecture."""
        from mula.checkpoint import load_weights  # imported lazily: only needed with init_weights
        from mula.checkpoint.settle import settle_for_reading

        # with several ranks: verified here by one reader per file (a collective; __init__ checked sizes)
        settle_for_reading(path, bool(self.hparams.get("verify_init_weights", True)))
        source = load_weights(path, verify=False)  # verified in __init__ or just above
        diff = self.config.architecture_differences(source.config)
        if diff:
            raise ValueError(
                f"init_weights {path} has a different architecture than the model ({', '.join(diff)})."
            )
        on_meta = any(p.is_meta for p in self.model.parameters())
        self.model.load_state_dict(source.state_dict(), assign=on_meta)

    def _compile_model(self) -> None:
        """Compile the blocks (once), now that the strategy has laid the model out: Inductor's cache
        in `cache_dir` (default: the run directory's `compile_cache`; a directory per rank in it under
        T or C, `rank_cache_dir`), the counters started."""
        settings = self.compile_settings
        if settings is None or self._compile_watch is not None:
            return
        cache_dir = settings.cache_dir or os.path.join(self.trainer.default_root_dir, "compile_cache")
        strategy = self._strategy()
        if strategy is not None:  # a rank of its own cache where the graphs hold its groups' collectives
            layout = strategy.parallel_layout(self.trainer.world_size)
            cache_dir = rank_cache_dir(cache_dir, self.trainer.global_rank, layout.tp, layout.cp)
        use_cache_dir(cache_dir)
        self._compile_watch = CompileWatch(settings.warmup_steps).start()
        compile_blocks(self.model.layers, settings)

    @override
    def on_fit_start(self) -> None:
        """Compile the blocks (`model.compile`) after the strategy's setup; on a CPU device, keep the
        host memory a step frees for the next (`mula.training.host_allocator`)."""
        if self.device.type == "cpu":
            reuse_freed_host_memory()
        self._compile_model()

    @override
    def on_validation_start(self) -> None:
        """Compile the blocks (`model.compile`) for `validate` too; the bytes per token of val/bpb."""
        self._compile_model()
        self._load_token_bytes()

    @override
    def on_test_start(self) -> None:
        """Compile the blocks (`model.compile`) for `test` too; the bytes per token of test/bpb."""
        self._compile_model()
        self._load_token_bytes()

    def _load_token_bytes(self) -> None:
        """The bytes of every token of the run's tokenizer (the data module's `tokenizer_path`) as a device
        tensor, built when the tokenizer is first seen; None (val/bpb not logged) without a tokenizer, or
        with one that is not byte-level or cannot be loaded (said once, in the log)."""
        datamodule = self._trainer.datamodule if self._trainer is not None else None
        reference = datamodule.tokenizer_path if isinstance(datamodule, TokenizedData) else None
        if reference == self._token_bytes_of:
            return
        self._token_bytes_of = reference
        self._token_bytes = tokenizer_byte_table(reference, self.config.vocab_size, self.device)

    @override
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Log the compile counters once after the warm-up steps; warn while recompilation continues."""
        if self._compile_watch is None or not ends_optimizer_step(self.trainer):
            return
        metrics = self._compile_watch.after_step()
        if metrics is not None and self.trainer.is_global_zero:
            for logger in self.trainer.loggers:
                logger.log_metrics(metrics, step=self.trainer.global_step)

    @override
    def teardown(self, stage: str) -> None:
        """Stop counting compilations (the compiled blocks stay compiled)."""
        if self._compile_watch is not None:
            self._compile_watch.stop()

    @override
    def forward(self, input_ids: Tensor):
        """Logits and router statistics for `input_ids` [B, T] (a `MulaOutput`)."""
        return self.model(input_ids)

    # ----- steps ---------------------------------------------------------------------------------
    def _losses(self, batch: Tensor, mtp: bool = False) -> tuple[Tensor, Tensor, Any]:
        """(total loss, cross-entropy, model output) for a batch of token ids [B, T + 1]; with `mtp` (training)
        the MTP modules run too and the total adds `mtp_loss_weight` times their loss (`out.mtp_loss`)."""
        if batch.dim() != 2 or batch.shape[1] < 2:
            raise ValueError(
                f"expected a batch of token ids [batch, seq_len + 1], got shape {tuple(batch.shape)}."
            )
        inputs, targets = batch[:, :-1], batch[:, 1:]
        self._batch_shape = (inputs.shape[0], inputs.shape[1])  # the whole sequence's tokens (throughput)
        # context parallelism: this rank's slice of the sequence (the whole of it otherwise); its loss is
        # the slice's mean, and the slices are equal, so the ranks' mean is the sequence's
        shard = self.model.sequence_shard
        inputs, targets = shard.take(inputs), shard.take(targets)
        depths = range(1, self.config.mtp_depth + 1) if mtp else range(0)
        out = self.model(inputs, [shard.take(shifted_ids(batch, k)) for k in depths])
        loss, ce = self.combine_losses(out.logits, targets, out.aux_loss, out.z_loss)
        if out.mtp_logits:
            out.mtp_loss = self.mtp_loss(out.mtp_logits, batch)
            loss = loss + self.config.mtp_loss_weight * out.mtp_loss
        return loss, ce, out

    def mtp_loss(self, mtp_logits: Sequence[Tensor], batch: Tensor) -> Tensor:
        """The mean over the MTP modules of their cross-entropies (`mula.model.mtp`), unweighted."""
        seq_len = batch.shape[1] - 1
        check_mtp_sequence(len(mtp_logits), seq_len)
        shard = self.model.sequence_shard
        terms = [
            mtp_cross_entropy(logits, shard.take(shifted_targets(batch, k)), k, seq_len, shard.count)
            for k, logits in enumerate(mtp_logits, start=1)
        ]
        return torch.stack(terms).mean()

    def combine_losses(
        self, logits: Tensor, targets: Tensor, aux_loss: Tensor, z_loss: Tensor
    ) -> tuple[Tensor, Tensor]:
        """(total loss, cross-entropy) of logits [B, T, V] against targets [B, T] and the router losses
        (one place for the loss, also used by a pipeline's last stage)."""
        # CE in fp32: bf16 log-softmax over a 50k vocabulary loses precision
        ce = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        if isinstance(ce, DTensor):  # vocabulary-parallel logits (tensor parallelism): a replicated loss
            ce = ce.full_tensor()
        loss = ce + self.config.router_aux_loss_coef * aux_loss + self.config.router_z_loss_coef * z_loss
        return loss, ce

    @override
    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        """One micro-batch: its loss (for backward), and the train/* (and moe/*) metrics of this step."""
        loss, ce, out = self._losses(batch, mtp=True)
        mtp = (out.mtp_loss,) if out.mtp_logits else ()
        self._log_step_losses(loss, ce, out.aux_loss, out.z_loss, *mtp)
        if self.config.is_moe and out.tokens_per_expert is not None:
            counts = out.tokens_per_expert.detach()
            self._step_counts = counts if self._step_counts is None else self._step_counts + counts
            self.log("moe/load_imbalance", load_imbalance(out.tokens_per_expert))
        self.log_learning_rate()
        return loss

    def log_learning_rate(self) -> None:
        """Log `train/lr` on the steps that hand their metrics to the loggers, from the step's last
        micro-batch: Lightning turns a logged number into a device tensor (on an accelerator a blocking
        copy from the host, which waits for the device), so other steps log none."""
        if ends_optimizer_step(self.trainer) and logs_train_step(self.trainer):
            self.log("train/lr", self.trainer.optimizers[0].param_groups[0]["lr"])

    @override
    def on_train_start(self) -> None:
        """Start a fresh accumulation window (a previous fit may have ended inside one)."""
        self._step_sums, self._step_micro_batches = None, 0

    def _log_step_losses(self, *losses: Tensor) -> None:
        """On logging steps, log the mean of `losses` (`STEP_LOSSES`) over the step's global batch.

        The mean runs over every micro-batch of the accumulation window on every data-parallel rank
        (every rank, also under expert parallelism), so that the curve of a run does not depend on its
        world size. Sums stay on the device (no host sync per micro-batch); one all-reduce of
        [sums, count] per logged step. They are not progress-bar metrics: Lightning reads every progress-bar
        metric on the host after each micro-batch, long after the step that logged it (a host sync per
        micro-batch); `mula fit`'s bar shows `train/loss` from the logging steps
        (`mula.training.progress_bar`).
        """
        self.record_step_losses(torch.stack([t.detach().float() for t in losses]), 1)

    def add_expert_counts(self, layer: int, counts: Tensor) -> None:
        """Add MoE block `layer`'s (global index) tokens per expert [E] of one micro-batch to the step's
        counts: how a pipeline stage, which holds only some blocks, reports them. Rows are MoE layers, as
        in `MulaOutput.tokens_per_expert`; the rows of the other stages' blocks stay zero here, so the
        step's one all-reduce adds every stage's rows in place."""
        if self._step_counts is None:
            self._step_counts = counts.new_zeros(self.config.num_moe_layers, counts.numel())
        self._step_counts[self.config.moe_layer_row(layer)] += counts.detach()

    def record_step_losses(self, sums: Tensor, count: int) -> None:
        """Add `count` micro-batches' summed [loss, ce, aux, z] to this step; log the step's global
        mean when it ends (see `_log_step_losses`). A pipeline stage without the loss adds zeros and 0."""
        self._step_sums = sums if self._step_sums is None else self._step_sums + sums
        self._step_micro_batches += count
        if not ends_optimizer_step(self.trainer):
            return
        sums, count = self._step_sums, self._step_micro_batches
        self._step_sums, self._step_micro_batches = None, 0
        if not logs_train_step(self.trainer):
            return
        total = self.trainer.strategy.reduce(torch.cat([sums, sums.new_tensor([count])]), reduce_op="sum")
        means = total[:-1] / total[-1]
        kept = (True, True, self.config.is_moe, self.config.is_moe, len(means) == len(STEP_LOSSES))
        names = [name for name, keep in zip(STEP_LOSSES, kept) if keep]
        for name, value in zip(names, means[[i for i, keep in enumerate(kept) if keep]]):
            self.log(name, value, prog_bar=False, on_step=True, on_epoch=False, sync_dist=False)

    @override
    def validation_step(self, batch: Tensor, batch_idx: int) -> None:
        """Accumulate the token-weighted cross-entropy (and the targets' bytes); `val/loss`, `val/ppl` and
        `val/bpb` are logged per epoch."""
        _, ce, _ = self._losses(batch)
        targets = self.model.sequence_shard.take(batch[:, 1:])  # the targets `ce` is the mean over
        self.record_evaluation(ce, batch[:, 1:].numel(), targets)

    def record_evaluation(self, ce: Tensor, tokens: int, targets: Tensor | None) -> None:
        """Add one evaluation batch: `ce`, the mean cross-entropy over `targets` (this rank's target ids: its
        context-parallel slice of the batch's), weighted by `tokens`, the batch's target tokens (the whole
        sequences': every rank of a CP group gives its slice the same weight, so the weighted mean over the
        ranks is the sequences'). A pipeline rank without the last stage adds `targets` None and 0 tokens.
        One place for both metrics, also used by a pipeline's last stage (`mula.training.bits_per_byte`)."""
        self.val_loss.update(ce, weight=tokens)
        table = self._token_bytes
        if table is None:
            return
        if targets is None or tokens == 0:
            zero = torch.zeros((), dtype=torch.long, device=table.device)
            self.val_bpb.update(zero.float(), zero)
            return
        if table.device != targets.device:  # once: the module may have moved since the table was built
            table = self._token_bytes = table.to(targets.device)
        self.val_bpb.update(ce.detach().float() * tokens, target_bytes(table, targets, tokens))

    def _log_bits_per_byte(self, name: str) -> None:
        """Log the epoch's bits per byte as `name` (when the tokenizer is known) and start a new sum."""
        if self._token_bytes is None:
            return
        bpb = float(self.val_bpb.compute())
        self.val_bpb.reset()
        if math.isfinite(bpb):
            self.log(name, bpb)

    @override
    def on_validation_epoch_end(self) -> None:
        """Log `val/loss` (cross-entropy, synced over ranks by torchmetrics), `val/ppl` = exp(val/loss) and
        `val/bpb` (bits per byte, when the run's tokenizer is known)."""
        if self.val_loss.update_count == 0:
            return
        loss = self.val_loss.compute()
        self.log("val/loss", loss, prog_bar=True)
        self.log("val/ppl", torch.exp(loss))
        self.val_loss.reset()
        self._log_bits_per_byte("val/bpb")

    @override
    def test_step(self, batch: Tensor, batch_idx: int) -> None:
        """Same as validation, logged as test/loss and test/ppl."""
        self.validation_step(batch, batch_idx)

    @override
    def on_test_epoch_end(self) -> None:
        """Log `test/loss`, `test/ppl` and `test/bpb`."""
        if self.val_loss.update_count == 0:
            return
        loss = self.val_loss.compute()
        self.log("test/loss", loss)
        self.log("test/ppl", torch.exp(loss))
        self.val_loss.reset()
        self._log_bits_per_byte("test/bpb")

    @override
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """The step's micro-batches are done: global expert counts, router bias update, new global scope.

        One all-reduce of the [layers, E] counts per step (no host sync); `step_expert_counts` keeps
        them for the metrics callbacks. The bias changes only here, never between a micro-batch's
        forward and its backward (an activation-checkpointing recompute must route the same way).
        """
        if self._step_counts is None:
            if not self.config.is_moe:
                return
            # a pipeline rank holding only dense blocks: zeros, so that it joins every rank's all-reduce
            self._step_counts = torch.zeros(
                self.config.num_moe_layers, self.config.num_experts, dtype=torch.long, device=self.device
            )
        self.step_expert_counts = step_counts(self._step_counts)
        self._step_counts = None
        named = list(iter_moe_layers(self.model))
        layers = [layer for _, layer in named]
        if self.config.router_bias_update_rate > 0:
            rate = self.config.router_bias_update_rate
            # each layer's row from its global block index ("layers.<i>.mlp"): a pipeline stage holds
            # only some blocks, and the dense first blocks have no row
            rows = self.step_expert_counts[
                [self.config.moe_layer_row(int(name.split(".")[1])) for name, _ in named]
            ]
            # a skipped step leaves every piece of trained state as it was, the balancing bias included:
            # the strategy's skip flag stays on the device, and equal (zero) loads move no bias
            # (strategies without a skip verdict never skip)
            strategy = self._strategy()
            if strategy is not None:
                rows = torch.where(strategy.update_skipped, torch.zeros_like(rows), rows)
            update_router_bias([layer.router for layer in layers], rows, rate)
        for layer in layers:
            if layer.global_load is not None:
                layer.global_load.reset()

    # ----- optimizer -----------------------------------------------------------------------------
    def param_groups(self) -> list[dict[str, Any]]:
        """The trainable parameters' groups by `weight_decay`, `no_decay` and `optimizer`
        (`mula.training.muon.optimizer_param_groups`: AdamW's decayed and no_decay groups, then, with
        Muon, Muon's two)."""
        trainable = ((n, p) for n, p in self.model.named_parameters() if p.requires_grad)
        return optimizer_param_groups(trainable, self.weight_decay, self.no_decay, self.optimizer)

    def _decay_steps(self) -> int:
        """Step where the cosine ends: `decay_steps`, else the Trainer's max_steps / estimated total."""
        if self.decay_steps is not None:
            return self.decay_steps
        if self.trainer.max_steps and self.trainer.max_steps > 0:
            return self.trainer.max_steps
        return int(self.trainer.estimated_stepping_batches)

    @override
    def configure_optimizers(self) -> dict[str, Any]:
        """AdamW (or Muon + AdamW, `optimizer`) + per-step LambdaLR implementing `warmup_cosine`.

        The optimizer comes from the strategy's `build_optimizer` when it has one (XPUMoEStrategy: the
        EP-aware sharded AdamW over this rank's parameters), else it is `torch.optim.AdamW` or
        `MulaMuon`; Muon's options are passed only with `optimizer="muon"`.
        """
        strategy = self._strategy()
        muon = self.optimizer == "muon"
        default = MulaMuon if muon else torch.optim.AdamW
        build = strategy.build_optimizer if strategy is not None else default
        options = self.muon_options if muon else {}
        optimizer = build(
            self.param_groups(),
            lr=self.lr,
            betas=self.betas,
            eps=self.eps,
            weight_decay=self.weight_decay,
            **options,
        )
        # a partial of a module-level function: LambdaLR checkpoints no state for it, so a resumed run
        # follows the schedule of its (possibly edited) recipe
        factor = functools.partial(
            lr_factor,
            lr=self.lr,
            min_lr=self.min_lr,
            warmup_steps=self.warmup_steps,
            decay_steps=self._decay_steps(),
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    @override
    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: torch.optim.Optimizer) -> None:
        """Lightning zeroes gradients before each step's first backward; a strategy that zeroes them at
        the end of its own optimizer step (`zeroes_grads_after_step`) needs no second zeroing, which
        would wipe a pipeline step's gradients (its backward passes run inside `training_step`)."""
        strategy = self._strategy()
        if strategy is None or not strategy.zeroes_grads_after_step:
            optimizer.zero_grad()

    def _strategy(self) -> MulaStrategy | None:
        """The trainer's strategy when it provides Mula's strategy contract; None under Lightning's own
        strategies and when the module is used without a Trainer."""
        return mula_strategy(self._trainer.strategy) if self._trainer is not None else None

    # ----- throughput / checkpoint ---------------------------------------------------------------
    def flops(self, batch_size: int, seq_len: int) -> int:
        """Training FLOPs (forward + backward) of one micro-batch of `batch_size` sequences of `seq_len`."""
        return self.config.flops_per_token(seq_len) * batch_size * seq_len

    def set_batch_shape(self, batch_size: int, seq_len: int) -> None:
        """Record the shape of the batch just trained on, for `tokens_per_batch` / `flops_per_batch`
        (a strategy that runs the model itself, e.g. through pipeline stages, calls this)."""
        self._batch_shape = (batch_size, seq_len)

    @property
    def tokens_per_batch(self) -> int | None:
        """Input tokens in the last micro-batch seen (None before the first)."""
        return None if self._batch_shape is None else self._batch_shape[0] * self._batch_shape[1]

    @property
    def flops_per_batch(self) -> int | None:
        """Training FLOPs of the last micro-batch seen, from `MulaConfig.flops_per_token` (None before the first)."""
        return None if self._batch_shape is None else self.flops(*self._batch_shape)

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Store the resolved model config so `mula export-hf` / `load_weights` can rebuild the model."""
        checkpoint["mula_config"] = dataclasses.asdict(self.config)


def load_imbalance(tokens_per_expert: Tensor) -> Tensor:
    """max / mean tokens per expert, averaged over MoE layers (1.0 = perfectly balanced)."""
    counts = tokens_per_expert.float()
    return (counts.max(dim=-1).values / counts.mean(dim=-1).clamp_min(1e-9)).mean()


def check_master_weights(precision: str, strategy: Any) -> None:
    """Refuse bf16/fp16 weights that `strategy` keeps no fp32 master weights for
    (`mula.layout.rules.check_master_weights`): only a strategy that says it keeps them
    (`keeps_fp32_master_weights`, e.g. `XPUMoEStrategy` with its sharded optimizer) may train such weights.
    """
    contract = mula_strategy(strategy)
    masters = contract is not None and contract.keeps_fp32_master_weights
    rules_check_master_weights(precision, masters, type(strategy).__name__)


def mula_module(module: Any) -> MulaLightningModule | None:
    """`module` as a `MulaLightningModule` (its config, optimizer choice, compile settings and step
    counts, typed), or None for any other module: how strategies and callbacks ask for Mula's module."""
    return module if isinstance(module, MulaLightningModule) else None
