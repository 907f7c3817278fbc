"""The training loop's pieces: the LightningModule (`module.py`), the crash-safe CSV logger, the
step progress bar, the CPU host allocator, the memory meter, the device lookup (`devices.py`), and
every private Lightning name Mula touches (`lightning_compat.py`).
"""
