"""Devices: the Intel XPU accelerator on native torch.xpu (`accelerator`). The mpiexec/PALS cluster
environment lives below, in `mula/cluster_environments.py`, which `mula prepare` uses too."""
