"""Ways to start a run's processes: local (this machine); Slurm and submitit come later."""
