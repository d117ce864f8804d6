"""Ways to start a run's processes: local (this machine), slurm (inside an allocation), submitit_launch (a job)."""
