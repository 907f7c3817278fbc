"""Pipeline stages: splitting a plain Mula into stages (`split`), driving torch.distributed.pipelining
schedules over a step's micro-batches (`schedule`), and the strategy's Lightning hooks for it (`steps`)."""
