"""The EP-aware optimizer: the bucketed gradient-reduce engine (`grad_reduce`), its all-reduce use for
torch optimizers (`grad_sync`), `EPShardedAdamW` (`sharded_optimizer`) with its options, parameter
all-gather, fp32 AdamW arithmetic (`adamw`) and resharding state dict (`state`)."""
