"""seerd: a batch rollout daemon for synchronous LLM RL, after the Seer system."""

__version__ = "0.1.0"


def submit(input, model, run_dir, *, cluster=None, folder=None, **options):  # noqa: A002, ANN001, ANN003, ANN201
    """Submit a rollout as a submitit job; return its handle (`job_id`, `done()`, `wait()`, `results()`).

    `input`, `model`, `run_dir` and the rollout options are those of `seerd run`, by parameter name
    (`policy`, `chunk_tokens`, `n`, `max_tokens`, `temperature`, ..., `prior`, and `engine_args`, a
    dict for vLLM); Slurm resources are the fields of `seerd.launch.submitit_launch.SlurmResources`
    (`nodes`, `workers_per_node`, `gpus_per_worker` (0: CPU workers), `time_min`, `partition`, ...).
    `cluster`: None picks Slurm when `srun` is on the PATH, else local processes ("slurm", "local"
    force one). `allow_model_change=True` resumes a run whose model checkpoint changed (recorded).
    Bad input, a run that a live coordinator owns or a changed checkpoint raise
    `seerd.launch.prepare.BadRun` before anything is submitted; an already finished run returns a
    handle with `job_id` None.
    """
    from seerd.launch.submitit_launch import submit as _submit

    return _submit(input, model, run_dir, cluster=cluster, folder=folder, **options)


def submit_serve(model, run_dir, *, cluster=None, folder=None, **options):  # noqa: ANN001, ANN003, ANN201
    """Submit `seerd serve` as a submitit job; return its handle (`job_id`, `client()` for batches,
    `done()`, `cancel()`). `model`, `run_dir` and the options are those of `seerd serve` by
    parameter name (`policy`, `chunk_tokens`, `n`, `max_tokens`, ..., `engine_args`), Slurm
    resources those of `seerd.submit`. Bad settings raise `seerd.launch.prepare.BadRun` before
    anything is submitted. The serve runs until the job is cancelled or its time is up (its
    warning signal requeues it)."""
    from seerd.serve.launch import submit_serve as _submit_serve

    return _submit_serve(model, run_dir, cluster=cluster, folder=folder, **options)


def __getattr__(name: str):  # noqa: ANN202 - `seerd.Client` without importing httpx for every user of seerd
    if name == "Client":
        from seerd.serve.client import Client

        return Client
    raise AttributeError(f"module 'seerd' has no attribute {name!r}")
