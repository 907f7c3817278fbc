"""Devices and launchers: the Intel XPU accelerator on native torch.xpu (`accelerator`) and the
mpiexec/PALS cluster environment (`environments`)."""
