"""How dlojz was launched (torchrun, srun, a single process) and everything that talks to
torch.distributed: the process group, DDP, stop signals."""
